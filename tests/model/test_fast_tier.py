"""The opt-in fp16x3 mixing-stack tier at the model level: plumbing, refusals, accuracy.

Accuracy bound (fp16x3 vs the float64 reference path). Each fp16x3 GEMM keeps three fp16 products
of split operands, ~2^-22 relative per GEMM (the op-level test allows 4e-6 normwise); the exact
fp32 path itself is ~1e-6 of max |F| off float64 on this model. Uncompensated fp16 GEMMs (a lost
tail) would be ~2^-11 ≈ 5e-4. ``REL_BOUND = 1e-5`` of max |F| (and of Σ|E_i| for energies) sits an
order of magnitude above fp32 noise and well over an order below a broken split, so it passes
only a working compensated tier.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from ase import Atoms
from pydantic import ValidationError

import service.model.layers.so2conv as so2conv
from clients.local import SO2LocalCalculator
from service.api.settings import ServiceSettings
from service.graph.structures import Structures
from service.model.captured import RECORD_AFTER
from service.model.config import preset
from service.model.potential import Potential, Prediction
from so2kernels import StackPrecision, so2_mixing_stack
from so2kernels._dispatch import INTERPRET
from tests.model.randomized import randomized_model

CONFIG = preset("tiny", ["O", "H"], rcut=4.0, channels=32, n_focus=2, focus_dim=32, n_blocks=2)
REL_BOUND = 1e-5
needs_interpreter = pytest.mark.skipif(
    not INTERPRET, reason="the fused path on CPU needs TRITON_INTERPRET=1"
)


def _triclinic() -> Structures:
    rng = np.random.default_rng(7)
    cell = np.array([[4.0, 0, 0], [0.7, 4.1, 0], [0.4, 0.5, 4.2]])
    atoms = Atoms("OHHOHH", positions=rng.uniform(0, 4, (6, 3)), cell=cell, pbc=True)
    return Structures.from_atoms([atoms])


def _potential(path: str, precision: str) -> Potential:
    model = randomized_model(CONFIG, seed=3)
    return Potential(model, device="cpu", path=path, precision=precision, capture=False)


@pytest.mark.parametrize("path", ["reference", "auto"])  # auto resolves to reference on CPU
def test_refused_off_the_fused_path(path: str) -> None:
    with pytest.raises(ValueError, match=r"fp16x3.*fused path"):
        _potential(path, "fp16x3")


def test_refused_by_the_model_on_the_reference_path() -> None:
    """The SO(2) layer itself refuses the fast tier without ``fused``: no silent exact fallback
    even if a caller gets past Potential's check."""
    pot = _potential("reference", "fp32")
    pot.stack_precision = StackPrecision.FAST
    with pytest.raises(ValueError, match="fused mixing-stack kernels only"):
        pot.predict(_triclinic())


def test_calculator_and_settings_pass_the_tier() -> None:
    """The calculator and the service settings pass the tier through / validate it."""
    with pytest.raises(ValueError, match=r"fp16x3.*fused path"):
        SO2LocalCalculator(None, device="cpu", path="reference", precision="fp16x3")
    assert ServiceSettings(precision="fp16x3").precision == "fp16x3"
    with pytest.raises(ValidationError):
        ServiceSettings(precision="tf32")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="fused kernels only"):
        ServiceSettings(precision="fp16x3", execution="reference")


@needs_interpreter
def test_execution_info_reports_the_tier() -> None:
    pot = _potential("fused", "fp16x3")
    assert pot.execution.precision == "fp16x3"
    assert pot.stack_precision is StackPrecision.FAST
    assert pot.info()["execution"]["precision"] == "fp16x3"
    assert _potential("fused", "fp32").stack_precision is StackPrecision.EXACT


@needs_interpreter
def test_create_graph_refused() -> None:
    with pytest.raises(ValueError, match="create_graph"):
        _potential("fused", "fp16x3").predict(_triclinic(), create_graph=True)


def _max_rel(got: torch.Tensor | None, want: torch.Tensor | None, scale: float) -> float:
    assert got is not None and want is not None
    # A replayed step answers on the host, an eager one on the device.
    return float((got.cpu() - want.cpu()).abs().max()) / scale


@pytest.mark.slow
@needs_interpreter
def test_fast_tier_against_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp16x3 forces/energies within ``REL_BOUND`` of float64; every stack ran the fast tier and
    its numbers differ from the exact fused tier's (the tier is not silently the exact one)."""
    tiers_called: list[Any] = []

    def spy(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tiers_called.append(StackPrecision.parse(kwargs["precision"]))
        return so2_mixing_stack(*args, **kwargs)

    monkeypatch.setattr(so2conv, "so2_mixing_stack", spy)
    structures = _triclinic()
    props = ("energy", "energies", "forces")
    results: dict[str, Prediction] = {}
    for name, path, precision in [
        ("fp64", "reference", "fp64"),
        ("exact", "fused", "fp32"),
        ("fast", "fused", "fp16x3"),
    ]:
        tiers_called.clear()
        results[name] = _potential(path, precision).predict(structures, props)
        if path == "fused":
            expected = StackPrecision.FAST if precision == "fp16x3" else StackPrecision.EXACT
            assert tiers_called == [expected] * CONFIG.n_blocks
        else:
            assert tiers_called == []
    ref, fast, exact = results["fp64"], results["fast"], results["exact"]
    assert ref.forces is not None and ref.energies is not None
    assert fast.forces is not None and exact.forces is not None
    f_scale = float(ref.forces.abs().max())
    e_scale = float(ref.energies.abs().sum())
    assert _max_rel(fast.forces, ref.forces, f_scale) < REL_BOUND
    assert _max_rel(fast.energy, ref.energy, e_scale) < REL_BOUND
    assert _max_rel(exact.forces, ref.forces, f_scale) < REL_BOUND
    assert not torch.equal(fast.forces, exact.forces)


@pytest.mark.gpu
def test_fast_tier_on_gpu_with_graph_replay() -> None:
    """Default model on CUDA: the replayed (CUDA-graph) fp16x3 step agrees with the eager one,
    and both stay within ``REL_BOUND`` of max |F| of the exact fp32 tier."""
    from service.model.potential import load_potential

    structures = _triclinic()
    exact = load_potential(None, device="cuda", precision="fp32", capture=False)
    fast_eager = load_potential(None, device="cuda", precision="fp16x3", capture=False)
    fast_replay = load_potential(None, device="cuda", precision="fp16x3")
    assert fast_replay.execution.precision == "fp16x3" and fast_replay._captured is not None
    want = exact.predict(structures)
    eager = fast_eager.predict(structures)
    for _ in range(RECORD_AFTER + 1):  # the last calls replay the recorded graph
        replayed = fast_replay.predict(structures)
    assert fast_replay._captured is not None and fast_replay._captured.n_graphs == 1
    assert want.forces is not None and eager.forces is not None
    scale = float(want.forces.abs().max())
    # Replay pads the batch, which changes GEMM blocking: equal to fp32 rounding, not bitwise.
    assert _max_rel(replayed.forces, eager.forces, scale) < REL_BOUND
    assert _max_rel(eager.forces, want.forces, scale) < REL_BOUND
    assert not torch.equal(eager.forces, want.forces)
