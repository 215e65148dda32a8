"""Chunked, recomputed SO(2) convolutions ("lean" memory) give the unchunked numbers."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch
from ase import Atoms

from service.model.config import preset
from service.model.layers.edge_chunks import node_ranges

pytest.importorskip("service.graph.edge_cache")

from service.graph.structures import Structures
from service.model import potential as potential_module
from service.model.potential import Potential, edge_chunk_for
from tests.model.randomized import randomized_model


def test_node_ranges_cover_nodes_within_budget() -> None:
    rowptr = [0, 3, 3, 10, 11, 30, 31, 31]
    ranges = node_ranges(rowptr, 8)
    assert ranges[0][0] == 0 and ranges[-1][1] == 7
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    for start, stop in ranges:
        edges = rowptr[stop] - rowptr[start]
        assert edges <= 8 or stop == start + 1  # a node above the budget stands alone
    assert node_ranges([0], 8) == []


def _water_like(n_molecules: int, seed: int) -> Atoms:
    rng = np.random.default_rng(seed)
    side = (n_molecules * 29.9) ** (1 / 3)
    o = rng.uniform(0, side, (n_molecules, 3))
    h = o[:, None, :] + rng.normal(0, 0.6, (n_molecules, 2, 3))
    pos = np.concatenate([o, h.reshape(-1, 3)])
    return Atoms(
        "O" * n_molecules + "H" * 2 * n_molecules, positions=pos, cell=np.eye(3) * side, pbc=True
    )


def _compare(
    path: str, monkeypatch: pytest.MonkeyPatch, n_molecules: int, rcut: float, chunk: int
) -> None:
    cfg = preset("tiny", ["O", "H"], rcut=rcut, channels=32, n_focus=2, focus_dim=32, n_blocks=2)
    model = randomized_model(cfg, seed=2)
    structures = Structures.from_atoms([_water_like(n_molecules, seed=5)])
    props = ("energy", "forces", "stress")
    monkeypatch.setattr(potential_module, "CPU_EDGE_CHUNK", chunk)
    results = {}
    for memory in ("fast", "lean"):
        pot = Potential(copy.deepcopy(model), device="cpu", path=path, memory=memory)
        results[memory] = pot.predict(structures, props)
    fast, lean = results["fast"], results["lean"]
    torch.testing.assert_close(lean.energy, fast.energy, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lean.forces, fast.forces, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lean.stress, fast.stress, rtol=1e-5, atol=1e-6)


def test_lean_matches_fast_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    _compare("reference", monkeypatch, n_molecules=8, rcut=4.0, chunk=41)  # 580 edges


@pytest.mark.slow
def test_lean_matches_fast_fused(monkeypatch: pytest.MonkeyPatch) -> None:
    _compare("fused", monkeypatch, n_molecules=2, rcut=2.5, chunk=13)  # 36 edges


def test_edge_chunk_policy() -> None:
    cfg = preset("tiny", ["O", "H"], channels=32)
    cpu = torch.device("cpu")
    chunk = potential_module.CPU_EDGE_CHUNK
    big = chunk + 1
    assert edge_chunk_for("fast", cfg, big, cpu, create_graph=False) is None
    assert edge_chunk_for("lean", cfg, big, cpu, create_graph=False) == chunk
    assert edge_chunk_for("lean", cfg, big, cpu, create_graph=True) is None
    assert edge_chunk_for("lean", cfg, chunk, cpu, create_graph=False) is None
    # On the CPU small chunks are faster as well as lighter: auto always chunks there.
    assert edge_chunk_for("auto", cfg, big, cpu, create_graph=False) == chunk
    assert edge_chunk_for("auto", cfg, big, cpu, create_graph=True) is None
    with pytest.raises(ValueError, match="memory must be"):
        edge_chunk_for("tiny", cfg, big, cpu, create_graph=False)


@pytest.mark.gpu
def test_auto_mode_counts_cached_allocator_memory_as_available() -> None:
    """After a large step frees its tensors, the caching allocator keeps the blocks: the auto
    memory mode must still see them as available, or a long-running server would chunk every
    later medium-size step."""
    from service.model.potential import available_memory

    device = torch.device("cuda")
    torch.cuda.empty_cache()
    before = available_memory(device)
    block = torch.empty(2**30, dtype=torch.uint8, device=device)  # 1 GiB, then cached
    del block
    assert torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device) >= 2**30
    assert available_memory(device) >= before - 64 * 2**20
