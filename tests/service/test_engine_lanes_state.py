"""The engine's per-request and per-device state when a request's passes run on two devices:
timings, metrics, failures, cancellation and shutdown while both lanes hold a part of it.

Two ``PairPotential`` instances stand in for two GPUs (``run_lanes`` of
``test_engine_devices``); where a test needs CUDA devices, their names are faked.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from service.engine import BatchLimits, Engine, ServiceMetrics, Worker
from service.engine.errors import EngineClosedError, StructureTooLargeError
from service.engine.worker import BatchOutput
from service.graph.structures import Structures
from tests.service.fakes import FakeExecution, PairPotential, rattled_copper
from tests.service.test_engine import PROPS, assert_same, direct, metric
from tests.service.test_engine_devices import crystals, run_lanes


class _LateWorker(Worker):
    """A worker whose thread begins each pass ``late_s`` after it was handed the batch."""

    def __init__(self, evaluator: PairPotential, metrics: ServiceMetrics, late_s: float) -> None:
        super().__init__(evaluator, metrics)
        self.late_s = late_s

    def run(
        self,
        parts: Sequence[Structures],
        properties: frozenset[str],
        part_properties: Sequence[frozenset[str]] | None = None,
    ) -> BatchOutput:
        time.sleep(self.late_s)
        return super().run(parts, properties, part_properties)


def test_a_request_on_two_devices_is_queued_until_its_first_pass_begins() -> None:
    """Its first part runs long on device 0; its second begins late on device 1 and comes
    back first. It was queued until device 0 began (not until the first answer's pass began),
    and ran until device 0 ended."""
    slow = PairPotential(delay_s=0.3)
    request = crystals(2)  # 8 atoms: one structure per device

    async def main() -> Any:
        metrics = ServiceMetrics()
        workers = [Worker(slow, metrics), _LateWorker(PairPotential(), metrics, late_s=0.15)]
        engine = Engine(workers, BatchLimits(inline_max_atoms=0), metrics, rcut=slow.rcut)
        await engine.start()
        try:
            result = await engine.evaluate(request, PROPS)
        finally:
            await engine.stop()
        return result, metrics

    result, metrics = asyncio.run(main())
    assert_same(result, direct(PairPotential(), request))
    timings = result.timings
    assert timings.passes == 2
    assert timings.queue_s < 0.1, timings
    assert timings.finished_at - (timings.admitted_at + timings.queue_s) >= 0.3, timings
    assert metric(metrics, "so2serve_queue_wait_seconds_count") == 1
    assert metric(metrics, "so2serve_queue_wait_seconds_sum") < 0.1


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, peaks: dict[str, int]) -> list[PairPotential]:
    """Two stand-ins named cuda:0 and cuda:1, whose memory high-water marks are ``peaks``."""
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: peaks[str(d)])
    return [PairPotential(execution=FakeExecution(device=name)) for name in peaks]


def test_each_device_has_its_own_memory_peak_and_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    """``so2serve_gpu_memory_peak_bytes`` and ``so2serve_atom_steps_per_second`` are per
    device: one unlabelled gauge showed whichever device ended a pass last."""
    lanes = _fake_gpus(monkeypatch, {"cuda:0": 7_000, "cuda:1": 9_000})
    metrics = ServiceMetrics()

    async def main() -> None:
        engine = Engine(
            [Worker(p, metrics) for p in lanes],
            BatchLimits(inline_max_atoms=0),
            metrics,
            rcut=lanes[0].rcut,
        )
        await engine.start()
        try:
            await engine.evaluate(crystals(4), PROPS)  # shared by the two idle devices
            await asyncio.sleep(0.01)  # the passes' bookkeeping runs after the answer
        finally:
            await engine.stop()

    asyncio.run(main())
    assert all(p.calls for p in lanes)
    sample = metrics.registry.get_sample_value
    for device, peak in (("cuda:0", 7_000), ("cuda:1", 9_000)):
        labels = {"device": device}
        assert sample("so2serve_gpu_memory_peak_bytes", labels) == peak
        rate = sample("so2serve_atom_steps_per_second", labels)
        assert rate is not None and rate > 0


def test_out_of_memory_on_one_device_leaves_the_other_devices_caches_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``torch.cuda.empty_cache`` acts on every device of the process (it waits for their
    work and frees their caches): the bisection after an out-of-memory error on one device
    must not call it (the allocator frees the failing device's cache by itself)."""
    emptied: list[int] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    lane = _fake_gpus(monkeypatch, {"cuda:1": 0})[0]
    lane.oom_above_atoms = 4
    request = crystals(2)

    async def scenario(engine: Engine) -> Any:
        return await engine.evaluate(request, PROPS)

    result = run_lanes([lane], scenario)
    assert_same(result, direct(PairPotential(), request))
    assert lane.calls == [(2, 8), (1, 4), (1, 4)]
    assert not emptied


def test_a_part_failing_on_one_device_fails_the_request_once() -> None:
    """Structure 1 of three does not fit device 1; parts 0 and 2 succeed on the others. The
    request fails once, naming structure 1, with no partial results; the engine goes on."""
    big = Structures.from_atoms(
        [rattled_copper(1, seed=0), rattled_copper(2, seed=1), rattled_copper(1, seed=2)]
    )  # 4, 32 and 4 atoms
    lanes = [PairPotential(delay_s=0.1, oom_above_atoms=8) for _ in range(3)]

    async def scenario(engine: Engine) -> tuple[BaseException | None, Any]:
        future = engine.submit(big, PROPS)
        error = None
        try:
            await future
        except StructureTooLargeError as exc:
            error = exc
        await asyncio.sleep(0.2)  # every part is back: a second answer would raise here
        return error, await engine.evaluate(crystals(1), PROPS)

    error, after = run_lanes(lanes, scenario, max_batch_atoms=8)
    assert isinstance(error, StructureTooLargeError) and error.index == 1, error
    assert sum(len(p.calls) for p in lanes) >= 3
    assert_same(after, direct(PairPotential(), crystals(1)))


def test_a_request_cancelled_while_its_parts_run_on_two_devices() -> None:
    """Its running parts finish and are discarded, its queued rest never runs, and the next
    request is answered."""
    lanes = [PairPotential(delay_s=0.15), PairPotential(delay_s=0.15)]

    async def scenario(engine: Engine) -> Any:
        future = engine.submit(crystals(6), PROPS)  # 3 passes of 8 atoms, 2 at once
        while not all(p.calls for p in lanes):
            await asyncio.sleep(0.002)
        future.cancel()
        result = await engine.evaluate(crystals(1), PROPS)
        return result, engine.queue_depth

    result, depth = run_lanes(lanes, scenario, max_batch_atoms=8)
    assert_same(result, direct(PairPotential(), crystals(1)))
    assert depth == 0
    assert sorted(call for p in lanes for call in p.calls) == [(1, 4), (2, 8), (2, 8)]


def test_stop_while_a_request_runs_on_two_devices_fails_it_once() -> None:
    lanes = [PairPotential(delay_s=0.2), PairPotential(delay_s=0.2)]

    async def scenario(engine: Engine) -> tuple[BaseException | None, list[tuple[int, int]]]:
        future = engine.submit(crystals(6), PROPS)
        while not all(p.calls for p in lanes):
            await asyncio.sleep(0.002)
        await engine.stop()  # returns once both running passes have ended
        await asyncio.sleep(0.01)
        return future.exception(), [call for p in lanes for call in p.calls]

    error, calls = run_lanes(lanes, scenario, max_batch_atoms=8)
    assert isinstance(error, EngineClosedError)
    assert calls == [(2, 8), (2, 8)]  # the queued third part never ran
