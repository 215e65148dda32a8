"""On a real GPU: the worker's probe after a failed pass tells a broken device (a device-side
assert, which CUDA keeps in the context) from a structure's own failure. The broken case runs
in a child process: its CUDA context cannot be used again."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

_SCENARIO = textwrap.dedent(
    """
    import asyncio, os, sys
    from dataclasses import dataclass
    import torch
    from service.engine import BatchLimits, DeviceFaultError, Engine, ServiceMetrics, Worker
    from tests.service.fakes import FakeExecution, PairPotential, element_numbers, small_molecule
    from service.graph.structures import Structures

    @dataclass
    class OnTheGpu(PairPotential):
        sticky: bool = False

        def __post_init__(self):
            self.execution = FakeExecution(device="cuda")

        def predict(self, structures, properties):
            self.calls.append((structures.n_structures, structures.n_atoms))
            if self.sticky:  # an index out of bounds on the device: a device-side assert
                values = torch.zeros(4, device="cuda")
                values[torch.tensor([1 << 20], device="cuda")].sum().item()
            raise RuntimeError("a structure's own failure")

    async def main(sticky):
        metrics = ServiceMetrics()
        potential = OnTheGpu(sticky=sticky)
        engine = Engine([Worker(potential, metrics)], BatchLimits(inline_max_atoms=0), metrics,
                        rcut=4.0, elements=element_numbers(potential))
        await engine.start()
        batch = Structures.from_atoms([small_molecule("H2O", seed=k) for k in range(4)])
        outcome = (await asyncio.gather(engine.evaluate(batch, {"energy"}),
                                        return_exceptions=True))[0]
        print(type(outcome).__name__, getattr(outcome, "code", None), len(potential.calls),
              len(engine.faults))

    asyncio.run(main(sys.argv[1] == "sticky"))
    sys.stdout.flush()
    os._exit(0)  # a broken context's teardown may abort the process: the answer is out
    """
)


def _run(kind: str) -> list[str]:
    child = subprocess.run(
        [sys.executable, "-c", _SCENARIO, kind],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    return child.stdout.split()


@pytest.mark.gpu
def test_a_device_side_assert_is_a_device_fault_without_bisection() -> None:
    assert _run("sticky") == ["DeviceFaultError", "device_error", "1", "1"]


@pytest.mark.gpu
def test_a_structures_own_failure_on_a_gpu_is_bisected_and_blamed() -> None:
    # 4 structures: 1 + 2 + 4 passes of the bisection, the device still working.
    name, code, calls, faults = _run("own")
    assert (name, code, faults) == ("EvaluationFailedError", "evaluation_failed", "0")
    assert int(calls) == 7
