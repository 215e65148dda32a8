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

It also writes with the interpreter lock released. uvloop, unlike asyncio's own transports,
calls ``write(2)`` holding the GIL, and on loopback that call delivers the data and wakes the
reader: 0.03 ms into a client polling for its answer, 0.4–0.5 ms into one asleep in its read
(2-core VM; the wake-up of a sleeping thread is what costs). With a crowd of clients, a device
pass's ~30 answers go out while the worker thread launches the next pass, which cannot run
Python meanwhile. So a plain TCP (or Unix) connection whose transport has nothing buffered
is written with ``os.write`` on its socket (which releases the GIL), and whatever the socket
does not take at once goes to the transport, which queues it as usual; TLS connections, and
anything else without a plain socket, go through the transport.

Bytes that are not HTTP get the service's JSON error body (``malformed_http``) like every other
failure, instead of uvicorn's plain-text 400.

A connection waiting for a request head (a new one, or one whose last answer went out) is
closed if no complete head arrives within the keep-alive timeout. uvicorn's own keep-alive
timer starts only after an answer and stops at the first byte received, so a connection that
never sent anything, or sends a head a byte at a time (slowloris), was held for ever. A head
(request line and headers) above ``MAX_HEAD_BYTES`` is refused with 431 ``headers_too_large``:
uvicorn's httptools protocol keeps every header line it is sent until the head ends, so an
endless head grew the server's memory without bound (300 MB of headers: +600 MB).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, cast

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from service.api.errors import error_body

MAX_HEAD_BYTES = 64 << 10
"""Largest request head (request line and headers). An so2serve request's is a few hundred
bytes; nginx allows 32 KiB by default, uvicorn's h11 parser 16 KiB."""


def _is_bare_head(data: bytes) -> bool:
    """A status line and headers with nothing after them (what uvicorn writes on
    ``http.response.start``); a whole answer written at once (uvicorn's own 400s) is not."""
    return data.startswith(b"HTTP/") and data.endswith(b"\r\n\r\n")


def plain_socket_fd(transport: asyncio.BaseTransport) -> int | None:
    """The descriptor of the transport's socket if its bytes go to it unchanged (no TLS);
    None otherwise."""
    if transport.get_extra_info("ssl_object") is not None:
        return None
    if transport.get_extra_info("sslcontext") is not None:
        return None
    sock = transport.get_extra_info("socket")
    if sock is None:
        return None
    try:
        fd = int(sock.fileno())
    except (OSError, ValueError, AttributeError):
        return None
    return fd if fd >= 0 else None


class HeadJoiningTransport:
    """Wraps a transport: a bare response head is held and prepended to the next write, and
    writes go to a plain socket directly, without the GIL (module docstring).

    Everything else is passed to the wrapped transport unchanged.
    """

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self._fd = plain_socket_fd(transport)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._held is not None:
            joined = self._held + bytes(data)
            self._held = None
            self._send(joined)
        elif isinstance(data, bytes) and _is_bare_head(data):
            self._held = data
            self._loop.call_soon(self.flush)
        else:
            self._send(data)

    def flush(self) -> None:
        """Write a held head now (nothing if none is held)."""
        if self._held is not None:
            head, self._held = self._held, None
            if not self._transport.is_closing():
                self._send(head)

    def _send(self, data: bytes | bytearray | memoryview) -> None:
        """``data`` after everything written before: what the socket takes at once straight
        to it (GIL released), the rest, or all of it while the transport still holds earlier
        bytes, through the transport."""
        transport = self._transport
        if (
            self._fd is not None
            and not transport.get_write_buffer_size()
            and not transport.is_closing()
        ):
            try:
                sent = os.write(self._fd, data)
            except OSError:
                # Full (EAGAIN) or broken: the transport queues the bytes, or meets the same
                # error and closes the connection its own way.
                sent = 0
            if sent == len(data):
                return
            if sent:
                data = bytes(memoryview(data)[sent:])
        transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        # Reading pauses, extra info, abort, ...: the wrapped transport's own.
        return getattr(self._transport, name)


class HeadJoiningHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
    """uvicorn's automatic HTTP protocol (httptools, else h11) over a
    ``HeadJoiningTransport``; pass it as uvicorn's ``http`` option. A request that is not
    parseable HTTP gets the service's JSON error (code ``malformed_http``) instead of
    uvicorn's plain-text 400; a head above ``MAX_HEAD_BYTES`` is 431 ``headers_too_large``,
    and one that is not complete within the keep-alive timeout closes the connection."""

    _head_timer: asyncio.TimerHandle | None = None
    _head_wait: tuple[object, float] = (None, 0.0)  # (cycle, loop time) when the wait began
    _head_bytes = 0  # received of the request head being read

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        # No request yet, or the last one's body is complete: these bytes start the next head.
        reading_head = cycle is None or not cycle.more_body
        super().data_received(data)
        if self.cycle is not cycle:  # a head was completed
            self._head_bytes = 0
        elif reading_head and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse_head()

    def _refuse_head(self) -> None:
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # The previous request is still being answered: an error now would cut into its
            # answer. The client has gone wrong either way.
            self.transport.close()
            return
        self._send_error_and_close(
            b"431 Request Header Fields Too Large",
            "headers_too_large",
            f"the request line and headers exceed {MAX_HEAD_BYTES} bytes",
        )

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports have the asyncio.Transport methods without subclassing it.
        stream = cast(asyncio.Transport, transport)
        super().connection_made(HeadJoiningTransport(stream, asyncio.get_running_loop()))
        self._await_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _await_head(self) -> None:
        """Close the connection unless a new request head is complete (both uvicorn protocols
        make a new ``cycle`` then) within the keep-alive timeout.

        Called after every answer, so it only notes when the wait began: one timer per
        connection re-arms itself for the rest of the wait, instead of a timer per request."""
        self._head_wait = (self.cycle, self.loop.time())
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.timeout_keep_alive, self._head_overdue)

    def _head_overdue(self) -> None:
        self._head_timer = None
        waiting_since, began = self._head_wait
        cycle = self.cycle
        # A pipelined request still being answered has had its head: not overdue.
        idle = cycle is None or cycle.response_complete
        if cycle is not waiting_since or not idle or self.transport.is_closing():
            return  # a head arrived: its answer starts the next wait
        left = began + self.timeout_keep_alive - self.loop.time()
        if left > 0:  # answered again since the timer was set
            self._head_timer = self.loop.call_later(left, self._head_overdue)
        else:
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        # Both uvicorn protocols call this on a parse error and write nothing else to the
        # connection, which closes right after: a whole answer as raw bytes fits either.
        self._send_error_and_close(
            b"400 Bad Request", "malformed_http", f"the request is not valid HTTP/1.1: {msg}"
        )

    def _send_error_and_close(self, status: bytes, code: str, message: str) -> None:
        """The JSON error answer as raw bytes, outside any request cycle, then close."""
        body = error_body(code, message)
        head = [b"HTTP/1.1 ", status, b"\r\n"]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
        ]
        self.transport.write(b"".join(head) + body)
        self.transport.close()
