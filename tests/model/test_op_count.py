"""Pins the number of aten ops (≈ device kernel launches) of one energy+forces step.

The step of small systems is launch bound, so an op-count regression is a latency regression.
The bounds sit ~15% above the counts of 2026-11-29 (after the batching of per-degree loops) so
only real regressions trip them; tighten them when the counts drop.
"""

from __future__ import annotations

import numpy as np
import pytest
from ase import Atoms

from service.graph.structures import Structures
from service.model.config import ModelConfig
from service.model.potential import Potential
from tests.model.op_count import OpCounter, count_step_ops
from tests.model.randomized import randomized_model

# DeePMD's bar architecture (lmax 2, 2 blocks, 3 mixing layers, rank 1, 1 head, S2 FFN), narrow.
CONFIG = ModelConfig(
    type_map=("O", "H"), channels=32, lmax=2, n_blocks=2, mixing_layers=3, n_focus=1,
    focus_dim=32, radial_so2_mode="degree_channel", radial_so2_rank=1, n_atten_head=1,
    ffn="s2", n_radial=8, rcut=4.0,
)  # fmt: skip

_EDGE_CACHE_LABELS = ("build_graph", "edge_vectors", "build_edge_cache", "assemble_forces_virial")


def _water_cluster() -> Structures:
    rng = np.random.default_rng(0)
    molecule = np.array([[0.0, 0.0, 0.0], [0.96, 0.0, 0.0], [-0.24, 0.93, 0.0]])
    centres = np.array([[1.0, 1.0, 1.0], [3.6, 1.2, 1.4], [1.5, 3.4, 1.1], [2.8, 2.9, 3.5]])
    positions = (centres[:, None, :] + molecule[None]).reshape(-1, 3)
    positions += rng.normal(scale=0.05, size=positions.shape)
    atoms = Atoms("OH2" * len(centres), positions=positions, cell=np.eye(3) * 5.0, pbc=True)
    return Structures.from_atoms([atoms])


def _model_ops(counter: OpCounter, direction: str) -> int:
    """Ops of the model's own modules in one direction (edge-cache phases excluded)."""
    total = 0
    for label, n in counter.counts.items():
        kind, _, where = label.partition(" ")
        if kind == direction and where and not where.startswith(_EDGE_CACHE_LABELS):
            total += n
    return total


@pytest.fixture(scope="module")
def counter() -> OpCounter:
    potential = Potential(randomized_model(CONFIG), device="cpu", path="reference", memory="fast")
    structures = _water_cluster()
    potential.predict(structures, ("energy", "forces"))  # builds per-model caches
    return count_step_ops(potential, structures)


def test_model_forward_op_count(counter: OpCounter) -> None:
    assert _model_ops(counter, "forward") <= 400  # 345 on 2026-11-29 (was 409)


def test_model_backward_op_count(counter: OpCounter) -> None:
    assert _model_ops(counter, "backward") <= 620  # 539 on 2026-11-29 (was 684)


def test_whole_step_op_count(counter: OpCounter) -> None:
    assert sum(counter.counts.values()) <= 1770  # 1540 on 2026-11-29 (was 1749)
