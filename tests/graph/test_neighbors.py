"""Neighbour list: exact agreement with brute force, ASE and vesin on hard geometries."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.neighborlist import neighbor_list

from service.graph.errors import InvalidStructureError
from service.graph.neighbors import Graph, build_graph, edge_vectors
from service.graph.structures import StructureArrays, Structures
from tests.graph.helpers import brute_force_pairs, random_cell, random_structure

BACKENDS = ["torch", "vesin", "direct"]


def _edge_set(graph: Graph, lo: int = 0, hi: int | None = None) -> set[tuple[int, ...]]:
    rows = torch.cat([graph.dst[:, None], graph.src[:, None], graph.shifts], 1).tolist()
    hi = graph.n_atoms if hi is None else hi
    return {(d - lo, s - lo, *sh) for d, s, *sh in rows if lo <= d < hi}


def _cases() -> list[tuple[str, StructureArrays, float]]:
    rng = np.random.default_rng(20260808)
    cases: list[tuple[str, StructureArrays, float]] = []
    for k in range(4):
        cell = random_cell(rng, 7.0)
        cases.append((f"triclinic{k}", random_structure(rng, 24, cell, (True,) * 3), 4.0))
    for k in range(3):
        cell = random_cell(rng, 2.2, skew=0.25)
        cases.append((f"tiny{k}", random_structure(rng, 3, cell, (True,) * 3), 5.0))
    one_atom = StructureArrays(numbers=[6], positions=[[0.1, 0.2, 0.3]], cell=np.eye(3) * 1.1)
    cases.append(("single_atom_tiny_cell", one_atom, 3.5))
    slab_cell = random_cell(rng, 6.0)
    cases.append(("slab_TTF", random_structure(rng, 20, slab_cell, (True, True, False)), 4.5))
    cases.append(("slab_TFT", random_structure(rng, 20, slab_cell, (True, False, True)), 4.5))
    wire = random_cell(rng, 3.0)
    cases.append(("wire_FFT", random_structure(rng, 8, wire, (False, False, True)), 5.0))
    zero_c = np.array([[5.0, 0.0, 0.0], [1.0, 4.5, 0.0], [0.0, 0.0, 0.0]])
    cases.append(("slab_zero_c", random_structure(rng, 12, zero_c, (True, True, False)), 4.0))
    cases.append(("molecule", random_structure(rng, 30, None, (False,) * 3, spread=8.0), 3.0))
    cases.append(("far_molecule", _far_apart_molecule(), 2.0))
    return cases


def _far_apart_molecule() -> StructureArrays:
    """Two clusters 1e6 Å apart: bins must stay O(N), not O(extent³)."""
    x = np.array([[0, 0, 0], [1.0, 0, 0], [1e6, 1e6, 0], [1e6 + 1.2, 1e6, 0.3]])
    return StructureArrays(numbers=[1, 1, 8, 8], positions=x)


CASES = _cases()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("name", "item", "rcut"), CASES, ids=[c[0] for c in CASES])
def test_matches_brute_force(name: str, item: StructureArrays, rcut: float, backend: str) -> None:
    structures = Structures.from_arrays([item])
    graph = build_graph(structures, rcut, backend=backend)  # type: ignore[arg-type]
    cell = None if item.cell is None else np.asarray(item.cell, dtype=np.float64)
    pbc = structures.pbc[0].numpy()
    expected = brute_force_pairs(structures.positions.numpy(), cell, pbc, rcut)
    assert graph.n_edges == len(expected)
    assert _edge_set(graph) == expected


@pytest.mark.parametrize(("name", "item", "rcut"), CASES[:-1], ids=[c[0] for c in CASES[:-1]])
def test_matches_ase(name: str, item: StructureArrays, rcut: float) -> None:
    structures = Structures.from_arrays([item])
    atoms = Atoms(
        numbers=structures.numbers.numpy(),
        positions=structures.positions.numpy(),
        cell=structures.cells[0].numpy(),
        pbc=structures.pbc[0].numpy(),
    )
    i, j, shift = neighbor_list("ijS", atoms, rcut, self_interaction=False)
    expected = {(int(a), int(b), *map(int, s)) for a, b, s in zip(i, j, shift, strict=True)}
    assert _edge_set(build_graph(structures, rcut, backend="torch")) == expected


def test_batched_mixture_equals_separate_graphs() -> None:
    items = [c[1] for c in CASES]
    rcut = 4.0
    batch = Structures.from_arrays(items)
    graphs = {b: build_graph(batch, rcut, backend=b) for b in BACKENDS}  # type: ignore[arg-type]
    torch_graph = graphs["torch"]
    for name in ("src", "dst", "shifts", "dst_rowptr", "src_order", "src_rowptr", "edge_ptr"):
        assert torch.equal(getattr(torch_graph, name), getattr(graphs["vesin"], name)), name
    ptr = batch.ptr.tolist()
    for b, item in enumerate(items):
        alone = build_graph(Structures.from_arrays([item]), rcut, backend="torch")
        assert _edge_set(torch_graph, ptr[b], ptr[b + 1]) == _edge_set(alone)
        lo, hi = torch_graph.edge_ptr[b], torch_graph.edge_ptr[b + 1]
        assert bool((torch_graph.edge_batch[lo:hi] == b).all())


def test_order_and_csr_invariants() -> None:
    rng = np.random.default_rng(3)
    items = [random_structure(rng, 15, random_cell(rng, 5.0), (True,) * 3) for _ in range(3)]
    structures = Structures.from_arrays(items)
    g = build_graph(structures, 4.0, backend="torch")
    key = torch.cat([g.dst[:, None], g.src[:, None], g.shifts], 1).tolist()
    assert key == sorted(key) and len(set(map(tuple, key))) == len(key)
    assert torch.equal(g.dst_rowptr, torch.searchsorted(g.dst, torch.arange(g.n_atoms + 1)))
    assert torch.equal(g.src_order, torch.argsort(g.src, stable=True))
    assert torch.equal(g.src[g.src_order], torch.sort(g.src).values)
    sorted_src = g.src[g.src_order]
    assert torch.equal(g.src_rowptr, torch.searchsorted(sorted_src, torch.arange(g.n_atoms + 1)))
    for t in (g.src, g.dst, g.shifts, g.edge_batch, g.dst_rowptr, g.src_order, g.src_rowptr):
        assert t.dtype == torch.int64
    # Full list: every edge has its reverse (j → i with −S).
    reverse = {(s, d, -a, -b, -c) for d, s, a, b, c in key}
    assert reverse == set(map(tuple, key))


def test_chunked_search_equals_single_chunk() -> None:
    rng = np.random.default_rng(5)
    item = random_structure(rng, 60, random_cell(rng, 9.0), (True,) * 3)
    structures = Structures.from_arrays([item])
    whole = build_graph(structures, 5.0, backend="torch")
    chunked = build_graph(structures, 5.0, backend="torch", candidate_budget=64)
    assert torch.equal(whole.dst, chunked.dst) and torch.equal(whole.src, chunked.src)
    assert torch.equal(whole.shifts, chunked.shifts)


def test_edge_vectors_and_strain() -> None:
    rng = np.random.default_rng(7)
    items = [random_structure(rng, 10, random_cell(rng, 5.0), (True,) * 3) for _ in range(2)]
    structures = Structures.from_arrays(items)
    g = build_graph(structures, 4.0)
    vec = edge_vectors(g, structures.positions, structures.cells)
    assert bool((vec.norm(dim=1) <= 4.0).all())
    strain = torch.zeros(2, 3, 3, dtype=torch.float64)
    strain[1] = torch.tensor([[0.01, 0.002, 0.0], [0.002, -0.005, 0.003], [0.0, 0.003, 0.02]])
    strained = edge_vectors(g, structures.positions, structures.cells, strain)
    deform = torch.eye(3, dtype=torch.float64) + strain[g.edge_batch]
    assert torch.allclose(strained, torch.bmm(vec.unsqueeze(1), deform).squeeze(1), atol=1e-12)


def test_coincident_atoms_found_by_graph() -> None:
    x = np.array([[0.0, 0, 0], [1.0, 0, 0], [1.0, 0, 5e-5]])
    item = StructureArrays(numbers=[1, 1, 1], positions=x)
    structures = Structures.from_arrays([item], check_coincident=False)
    for backend in BACKENDS:
        with pytest.raises(InvalidStructureError) as info:
            build_graph(structures, 3.0, backend=backend)  # type: ignore[arg-type]
        assert info.value.code == "coincident_atoms" and info.value.index == 0


def test_auto_backend_choice_by_device_and_size() -> None:
    """``auto``: vesin on the host for CPU batches; on CUDA the direct search up to
    DIRECT_MAX_CANDIDATES candidates (torch beyond, or without the table); explicit choices are
    kept, unknown names refused."""
    from service.graph.neighbors import DIRECT_MAX_CANDIDATES, resolve_backend
    from service.graph.pair_search import ImageWindows

    def windows(n_candidates: int) -> ImageWindows:
        return ImageWindows(np.zeros((1, 17)), n_candidates, single_image=True)

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_backend(cpu, "auto", windows(1)) == "vesin"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("so2kernels._dispatch.triton_available", lambda: True)
        assert resolve_backend(cuda, "auto", windows(DIRECT_MAX_CANDIDATES)) == "direct"
        assert resolve_backend(cuda, "auto", windows(DIRECT_MAX_CANDIDATES + 1)) == "torch"
        assert resolve_backend(cuda, "auto") == "torch"
    for name in ("torch", "vesin", "direct"):
        assert resolve_backend(cuda, name) == name
    with pytest.raises(ValueError, match="backend"):
        resolve_backend(cpu, "cuda")  # type: ignore[arg-type]
