"""A request's outcome does not depend on its batch mates; requests cut off by a server
shutdown get the JSON 503 the clients retry; every refusal of a too-large request is counted;
large requests are estimated in numpy at admission. Fakes only (``PairPotential``), CPU."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import numpy as np
import torch
import uvicorn

from service.api import ServiceSettings, create_app
from service.api.http_protocol import HeadJoiningHTTPProtocol
from service.engine import Engine, EvaluationResult, ServiceMetrics
from service.engine.batcher import estimate_edges
from service.graph.structures import StructureArrays, Structures
from tests.service.fakes import (
    FakePrediction,
    PairPotential,
    free_port_socket,
    rattled_copper,
    request_document,
    running_server,
    small_molecule,
)
from tests.service.test_engine import device_started, direct, run_engine, structures_of

GRADIENT_PROPERTIES = frozenset(("forces", "virial", "stress"))


class BackwardNeedsMemory(PairPotential):
    """Like ``Potential``: energy alone runs without autograd and needs little memory; forces
    or stress need the backward pass, which does not fit above ``backward_atoms`` atoms."""

    backward_atoms: int = 20

    def predict(self, structures: Structures, properties: Collection[str]) -> FakePrediction:
        if GRADIENT_PROPERTIES & set(properties) and structures.n_atoms > self.backward_atoms:
            with self.lock:
                self.calls.append((structures.n_structures, structures.n_atoms))
            raise torch.OutOfMemoryError("CUDA out of memory (injected: backward pass)")
        return super().predict(structures, properties)


def test_an_energy_only_request_does_not_fail_because_a_batch_mate_asked_for_forces() -> None:
    """A 32-atom crystal asked for energy only fits alone; coalesced with a small request that
    asks for forces, the pass computes forces for every structure (the union of the asked
    properties) and runs out of memory. The crystal is then tried alone for what its own
    request asked (no backward pass) and succeeds, with the numbers it gets alone; it used to
    fail with 507 out_of_memory for a backward pass it never asked for."""
    pot = BackwardNeedsMemory(delay_s=0.1)
    crystal = structures_of(rattled_copper(2))  # 32 atoms
    water = structures_of(small_molecule("H2O"))
    energy_only = frozenset(("energy",))

    async def scenario(engine: Engine, metrics: ServiceMetrics) -> list[Any]:
        alone = await engine.evaluate(crystal, energy_only)  # control: fits on its own
        before = len(pot.calls)
        blocker = engine.submit(structures_of(small_molecule("CH4")), energy_only)
        await device_started(pot, before)
        together = [engine.submit(crystal, energy_only), engine.submit(water, {"forces"})]
        results = await asyncio.gather(blocker, *together, return_exceptions=True)
        return [alone, *results[1:]]

    alone, coalesced, small = run_engine(pot, scenario)
    assert isinstance(small, EvaluationResult)
    assert isinstance(coalesced, EvaluationResult), f"energy-only request failed: {coalesced!r}"
    np.testing.assert_array_equal(coalesced.energy, alone.energy)
    np.testing.assert_allclose(coalesced.energy, direct(PairPotential(), crystal)["energy"])


def _sample(metrics_text: str, name: str) -> float:
    for line in metrics_text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_request_above_the_request_atom_limit_is_counted_as_rejected() -> None:
    """``so2serve_rejected_requests_total{reason="too_many_atoms"}`` counts both 413
    ``too_many_atoms`` refusals: a structure above ``--max-atoms`` (the engine's) and a request
    above ``max_request_atoms`` (refused before the engine)."""
    app = create_app(ServiceSettings(max_atoms=5, max_request_atoms=10), evaluator=PairPotential())
    rejected = 'so2serve_rejected_requests_total{reason="too_many_atoms"}'
    with running_server(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        for doc in (
            request_document([small_molecule("CH3OH")]),  # one structure of 6 atoms > 5: counted
            request_document([small_molecule("H2O")] * 2 + [small_molecule("CH4")]),  # 11 > 10
        ):
            response = c.post("/evaluate", json=doc)
            assert (response.status_code, response.json()["code"]) == (413, "too_many_atoms")
        metrics = c.get("/metrics").text
    assert _sample(metrics, rejected) == 2


@contextmanager
def _server_with_grace(app: Any, grace_s: int) -> Iterator[tuple[str, uvicorn.Server]]:
    """Like ``running_server``, with a short graceful-shutdown deadline; yields (url, server)."""
    sock = free_port_socket()
    config = uvicorn.Config(
        app,
        log_level="critical",
        lifespan="on",
        timeout_graceful_shutdown=grace_s,
        http=HeadJoiningHTTPProtocol,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", server
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def test_requests_cut_off_by_shutdown_get_503_not_ready_json() -> None:
    """Requests still queued or on the device when the graceful-shutdown deadline passes
    (``timeout_graceful_shutdown``, 30 s in ``so2serve serve``) get the JSON 503 ``not_ready``
    with Retry-After, which the clients retry against the restarted server (uvicorn's own
    answer to a cancelled handler is a plain-text 500, which they do not retry)."""
    pot = PairPotential(delay_s=2.0)
    app = create_app(ServiceSettings(), evaluator=pot)
    docs = [request_document([small_molecule(seed=k)]) for k in range(3)]

    async def cut_off(url: str, server: uvicorn.Server) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            posts = [asyncio.ensure_future(c.post("/evaluate", json=d)) for d in docs]
            before = len(pot.calls)
            await asyncio.sleep(0.3)
            assert len(pot.calls) > before  # a pass is on the device, the rest queued
            server.should_exit = True
            return list(await asyncio.gather(*posts))

    with _server_with_grace(app, grace_s=1) as (url, server):
        responses = asyncio.run(cut_off(url, server))
    for response in responses:
        assert response.status_code == 503, (response.status_code, response.text)
        assert response.headers["content-type"].startswith("application/json")
        assert response.json()["code"] == "not_ready"
        assert "retry-after" in response.headers


def test_many_structures_are_estimated_like_one_at_a_time() -> None:
    """Admission estimates a request of more than a few dozen structures in numpy (a Python
    loop over 20,000 held the event loop for 0.2 s): the same numbers as one at a time, for
    crystals, molecules and slabs."""
    items = []
    for k in range(40):
        atoms = [rattled_copper(1, seed=k), small_molecule("CH3OH", seed=k), small_molecule("H2O")][
            k % 3
        ]
        if k % 3 == 2:
            atoms.center(vacuum=3.0)
            atoms.pbc = (True, True, False)
        items.append(StructureArrays(numbers=atoms.numbers, positions=atoms.positions,
                                     cell=atoms.cell.array if atoms.cell.rank else None,
                                     pbc=atoms.pbc if atoms.cell.rank else None))  # fmt: skip
    together = estimate_edges(Structures.from_arrays(items), 6.0)
    alone = np.concatenate([estimate_edges(Structures.from_arrays([it]), 6.0) for it in items])
    np.testing.assert_array_equal(together, alone)
