"""``HeadJoiningTransport``: an answer's head goes out with its body, never later than one
event-loop iteration after it, and nothing else is held."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import httpx

from service.api.http_protocol import HeadJoiningTransport
from tests.service.fakes import running_server

HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\n"
WHOLE_ANSWER = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 3\r\n\r\nbad"


class RecordingTransport:
    """The transport methods the wrapper calls, recording each write."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 1234)}.get(name, default)


def joining(loop: asyncio.AbstractEventLoop) -> tuple[HeadJoiningTransport, RecordingTransport]:
    inner = RecordingTransport()
    return HeadJoiningTransport(cast(asyncio.Transport, inner), loop), inner


def test_head_and_body_go_out_in_one_write() -> None:
    async def run() -> list[bytes]:
        transport, inner = joining(asyncio.get_running_loop())
        transport.write(HEAD)
        assert inner.writes == []
        transport.write(b"body")
        await asyncio.sleep(0)  # the scheduled flush finds nothing held
        return inner.writes

    assert asyncio.run(run()) == [HEAD + b"body"]


def test_a_head_alone_is_written_on_the_next_loop_iteration() -> None:
    async def run() -> list[bytes]:
        transport, inner = joining(asyncio.get_running_loop())
        transport.write(HEAD)
        await asyncio.sleep(0)
        return inner.writes

    assert asyncio.run(run()) == [HEAD]


def test_close_writes_a_held_head_first() -> None:
    async def run() -> tuple[list[bytes], bool]:
        transport, inner = joining(asyncio.get_running_loop())
        transport.write(HEAD)
        transport.close()
        return inner.writes, inner.closed

    assert asyncio.run(run()) == ([HEAD], True)


def test_whole_answers_and_body_chunks_pass_through() -> None:
    async def run() -> list[bytes]:
        transport, inner = joining(asyncio.get_running_loop())
        transport.write(WHOLE_ANSWER)
        transport.write(b"chunk")
        return inner.writes

    assert asyncio.run(run()) == [WHOLE_ANSWER, b"chunk"]


def test_other_attributes_are_the_wrapped_transports() -> None:
    async def run() -> Any:
        transport, _ = joining(asyncio.get_running_loop())
        return cast(Any, transport).get_extra_info("peername")

    assert asyncio.run(run()) == ("127.0.0.1", 1234)


def test_head_only_and_streamed_answers_through_uvicorn() -> None:
    """HEAD (a head and never a body) and a streamed answer (head, then body messages in
    later loop steps) arrive whole through the protocol."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.api_route("/plain", methods=["GET", "HEAD"])
    def plain() -> dict[str, str]:
        return {"ok": "yes"}

    @app.get("/stream")
    def stream() -> StreamingResponse:
        async def parts() -> Any:
            for k in range(3):
                await asyncio.sleep(0.01)
                yield f"part{k};".encode()

        return StreamingResponse(parts(), media_type="text/plain")

    with running_server(app) as url, httpx.Client(base_url=url, timeout=10) as client:
        head = client.head("/plain")
        assert head.status_code == 200 and head.content == b""
        assert client.get("/plain").json() == {"ok": "yes"}
        assert client.get("/stream").content == b"part0;part1;part2;"
        assert client.get("/plain").json() == {"ok": "yes"}  # same connection, still in step
