"""The calculator's keep-alive HTTP/1.1 client against a raw socket server that answers each
request with scripted bytes: body framings, interim answers, closes and broken peers."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from clients._connection import AnswerTimeout, KeepAliveConnection, TransportError


class RawServer:
    """Accepts connections one after another; answers the k-th request (over all
    connections) with ``answers[k]``, ``delays_s[k]`` seconds after reading it (none by
    default), and closes the connection after it if that answer's ``close`` flag is set.
    Records each request's raw head and body."""

    def __init__(
        self, answers: list[tuple[bytes, bool]], delays_s: list[float] | None = None
    ) -> None:
        self.answers = answers
        self.delays_s = delays_s or [0.0] * len(answers)
        self.requests: list[bytes] = []
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}/base"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while len(self.requests) < len(self.answers):
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            with conn, conn.makefile("rb") as reader:
                while len(self.requests) < len(self.answers):
                    head = b""
                    while not head.endswith(b"\r\n\r\n"):
                        line = reader.readline()
                        if not line:
                            break
                        head += line
                    if not head:
                        break
                    length = 0
                    for line in head.split(b"\r\n"):
                        if line.lower().startswith(b"content-length:"):
                            length = int(line.split(b":")[1])
                    self.requests.append(head + reader.read(length))
                    answer, close = self.answers[len(self.requests) - 1]
                    time.sleep(self.delays_s[len(self.requests) - 1])
                    conn.sendall(answer)
                    if close:
                        break

    def close(self) -> None:
        self._listener.close()
        self._thread.join(5)


@contextmanager
def raw_server(
    answers: list[tuple[bytes, bool]], delays_s: list[float] | None = None
) -> Iterator[RawServer]:
    server = RawServer(answers, delays_s)
    try:
        yield server
    finally:
        server.close()


def ok(body: bytes, *headers: bytes) -> bytes:
    lines = [b"HTTP/1.1 200 OK", b"Content-Length: %d" % len(body), *headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def test_framings_headers_and_one_connection_for_all() -> None:
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Tag: a\r\nX-Tag: b\r\n\r\n"
        b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nTrailer: t\r\n\r\n"
    )
    interim = b"HTTP/1.1 100 Continue\r\n\r\n" + ok(b"after 100")
    no_content = b"HTTP/1.1 204 No Content\r\n\r\n"
    answers = [(ok(b"{}", b"Content-Type: application/json"), False), (chunked, False)]
    answers += [(interim, False), (no_content, False)]
    with raw_server(answers) as server:
        http = KeepAliveConnection(server.url, 5.0, {"Accept": "application/msgpack"})
        first = http.request("POST", "/evaluate", b"payload", {"Content-Type": "x/y"})
        assert (first.status, first.content, first.header("content-type")) == (
            200,
            b"{}",
            "application/json",
        )
        second = http.request("GET", "/info")
        assert second.content == b"hello world" and second.header("x-tag") == "a, b"
        assert http.request("GET", "/info").content == b"after 100"
        assert http.request("GET", "/info").content == b""
        http.close()
    assert server.connections == 1
    head, _, body = server.requests[0].partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /base/evaluate HTTP/1.1"
    assert set(lines[1:]) == {
        b"Host: 127.0.0.1:%d" % int(server.url.split(":")[2].split("/")[0]),
        b"Accept: application/msgpack",
        b"Content-Type: x/y",
        b"Content-Length: 7",
    }
    assert body == b"payload"


@contextmanager
def descriptors_taken_below(n: int) -> Iterator[None]:
    """Hold every free descriptor below ``n``: the next socket gets one at or above it."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n + 64:
        if hard != resource.RLIM_INFINITY and hard < n + 64:
            pytest.skip(f"the descriptor limit ({hard}) is below {n + 64}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (n + 64, hard))
    held: list[int] = []
    try:
        while not held or held[-1] < n - 1:
            held.append(os.open(os.devnull, os.O_RDONLY))
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("spin_lead_s", [0.0, 0.002])
def test_a_connection_past_select_s_descriptor_limit_is_reused(spin_lead_s: float) -> None:
    # select() refuses descriptors from 1024 on; a process holding many files (NEB images,
    # thread pools) reaches them, and every reuse check failed into a reconnect after backoff.
    closing = ok(b"closed after this", b"Connection: close")
    answers = [(ok(b"one"), False), (ok(b"two"), False), (closing, True), (ok(b"four"), False)]
    with descriptors_taken_below(1100), raw_server(answers) as server:
        http = KeepAliveConnection(server.url, 5.0, {}, spin_lead_s=spin_lead_s)
        assert [http.request("GET", "/x").content for _ in range(2)] == [b"one", b"two"]
        assert server.connections == 1
        assert http.request("GET", "/x").content == b"closed after this"
        assert http.request("GET", "/x").content == b"four"
        http.close()
    assert server.connections == 2


def test_connection_close_and_body_until_eof() -> None:
    closing = ok(b"one", b"Connection: close")
    until_eof = b"HTTP/1.0 200 OK\r\n\r\nto the end"
    with raw_server([(closing, True), (until_eof, True), (ok(b"three"), False)]) as server:
        http = KeepAliveConnection(server.url, 5.0, {})
        assert http.request("GET", "/a").content == b"one"
        assert not http.connected
        assert http.request("GET", "/b").content == b"to the end"
        assert http.request("GET", "/c").content == b"three"
        http.close()
    assert server.connections == 3


def test_a_reused_connection_dropped_before_the_answer_is_retried_once() -> None:
    # The server closes right after reading the second request, without answering it.
    with raw_server([(ok(b"1"), False), (b"", True), (ok(b"2"), False)]) as server:
        http = KeepAliveConnection(server.url, 5.0, {})
        assert http.request("GET", "/x").content == b"1"
        assert http.request("GET", "/x").content == b"2"
        http.close()
    assert server.connections == 2 and len(server.requests) == 3


@pytest.mark.parametrize(
    "answer",
    [
        b"SSH-2.0-OpenSSH\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
        b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n",
    ],
    ids=["not-http", "short-body", "bad-length", "bad-header", "bad-chunk", "cut-headers"],
)
def test_broken_answers_are_transport_errors(answer: bytes) -> None:
    with raw_server([(answer, True)]) as server:
        http = KeepAliveConnection(server.url, 5.0, {})
        with pytest.raises(TransportError):
            http.request("GET", "/x")
        assert not http.connected


def test_nobody_listening_and_bad_urls() -> None:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    with pytest.raises(TransportError):
        KeepAliveConnection(f"http://127.0.0.1:{port}", 2.0, {}).request("GET", "/")
    with pytest.raises(ValueError, match="http"):
        KeepAliveConnection("ftp://example.org", 1.0, {})


def test_a_spinning_connection_reads_answers_due_early_late_and_on_time() -> None:
    """Polling for the answer from shortly before it is due (as predicted from the last
    answer to a request of the same size) changes when the answer is read, never what: an
    answer earlier than predicted is read at once, a much later one after a bounded spin,
    asleep (the wait costs next to no CPU)."""
    delays = [0.05, 0.05, 0.05, 0.005, 0.3]
    answers = [(ok(b"answer %d" % k), False) for k in range(len(delays))]
    with raw_server(answers, delays) as server:
        http = KeepAliveConnection(server.url, 5.0, {}, spin_lead_s=0.002)
        for k in range(3):
            assert http.request("POST", "/e", b"same size").content == b"answer %d" % k
        start = time.perf_counter()
        assert http.request("POST", "/e", b"same size").content == b"answer 3"
        assert time.perf_counter() - start < 0.04  # not held until the predicted 50 ms
        cpu_before, start = time.thread_time(), time.perf_counter()
        assert http.request("POST", "/e", b"same size").content == b"answer 4"
        assert time.perf_counter() - start >= 0.3
        assert time.thread_time() - cpu_before < 0.1  # asleep through most of the 0.3 s
        http.close()
    assert server.connections == 1
    with pytest.raises(ValueError, match="spin_lead_s"):
        KeepAliveConnection(server.url, 1.0, {}, spin_lead_s=-1.0)


def test_a_server_that_stops_reading_times_out_once() -> None:
    """A body the server does not take (stuck, or stopped with SIGSTOP) fails with
    ``AnswerTimeout`` after the timeout, not as a broken connection the caller would send
    again (four full timeouts with the calculator's retries)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        http = KeepAliveConnection(url, 0.3, {})
        start = time.perf_counter()
        with pytest.raises(AnswerTimeout, match="took no request"):
            http.request("POST", "/e", b"x" * (64 << 20))
        assert time.perf_counter() - start < 2.0
        assert not http.connected


@pytest.mark.parametrize("spin_lead_s", [0.0, 0.002])
def test_the_timeout_counts_from_sending_while_spinning(spin_lead_s: float) -> None:
    """With an answer time predicted from the last request, the wait before polling was
    added to the timeout: 0.3 s of pass before it, and a silent server was given up on after
    timeout + 0.3 s."""
    with raw_server([(ok(b"first"), False), (ok(b"never"), False)], [0.3, 30.0]) as server:
        http = KeepAliveConnection(server.url, 0.5, {}, spin_lead_s=spin_lead_s)
        assert http.request("POST", "/e", b"same size").content == b"first"
        start = time.perf_counter()
        with pytest.raises(AnswerTimeout, match=r"no answer within 0\.5 s"):
            http.request("POST", "/e", b"same size")
        assert time.perf_counter() - start < 0.7
