"""Force/virial assembly against autograd, and stress against finite differences of the energy."""

from __future__ import annotations

import math

import numpy as np
import torch

from service.graph.assembly import assemble_forces_virial, stress_from_virial
from service.graph.neighbors import Graph, build_graph, edge_vectors
from service.graph.radial import c3_envelope
from service.graph.segments import csr_segment_sum
from service.graph.structures import StructureArrays, Structures
from so2kernels.segment import csr_from_index
from tests.graph.helpers import random_cell, random_structure

RCUT = 4.0


def _pair_energy(vec: torch.Tensor, graph: Graph) -> torch.Tensor:
    """(B,) toy many-image pair potential, smooth at the cutoff, per structure."""
    r = torch.sqrt((vec * vec).sum(-1))
    per_edge = 0.7 * (r - 1.8) ** 2 * c3_envelope(r, RCUT, 5) - 0.1 * torch.exp(-r)
    return torch.zeros(graph.n_structures, dtype=vec.dtype).index_add(0, graph.edge_batch, per_edge)


def _system() -> Structures:
    rng = np.random.default_rng(11)
    items = [
        random_structure(rng, 9, random_cell(rng, 4.5), (True, True, True)),
        random_structure(rng, 5, random_cell(rng, 2.6), (True, True, True)),
        random_structure(rng, 7, None, (False, False, False)),
        random_structure(rng, 6, random_cell(rng, 4.0), (True, False, True)),
    ]
    return Structures.from_arrays(items)


def test_forces_and_virial_match_autograd() -> None:
    structures = _system()
    graph = build_graph(structures, RCUT)
    positions = structures.positions.clone().requires_grad_(True)
    strain = torch.zeros(structures.n_structures, 3, 3, dtype=torch.float64, requires_grad=True)
    energy = _pair_energy(edge_vectors(graph, positions, structures.cells, strain), graph)
    grad_x, grad_strain = torch.autograd.grad(energy.sum(), (positions, strain))

    leaf = edge_vectors(graph, structures.positions, structures.cells).requires_grad_(True)
    (edge_grad,) = torch.autograd.grad(_pair_energy(leaf, graph).sum(), leaf)
    out = assemble_forces_virial(graph, edge_grad, leaf.detach())

    assert out.forces.dtype == torch.float64 and out.virial.shape == (4, 3, 3)
    assert torch.allclose(out.forces, -grad_x, atol=1e-12, rtol=1e-10)
    # virial = −∂E/∂ε with x' = x(I+ε): for a pair potential W is symmetric, W = −(∂E/∂ε)ᵀ.
    assert torch.allclose(out.virial, -grad_strain.transpose(1, 2), atol=1e-11, rtol=1e-10)
    assert torch.allclose(out.virial, out.virial.transpose(1, 2), atol=1e-12)
    assert out.atom_virial is not None
    per_structure = torch.zeros(4, 3, 3, dtype=torch.float64).index_add(
        0, structures.atom_batch, out.atom_virial
    )
    assert torch.allclose(per_structure, out.virial, atol=1e-12)
    net = torch.zeros(4, 3, dtype=torch.float64).index_add(0, structures.atom_batch, out.forces)
    assert float(net.abs().max()) < 1e-12


def test_stress_matches_finite_difference_of_strain() -> None:
    structures = _system()
    graph = build_graph(structures, RCUT)

    def energy(strain: torch.Tensor) -> torch.Tensor:
        return _pair_energy(
            edge_vectors(graph, structures.positions, structures.cells, strain), graph
        )

    leaf = edge_vectors(graph, structures.positions, structures.cells).requires_grad_(True)
    (edge_grad,) = torch.autograd.grad(_pair_energy(leaf, graph).sum(), leaf)
    virial = assemble_forces_virial(graph, edge_grad, leaf.detach(), atom_virial=False).virial
    stress = stress_from_virial(virial, structures.cells, structures.pbc)
    assert stress.shape == (4, 6)
    assert bool(torch.isnan(stress[2:]).all()), "non-periodic / mixed structures have no stress"

    h = 1e-6
    volume = torch.linalg.det(structures.cells).abs()
    voigt = [(0, 0), (1, 1), (2, 2), (1, 2), (0, 2), (0, 1)]
    for k, (a, b) in enumerate(voigt):
        step = torch.zeros(4, 3, 3, dtype=torch.float64)
        step[:, a, b] = h
        step[:, b, a] = h  # symmetric strain: d/dε_ab counts both off-diagonal entries
        de = (energy(step) - energy(-step)) / (2 * h)
        fd = de / volume / (1.0 if a == b else 2.0)
        assert torch.allclose(stress[:2, k], fd[:2], atol=1e-8, rtol=1e-6), (k, stress[:2, k], fd)


def test_assembly_is_deterministic_and_handles_isolated_atoms() -> None:
    x = np.array([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [50.0, 0.0, 0.0]])
    structures = Structures.from_arrays([StructureArrays(numbers=[1, 1, 1], positions=x)])
    graph = build_graph(structures, RCUT)
    assert graph.n_edges == 2
    leaf = edge_vectors(graph, structures.positions, structures.cells).requires_grad_(True)
    (edge_grad,) = torch.autograd.grad(_pair_energy(leaf, graph).sum(), leaf)
    a = assemble_forces_virial(graph, edge_grad, leaf.detach())
    b = assemble_forces_virial(graph, edge_grad, leaf.detach())
    assert torch.equal(a.forces, b.forces) and torch.equal(a.virial, b.virial)
    assert float(a.forces[2].abs().max()) == 0.0
    assert float((a.forces[0] + a.forces[1]).abs().max()) == 0.0


def test_empty_graph() -> None:
    structures = Structures.from_arrays([StructureArrays(numbers=[1], positions=[[0.0, 0, 0]])])
    graph = build_graph(structures, RCUT)
    assert graph.n_edges == 0
    out = assemble_forces_virial(graph, torch.zeros(0, 3), torch.zeros(0, 3))
    assert out.forces.shape == (1, 3) and float(out.forces.abs().sum()) == 0.0
    assert out.virial.shape == (1, 3, 3)


def test_csr_segment_sum_accumulates_in_float64() -> None:
    """fp32 edge values, float64 sums: against exact (fsum) per-segment totals, including the
    grouped (dst-sorted) and the ordered (src CSR) forms, and bitwise stable run to run."""
    gen = torch.Generator().manual_seed(3)
    index = torch.randint(0, 5, (700,), generator=gen)
    values = (torch.randn(700, 3, generator=gen) * 1e4).float()
    order, rowptr = csr_from_index(index, 6)
    exact = torch.tensor(
        [[math.fsum(values[index == s, c].double().tolist()) for c in range(3)] for s in range(6)],
        dtype=torch.float64,
    )
    ordered = csr_segment_sum(values, rowptr, order)
    grouped = csr_segment_sum(values.index_select(0, order), rowptr)
    assert ordered.dtype == torch.float64
    torch.testing.assert_close(ordered, exact, atol=1e-8, rtol=1e-12)
    torch.testing.assert_close(grouped, exact, atol=1e-8, rtol=1e-12)
    assert torch.equal(ordered, csr_segment_sum(values, rowptr, order))
