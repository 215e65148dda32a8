"""The engine alone (no HTTP): batching, splitting, limits, cancellation, OOM recovery."""

from __future__ import annotations

import asyncio
import json
import math
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import torch
from ase import Atoms

from service.engine import (
    BatchLimits,
    Engine,
    EvaluationFailedError,
    EvaluationResult,
    QueueFullError,
    ServiceMetrics,
    StructureTooLargeError,
    TooManyAtomsError,
    Worker,
    batcher,
)
from service.engine.batcher import estimate_edges
from service.engine.profiling import PassProfiler, ProfileRequest
from service.engine.worker import DeviceThread
from service.graph.errors import InvalidStructureError
from service.graph.structures import OPEN_AXIS_ROOM, Structures
from service.model.errors import HostMemoryError
from tests.service.fakes import PairPotential, element_numbers, rattled_copper, small_molecule

T = TypeVar("T")
PROPS = frozenset(("energy", "forces", "stress", "energies"))


def run_engine(
    potential: PairPotential,
    scenario: Callable[[Engine, ServiceMetrics], Awaitable[T]],
    profiler: PassProfiler | None = None,
    **limits: Any,
) -> T:
    # The worker path unless a test asks for inline passes: the schedules pinned here are
    # the worker thread's (a lone client's inline pass has tests of its own).
    limits.setdefault("inline_max_atoms", 0)

    async def main() -> T:
        metrics = ServiceMetrics()
        engine = Engine(
            [Worker(potential, metrics)],
            BatchLimits(**limits),
            metrics,
            rcut=potential.rcut,
            elements=element_numbers(potential),
            profiler=profiler,
        )
        await engine.start()
        try:
            return await scenario(engine, metrics)
        finally:
            await engine.stop()

    return asyncio.run(main())


def metric(metrics: ServiceMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name)
    return 0.0 if value is None else value


def structures_of(*atoms: Atoms) -> Structures:
    return Structures.from_atoms(list(atoms))


def direct(potential: PairPotential, s: Structures) -> dict[str, np.ndarray]:
    p = potential.predict(s, PROPS)
    return {k: getattr(p, k).numpy() for k in ("energy", "forces", "energies", "stress")}


def assert_same(result: EvaluationResult, expected: dict[str, np.ndarray]) -> None:
    for name, want in expected.items():
        got = getattr(result, name)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=name)


async def device_started(potential: PairPotential, calls: int) -> None:
    """Wait until the potential has been called more than ``calls`` times."""
    while len(potential.calls) <= calls:
        await asyncio.sleep(0.002)


async def busy(engine: Engine, potential: PairPotential) -> asyncio.Task[EvaluationResult]:
    """Occupy the device with one request so that the following ones queue up together."""
    before = len(potential.calls)
    blocker = asyncio.create_task(engine.evaluate(structures_of(small_molecule("H2O")), PROPS))
    await device_started(potential, before)
    return blocker


def test_concurrent_requests_coalesce_and_get_their_own_results() -> None:
    pot = PairPotential(delay_s=0.15)
    requests = [structures_of(rattled_copper(1, seed=k)) for k in range(4)] + [
        structures_of(small_molecule(name, seed=k))
        for k, name in enumerate(("CH4", "CH3OH", "H2O", "C2H6"))
    ]
    expected = [direct(PairPotential(), s) for s in requests]

    async def scenario(engine: Engine, metrics: ServiceMetrics) -> list[EvaluationResult]:
        blocker = await busy(engine, pot)
        results = await asyncio.gather(*(engine.evaluate(s, PROPS) for s in requests))
        await blocker
        return list(results)

    results = run_engine(pot, scenario)
    for result, want in zip(results, expected, strict=True):
        assert_same(result, want)
    assert pot.calls[1] == (8, sum(s.n_atoms for s in requests))  # one pass after the blocker


def test_pass_gaps_are_observed_only_for_work_queued_before_the_device_freed() -> None:
    """``so2serve_pass_gap_seconds``: the device idle from the end of a pass to the start of
    the next, observed when that next pass's work was queued before the first ended (the
    requests waiting behind the blocker), not for a request arriving to an idle device."""
    pot = PairPotential(delay_s=0.1)
    water = structures_of(small_molecule("H2O"))

    async def scenario(engine: Engine, metrics: ServiceMetrics) -> tuple[float, float, float]:
        blocker = await busy(engine, pot)
        await asyncio.gather(*(engine.evaluate(water, PROPS) for _ in range(3)))
        await blocker
        after_backlog = metric(metrics, "so2serve_pass_gap_seconds_count")
        await asyncio.sleep(0.05)  # the device idles with nothing queued
        await engine.evaluate(water, PROPS)
        return (
            after_backlog,
            metric(metrics, "so2serve_pass_gap_seconds_count"),
            metric(metrics, "so2serve_pass_gap_seconds_sum"),
        )

    after_backlog, total, seconds = run_engine(pot, scenario)
    assert after_backlog == 1  # the pass after the blocker
    assert total == 1  # the late request found the device idle: no gap
    assert 0.0 <= seconds < 0.1  # a loop turn and a thread hop, not a pass


def test_a_lone_client_never_waits_for_the_window() -> None:
    async def scenario(engine: Engine, metrics: ServiceMetrics) -> float:
        start = time.perf_counter()
        for _ in range(3):
            await engine.evaluate(structures_of(small_molecule()), PROPS)
        return time.perf_counter() - start

    assert run_engine(PairPotential(), scenario, window_s=2.0) < 1.0


async def sequential_client(
    engine: Engine, key: str, structures: Structures, requests: int
) -> list[EvaluationResult]:
    """A client like an MD run: its next request as soon as the previous answer is back."""
    return [await engine.evaluate(structures, PROPS, client=key) for _ in range(requests)]


async def lockstep_pair(engine: Engine, structures: Structures) -> None:
    """Clients "a" and "b" until their pace is known and they share passes (the first one
    runs alone, hence its extra request), both answered by the last pass."""
    await asyncio.gather(
        sequential_client(engine, "a", structures, 4),
        sequential_client(engine, "b", structures, 3),
    )


def requests_per_pass(pot: PairPotential) -> list[int]:
    return [n_structures for n_structures, _ in pot.calls]


GATHER_SUM = "so2serve_gather_wait_seconds_sum"


def gather_waits(metrics: ServiceMetrics) -> float:
    return metric(metrics, "so2serve_gather_wait_seconds_count")


@pytest.fixture
def loaded_machine_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loaded test machine may stall a client's return by milliseconds, which would make
    its measured pace exceed a quarter of these short passes now and then: allow a whole
    pass (what is tested is who is waited for, not the bound's value)."""
    monkeypatch.setattr(batcher, "GATHER_FRACTION", 1.0)


@pytest.mark.usefixtures("loaded_machine_bound")
@pytest.mark.parametrize("window_s", [0.0, 0.2], ids=["continuous", "gathering"])
def test_cohorts_of_returning_clients_merge_into_one_pass(window_s: float) -> None:
    """Eight clients start together: the first request finds the device idle and runs alone,
    the other seven run next, and from then on, under plain continuous batching, the two
    cohorts take turns (each pass carries whoever arrived during the previous one). Gathering
    waits for the cohort just answered, once the clients' pace is known, and merges them.
    (The first client makes one request more: all eight then finish in the same pass.)"""
    pot = PairPotential(delay_s=0.08)
    water = structures_of(small_molecule("H2O"))

    async def scenario(engine: Engine, metrics: ServiceMetrics) -> None:
        counts = [7] + [6] * 7
        await asyncio.gather(
            *(sequential_client(engine, f"c{k}", water, n) for k, n in enumerate(counts))
        )

    run_engine(pot, scenario, window_s=window_s)
    passes = requests_per_pass(pot)
    assert sum(passes) == 49
    if window_s == 0.0:
        assert passes == [1, 7] * 6 + [1]  # the split never heals by itself
    else:
        assert passes == [1, 7, 1] + [8] * 5


def test_a_lone_client_with_a_known_pace_is_never_held() -> None:
    pot = PairPotential(delay_s=0.05)

    async def scenario(engine: Engine, metrics: ServiceMetrics) -> float:
        await sequential_client(engine, "md", structures_of(small_molecule()), 6)
        return gather_waits(metrics)

    assert run_engine(pot, scenario, window_s=1.0) == 0
    assert requests_per_pass(pot) == [1] * 6


@pytest.mark.usefixtures("loaded_machine_bound")
@pytest.mark.parametrize(("think_s", "held"), [(0.002, True), (0.15, False)])
def test_only_clients_quicker_than_the_bound_are_waited_for(think_s: float, held: bool) -> None:
    """A keyed client that pauses between requests, next to an anonymous MD loop that keeps
    the device busy: its return is waited for if it comes back within the bound (a whole
    40 ms pass here, see ``loaded_machine_bound``), never if it thinks for longer."""
    pot = PairPotential(delay_s=0.04)
    water = structures_of(small_molecule("H2O"))

    async def scenario(engine: Engine, metrics: ServiceMetrics) -> float:
        async def thinker() -> None:
            for _ in range(5):
                await engine.evaluate(water, PROPS, client="thinker")
                await asyncio.sleep(think_s)

        async def anonymous_md() -> None:
            for _ in range(16):
                await engine.evaluate(water, PROPS)

        await asyncio.gather(thinker(), anonymous_md())
        return gather_waits(metrics)

    waits = run_engine(pot, scenario, window_s=1.0)
    assert (waits > 0) is held


@pytest.mark.usefixtures("loaded_machine_bound")
def test_a_client_that_does_not_return_holds_one_pass_within_the_bound() -> None:
    pot = PairPotential(delay_s=0.08)
    water = structures_of(small_molecule("H2O"))

    async def scenario(engine: Engine, metrics: ServiceMetrics) -> tuple[float, float]:
        # Then one of them stops.
        await lockstep_pair(engine, water)
        count, held_s = gather_waits(metrics), metric(metrics, GATHER_SUM)
        await sequential_client(engine, "a", water, 3)
        return gather_waits(metrics) - count, metric(metrics, GATHER_SUM) - held_s

    count, held_s = run_engine(pot, scenario, window_s=1.0)
    assert count == 1  # once: a client that missed its return is not waited for again
    # Until its due time (1.5 × its pace, well below a millisecond here, + 2 ms), far below
    # the bound (a pass here), even with the stalls of a loaded machine.
    assert held_s < 0.05


@pytest.mark.usefixtures("loaded_machine_bound")
def test_a_departed_client_is_not_waited_for() -> None:
    pot = PairPotential(delay_s=0.08)
    water = structures_of(small_molecule("H2O"))

    async def scenario(engine: Engine, metrics: ServiceMetrics) -> float:
        await lockstep_pair(engine, water)
        passes = len(pot.calls)
        gone = asyncio.ensure_future(engine.evaluate(water, PROPS, client="b"))
        stays = asyncio.ensure_future(engine.evaluate(water, PROPS, client="a"))
        await device_started(pot, passes)
        assert pot.calls[-1][0] == 2
        gone.cancel()  # its connection dropped while its pass ran
        await stays
        before = gather_waits(metrics)
        await sequential_client(engine, "a", water, 2)
        return gather_waits(metrics) - before

    assert run_engine(pot, scenario, window_s=1.0) == 0


def test_a_full_budget_starts_at_once() -> None:
    """Returning clients are not waited for once the queued work fills the atom budget."""
    pot = PairPotential(delay_s=0.06)
    methanol = structures_of(small_molecule("CH3OH"))  # 6 atoms

    async def scenario(engine: Engine, metrics: ServiceMetrics) -> float:
        clients = [
            asyncio.ensure_future(sequential_client(engine, f"c{k}", methanol, 5)) for k in range(4)
        ]
        # Until the first client is done (the last few requests have nobody to pair with).
        await asyncio.wait(clients, return_when=asyncio.FIRST_COMPLETED)
        waits = gather_waits(metrics)
        await asyncio.gather(*clients)
        return waits

    assert run_engine(pot, scenario, window_s=1.0, max_batch_atoms=12) == 0
    assert max(requests_per_pass(pot)) == 2


def test_big_request_is_spread_over_passes_in_order() -> None:
    pot = PairPotential()
    molecules = [small_molecule(name, seed=k) for k, name in enumerate(["CH3OH", "CH4", "H2O"] * 4)]
    s = structures_of(*molecules)
    expected = direct(PairPotential(), s)

    async def scenario(engine: Engine, metrics: ServiceMetrics) -> EvaluationResult:
        return await engine.evaluate(s, PROPS)

    result = run_engine(pot, scenario, max_batch_atoms=14)
    assert_same(result, expected)
    assert result.timings.passes == len(pot.calls) > 3
    assert all(atoms <= 14 for _, atoms in pot.calls)
    assert sum(n for n, _ in pot.calls) == len(molecules)


def test_a_structure_above_the_budget_runs_alone() -> None:
    pot = PairPotential()
    crystal = structures_of(rattled_copper(2))

    async def scenario(engine: Engine, metrics: ServiceMetrics) -> EvaluationResult:
        return await engine.evaluate(crystal, PROPS)

    result = run_engine(pot, scenario, max_batch_atoms=10, max_batch_edges=50)
    assert pot.calls == [(1, 32)]
    assert_same(result, direct(PairPotential(), crystal))


def test_refusals_at_admission() -> None:
    pot = PairPotential()

    async def scenario(engine: Engine, metrics: ServiceMetrics) -> None:
        with pytest.raises(TooManyAtomsError) as too_many:
            await engine.evaluate(structures_of(small_molecule(), rattled_copper(2)), PROPS)
        assert (too_many.value.index, too_many.value.n_atoms, too_many.value.limit) == (1, 32, 20)
        uranium = Atoms("HU", positions=[[0, 0, 0], [2, 0, 0]])
        with pytest.raises(InvalidStructureError) as unknown:
            await engine.evaluate(structures_of(small_molecule(), uranium), PROPS)
        assert (unknown.value.code, unknown.value.field) == (
            "unknown_element",
            "structures[1].species",
        )
        assert (
            metrics.registry.get_sample_value(
                "so2serve_rejected_requests_total", {"reason": "too_many_atoms"}
            )
            == 1
        )

    run_engine(pot, scenario, max_atoms=20)
    assert pot.calls == []


def test_full_queue_answers_with_retry_after() -> None:
    pot = PairPotential(delay_s=0.2)

    async def scenario(engine: Engine, metrics: ServiceMetrics) -> None:
        blocker = await busy(engine, pot)
        queued = [
            asyncio.create_task(engine.evaluate(structures_of(small_molecule()), PROPS))
            for _ in range(2)
        ]
        await asyncio.sleep(0)
        with pytest.raises(QueueFullError) as full:
            await engine.evaluate(structures_of(small_molecule()), PROPS)
        assert full.value.retry_after_s >= 1
        await asyncio.gather(blocker, *queued)  # the admitted ones still complete

    run_engine(pot, scenario, max_queue=2)


def test_withdrawn_request_never_reaches_the_device() -> None:
    pot = PairPotential(delay_s=0.2)
    ethane = structures_of(small_molecule("C2H6"))  # 8 atoms: recognisable in pot.calls

    async def scenario(engine: Engine, metrics: ServiceMetrics) -> None:
        blocker = await busy(engine, pot)
        doomed = asyncio.create_task(engine.evaluate(ethane, PROPS))
        survivor = asyncio.create_task(engine.evaluate(structures_of(small_molecule("CH4")), PROPS))
        await asyncio.sleep(0.02)
        doomed.cancel()
        await asyncio.gather(blocker, survivor)
        assert doomed.cancelled()
        assert engine.queue_depth == 0
        assert metric(metrics, "so2serve_cancelled_requests_total") == 1

    run_engine(pot, scenario)
    assert all(atoms != 8 for _, atoms in pot.calls)
    assert pot.calls[-1] == (1, 5)


def test_out_of_memory_bisects_and_recovers() -> None:
    pot = PairPotential(delay_s=0.05, oom_above_atoms=20)
    requests = [structures_of(small_molecule("CH3OH", seed=k)) for k in range(4)]  # 4 × 6 atoms

    async def scenario(engine: Engine, metrics: ServiceMetrics) -> list[EvaluationResult]:
        blocker = await busy(engine, pot)
        results = await asyncio.gather(*(engine.evaluate(s, PROPS) for s in requests))
        await blocker
        assert metric(metrics, "so2serve_oom_splits_total") == 1
        return list(results)

    results = run_engine(pot, scenario)
    for result, s in zip(results, requests, strict=True):
        assert_same(result, direct(PairPotential(), s))
    assert [atoms for _, atoms in pot.calls[1:]] == [24, 12, 12]


def test_a_structure_that_never_fits_fails_alone_with_a_typed_error() -> None:
    pot = PairPotential(delay_s=0.05, oom_above_atoms=20)
    crystal_request = structures_of(small_molecule("CH4"), rattled_copper(2))  # 5 + 32 atoms
    molecule_request = structures_of(small_molecule("H2O"))

    async def scenario(engine: Engine, metrics: ServiceMetrics) -> EvaluationResult:
        blocker = await busy(engine, pot)
        crystal = asyncio.create_task(engine.evaluate(crystal_request, PROPS))
        molecule = asyncio.create_task(engine.evaluate(molecule_request, PROPS))
        with pytest.raises(StructureTooLargeError) as oom:
            await crystal
        assert (oom.value.index, oom.value.n_atoms) == (1, 32)
        await blocker
        assert metric(metrics, "so2serve_oom_failures_total") == 1
        # The server keeps serving, and the failed structure left no stale state behind.
        again = await engine.evaluate(molecule_request, PROPS)
        assert_same(again, direct(PairPotential(), molecule_request))
        return await molecule

    result = run_engine(pot, scenario)
    assert_same(result, direct(PairPotential(), molecule_request))


class HostBoundPairPotential(PairPotential):
    """A CPU potential whose memory check refuses passes above ``limit_atoms``."""

    def __init__(self, limit_atoms: int) -> None:
        super().__init__()
        self.limit_atoms = limit_atoms

    def predict(self, structures: Structures, properties: Any) -> Any:
        if structures.n_atoms > self.limit_atoms:
            raise HostMemoryError(f"evaluating {structures.n_atoms} atoms needs too much")
        return super().predict(structures, properties)


def test_a_host_memory_refusal_is_bisected_like_a_device_out_of_memory() -> None:
    pot = HostBoundPairPotential(limit_atoms=20)
    request = structures_of(small_molecule("CH4"), rattled_copper(2), small_molecule("H2O"))

    async def scenario(engine: Engine, metrics: ServiceMetrics) -> None:
        with pytest.raises(StructureTooLargeError) as refused:
            await engine.evaluate(request, PROPS)
        assert (refused.value.index, refused.value.n_atoms) == (1, 32)
        assert "(evaluating 32 atoms needs too much)" in str(refused.value)  # its own figures
        assert metric(metrics, "so2serve_oom_failures_total") == 1
        alone = structures_of(small_molecule("H2O"))
        assert_same(await engine.evaluate(alone, PROPS), direct(PairPotential(), alone))

    run_engine(pot, scenario)


class ExplodingOnMethane(PairPotential):
    def predict(self, structures: Structures, properties: Any) -> Any:
        if 5 in np.diff(structures.ptr.numpy()):
            raise RuntimeError("model bug on 5-atom structures")
        return super().predict(structures, properties)


def test_a_model_error_fails_only_its_request() -> None:
    pot = ExplodingOnMethane(delay_s=0.05)
    good = structures_of(small_molecule("H2O"))

    async def scenario(engine: Engine, metrics: ServiceMetrics) -> EvaluationResult:
        blocker = await busy(engine, pot)
        bad = asyncio.create_task(
            engine.evaluate(structures_of(small_molecule("H2O"), small_molecule("CH4")), PROPS)
        )
        fine = asyncio.create_task(engine.evaluate(good, PROPS))
        with pytest.raises(EvaluationFailedError, match=r"structures\[1\].*model bug"):
            await bad
        await blocker
        return await fine

    assert_same(run_engine(pot, scenario), direct(PairPotential(), good))


def test_a_failed_pass_blames_no_structure(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass that fails as a whole (outside the per-structure isolation) fails its requests
    without naming a structure: naming the first made ``screen`` mark that one failed and send
    the others again. The engine then keeps serving."""
    pot = PairPotential()
    request = structures_of(small_molecule("H2O"), small_molecule("CH4"))
    working = Worker.run

    def broken(self: Worker, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("device lost")

    async def scenario(engine: Engine, metrics: ServiceMetrics) -> EvaluationResult:
        monkeypatch.setattr(Worker, "run", broken)
        with pytest.raises(EvaluationFailedError, match="evaluating the batch failed") as caught:
            await engine.evaluate(request, PROPS)
        assert caught.value.index is None
        monkeypatch.setattr(Worker, "run", working)
        return await engine.evaluate(request, PROPS)

    assert_same(run_engine(pot, scenario), direct(PairPotential(), request))


class NaNOnMethane(PairPotential):
    def predict(self, structures: Structures, properties: Any) -> Any:
        out = super().predict(structures, properties)
        if 5 in np.diff(structures.ptr.numpy()):
            out.forces = torch.full_like(out.forces, float("nan"))
        return out


def test_a_non_finite_result_fails_only_its_structure() -> None:
    pot = NaNOnMethane()
    good = structures_of(small_molecule("H2O"))

    async def scenario(engine: Engine, metrics: ServiceMetrics) -> EvaluationResult:
        with pytest.raises(EvaluationFailedError, match=r"structures\[1\].*non-finite forces"):
            await engine.evaluate(
                structures_of(small_molecule("H2O"), small_molecule("CH4")), PROPS
            )
        return await engine.evaluate(good, PROPS)

    assert_same(run_engine(pot, scenario), direct(PairPotential(), good))


def test_edge_estimate() -> None:
    crystal, mol = rattled_copper(2), small_molecule("CH3OH")
    slab = rattled_copper(2)
    slab.pbc = (True, True, False)
    slab.center(vacuum=5.0, axis=2)
    # A cluster packed far tighter than a liquid (0.58 atoms/Å³ in its box), yet physical
    # enough to be accepted: a liquid's density would under-estimate it six times.
    cluster = Atoms("H200", positions=np.random.default_rng(3).uniform(0.0, 6.0, (200, 3)))
    estimate = estimate_edges(structures_of(crystal, mol, slab, cluster), rcut=4.0)
    sphere = 4 / 3 * math.pi * 4.0**3
    density = len(crystal) / crystal.get_volume()
    assert estimate[0] == pytest.approx(len(crystal) * density * sphere)
    assert estimate[1] == len(mol) * (len(mol) - 1)  # a small molecule: everyone is a neighbour
    # Not periodic along every axis: the density in the lattice area times the slab's thickness
    # (+1 Å), at least the reference density, and no cap at n - 1.
    thickness = np.ptp(slab.positions[:, 2]) + OPEN_AXIS_ROOM
    slab_density = len(slab) / (np.linalg.norm(np.cross(*slab.cell[:2])) * thickness)
    assert slab_density < batcher.REFERENCE_DENSITY < 1.2 * slab_density
    assert estimate[2] == pytest.approx(len(slab) * batcher.REFERENCE_DENSITY * sphere)
    box = np.prod(np.ptp(cluster.positions, axis=0) + OPEN_AXIS_ROOM)
    assert estimate[3] == pytest.approx(len(cluster) * len(cluster) / box * sphere)
    actual = PairPotential()._edges(structures_of(crystal), [0, len(crystal)])[0].numel()
    assert 0.7 < estimate[0] / actual < 1.3
    # The cluster's surface atoms have fewer neighbours than its box density says: an
    # over-estimate (safe: its pass budget is kept), where a liquid's density was 4× under.
    actual = PairPotential()._edges(structures_of(cluster), [0, len(cluster)])[0].numel()
    assert 1.0 < estimate[3] / actual < 2.0
    assert len(cluster) * batcher.REFERENCE_DENSITY * sphere < 0.3 * actual


def test_device_thread_runs_in_order_reports_back_and_survives_failures() -> None:
    async def scenario() -> None:
        device = DeviceThread(name="test-device")
        order: list[int] = []
        device.submit(lambda: order.append(1))
        device.submit(lambda: 1 / 0)  # a failing call is logged; the thread carries on
        assert await device.run(lambda: [*order, 2]) == [1, 2]
        with pytest.raises(ZeroDivisionError):
            await device.run(lambda: 1 / 0)
        assert await device.run(threading.current_thread) is not threading.main_thread()
        await asyncio.to_thread(device.close)

    asyncio.run(scenario())


def test_a_structure_the_model_refuses_fails_alone_without_bisection() -> None:
    """Coincident atoms found by the model (not at admission): that request gets the 422
    error naming its own structure; the rest of the batch is evaluated in two passes."""
    pot = PairPotential(delay_s=0.05, refuses_coincident_atoms=True)
    good = [structures_of(small_molecule("H2O", seed=k)) for k in range(4)]
    twin = small_molecule("H2O")
    twin.positions[1] = twin.positions[0]
    bad = Structures.from_atoms([small_molecule("CH4"), twin], check_coincident=False)

    async def scenario(engine: Engine, metrics: ServiceMetrics) -> list[Any]:
        blocker = engine.submit(good[0], PROPS)  # the rest queue up behind it: one batch
        queued = [engine.submit(s, PROPS) for s in (good[1], bad, good[2], good[3])]
        return await asyncio.gather(blocker, *queued, return_exceptions=True)

    results = run_engine(pot, scenario)
    # The blocker, the batch of 5 structures that failed, then the 2 structures before the
    # refused one and the 2 after it.
    assert requests_per_pass(pot) == [1, 5, 2, 2]
    failure = results.pop(2)
    assert isinstance(failure, InvalidStructureError)
    assert failure.code == "coincident_atoms"
    assert failure.index == 1
    assert failure.field == "structures[1].positions"
    assert str(failure).startswith("structure 1:")
    for result, structures in zip(results, good, strict=True):
        assert isinstance(result, EvaluationResult)
        np.testing.assert_array_equal(result.forces, direct(pot, structures)["forces"])


def test_pass_profiler_records_the_asked_passes(tmp_path: Path) -> None:
    request = ProfileRequest(passes=2, skip=1, out_dir=tmp_path, label="test")
    profiler = PassProfiler(request)
    water = structures_of(small_molecule("H2O"))

    async def scenario(engine: Engine, metrics: ServiceMetrics) -> None:
        for _ in range(5):
            await engine.evaluate(water, PROPS)

    run_engine(PairPotential(), scenario, profiler)
    assert profiler.written is not None
    document = json.loads(profiler.written.read_text())
    assert [p["atoms"] for p in document["passes"]] == [3, 3]
    first = document["passes"][0]
    assert first["wall_ms"] > 0 and first["worker_cpu_ms"] > 0
    assert first["loop_cpu_ms"] is not None
    names = {op["name"] for op in first["top_cpu_ops"]}
    assert "so2serve::pass" in names  # Python time between ops is its self time
    assert any(name.startswith("aten::") for name in names)
    assert document["context"]["switch_interval_s"] == sys.getswitchinterval()
    assert set(document["medians"]) >= {"wall_ms", "worker_cpu_ms", "worker_blocked_ms"}


class ThreadRecording(PairPotential):
    """Records the thread of every pass."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.threads: list[int] = []

    def predict(self, structures: Structures, properties: Any) -> Any:
        self.threads.append(threading.get_ident())
        return super().predict(structures, properties)


INLINE = 2048  # the service's default inline_max_atoms (run_engine turns inline off)


async def socket_client(
    engine: Engine, key: str, structures: Structures, requests: int
) -> list[EvaluationResult]:
    """``sequential_client`` whose requests reach the engine as an HTTP client's do: the
    event loop turns in between (they come through its poll)."""
    results = []
    for _ in range(requests):
        await asyncio.sleep(0)
        results.append(await engine.evaluate(structures, PROPS, client=key))
    return results


def test_a_lone_client_runs_on_the_event_loop_and_anonymous_requests_do_not() -> None:
    pot = ThreadRecording()
    water = structures_of(small_molecule("H2O"))

    async def scenario(engine: Engine, metrics: ServiceMetrics) -> None:
        loop_thread = threading.get_ident()
        for result in await socket_client(engine, "md", water, 4):
            assert result.timings.inline
            assert_same(result, direct(PairPotential(), water))
        assert pot.threads == [loop_thread] * 4
        assert metric(metrics, "so2serve_inline_passes_total") == 4
        anonymous = await engine.evaluate(water, PROPS)
        assert not anonymous.timings.inline
        assert pot.threads[-1] != loop_thread
        await asyncio.sleep(0)  # a pass's metrics are recorded once its answer is out
        assert metric(metrics, "so2serve_batch_requests_count") == 5

    run_engine(pot, scenario, inline_max_atoms=INLINE)


def test_a_crowd_is_batched_in_the_worker_thread() -> None:
    """Eight clients start together: the first request finds nobody else and runs inline;
    from then on the others are out between their requests, so every pass goes to the
    worker thread and they share passes as without inline passes."""
    pot = PairPotential(delay_s=0.05)
    water = structures_of(small_molecule("H2O"))

    async def scenario(engine: Engine, metrics: ServiceMetrics) -> list[EvaluationResult]:
        runs = await asyncio.gather(
            *(sequential_client(engine, f"c{k}", water, 5) for k in range(8))
        )
        return [result for run in runs for result in run]

    results = run_engine(pot, scenario, inline_max_atoms=INLINE)
    assert sum(result.timings.inline for result in results) == 1
    passes = requests_per_pass(pot)
    assert sum(passes) == 40
    assert max(passes) >= 7


def test_another_client_just_answered_keeps_passes_off_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(batcher, "INLINE_QUIET_S", 0.1)
    water = structures_of(small_molecule("H2O"))

    async def scenario(engine: Engine, metrics: ServiceMetrics) -> list[bool]:
        ran_inline = []
        for client in ("a", "b", "b"):  # "a" answered and not back: "b" is not alone
            ran_inline.append((await engine.evaluate(water, PROPS, client=client)).timings.inline)
        await asyncio.sleep(0.15)  # "a" has stayed away longer than the quiet time
        ran_inline.append((await engine.evaluate(water, PROPS, client="b")).timings.inline)
        return ran_inline

    assert run_engine(PairPotential(), scenario, inline_max_atoms=INLINE) == [
        True,
        False,
        False,
        True,
    ]


def test_only_small_whole_requests_run_inline() -> None:
    pot = PairPotential()
    water, crystal = small_molecule("H2O"), rattled_copper(2)  # 3 and 32 atoms

    async def scenario(engine: Engine, metrics: ServiceMetrics) -> list[tuple[bool, int]]:
        outcomes = []
        for structures in (
            structures_of(water, water),  # two structures, 6 atoms: one pass, inline
            structures_of(crystal),  # above inline_max_atoms
            structures_of(*[water] * 8),  # 24 atoms: above the batch budget, two passes
        ):
            result = await engine.evaluate(structures, PROPS, client="md")
            outcomes.append((result.timings.inline, result.timings.passes))
        return outcomes

    outcomes = run_engine(pot, scenario, inline_max_atoms=20, max_batch_atoms=20)
    assert outcomes == [(True, 1), (False, 1), (False, 2)]


def test_an_inline_pass_bisects_out_of_memory_and_isolates_model_errors() -> None:
    crystal_request = structures_of(small_molecule("CH4"), rattled_copper(2))  # 5 + 32 atoms
    water = structures_of(small_molecule("H2O"))

    async def scenario(engine: Engine, metrics: ServiceMetrics) -> None:
        with pytest.raises(StructureTooLargeError) as oom:
            await engine.evaluate(crystal_request, PROPS, client="md")
        assert (oom.value.index, oom.value.n_atoms) == (1, 32)
        assert metric(metrics, "so2serve_oom_failures_total") == 1
        assert metric(metrics, "so2serve_inline_passes_total") == 1
        [again] = await socket_client(engine, "md", water, 1)
        assert again.timings.inline
        assert_same(again, direct(PairPotential(), water))

    run_engine(PairPotential(oom_above_atoms=20), scenario, inline_max_atoms=INLINE)

    async def failing(engine: Engine, metrics: ServiceMetrics) -> None:
        methane_pair = structures_of(small_molecule("H2O"), small_molecule("CH4"))
        with pytest.raises(EvaluationFailedError, match=r"structures\[1\].*model bug"):
            await engine.evaluate(methane_pair, PROPS, client="md")
        [again] = await socket_client(engine, "md", water, 1)
        assert again.timings.inline

    run_engine(ExplodingOnMethane(), failing, inline_max_atoms=INLINE)


def test_pass_profiler_records_inline_passes_on_the_loop_thread(tmp_path: Path) -> None:
    profiler = PassProfiler(ProfileRequest(passes=2, skip=1, out_dir=tmp_path, label="inline"))
    water = structures_of(small_molecule("H2O"))

    async def scenario(engine: Engine, metrics: ServiceMetrics) -> None:
        await socket_client(engine, "md", water, 4)

    run_engine(PairPotential(), scenario, profiler, inline_max_atoms=INLINE)
    assert profiler.written is not None
    passes = json.loads(profiler.written.read_text())["passes"]
    assert [(p["inline"], p["loop_cpu_ms"]) for p in passes] == [(True, None)] * 2
    assert all(p["worker_cpu_ms"] > 0 for p in passes)


def test_a_client_in_this_process_does_not_keep_the_loop_to_itself() -> None:
    """An inline pass completes inside ``submit``, so a coroutine client resumes without the
    loop turning: its next request goes to the worker thread (and yields), so that the
    others get their turn."""
    water = structures_of(small_molecule("H2O"))

    async def scenario(engine: Engine, metrics: ServiceMetrics) -> list[bool]:
        results = await sequential_client(engine, "md", water, 4)
        return [result.timings.inline for result in results]

    assert run_engine(PairPotential(), scenario, inline_max_atoms=INLINE) == [True, False] * 2
