"""``HeadJoiningTransport``: an answer's head goes out with its body, never later than one
event-loop iteration after it, and nothing else is held."""

from __future__ import annotations

import asyncio
import socket
from typing import Any, cast

import httpx

from service.api.http_protocol import HeadJoiningTransport, plain_socket_fd
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


class SocketTransport(RecordingTransport):
    """A transport over one end of a socket pair: what the wrapper writes itself arrives
    at the other end; what it hands to the transport is recorded (as a queued write)."""

    def __init__(self, sock: socket.socket, buffered: int = 0, **extra: Any) -> None:
        super().__init__()
        self.sock = sock
        self.buffered = buffered
        self.extra = {"socket": sock, **extra}

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.extra.get(name, default)


def received(sock: socket.socket, size: int) -> bytes:
    chunks = []
    while size > 0:
        chunk = sock.recv(min(size, 1 << 16))
        assert chunk, "the connection closed early"
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def test_a_plain_socket_is_written_directly_and_in_order() -> None:
    """Head and body go to the socket itself (without the GIL); nothing through the
    transport."""
    ours, peer = socket.socketpair()
    with ours, peer:
        ours.setblocking(False)

        async def run() -> SocketTransport:
            inner = SocketTransport(ours)
            transport = HeadJoiningTransport(
                cast(asyncio.Transport, inner), asyncio.get_running_loop()
            )
            transport.write(HEAD)
            transport.write(b"body")
            transport.write(b"more")
            return inner

        inner = asyncio.run(run())
        assert inner.writes == []
        assert received(peer, len(HEAD) + 8) == HEAD + b"bodymore"


def test_what_the_socket_does_not_take_goes_to_the_transport_after_it() -> None:
    ours, peer = socket.socketpair()
    with ours, peer:
        ours.setblocking(False)
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        payload = bytes(range(256)) * (1 << 14)  # 4 MiB: more than the socket buffers hold

        async def run() -> SocketTransport:
            inner = SocketTransport(ours)
            transport = HeadJoiningTransport(
                cast(asyncio.Transport, inner), asyncio.get_running_loop()
            )
            transport.write(payload)
            return inner

        inner = asyncio.run(run())
        assert len(inner.writes) == 1
        tail = inner.writes[0]
        assert 0 < len(tail) < len(payload)
        assert received(peer, len(payload) - len(tail)) + tail == payload


def test_bytes_queued_in_the_transport_keep_later_writes_behind_them() -> None:
    ours, peer = socket.socketpair()
    with ours, peer:
        ours.setblocking(False)

        async def run() -> SocketTransport:
            inner = SocketTransport(ours, buffered=10)
            transport = HeadJoiningTransport(
                cast(asyncio.Transport, inner), asyncio.get_running_loop()
            )
            transport.write(b"later")
            return inner

        assert asyncio.run(run()).writes == [b"later"]


def test_tls_and_socketless_transports_are_written_through_the_transport() -> None:
    ours, peer = socket.socketpair()
    with ours, peer:
        assert plain_socket_fd(cast(asyncio.Transport, SocketTransport(ours))) == ours.fileno()
        for extra in ({"ssl_object": object()}, {"sslcontext": object()}):
            tls = SocketTransport(ours, **extra)
            assert plain_socket_fd(cast(asyncio.Transport, tls)) is None
    assert plain_socket_fd(cast(asyncio.Transport, RecordingTransport())) is None


def test_bytes_that_are_not_http_get_a_json_400() -> None:
    """uvicorn's plain-text answer to an unparseable request becomes the service's JSON error,
    and the server keeps serving."""
    import json

    from fastapi import FastAPI

    app = FastAPI()

    @app.get("/plain")
    def plain() -> dict[str, str]:
        return {"ok": "yes"}

    with running_server(app) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            conn.sendall(b"NOT HTTP AT ALL\x00\x01\r\n\r\n")
            answer = b""
            while chunk := conn.recv(4096):
                answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 ")
        assert b"content-type: application/json" in head.lower()
        error = json.loads(body)
        assert error["code"] == "malformed_http" and "not valid HTTP" in error["message"]
        with httpx.Client(base_url=url, timeout=10) as client:
            assert client.get("/plain").json() == {"ok": "yes"}
