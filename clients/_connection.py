"""One persistent HTTP/1.1 connection to a service, on a plain socket.

Why not ``http.client`` or httpx: the ASE calculator sends one request at a time and waits
for it, so it needs neither a pool nor async, and the per-request work of those clients
(``http.client`` parses every header block with the ``email`` package; httpx adds its own
pure-Python layers) measured 0.12–0.4 ms per round trip on loopback, against a 1 ms overhead
budget for a whole service call. This client writes the request line, headers and body in one
``sendall`` and reads the answer through one buffered reader: a status line, headers, then a
body delimited by ``Content-Length``, chunked transfer coding, or the end of the connection.
The screening client, which keeps many requests in flight, stays on ``httpx.AsyncClient``.

Waiting for the answer: a thread that sleeps in its socket read through a whole device pass
(milliseconds) pays a wake-up when the answer arrives, and on a host whose idle cores drop
into deep sleep states that costs 0.1–0.4 ms per request. With ``spin_lead_s`` > 0 the
connection predicts when the answer is due (the last time from sending to the first answer
byte, for a request of about the same size: an MD run asks the same thing every step),
sleeps in ``select`` until ``spin_lead_s`` before that, then polls the socket without
sleeping until the answer is readable, for at most ``2 × spin_lead_s`` before it falls back
to sleeping. The price is CPU: up to ``2 × spin_lead_s`` of one core per request, typically
``spin_lead_s`` plus the prediction's error.

A kept-alive connection may be closed by the server while idle (uvicorn's keep-alive timeout).
Before reusing one, a zero-timeout poll checks that the server has not closed it; if the
server closes it anyway between that check and the request (nothing of the answer arrives),
the request is sent once more on a fresh connection. Both are safe because an evaluation has
no side effects. A request that gets no answer within the timeout is not: the server may still
be working on it, so it raises ``AnswerTimeout`` (and the connection is closed, so that a late
answer is never read as the next one's).

A server may answer before it has read the whole body (413 for a body above its limit) and
close the connection: the answer is read and returned although sending the rest failed.

The connection belongs to the process that opened it: a forked child (``multiprocessing``)
opens its own instead of writing into the parent's socket, and a pickled copy starts without
one.
"""

from __future__ import annotations

import io
import os
import select
import socket
import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

MAX_LINE_BYTES = 65536
"""Longest status or header line accepted (a guard against a peer that is not HTTP)."""

MAX_HEADERS = 100

SAME_SIZE = 0.1
"""Relative difference of request sizes within which the last answer time predicts the next."""

DUE_SMOOTHING = 0.3
"""Weight of a later answer in the predicted answer time (an earlier one replaces it)."""

CONNECT_TIMEOUT_S = 10.0
"""Longest wait for a connection: a firewalled or mistyped host fails in seconds, not after the
(long) answer timeout times every retry."""
SELECT_FD_LIMIT = 1024
"""``select`` cannot watch descriptors from FD_SETSIZE on: such a connection waits in ``poll``
(millisecond timeouts) and does not spin."""


class TransportError(Exception):
    """The service could not be reached, the connection broke, or it did not speak HTTP."""


class _Dropped(TransportError):
    """The peer closed the connection before any byte of the answer (idle close)."""


class AnswerTimeout(TransportError):
    """The request was sent but its answer did not arrive within the timeout."""


@dataclass(frozen=True)
class Reply:
    """A complete HTTP response."""

    status: int
    headers: Mapping[str, str]  # lower-case names
    content: bytes

    def header(self, name: str, default: str | None = None) -> str | None:
        return self.headers.get(name.lower(), default)


def split_service_url(url: str) -> SplitResult:
    """``url`` split into its parts; ``ValueError`` unless it names an http(s) host and, if
    any, a valid port."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http:// or https:// URL, got {url!r}")
    _ = parts.port  # a non-numeric or out-of-range port raises ValueError here
    return parts


class KeepAliveConnection:
    """Sequential requests over one kept-alive connection to ``url`` (http or https).

    Args:
        url: base URL; request paths are appended to its path.
        timeout: seconds for each blocking socket operation (connecting: at most
            ``CONNECT_TIMEOUT_S``).
        headers: sent with every request (e.g. ``Accept``, ``X-API-Key``).
        spin_lead_s: poll for the answer from this long before it is due instead of
            sleeping through the wait (module docstring); 0 sleeps.
    """

    def __init__(
        self, url: str, timeout: float, headers: Mapping[str, str], spin_lead_s: float = 0.0
    ) -> None:
        if spin_lead_s < 0:
            raise ValueError(f"spin_lead_s must be >= 0, got {spin_lead_s}")
        if not timeout > 0:  # 0 would make the socket non-blocking
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        parts = split_service_url(url)
        self._tls = parts.scheme == "https"
        assert parts.hostname is not None  # split_service_url requires a host
        self._host = parts.hostname
        self._port = parts.port or (443 if self._tls else 80)
        self._prefix = parts.path.rstrip("/")
        self._timeout = timeout
        host = f"[{self._host}]" if ":" in self._host else self._host
        default_port = self._port == (443 if self._tls else 80)
        authority = host if default_port else f"{host}:{self._port}"
        # The header lines every request repeats, encoded once.
        self._fixed_headers = _header_lines({"Host": authority, **headers})
        self._socket: socket.socket | None = None
        self._reader: io.BufferedReader | None = None
        self._owner_pid = 0  # the process that opened the socket
        self._reused = False
        self._spin_lead_s = spin_lead_s
        # The last request's size and the seconds from sending it to its first answer byte.
        self._last_size = 0
        self._answer_due_s: float | None = None

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Reply:
        """Send one request and read the whole answer; raises ``TransportError``."""
        head = b"".join(
            (
                f"{method} {self._prefix}{path} HTTP/1.1\r\n".encode("latin-1"),
                self._fixed_headers,
                _header_lines(headers or {}),
                b"" if body is None else b"Content-Length: %d\r\n" % len(body),
                b"\r\n",
            )
        )
        message = head if body is None else head + body
        try:
            try:
                return self._exchange(message)
            except (_Dropped, ConnectionResetError, BrokenPipeError):
                if not self._reused:
                    raise
                self.close()  # the server dropped an idle connection just now: once more
                return self._exchange(message)
        except TransportError:
            self.close()
            raise
        except (OSError, ValueError) as exc:
            self.close()
            raise TransportError(f"{type(exc).__name__}: {exc}") from exc

    def __getstate__(self) -> dict[str, object]:
        """Everything but the open connection (a copy opens its own)."""
        return {**self.__dict__, "_socket": None, "_reader": None, "_reused": False}

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    @property
    def connected(self) -> bool:
        return self._socket is not None

    def _exchange(self, message: bytes) -> Reply:
        sock, reader = self._open()
        try:
            sock.sendall(message)
        except (BrokenPipeError, ConnectionResetError):
            early = _early_answer(reader)
            if early is None:
                raise
            self.close()  # the server closed the connection after answering
            return early
        except TimeoutError:
            # A server that stopped reading (stuck, or stopped with SIGSTOP) may have the
            # request's first part: not sent again, like a request it does not answer.
            raise AnswerTimeout(f"the service took no request within {self._timeout:g} s") from None
        try:
            if self._spin_lead_s > 0 and sock.fileno() < SELECT_FD_LIMIT:
                self._await_answer(sock, time.perf_counter(), len(message))
            status, headers, closes = _read_head(reader)
            content = _read_body(reader, status, headers)
        except TimeoutError:
            raise AnswerTimeout(f"no answer within {self._timeout:g} s") from None
        if closes:
            self.close()
        return Reply(status=status, headers=headers, content=content)

    def _await_answer(self, sock: socket.socket, sent: float, size: int) -> None:
        """Return once ``sock`` is readable (or the wait would outlast the timeout): asleep
        until ``spin_lead_s`` before the answer is due, then polling (module docstring). Learns
        when the next answer of this size is due."""
        due = self._answer_due_s
        readable = False
        if due is not None and abs(size - self._last_size) <= SAME_SIZE * self._last_size:
            spin_from = sent + due - self._spin_lead_s
            readable = _readable(sock, spin_from - time.perf_counter())
            spin_until = sent + due + self._spin_lead_s
            while not readable and time.perf_counter() < spin_until:
                readable = _readable(sock, 0.0)
        left = self._timeout - (time.perf_counter() - sent)  # the timeout counts from sending
        if not readable and not _readable(sock, left):
            raise TimeoutError  # not a second full timeout in the read that would follow
        took = time.perf_counter() - sent
        # Never later than the last answer: polling early only costs CPU, late costs the
        # wake-up this is here to avoid.
        if due is not None and took > due:
            took = due + DUE_SMOOTHING * (took - due)
        self._answer_due_s = took
        self._last_size = size

    def _open(self) -> tuple[socket.socket, io.BufferedReader]:
        """The kept-alive connection if this process opened it and the server still holds it
        open, else a new one."""
        if self._socket is not None and self._owner_pid != os.getpid():
            # Inherited through fork: closing this process's descriptor leaves the parent's
            # connection open (the peer sees no close while the parent holds it).
            self.close()
        if self._socket is not None and _peer_closed(self._socket):
            self.close()
        if self._socket is None or self._reader is None:
            address = (self._host, self._port)
            sock = socket.create_connection(address, min(self._timeout, CONNECT_TIMEOUT_S))
            sock.settimeout(self._timeout)
            # Small requests must not wait for the previous segment's ACK (Nagle).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls:
                context = ssl.create_default_context()
                sock = context.wrap_socket(sock, server_hostname=self._host)
            self._socket, self._reader = sock, sock.makefile("rb")
            self._owner_pid = os.getpid()
            self._reused = False
        else:
            self._reused = True
        return self._socket, self._reader


def _header_lines(headers: Mapping[str, str]) -> bytes:
    # UTF-8, as the server reads an API key: latin-1 could not send most non-ASCII keys at all
    # and would send the rest as bytes the server's key does not have.
    return "".join(f"{name}: {value}\r\n" for name, value in headers.items()).encode()


def _readable(sock: socket.socket, timeout_s: float) -> bool:
    """Whether ``sock`` has bytes (or EOF) to read, waiting up to ``timeout_s`` (0: a poll).

    ``select`` (microsecond timeouts, which the spin's sleep needs) below FD_SETSIZE; past it
    ``poll``, as a process holding many files (NEB images, thread pools) hands out such
    descriptors and ``select`` refuses them."""
    if sock.fileno() < SELECT_FD_LIMIT or not hasattr(select, "poll"):
        readable, _, _ = select.select([sock], [], [], max(0.0, timeout_s))
        return bool(readable)
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLPRI)
    return bool(poller.poll(max(0.0, timeout_s) * 1e3))


def _peer_closed(sock: socket.socket) -> bool:
    """An idle HTTP/1.1 connection is readable only if the server closed it (EOF)."""
    return sock.fileno() < 0 or _readable(sock, 0.0)


def _early_answer(reader: io.BufferedReader) -> Reply | None:
    """The answer a server sent before it stopped reading the request, if a whole one
    arrived (else None: the connection broke for another reason)."""
    try:
        status, headers, _ = _read_head(reader)
        return Reply(status=status, headers=headers, content=_read_body(reader, status, headers))
    except (TransportError, OSError, ValueError):
        return None


def _read_line(reader: io.BufferedReader) -> bytes:
    line = reader.readline(MAX_LINE_BYTES + 1)
    if len(line) > MAX_LINE_BYTES:
        raise TransportError("an HTTP line of the answer is too long")
    return line


def _read_head(reader: io.BufferedReader) -> tuple[int, dict[str, str], bool]:
    """Status, headers (lower-case names; repeated ones joined by ', ') and whether the
    server closes the connection after this answer. Interim 1xx answers are skipped."""
    while True:
        line = _read_line(reader)
        if not line:
            raise _Dropped("the server closed the connection before answering")
        version, _, rest = line.decode("latin-1").rstrip("\r\n").partition(" ")
        code = rest[:3]
        if not (version.startswith("HTTP/1.") and code.isdigit()):
            raise TransportError(f"not an HTTP/1.x status line: {line[:80]!r}")
        headers: dict[str, str] = {}
        for _ in range(MAX_HEADERS + 1):
            field = _read_line(reader)
            if field in (b"\r\n", b"\n"):
                break
            if not field:
                raise TransportError("the connection closed inside the answer's headers")
            name, colon, value = field.decode("latin-1").partition(":")
            if not colon:
                raise TransportError(f"malformed header line {field[:80]!r}")
            key, value = name.strip().lower(), value.strip()
            headers[key] = f"{headers[key]}, {value}" if key in headers else value
        else:
            raise TransportError(f"more than {MAX_HEADERS} header lines in the answer")
        status = int(code)
        if 100 <= status < 200:
            continue
        connection = headers.get("connection", "").lower()
        closes = "close" in connection or (version == "HTTP/1.0" and "keep-alive" not in connection)
        return status, headers, closes


def _read_body(reader: io.BufferedReader, status: int, headers: Mapping[str, str]) -> bytes:
    if status in (204, 304):
        return b""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return _read_chunked(reader)
    length = headers.get("content-length")
    if length is None:
        return reader.read()  # delimited by the end of the connection
    if not length.isdigit():
        raise TransportError(f"bad Content-Length {length!r}")
    return _read_exactly(reader, int(length))


def _read_exactly(reader: io.BufferedReader, size: int) -> bytes:
    data = reader.read(size)
    if len(data) != size:
        raise TransportError(f"the connection closed after {len(data)} of {size} body bytes")
    return data


def _read_chunked(reader: io.BufferedReader) -> bytes:
    chunks: list[bytes] = []
    while True:
        size_field = _read_line(reader).split(b";", 1)[0].strip()
        try:
            size = int(size_field, 16)
        except ValueError:
            raise TransportError(f"bad chunk size {size_field[:20]!r}") from None
        if size == 0:
            while _read_line(reader) not in (b"\r\n", b"\n", b""):  # trailers
                pass
            return b"".join(chunks)
        chunks.append(_read_exactly(reader, size))
        _read_line(reader)  # the CRLF after each chunk
