"""Bad input against a real server: every refusal is a clear JSON error naming what to fix,
read the same way on every route, and the server goes on serving."""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import msgpack
import orjson
import pytest
import uvicorn

from service.api import ServiceSettings, create_app
from service.api.http_protocol import HeadJoiningHTTPProtocol
from tests.service.fakes import PairPotential, free_port_socket, request_document, small_molecule
from tests.service.test_api import assert_error, serve

KEY = "s3cret"
ONE_H = {"species": ["H"], "positions": [[0.0, 0.0, 0.0]]}


@pytest.fixture(scope="module")
def keyed_url() -> Iterator[str]:
    """A server that wants an API key."""
    with serve(PairPotential(), api_key=KEY) as (url, _):
        yield url


@pytest.fixture
def client(keyed_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=keyed_url, timeout=30, headers={"X-API-Key": KEY}) as c:
        yield c


def post(client: httpx.Client, body: bytes, content_type: str) -> httpx.Response:
    return client.post("/evaluate", content=body, headers={"Content-Type": content_type})


def still_serving(client: httpx.Client) -> None:
    doc = request_document([small_molecule()], ["energy"])
    assert client.post("/evaluate", json=doc).status_code == 200


@pytest.mark.parametrize(
    ("body", "reason"),
    [(b"\x91" * 200_000 + b"\xc0", "nest"), (b"\xc1", "0xc1"), (b"\x81\xa1a\xc1", "0xc1")],
)
def test_msgpack_errors_without_a_text_are_400_with_a_reason(
    client: httpx.Client, body: bytes, reason: str
) -> None:
    """msgpack's nesting limit and its reserved type byte raise exceptions without a message:
    the answer must still say what is wrong, not end at "not valid msgpack: "."""
    message = assert_error(post(client, body, "application/msgpack"), 400, "malformed_body")[
        "message"
    ]
    assert not message.rstrip().endswith(":") and reason in message
    still_serving(client)


@pytest.mark.parametrize("pbc", [[1, 0, 1], "TTT", [None, True, True], 1, {}])
def test_pbc_of_the_wrong_type_names_the_pbc_field(client: httpx.Client, pbc: object) -> None:
    """The fields named were pydantic's union branches (``pbc.bool``,
    ``pbc.list[bool][0]``), which are nothing a client can find in its request."""
    structure = ONE_H | {"cell": [5.0, 5.0, 5.0], "pbc": pbc}
    error = assert_error(
        client.post("/evaluate", json={"structures": [structure]}), 422, "invalid_request"
    )
    assert [e["field"] for e in error["detail"]["errors"]] == ["structures[0].pbc"]
    assert "boolean" in error["message"]


def test_pbc_still_takes_one_boolean_or_three(client: httpx.Client) -> None:
    for pbc in (True, [True, False, True]):
        structure = ONE_H | {"cell": [5.0, 5.0, 5.0], "pbc": pbc}
        assert client.post("/evaluate", json={"structures": [structure]}).status_code == 200
    structure = ONE_H | {"cell": [5.0, 5.0, 5.0], "pbc": [True, False]}
    assert_error(client.post("/evaluate", json={"structures": [structure]}), 422, "bad_pbc")


def test_a_key_under_another_authorization_scheme_is_named_as_such(keyed_url: str) -> None:
    """``Authorization: Basic <key>`` was answered "missing API key"."""
    doc = request_document([small_molecule()], ["energy"])
    with httpx.Client(base_url=keyed_url, timeout=30) as c:
        for route in ("/evaluate", "/info"):
            headers = {"Authorization": f"Basic {KEY}"}
            response = (
                c.post(route, json=doc, headers=headers)
                if route == "/evaluate"
                else c.get(route, headers=headers)
            )
            message = assert_error(response, 401, "unauthorized")["message"]
            assert "Basic" in message and "Bearer" in message, route
        assert c.get("/info", headers={"Authorization": f"bearer {KEY}"}).status_code == 200


def test_repeated_headers_are_read_alike_by_every_route(keyed_url: str) -> None:
    """/evaluate took the last of repeated headers, FastAPI's routes (and the request id
    middleware) the first: one key was accepted on /info and refused on /evaluate."""
    doc = request_document([small_molecule()], ["energy"])
    twice = [("X-API-Key", KEY), ("X-API-Key", "nope"), ("X-Request-ID", "first")]
    twice.append(("X-Request-ID", "second"))
    with httpx.Client(base_url=keyed_url, timeout=30) as c:
        info = c.get("/info", headers=twice)
        evaluate = c.post("/evaluate", json=doc, headers=twice)
    assert info.status_code == evaluate.status_code == 200
    assert info.headers["x-request-id"] == evaluate.headers["x-request-id"] == "first"
    assert evaluate.json()["provenance"]["request_id"] == "first"


def test_a_non_ascii_api_key_sent_as_utf8_is_accepted() -> None:
    """Header bytes are decoded as latin-1; the key was then compared as UTF-8 of that text,
    so a key with any non-ASCII character could never match."""
    key = "s\u00e9cret"
    doc = request_document([small_molecule()], ["energy"])
    with serve(api_key=key) as (url, _), httpx.Client(base_url=url, timeout=30) as c:
        sent = {b"X-API-Key": key.encode()}
        assert c.post("/evaluate", json=doc, headers=sent).status_code == 200
        assert c.get("/info", headers=sent).status_code == 200
        bearer = {b"Authorization": b"Bearer " + key.encode()}
        assert c.get("/metrics", headers=bearer).status_code == 200
        wrong = {b"X-API-Key": "s\u00e8cret".encode()}
        assert_error(c.get("/info", headers=wrong), 401, "unauthorized")


@contextmanager
def short_keep_alive_server(keep_alive_s: int) -> Iterator[tuple[str, int]]:
    """The service (fake potential) under uvicorn with a short keep-alive: (host, port)."""
    app = create_app(ServiceSettings(), evaluator=PairPotential())
    sock = free_port_socket()
    config = uvicorn.Config(
        app, log_level="warning", timeout_keep_alive=keep_alive_s, http=HeadJoiningHTTPProtocol
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the test server did not start"
        time.sleep(0.01)
    try:
        yield sock.getsockname()
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def closed_within(conn: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before closing ``conn`` within ``seconds``; None if still open."""
    conn.settimeout(seconds)
    received = b""
    try:
        while chunk := conn.recv(4096):
            received += chunk
    except TimeoutError:
        return None
    return received


def test_a_request_head_that_never_completes_is_closed_after_the_keep_alive() -> None:
    """A connection that sends nothing, or a head a byte at a time (slowloris), was held open
    for ever: uvicorn's keep-alive timer starts only after an answer and stops at any byte."""
    with short_keep_alive_server(1) as address:
        with socket.create_connection(address) as silent, socket.create_connection(address) as slow:
            slow.sendall(b"POST /evaluate HTTP/1.1\r\nHost: x\r\n")
            slow.sendall(b"X-Slow: 1\r\n")
            assert closed_within(slow, 5) == b""
            assert closed_within(silent, 5) == b""
        with socket.create_connection(address) as kept:
            # A request answered, then a head that stalls: closed too, after its answer.
            kept.sendall(
                b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\nGET /health/live HTTP/1.1\r\n"
            )
            answer = closed_within(kept, 5)
            assert answer is not None and answer.startswith(b"HTTP/1.1 200")
        with httpx.Client(base_url=f"http://{address[0]}:{address[1]}", timeout=10) as c:
            doc = request_document([small_molecule()], ["energy"])
            assert c.post("/evaluate", json=doc).status_code == 200
            time.sleep(0.1)  # an idle keep-alive connection within the timeout is reused
            assert c.post("/evaluate", json=doc).status_code == 200


def test_a_connection_answered_again_and_again_outlives_the_keep_alive() -> None:
    """The head deadline starts again after every answer: a client whose requests keep coming
    within the keep-alive is never cut off, however long it stays."""
    with short_keep_alive_server(1) as address:
        conn = http.client.HTTPConnection(*address, timeout=10)
        try:
            ports: set[int] = set()
            started = time.perf_counter()
            while time.perf_counter() - started < 2.6:
                conn.request("GET", "/health/live")
                assert conn.getresponse().read() and conn.sock is not None
                ports.add(conn.sock.getsockname()[1])
                time.sleep(0.4)
            assert len(ports) == 1, ports  # one connection throughout
        finally:
            conn.close()


def test_an_endless_request_head_is_refused_with_431_before_it_fills_memory(
    client: httpx.Client, keyed_url: str
) -> None:
    """uvicorn's httptools protocol keeps every header line until the head ends: 300 MB of
    headers took 600 MB of server memory. Past 64 KiB the head is refused."""
    host, port = keyed_url.removeprefix("http://").split(":")
    line = b"X-Filler: " + b"a" * 1000 + b"\r\n"
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(b"POST /evaluate HTTP/1.1\r\nHost: x\r\n")
        try:
            for _ in range(1000):  # 1 MB at most
                conn.sendall(line * 10)
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = closed_within(conn, 5) or b""
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert orjson.loads(body)["code"] == "headers_too_large"
    # A head of a few kilobytes is fine, and the server goes on serving.
    doc = request_document([small_molecule()], ["energy"])
    headers = {f"X-Filler-{k}": "a" * 1000 for k in range(20)}
    assert client.post("/evaluate", json=doc, headers=headers).status_code == 200
    still_serving(client)


def test_a_large_body_meets_a_full_queue_before_it_is_read() -> None:
    # It was read and parsed (seconds of a core for megabytes of JSON) only to be refused, and
    # a client retrying on 503 sends it again.
    with serve(PairPotential(delay_s=1.0), max_queue=1, inline_max_atoms=0) as (url, potential):
        doc = request_document([small_molecule()], ["energy"])
        with httpx.Client(base_url=url, timeout=30) as c:
            busy = threading.Thread(target=c.post, args=("/evaluate",), kwargs={"json": doc})
            busy.start()
            while not potential.calls:  # the first request is on the device
                time.sleep(0.01)
            queued = threading.Thread(target=c.post, args=("/evaluate",), kwargs={"json": doc})
            queued.start()
            time.sleep(0.2)  # now the queue is full
            port = int(url.rsplit(":", 1)[1])
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                # A 10 MB body announced, none of it sent: the answer comes at once.
                sock.sendall(b"POST /evaluate HTTP/1.1\r\nHost: x\r\nContent-Type: "
                             b"application/json\r\nContent-Length: 10000000\r\n\r\n")  # fmt: skip
                started = time.perf_counter()
                answer = sock.recv(65536)
                waited = time.perf_counter() - started
            busy.join()
            queued.join()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), answer
    assert b"connection: close" in head.lower() and b"retry-after:" in head.lower()
    assert orjson.loads(body)["code"] == "queue_full"
    assert waited < 0.5  # not after a body timeout


def test_a_large_answer_encoded_in_a_thread_is_the_answer_encoded_inline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from service.api import evaluate

    structures = [small_molecule("CH3OH", seed=k) for k in range(3)]
    doc = request_document(structures, ["energy", "forces", "energies"])
    answers = []
    with serve() as (url, _), httpx.Client(base_url=url, timeout=30) as c:
        for threshold in (10**9, 4):  # inline, then in a thread
            monkeypatch.setattr(evaluate, "ENCODE_IN_THREAD_ITEMS", threshold)
            for accept in ("application/json", "application/msgpack"):
                reply = c.post("/evaluate", json=doc, headers={"Accept": accept})
                assert reply.status_code == 200, reply.text
                answers.append(reply.content)
    # The same results (the provenance's timings differ).
    assert orjson.loads(answers[0])["results"] == orjson.loads(answers[2])["results"]
    assert msgpack.unpackb(answers[1])["results"] == msgpack.unpackb(answers[3])["results"]
