"""uvicorn's HTTP protocol with each answer's head and body in one socket write.

uvicorn writes the status line and headers as soon as the app sends
``http.response.start`` and the body with ``http.response.body``: two writes, so with
``TCP_NODELAY`` two TCP segments, and a client waiting for the answer wakes up for the head
alone and blocks again for the body (strace of ``SO2Calculator`` on loopback: two
poll + recv pairs per answer). ``/evaluate`` sends both messages in one event-loop step, so
holding a complete head back until the next write joins them: one send on the server, one
wake-up on the client. A held head is written at the latest on the next loop iteration (or
before the connection closes), so a head sent alone (HEAD, 204, a streamed body that comes
later) is delayed by one iteration at most.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from uvicorn.protocols.http.auto import AutoHTTPProtocol


def _is_bare_head(data: bytes) -> bool:
    """A status line and headers with nothing after them (what uvicorn writes on
    ``http.response.start``); a whole answer written at once (uvicorn's own 400s) is not."""
    return data.startswith(b"HTTP/") and data.endswith(b"\r\n\r\n")


class HeadJoiningTransport:
    """Wraps a transport: a bare response head is held and prepended to the next write.

    Everything else is passed to the wrapped transport unchanged.
    """

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._held is not None:
            joined = self._held + bytes(data)
            self._held = None
            self._transport.write(joined)
        elif isinstance(data, bytes) and _is_bare_head(data):
            self._held = data
            self._loop.call_soon(self.flush)
        else:
            self._transport.write(data)

    def flush(self) -> None:
        """Write a held head now (nothing if none is held)."""
        if self._held is not None:
            head, self._held = self._held, None
            if not self._transport.is_closing():
                self._transport.write(head)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        # Reading pauses, extra info, abort, ...: the wrapped transport's own.
        return getattr(self._transport, name)


class HeadJoiningHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
    """uvicorn's automatic HTTP protocol (httptools, else h11) over a
    ``HeadJoiningTransport``; pass it as uvicorn's ``http`` option."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports have the asyncio.Transport methods without subclassing it.
        stream = cast(asyncio.Transport, transport)
        super().connection_made(HeadJoiningTransport(stream, asyncio.get_running_loop()))
