"""Pins the number of aten ops (≈ device kernel launches) of one energy+forces step.

The step of small systems is launch bound, so an op-count regression is a latency regression.
Both execution paths are pinned: the fused path is what CUDA serves (each so2kernels op counts
one), the reference path shares all the glue. The bounds sit ~6% above the counts of 2026-11-30
(after folding the radial features into per-edge block inputs, closed-form frozen norms,
attention normalised per node, cached derived weights) so only real regressions trip them;
tighten them when the counts drop. History (model forward / backward / whole step, this
config): reference 409/684/1749 → 345/539/1540 (2026-11-29) → 344/518/1484 → 267/391/1280
(2026-11-30); fused 251/348/1222 → 176/232/1031 (2026-11-30). Whole step after closed-form
envelope and edge-frame backwards (2026-11-30): fused 722 → 641, reference 971 → 891. Glue
pass (2026-11-30, issue #4): envelopes as one pow + one GEMM (no cumprod scan), mask-free pole
blend and chart norms, dense-column Wigner GEMM, closed-form length and degree backwards,
addcmul-free multiply-adds, two-launch log-envelope bias, shared first radial layer, closed-form
env-seed vectors: fused 176/232/641 → 168/221/565, reference 267/391/891 → 259/380/815.
"""

from __future__ import annotations

import numpy as np
import pytest
from ase import Atoms

import so2kernels._dispatch as dispatch
from service.graph.structures import Structures
from service.model.config import ModelConfig
from service.model.potential import Potential
from tests.model.op_count import OpCounter, count_step_ops, model_ops
from tests.model.randomized import randomized_model

# DeePMD's bar architecture (lmax 2, 2 blocks, 3 mixing layers, rank 1, 1 head, S2 FFN), narrow.
CONFIG = ModelConfig(
    type_map=("O", "H"), channels=32, lmax=2, n_blocks=2, mixing_layers=3, n_focus=1,
    focus_dim=32, radial_so2_mode="degree_channel", radial_so2_rank=1, n_atten_head=1,
    ffn="s2", n_radial=8, rcut=4.0,
)  # fmt: skip

# (model forward, model backward, whole step) upper bounds per path, ~6 % above the counts on
# torch 2.13 (2026-11-30: 168 / 221 / 565 fused, 259 / 380 / 815 reference).
BUDGETS = {"reference": (275, 403, 864), "fused": (178, 234, 599)}


def _water_cluster() -> Structures:
    rng = np.random.default_rng(0)
    molecule = np.array([[0.0, 0.0, 0.0], [0.96, 0.0, 0.0], [-0.24, 0.93, 0.0]])
    centres = np.array([[1.0, 1.0, 1.0], [3.6, 1.2, 1.4], [1.5, 3.4, 1.1], [2.8, 2.9, 3.5]])
    positions = (centres[:, None, :] + molecule[None]).reshape(-1, 3)
    positions += rng.normal(scale=0.05, size=positions.shape)
    atoms = Atoms("OH2" * len(centres), positions=positions, cell=np.eye(3) * 5.0, pbc=True)
    return Structures.from_atoms([atoms])


@pytest.fixture(scope="module", params=sorted(BUDGETS))
def counted(request: pytest.FixtureRequest) -> tuple[str, OpCounter]:
    path = request.param
    with pytest.MonkeyPatch.context() as patch:
        # The dispatcher sees each so2kernels op as one op whether it runs Triton or its
        # reference, so the fused path is counted on the references: seconds, not the
        # interpreter's minutes.
        patch.setattr(dispatch, "INTERPRET", False)
        potential = Potential(randomized_model(CONFIG), device="cpu", path=path, memory="fast")
        structures = _water_cluster()
        potential.predict(structures, ("energy", "forces"))  # builds per-model caches
        return path, count_step_ops(potential, structures)


def test_model_forward_op_count(counted: tuple[str, OpCounter]) -> None:
    path, counter = counted
    assert model_ops(counter, "forward") <= BUDGETS[path][0]


def test_model_backward_op_count(counted: tuple[str, OpCounter]) -> None:
    path, counter = counted
    assert model_ops(counter, "backward") <= BUDGETS[path][1]


def test_whole_step_op_count(counted: tuple[str, OpCounter]) -> None:
    path, counter = counted
    assert sum(counter.counts.values()) <= BUDGETS[path][2]


def test_so2kernels_ops_are_counted_once(counted: tuple[str, OpCounter]) -> None:
    """On the fused path the value path is whole ops (one dispatched op each), not their
    decompositions: 2 blocks × (rotate-mix, stack, aggregate) forward and their backwards."""
    path, counter = counted
    if path != "fused":
        pytest.skip("the reference path decomposes the value path")
    ops = {"so2_rotate_mix", "so2_mixing_stack", "so2_attention_aggregate"}
    counts = {name: 0 for name in ops}
    for label, n in counter.by_name.items():
        name = label.rsplit(" ", 1)[-1]
        if name in counts:
            counts[name] += n
    assert counts == dict.fromkeys(ops, CONFIG.n_blocks)
