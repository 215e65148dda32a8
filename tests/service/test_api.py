"""The HTTP service end to end: real uvicorn on a free loopback port, an analytic potential."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import msgpack
import numpy as np
import orjson
import pytest
from ase.data import atomic_numbers
from fastapi import FastAPI

from service.api import ServiceSettings, create_app
from service.api.wire import WireFormat, parse_evaluate
from service.engine import batcher
from service.graph.errors import InvalidStructureError
from service.graph.structures import Structures
from tests.service.fakes import (
    PairPotential,
    rattled_copper,
    request_document,
    running_server,
    small_molecule,
)

ALL = ["energy", "forces", "stress", "energies", "virial"]
MSGPACK = {"Content-Type": "application/msgpack", "Accept": "application/msgpack"}


@contextmanager
def serve(
    potential: PairPotential | None = None, **settings: Any
) -> Iterator[tuple[str, PairPotential]]:
    """A real server for the fake potential with these settings: (url, potential)."""
    potential = potential or PairPotential()
    app = create_app(ServiceSettings(**settings), evaluator=potential)
    with running_server(app) as url:
        yield url, potential


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, PairPotential]]:
    with serve(max_atoms=40, max_body_mb=0.5) as served:
        yield served


@pytest.fixture
def client(server: tuple[str, PairPotential]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server[0], timeout=30) as c:
        yield c


def sample_value(metrics_text: str, name: str) -> float:
    for line in metrics_text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def binary_document(doc: dict[str, Any], typed: bool = False) -> dict[str, Any]:
    """The msgpack form: float64 arrays as raw little-endian bytes, bare or (``typed``)
    ``{"dtype", "shape", "data"}`` with the species as atomic numbers."""

    def array(values: Any, dtype: str) -> Any:
        raw = np.asarray(values, dtype)
        return (
            {"dtype": dtype, "shape": list(raw.shape), "data": raw.tobytes()}
            if typed
            else raw.tobytes()
        )

    structures = []
    for s in doc["structures"]:
        item = dict(s, positions=array(s["positions"], "<f8"))
        if typed:
            item["species"] = array([atomic_numbers[e] for e in s["species"]], "<i8")
        if "cell" in s:
            item["cell"] = array(s["cell"], "<f8")
        structures.append(item)
    return {**doc, "structures": structures}


def assert_error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body: dict[str, Any] = response.json()
    assert set(body) == {"code", "message", "detail"}
    assert body["code"] == code and body["message"]
    return body


def test_health_info_metrics_and_docs(client: httpx.Client) -> None:
    assert client.get("/health/live").json() == {"status": "alive"}
    assert client.get("/health/ready").json() == {"status": "ready"}
    info = client.get("/info").json()
    assert info["model"]["name"] == "pair-test" and info["model"]["elements"] == [
        "H",
        "C",
        "O",
        "Cu",
    ]
    assert info["limits"]["max_atoms"] == 40 and info["auth_required"] is False
    assert info["execution"] == {"path": "reference", "precision": "fp64", "device": "cpu"}
    metrics = client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    assert 'so2serve_model_info{device="cpu"' in metrics.text
    spec = client.get("/openapi.json").json()
    body = spec["paths"]["/evaluate"]["post"]["requestBody"]["content"]
    assert set(body) == {"application/json", "application/msgpack"}
    assert "EvaluateRequest" in spec["components"]["schemas"]
    assert client.get("/docs").status_code == 200


def test_fresh_request_ids_are_distinct_32_hex_digit_tokens(client: httpx.Client) -> None:
    """Without (or with an unusable) ``X-Request-ID`` the server makes one up: distinct for
    every request, in the answer's header and provenance alike."""
    ids = []
    for sent in (None, "not a token!", None):
        headers = {} if sent is None else {"X-Request-ID": sent}
        response = client.post(
            "/evaluate", json=request_document([small_molecule()], ("energy",)), headers=headers
        )
        assert response.status_code == 200
        fresh = response.headers["x-request-id"]
        assert fresh == response.json()["provenance"]["request_id"]
        assert len(fresh) == 32 and int(fresh, 16) >= 0
        ids.append(fresh)
    assert len(set(ids)) == 3


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_worker_draws_its_own_request_ids() -> None:
    """A pre-forking server's children must not repeat their parent's ids."""
    from service.api.deps import request_id_from

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: send one fresh id and leave at once
        os.write(write, request_id_from(None).encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 64).decode()
    os.close(read)
    os.waitpid(pid, 0)
    parent = request_id_from(None)
    assert len(child) == 32 and child[:20] != parent[:20]


def test_results_match_the_potential_and_carry_provenance(
    client: httpx.Client, server: tuple[str, PairPotential]
) -> None:
    atoms = [rattled_copper(1, seed=3), small_molecule()]
    response = client.post(
        "/evaluate", json=request_document(atoms, ALL), headers={"X-Request-ID": "abc-1"}
    )
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "abc-1"
    body = response.json()
    direct = PairPotential().predict(Structures.from_atoms(atoms), set(ALL))
    assert direct.forces is not None and direct.stress is not None and direct.virial is not None
    crystal, mol = body["results"]
    assert crystal["n_atoms"] == 4 and mol["n_atoms"] == 6
    assert crystal["energy"] == pytest.approx(float(direct.energy[0]), rel=1e-12)
    np.testing.assert_allclose(
        np.array(crystal["forces"] + mol["forces"]), direct.forces.numpy(), atol=1e-12
    )
    np.testing.assert_allclose(crystal["stress"], direct.stress[0].numpy(), atol=1e-12)
    assert mol["stress"] is None  # not periodic: no stress, but a virial
    np.testing.assert_allclose(mol["virial"], direct.virial[1].numpy(), atol=1e-12)
    provenance = body["provenance"]
    assert provenance["request_id"] == "abc-1"
    assert provenance["model"] == {"name": "pair-test", "sha256": "0" * 64}
    assert provenance["execution"]["path"] == "reference"
    assert set(provenance["timings"]) == {
        "read_ms",
        "decode_ms",
        "admit_ms",
        "queue_ms",
        "compute_ms",
        "handoff_ms",
        "return_ms",
        "resume_ms",
        "total_ms",
    }
    timings = provenance["timings"]
    split = timings["return_ms"] + timings["resume_ms"]
    assert split == pytest.approx(timings["handoff_ms"], abs=1e-6)
    # The phases cover the request from arrival to the answer in hand (only the few steps
    # between them are left: queueing it after its admission checks, and the like).
    phases = ("read_ms", "decode_ms", "admit_ms", "queue_ms", "compute_ms", "handoff_ms")
    assert sum(timings[k] for k in phases) <= timings["total_ms"] + 1e-6
    energy_only = client.post("/evaluate", json=request_document(atoms, ["energy"])).json()
    assert set(energy_only["results"][0]) == {"n_atoms", "energy"}


@pytest.mark.parametrize("typed", [False, True], ids=["bare-bin", "typed-arrays"])
def test_json_and_msgpack_agree_bit_for_bit(client: httpx.Client, typed: bool) -> None:
    atoms = [rattled_copper(1, seed=k) for k in range(3)] + [small_molecule("CH3OH", seed=4)]
    doc = request_document(atoms, ALL)
    as_json = client.post("/evaluate", json=doc).json()["results"]
    body = msgpack.packb(binary_document(doc, typed))
    reply = client.post("/evaluate", content=body, headers=MSGPACK)
    assert reply.headers["content-type"] == "application/msgpack"
    as_msgpack = msgpack.unpackb(reply.content)["results"]
    for j, m in zip(as_json, as_msgpack, strict=True):
        assert j["energy"] == m["energy"]
        for name in ("forces", "energies", "virial", "stress"):
            if j[name] is None:
                assert m[name] is None
                continue
            from_json = np.asarray(j[name], dtype=np.float64).ravel()
            from_msgpack = np.frombuffer(m[name], dtype="<f8")
            assert from_json.tobytes() == from_msgpack.tobytes(), name


ONE_H = b'{"species": [1], "positions": [[0, 0, 0]]}'
TWO_H_AT_ORIGIN = b'{"species": [1, 1], "positions": [[0, 0, 0], [0, 0, 0]]}'
H_AND_U = b'{"species": ["H", "U"], "positions": [[0, 0, 0], [2, 0, 0]]}'
JSON = "application/json"
ERROR_CASES = [
    ("malformed JSON", b'{"structures": [', JSON, 400, "malformed_body"),
    ("malformed msgpack", b"\xc1\xc1", "application/msgpack", 400, "malformed_body"),
    ("form body", b"species=H", "application/x-www-form-urlencoded", 415, "unsupported_media_type"),
    (
        "unknown property",
        b'{"structures": [' + ONE_H + b'], "properties": ["hessian"]}',
        JSON,
        422,
        "invalid_request",
    ),
    (
        "coincident atoms",
        b'{"structures": [' + TWO_H_AT_ORIGIN + b"]}",
        JSON,
        422,
        "coincident_atoms",
    ),
    ("unknown element", b'{"structures": [' + H_AND_U + b"]}", JSON, 422, "unknown_element"),
    (
        "binary positions of the wrong dtype",
        msgpack.packb(
            {
                "structures": [
                    {
                        "species": [1],
                        "positions": {"dtype": "<i8", "shape": [1, 3], "data": bytes(24)},
                    }
                ]
            }
        ),
        "application/msgpack",
        422,
        "bad_array",
    ),
    (
        "non-finite binary positions",
        msgpack.packb(
            {"structures": [{"species": [1], "positions": np.full(3, np.nan).tobytes()}]}
        ),
        "application/msgpack",
        422,
        "non_finite_positions",
    ),
]


@pytest.mark.parametrize(("case", "body", "content_type", "status", "code"), ERROR_CASES)
def test_bad_requests_get_typed_json_errors(
    client: httpx.Client, case: str, body: bytes, content_type: str, status: int, code: str
) -> None:
    response = client.post("/evaluate", content=body, headers={"Content-Type": content_type})
    assert_error(response, status, code)
    # ... and the same connection goes on serving
    assert client.post("/evaluate", json=request_document([small_molecule()])).status_code == 200


def test_errors_name_the_field(client: httpx.Client) -> None:
    doc = request_document([small_molecule(), small_molecule("H2O")])
    doc["structures"][1]["positions"][2] = [0.0, 1.0]
    detail = assert_error(client.post("/evaluate", json=doc), 422, "ragged_positions")["detail"]
    assert detail == {"field": "structures[1].positions", "index": 1}
    doc = request_document([small_molecule()]) | {"properties": ["energy", "dipole"]}
    detail = assert_error(client.post("/evaluate", json=doc), 422, "invalid_request")["detail"]
    assert detail["errors"][0]["field"] == "properties[1]"


def test_size_limits(client: httpx.Client) -> None:
    too_many = request_document([small_molecule(), rattled_copper(3)])  # 108 atoms > 40
    detail = assert_error(client.post("/evaluate", json=too_many), 413, "too_many_atoms")["detail"]
    assert (detail["index"], detail["n_atoms"], detail["limit"]) == (1, 108, 40)
    huge = b'{"structures": [' + b" " * 600_000 + b"]}"
    assert_error(
        client.post("/evaluate", content=huge, headers={"Content-Type": "application/json"}),
        413,
        "body_too_large",
    )


def test_request_atom_limit_counts_every_structure() -> None:
    # Each structure is within max_atoms; together they are not.
    with serve(max_atoms=40, max_request_atoms=10) as (url, _), httpx.Client(base_url=url) as c:
        assert c.get("/info").json()["limits"]["max_request_atoms"] == 10
        doc = request_document([small_molecule(), small_molecule("H2O")])  # 6 + 3 atoms
        assert c.post("/evaluate", json=doc).status_code == 200
        doc = request_document([small_molecule()] * 2)
        detail = assert_error(c.post("/evaluate", json=doc), 413, "too_many_atoms")["detail"]
        assert detail == {"n_atoms": 12, "limit": 10}


def test_a_stalled_body_gets_408_and_the_server_keeps_serving() -> None:
    with serve(body_timeout_s=0.3) as (url, _):
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(
                b"POST /evaluate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 100\r\n\r\n{"structures": ['
            )
            answer = sock.recv(65536)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408")
        assert b"connection: close" in head.lower()
        assert orjson.loads(body)["code"] == "body_timeout"
        with httpx.Client(base_url=url) as c:
            doc = request_document([small_molecule()])
            assert c.post("/evaluate", json=doc).status_code == 200


def test_unknown_routes_and_methods(client: httpx.Client) -> None:
    assert_error(client.get("/nowhere"), 404, "not_found")
    assert_error(client.get("/evaluate"), 405, "method_not_allowed")
    assert_error(client.get("/evaluate/"), 405, "method_not_allowed")


def test_evaluate_answers_with_a_trailing_slash(client: httpx.Client) -> None:
    doc = request_document([small_molecule()], ["energy"])
    plain = client.post("/evaluate", json=doc)
    slashed = client.post("/evaluate/", json=doc)
    assert slashed.status_code == plain.status_code == 200
    assert slashed.json()["results"] == plain.json()["results"]


def test_api_key_is_enforced_when_set() -> None:
    with serve(api_key="s3cret") as (url, _), httpx.Client(base_url=url) as c:
        doc = request_document([small_molecule()])
        body = assert_error(c.post("/evaluate", json=doc), 401, "unauthorized")
        assert body["message"] == "missing API key"
        assert c.post("/evaluate", json=doc).headers["www-authenticate"] == "Bearer"
        wrong = c.post("/evaluate", json=doc, headers={"X-API-Key": "guess"})
        assert assert_error(wrong, 401, "unauthorized")["message"] == "wrong API key"
        assert c.post("/evaluate", json=doc, headers={"X-API-Key": "s3cret"}).status_code == 200
        bearer = {"Authorization": "Bearer s3cret"}
        assert c.post("/evaluate", json=doc, headers=bearer).status_code == 200
        assert c.get("/info").status_code == 401 and c.get("/metrics").status_code == 401
        assert c.get("/info", headers=bearer).json()["auth_required"] is True
        assert c.get("/health/ready").status_code == 200  # probes need no key


async def _before_startup(app: FastAPI) -> list[httpx.Response]:
    transport = httpx.ASGITransport(app=app)  # no lifespan: the model was never loaded
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        return [
            await c.get("/health/ready"),
            await c.post("/evaluate", json=request_document([small_molecule()])),
            await c.get("/health/live"),
        ]


def test_not_ready_until_the_lifespan_has_run() -> None:
    app = create_app(ServiceSettings(), evaluator=PairPotential())
    ready, evaluate, live = asyncio.run(_before_startup(app))
    assert_error(ready, 503, "not_ready")
    assert_error(evaluate, 503, "not_ready")
    assert evaluate.headers["retry-after"] == "5"
    assert live.status_code == 200


async def _post_all(url: str, docs: list[dict[str, Any]]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        return list(await asyncio.gather(*(c.post("/evaluate", json=d) for d in docs)))


def test_concurrent_clients_get_exactly_their_own_results_in_coalesced_batches() -> None:
    atoms = [rattled_copper(1, seed=k) for k in range(12)] + [
        small_molecule(name, seed=k) for k in range(4) for name in ("CH4", "CH3OH", "H2O")
    ]
    docs = [request_document([a], ALL) for a in atoms]
    with serve(PairPotential(delay_s=0.03)) as (url, _), httpx.Client(base_url=url) as c:
        one_at_a_time = [c.post("/evaluate", json=d).json()["results"] for d in docs]
        before = c.get("/metrics").text
        together = [r.json()["results"] for r in asyncio.run(_post_all(url, docs))]
        after = c.get("/metrics").text
    assert together == one_at_a_time
    passes = sample_value(after, "so2serve_batch_requests_count") - sample_value(
        before, "so2serve_batch_requests_count"
    )
    requests = sample_value(after, "so2serve_batch_requests_sum") - sample_value(
        before, "so2serve_batch_requests_sum"
    )
    assert requests == len(docs)
    assert requests / passes > 2  # batch fill: several requests per device pass


def test_keep_alive_connections_are_the_clients_a_pass_waits_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Four MD-like clients, each on its own keep-alive connection, answered in turns at
    first; the engine learns each connection's pace and gathers them into shared passes."""
    # Allow a whole (short) pass for the return of a client on a loaded test machine.
    monkeypatch.setattr(batcher, "GATHER_FRACTION", 1.0)
    body = request_document([small_molecule("H2O")])

    def md_client(url: str) -> None:
        with httpx.Client(base_url=url, timeout=30) as http:
            for _ in range(6):
                http.post("/evaluate", json=body).raise_for_status()

    with serve(PairPotential(delay_s=0.1), batch_window_ms=1000) as (url, pot):
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(md_client, [url] * 4))
        with httpx.Client(base_url=url) as c:
            metrics = c.get("/metrics").text
    assert sample_value(metrics, "so2serve_gather_wait_seconds_count") > 0
    assert max(n for n, _ in pot.calls) == 4


def test_a_cpu_model_runs_every_pass_in_the_worker_unless_told_otherwise() -> None:
    """A CPU pass of thousands of atoms takes seconds: by default it must not run on (and
    block) the event loop; an explicit ``inline_max_atoms`` is still obeyed."""
    with serve() as (url, _), httpx.Client(base_url=url, timeout=30) as c:
        c.post("/evaluate", json=request_document([small_molecule("H2O")], ALL))
        assert c.get("/info").json()["limits"]["inline_max_atoms"] == 0
        assert sample_value(c.get("/metrics").text, "so2serve_inline_passes_total") == 0


class HostSizedPairPotential(PairPotential):
    """A CPU potential whose passes hold 12,345 edges in the host's memory."""

    def pass_edge_capacity(self) -> int:
        return 12_345


def test_a_cpu_models_pass_budget_follows_the_hosts_memory_unless_set() -> None:
    for settings, budget in (({}, 12_345), ({"max_batch_edges": 50_000}, 50_000)):
        with (
            serve(HostSizedPairPotential(), **settings) as (url, _),
            httpx.Client(base_url=url, timeout=30) as c,
        ):
            assert c.get("/info").json()["limits"]["max_batch_edges"] == budget
    with serve() as (url, _), httpx.Client(base_url=url, timeout=30) as c:  # nothing reported
        assert c.get("/info").json()["limits"]["max_batch_edges"] == 2_000_000


@pytest.mark.parametrize("inline_max_atoms", [0, 2048])
def test_a_lone_client_is_answered_from_the_event_loop_unless_turned_off(
    inline_max_atoms: int,
) -> None:
    body = request_document([small_molecule("H2O")], ALL)
    with (
        serve(inline_max_atoms=inline_max_atoms) as (url, _),
        httpx.Client(base_url=url, timeout=30) as c,
    ):
        answers = [c.post("/evaluate", json=body).json() for _ in range(3)]
        assert c.get("/info").json()["limits"]["inline_max_atoms"] == inline_max_atoms
        metrics = c.get("/metrics").text
    expected = PairPotential().predict(Structures.from_atoms([small_molecule("H2O")]), set(ALL))
    assert expected.forces is not None
    for answer in answers:
        assert answer["provenance"]["inline"] is (inline_max_atoms > 0)
        np.testing.assert_allclose(answer["results"][0]["forces"], expected.forces, atol=1e-12)
    inline_passes = sample_value(metrics, "so2serve_inline_passes_total")
    assert inline_passes == (3 if inline_max_atoms else 0)


def test_full_queue_answers_503_with_retry_after() -> None:
    docs = [request_document([small_molecule(seed=k)]) for k in range(6)]
    with serve(PairPotential(delay_s=0.3), max_queue=1) as (url, _):
        responses = asyncio.run(_post_all(url, docs))
        with httpx.Client(base_url=url) as c:
            metrics = c.get("/metrics").text
    full = [r for r in responses if r.status_code == 503]
    assert full and any(r.status_code == 200 for r in responses)
    for r in full:
        assert_error(r, 503, "queue_full")
        assert int(r.headers["retry-after"]) >= 1
    assert sample_value(metrics, 'so2serve_rejected_requests_total{reason="queue_full"}') == len(
        full
    )


def test_structure_too_big_for_memory_is_507_and_the_server_carries_on() -> None:
    with serve(PairPotential(oom_above_atoms=20)) as (url, _), httpx.Client(base_url=url) as c:
        doc = request_document([small_molecule(), rattled_copper(2)])  # 6 + 32 atoms
        detail = assert_error(c.post("/evaluate", json=doc), 507, "out_of_memory")["detail"]
        assert (detail["index"], detail["n_atoms"]) == (1, 32)
        assert c.post("/evaluate", json=request_document([small_molecule()])).status_code == 200
        metrics = c.get("/metrics").text
    assert sample_value(metrics, "so2serve_oom_splits_total") == 1
    assert sample_value(metrics, "so2serve_oom_failures_total") == 1


async def _leave_early(url: str, pot: PairPotential) -> httpx.Response:
    """One client keeps its request; another gives up on a queued one after 0.1 s."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as keeper:
        doc = request_document([small_molecule("H2O")])
        before = len(pot.calls)
        kept = asyncio.create_task(keeper.post("/evaluate", json=doc))
        while len(pot.calls) == before:  # until the device is busy with it
            await asyncio.sleep(0.002)
        async with httpx.AsyncClient(base_url=url, timeout=0.1) as leaver:
            with pytest.raises(httpx.ReadTimeout):
                await leaver.post("/evaluate", json=request_document([small_molecule("C6H6")]))
        return await kept


def test_client_disconnect_cancels_only_its_own_work() -> None:
    pot = PairPotential(delay_s=0.4)
    # The keeper's pass in the worker thread: run inline, it would hold the event loop, and
    # the leaver's request would reach the server only after its client had gone.
    with serve(pot, inline_max_atoms=0) as (url, _):
        assert asyncio.run(_leave_early(url, pot)).status_code == 200
        with httpx.Client(base_url=url) as c:
            assert (
                c.post("/evaluate", json=request_document([small_molecule("CH4")])).status_code
                == 200
            )
            metrics = c.get("/metrics").text
    assert sample_value(metrics, "so2serve_cancelled_requests_total") == 1
    assert all(atoms != 12 for _, atoms in pot.calls)  # the benzene never reached the device


def test_a_large_request_is_parsed_off_the_loop_and_spread_over_passes() -> None:
    crystals = [rattled_copper(2, seed=k) for k in range(120)]  # 3840 atoms
    body = orjson.dumps(request_document(crystals)) + b" " * (1 << 20)  # > 1 MB: parsed in a thread
    with serve(max_batch_atoms=1000) as (url, pot), httpx.Client(base_url=url, timeout=60) as c:
        response = c.post("/evaluate", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 200
    document = response.json()
    assert document["provenance"]["passes"] == 4  # 31 crystals of 32 atoms fit in 1000
    direct = PairPotential().predict(Structures.from_atoms(crystals), {"energy", "forces"})
    energies = [r["energy"] for r in document["results"]]
    np.testing.assert_allclose(energies, direct.energy.numpy(), rtol=1e-12)
    assert max(atoms for _, atoms in pot.calls) <= 1000


def test_a_model_that_refuses_coincident_atoms_is_not_checked_twice() -> None:
    """Decoding leaves the coincident-atoms check to such a model (it is about half of the
    validation of a small structure); the client gets the same 422 from the worker."""
    body = b'{"structures": [' + ONE_H + b", " + TWO_H_AT_ORIGIN + b"]}"
    with (
        serve(PairPotential(refuses_coincident_atoms=True)) as (url, _),
        httpx.Client(base_url=url, timeout=30) as c,
    ):
        response = c.post("/evaluate", content=body, headers={"Content-Type": JSON})
    error = assert_error(response, 422, "coincident_atoms")
    assert error["detail"]["field"] == "structures[1].positions"
    assert error["message"].startswith("structure 1:")


def test_parse_skips_only_the_coincident_check_when_asked() -> None:
    body = b'{"structures": [' + TWO_H_AT_ORIGIN + b"]}"
    _, structures = parse_evaluate(body, WireFormat.JSON, check_coincident=False)
    assert structures.n_atoms == 2
    with pytest.raises(InvalidStructureError, match="coincident"):
        parse_evaluate(body, WireFormat.JSON)
