"""The engine over several devices: one queue, one worker thread per device.

Two ``PairPotential`` instances stand in for two GPUs (each records the passes it ran). The
GPU test at the end runs the real model on two CUDA devices, the second not the current one.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any, TypeVar

import httpx
import numpy as np
import pytest
import torch

from service.api.app import create_app
from service.api.settings import ServiceSettings
from service.engine import BatchLimits, Engine, ServiceMetrics, Worker
from service.engine.errors import EngineClosedError
from service.graph.structures import Structures
from service.model.potential import resolve_devices
from tests.service.fakes import (
    FakePrediction,
    PairPotential,
    element_numbers,
    rattled_copper,
    request_document,
    running_server,
    small_molecule,
)
from tests.service.test_engine import PROPS, assert_same, direct

T = TypeVar("T")


def run_lanes(
    potentials: Sequence[PairPotential],
    scenario: Callable[[Engine], Awaitable[T]],
    **limits: Any,
) -> T:
    limits.setdefault("inline_max_atoms", 0)

    async def main() -> T:
        metrics = ServiceMetrics()
        engine = Engine(
            [Worker(p, metrics) for p in potentials],
            BatchLimits(**limits),
            metrics,
            rcut=potentials[0].rcut,
            elements=element_numbers(potentials[0]),
        )
        await engine.start()
        try:
            return await scenario(engine)
        finally:
            await engine.stop()

    return asyncio.run(main())


def crystals(n: int) -> Structures:
    return Structures.from_atoms([rattled_copper(1, seed=k) for k in range(n)])


def test_a_large_request_is_spread_over_every_device_and_joined_in_order() -> None:
    lanes = [PairPotential(delay_s=0.05), PairPotential(delay_s=0.05)]
    request = crystals(12)  # 4 atoms each; 8 atoms per pass → 6 passes
    expected = direct(PairPotential(), request)

    async def scenario(engine: Engine) -> Any:
        return await engine.evaluate(request, PROPS)

    result = run_lanes(lanes, scenario, max_batch_atoms=8)
    assert_same(result, expected)
    assert result.timings.passes == 6
    assert all(len(p.calls) >= 2 for p in lanes), [p.calls for p in lanes]
    assert sum(len(p.calls) for p in lanes) == 6


def test_work_that_fits_one_pass_is_shared_among_idle_devices() -> None:
    lanes = [PairPotential(), PairPotential()]
    request = crystals(12)  # 48 atoms: one pass of the default budget

    async def scenario(engine: Engine) -> Any:
        return await engine.evaluate(request, PROPS)

    result = run_lanes(lanes, scenario)
    assert_same(result, direct(PairPotential(), request))
    assert [p.calls for p in lanes] == [[(6, 24)], [(6, 24)]]
    alone = PairPotential()
    run_lanes([alone], scenario)
    assert alone.calls == [(12, 48)]


class _Rendezvous(PairPotential):
    """A pass that waits (up to a timeout) until another lane's pass is running too: it
    finishes quickly only if the two devices really run at the same time."""

    def __init__(self, barrier: threading.Barrier) -> None:
        super().__init__()
        self.barrier = barrier
        self.met = False

    def predict(self, structures: Structures, properties: Collection[str]) -> FakePrediction:
        try:
            self.barrier.wait(timeout=5.0)
            self.met = True
        except threading.BrokenBarrierError:
            pass
        return super().predict(structures, properties)


def test_two_devices_run_passes_at_the_same_time() -> None:
    barrier = threading.Barrier(2)
    lanes = [_Rendezvous(barrier), _Rendezvous(barrier)]
    requests = [crystals(1), crystals(1)]

    async def scenario(engine: Engine) -> list[Any]:
        return list(await asyncio.gather(*(engine.evaluate(s, PROPS) for s in requests)))

    # One structure per pass: the second request cannot join the first one's batch.
    started = time.perf_counter()
    results = run_lanes(lanes, scenario, max_batch_atoms=4)
    assert time.perf_counter() - started < 4.0
    assert all(p.met for p in lanes)
    for result, s in zip(results, requests, strict=True):
        assert_same(result, direct(PairPotential(), s))


def test_a_structure_failing_on_one_device_fails_only_its_request() -> None:
    lanes = [PairPotential(oom_above_atoms=6), PairPotential(oom_above_atoms=6)]
    big = Structures.from_atoms([rattled_copper(2, seed=1)])  # 32 atoms: too large everywhere
    small = [crystals(1) for _ in range(3)]

    async def scenario(engine: Engine) -> list[Any]:
        tasks = [engine.evaluate(big, PROPS), *(engine.evaluate(s, PROPS) for s in small)]
        return list(await asyncio.gather(*tasks, return_exceptions=True))

    outcomes = run_lanes(lanes, scenario, max_batch_atoms=4)
    assert type(outcomes[0]).__name__ == "StructureTooLargeError"
    for outcome, s in zip(outcomes[1:], small, strict=True):
        assert_same(outcome, direct(PairPotential(), s))


def test_stop_fails_the_requests_running_on_every_device() -> None:
    lanes = [PairPotential(delay_s=0.3), PairPotential(delay_s=0.3)]

    async def scenario(engine: Engine) -> list[BaseException | Any]:
        futures = [engine.submit(crystals(1), PROPS) for _ in range(3)]
        while not all(p.calls for p in lanes):
            await asyncio.sleep(0.005)
        await engine.stop()
        return list(await asyncio.gather(*futures, return_exceptions=True))

    outcomes = run_lanes(lanes, scenario, max_batch_atoms=4)
    assert all(isinstance(o, EngineClosedError) for o in outcomes), outcomes


def test_engine_reports_its_devices_and_needs_one() -> None:
    metrics = ServiceMetrics()
    engine = Engine(
        [Worker(PairPotential(), metrics), Worker(PairPotential(), metrics)],
        BatchLimits(),
        metrics,
        rcut=4.0,
    )
    assert engine.devices == ["cpu", "cpu"]
    with pytest.raises(ValueError, match="at least one worker"):
        Engine([], BatchLimits(), metrics, rcut=4.0)


@pytest.mark.parametrize("spec", ["cuda:0,cuda:1", "cuda:all", "cuda:3", "cpu", "auto"])
def test_device_settings_accept_lists_of_gpus(spec: str) -> None:
    assert ServiceSettings(device=spec).device == spec


@pytest.mark.parametrize("spec", ["cpu,cpu", "cuda:0,", "cuda,cuda:1", "gpu:0", "cuda:all,cuda:0"])
def test_device_settings_refuse_other_lists(spec: str) -> None:
    with pytest.raises(ValueError, match="device must be"):
        ServiceSettings(device=spec)


def test_pass_profiling_needs_one_device() -> None:
    with pytest.raises(ValueError, match="pass profiling records one device"):
        ServiceSettings(device="cuda:0,cuda:1", profile_passes=3)


def test_resolve_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_devices("cpu") == [torch.device("cpu")]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert resolve_devices("cuda:all") == [torch.device("cuda", k) for k in range(3)]
    assert resolve_devices("cuda:2,cuda:0") == [torch.device("cuda", 2), torch.device("cuda", 0)]
    with pytest.raises(ValueError, match="named twice"):
        resolve_devices("cuda:1,cuda:1")
    with pytest.raises(ValueError, match="3 CUDA device"):
        resolve_devices("cuda:0,cuda:3")
    with pytest.raises(ValueError, match="each be cuda:N"):
        resolve_devices("cuda,cuda:1")


def test_load_potentials_reads_the_file_once_and_places_a_copy_on_each_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import service.model.io as model_io
    from service.model.potential import load_potentials

    reads: list[object] = []
    real_load = model_io.load_model
    monkeypatch.setattr(model_io, "load_model", lambda path: reads.append(path) or real_load(path))
    monkeypatch.setattr(
        "service.model.potential.resolve_devices", lambda spec: [torch.device("cpu")] * 2
    )
    first, second = load_potentials(None, devices="cuda:0,cuda:1")
    assert len(reads) == 1
    assert first.model is not second.model
    assert next(first.model.parameters()) is not next(second.model.parameters())
    request = Structures.from_atoms([small_molecule("H2O")])
    a, b = (p.predict(request, ("energy", "forces")) for p in (first, second))
    torch.testing.assert_close(a.energy, b.energy, rtol=0, atol=0)
    torch.testing.assert_close(a.forces, b.forces, rtol=0, atol=0)


def test_resolve_devices_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_devices("cuda:all")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_model_on_two_gpus_matches_one_and_serves_from_one_queue() -> None:
    """The real model on cuda:1 while cuda:0 is current (Triton launches and CUDA-graph
    capture follow the current device), then an engine over both GPUs."""
    from service.model.potential import load_potential

    torch.cuda.set_device(0)
    first, second = (load_potential(None, device=f"cuda:{k}") for k in range(2))
    assert next(second.model.parameters()).device == torch.device("cuda", 1)
    props = ("energy", "forces")
    for step in range(6):  # eager, then recorded and replayed passes, new positions each
        request = water_batch(6, seed=10 * step)
        a = first.predict(request, props)
        b = second.predict(request, props)
        assert a.forces is not None and b.forces is not None
        np.testing.assert_allclose(b.energy.cpu(), a.energy.cpu(), rtol=1e-6, atol=1e-5)
        np.testing.assert_allclose(b.forces.cpu(), a.forces.cpu(), rtol=1e-5, atol=1e-5)
    assert torch.cuda.current_device() == 0
    assert first.info()["execution"]["cuda_graphs"] and second.info()["execution"]["cuda_graphs"]

    async def main() -> Any:
        metrics = ServiceMetrics()
        engine = Engine(
            [Worker(first, metrics), Worker(second, metrics)],
            BatchLimits(max_batch_atoms=6, inline_max_atoms=0),
            metrics,
            rcut=float(first.info()["rcut"]),
        )
        await engine.start()
        try:
            await engine.warm_up([1, 8])
            return await engine.evaluate(request, frozenset(props))
        finally:
            await engine.stop()

    served = asyncio.run(main())
    direct_result = first.predict(request, props)
    assert direct_result.forces is not None
    np.testing.assert_allclose(served.energy, direct_result.energy.cpu().double(), atol=1e-5)
    np.testing.assert_allclose(served.forces, direct_result.forces.cpu().double(), atol=1e-5)


def water_batch(n: int, seed: int) -> Structures:
    return Structures.from_atoms([small_molecule("H2O", seed=seed + k) for k in range(n)])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpus_record_cuda_graphs_at_the_same_time() -> None:
    """Two lanes meet the same new batch shapes together, so they record their CUDA graphs at
    the same time: each graph must be recorded on its own device's stream (torch's default
    capture stream is one per process, made on the first device that captured: a graph of
    the other device came out empty and replayed stale results), and captures must not
    overlap (they invalidated each other, which turned graphs off for good)."""
    from service.model.potential import load_potential

    potentials = [load_potential(None, device=f"cuda:{k}") for k in range(2)]
    reference = load_potential(None, device="cpu")
    props = ("energy", "forces")
    barrier = threading.Barrier(2)
    outcomes: dict[int, list[Any]] = {0: [], 1: []}

    def lane(k: int) -> None:
        for step in range(6):
            barrier.wait(timeout=60)
            outcomes[k].append(potentials[k].predict(water_batch(6, seed=10 * step), props))

    threads = [threading.Thread(target=lane, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    for k, potential in enumerate(potentials):
        assert potential.info()["execution"]["cuda_graphs"], f"cuda:{k} turned its graphs off"
        assert len(outcomes[k]) == 6
        for step, got in enumerate(outcomes[k]):
            want = reference.predict(water_batch(6, seed=10 * step), props)
            assert got.forces is not None and want.forces is not None
            np.testing.assert_allclose(got.energy.cpu(), want.energy, rtol=1e-4, atol=1e-3)
            np.testing.assert_allclose(got.forces.cpu(), want.forces, rtol=1e-4, atol=1e-3)


def test_service_over_two_devices_answers_and_reports_both() -> None:
    lanes = [PairPotential(delay_s=0.02), PairPotential(delay_s=0.02)]
    app = create_app(ServiceSettings(max_batch_atoms=8, inline_max_atoms=0), evaluator=lanes)
    waters = [small_molecule("H2O", seed=k) for k in range(10)]
    expected = direct(PairPotential(), Structures.from_atoms(waters))
    with running_server(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        info = client.get("/info").json()
        assert info["execution"]["device"] == "cpu,cpu"
        answer = client.post("/evaluate", json=request_document(waters))
        assert answer.status_code == 200, answer.text
        results = answer.json()["results"]
    energies = [r["energy"] for r in results]
    np.testing.assert_allclose(energies, expected["energy"], rtol=1e-12)
    assert all(p.calls for p in lanes)
