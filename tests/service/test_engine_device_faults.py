"""When the device itself breaks (a sticky CUDA error), no structure is blamed and the server
says it is not ready; a request cancelled just before its pass is not computed; throughput
counters count delivered results only. Fakes only (``PairPotential``), CPU: the broken device
is a potential that raises and a worker whose device probe fails."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import torch

from service.api import ServiceSettings, create_app
from service.engine import DeviceFaultError, Engine, EvaluationResult, ServiceMetrics, Worker
from service.graph.structures import Structures
from tests.service.fakes import (
    FakePrediction,
    PairPotential,
    rattled_copper,
    request_document,
    running_server,
    small_molecule,
)
from tests.service.test_engine import device_started, run_engine, structures_of

# torch's type for CUDA errors (a RuntimeError where a torch of the range lacks it)
CUDA_ERROR: type[Exception] = getattr(torch, "AcceleratorError", RuntimeError)


@dataclass
class IllegalAddress(PairPotential):
    """Once ``broken``, every pass fails as a GPU's does after an illegal memory access."""

    broken: bool = True

    def predict(self, structures: Structures, properties: Collection[str]) -> FakePrediction:
        if not self.broken:
            return super().predict(structures, properties)
        with self.lock:
            self.calls.append((structures.n_structures, structures.n_atoms))
        raise CUDA_ERROR("CUDA error: an illegal memory access was encountered")


class FailsOnMethane(PairPotential):
    """Fails on a 5-atom structure (methane) alone, with a CUDA-looking message: whether the
    device is broken is the probe's answer, not the message's."""

    def predict(self, structures: Structures, properties: Collection[str]) -> FakePrediction:
        if structures.n_atoms == 5:
            raise RuntimeError("CUDA error: invalid configuration argument")
        return super().predict(structures, properties)


@pytest.fixture
def broken_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device probe after a failed pass fails too, as on a GPU whose context is gone."""
    monkeypatch.setattr(Worker, "_device_responds", lambda self: False)


def test_a_broken_device_fails_the_pass_without_bisecting_or_blaming(
    broken_device: None,
) -> None:
    pot = IllegalAddress()
    molecules = structures_of(*(small_molecule("H2O", seed=k) for k in range(8)))

    async def scenario(engine: Engine, metrics: ServiceMetrics) -> list[Any]:
        first = await asyncio.gather(engine.evaluate(molecules, {"energy"}), return_exceptions=True)
        try:  # refused at once: no device is left to queue for
            engine.submit(structures_of(small_molecule("CH4")), {"energy"})
        except DeviceFaultError as exc:
            later: Any = exc
        return [*first, later, engine.faults, metrics]

    failed, later, faults, metrics = run_engine(pot, scenario)
    # One pass, not 15 (a bisection down to 8 single structures, each failing alike).
    assert pot.calls == [(8, 24)]
    assert isinstance(failed, DeviceFaultError) and "no structure is to blame" in failed.message
    assert isinstance(later, DeviceFaultError)
    assert [fault.device for fault in faults] == ["cpu"]
    registry = metrics.registry
    assert registry.get_sample_value("so2serve_device_faults_total", {"device": "cpu"}) == 1
    assert registry.get_sample_value("so2serve_structures_total") == 0
    failures = {"code": "device_error"}
    assert registry.get_sample_value("so2serve_evaluation_failures_total", failures) == 8


def test_a_structures_own_failure_still_fails_alone_on_a_working_device() -> None:
    pot = FailsOnMethane()
    methane = structures_of(small_molecule("CH4"))  # 5 atoms

    async def scenario(engine: Engine, metrics: ServiceMetrics) -> list[Any]:
        outcome = await asyncio.gather(engine.evaluate(methane, {"energy"}), return_exceptions=True)
        water = await engine.evaluate(structures_of(small_molecule("H2O")), {"energy"})
        return [*outcome, water, engine.faults]

    failed, water, faults = run_engine(pot, scenario)
    assert getattr(failed, "code", None) == "evaluation_failed"  # the device probe answered
    assert isinstance(water, EvaluationResult) and faults == []


def test_readiness_and_evaluate_answer_503_device_error_once_the_device_broke(
    broken_device: None,
) -> None:
    potential = IllegalAddress(broken=False)  # through the warm-up
    app = create_app(ServiceSettings(), evaluator=potential)
    with running_server(app) as url:
        potential.broken = True
        body = request_document([small_molecule("H2O"), small_molecule("CH4")])
        first = httpx.post(f"{url}/evaluate", json=body)
        ready = httpx.get(f"{url}/health/ready")
        again = httpx.post(f"{url}/evaluate", json=body)
        live = httpx.get(f"{url}/health/live")
    for answer in (first, again):
        assert answer.status_code == 503, answer.text
        assert answer.json()["code"] == "device_error"
        assert "index" not in (answer.json().get("detail") or {})
    assert ready.status_code == 503 and ready.json()["code"] == "device_error"
    assert ready.json()["detail"] == {"devices": ["cpu"]}
    assert live.status_code == 200  # the process is up: an orchestrator restarts it


def test_a_request_cancelled_while_the_loop_was_busy_is_not_computed() -> None:
    # Its withdrawal (a done-callback) runs a loop turn after the pass before it ended.
    pot = PairPotential(delay_s=0.2)

    async def scenario(engine: Engine, metrics: ServiceMetrics) -> list[Any]:
        blocker = engine.submit(structures_of(small_molecule("H2O")), {"energy"})
        await device_started(pot, 0)
        queued = engine.submit(structures_of(rattled_copper(2)), {"energy"})  # 32 atoms
        time.sleep(0.3)  # the loop is busy while the blocker's pass ends
        queued.cancel()
        await blocker
        await asyncio.sleep(0.3)
        return [metrics]

    (metrics,) = run_engine(pot, scenario)
    assert pot.calls == [(1, 3)]
    assert metrics.registry.get_sample_value("so2serve_cancelled_requests_total") == 1


def test_refusals_after_a_fault_pin_no_request(broken_device: None) -> None:
    # One fault instance raised for every refused request chained each request's frames (its
    # body and structures) onto its traceback, which the worker kept for good.
    pot = IllegalAddress()

    async def scenario(engine: Engine, metrics: ServiceMetrics) -> list[Any]:
        await asyncio.gather(engine.evaluate(structures_of(small_molecule()), {"energy"}),
                             return_exceptions=True)  # fmt: skip
        refused = []
        for _ in range(3):
            try:
                engine.submit(structures_of(small_molecule("CH4")), {"energy"})
            except DeviceFaultError as exc:
                refused.append(exc)
        return [refused, engine.faults]

    refused, faults = run_engine(pot, scenario)
    assert len({id(exc) for exc in refused}) == 3
    assert faults[0].__traceback__ is None
    assert all(exc.message == faults[0].message for exc in refused)


def test_a_request_failing_in_its_second_pass_counts_as_no_throughput() -> None:
    pot = FailsOnMethane()
    waters = (small_molecule("H2O", seed=k) for k in range(3))
    request = structures_of(*waters, small_molecule("CH4"))  # split: 9 atoms a pass

    async def scenario(engine: Engine, metrics: ServiceMetrics) -> list[Any]:
        outcome = await asyncio.gather(engine.evaluate(request, {"energy"}), return_exceptions=True)
        await asyncio.sleep(0.1)  # the pass records run a loop turn after the answers
        return [*outcome, metrics.registry]

    failed, registry = run_engine(pot, scenario, max_batch_atoms=9)
    assert getattr(failed, "code", None) == "evaluation_failed"
    assert registry.get_sample_value("so2serve_structures_total") == 0
    assert registry.get_sample_value("so2serve_atom_steps_total") == 0
    failures = {"code": "evaluation_failed"}
    assert registry.get_sample_value("so2serve_evaluation_failures_total", failures) == 4
