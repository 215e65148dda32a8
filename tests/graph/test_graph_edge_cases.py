"""The per-request graph on geometries a demanding user sends: tiny, elongated, skewed and
left-handed cells, mixed periodicity, unwrapped and far-away positions, pairs exactly at the
cutoff, isolated atoms, mixed batches, edges along ±z. Neighbour lists are checked against an
independent float64 brute force that enumerates every image explicitly; energies, forces and
stress against the shipped default model (finite differences in float64)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from functools import cache

import numpy as np
import pytest
import torch
from numpy.typing import NDArray

from service.graph.cell_list import canonical_order
from service.graph.errors import InvalidStructureError
from service.graph.neighbors import Graph, build_graph
from service.graph.structures import StructureArrays, Structures
from service.graph.wigner import edge_quaternion, quaternion_to_rotation, wigner_d
from service.model.potential import Potential, load_potential

BACKENDS = ("torch", "vesin", "direct")
RCUT = 6.0
"""The shipped model's cutoff."""

Edge = tuple[int, int, int, int, int]


def _edge_set(graph: Graph) -> set[Edge]:
    rows = torch.cat([graph.dst[:, None], graph.src[:, None], graph.shifts], 1).tolist()
    return {(d, s, a, b, c) for d, s, a, b, c in rows}


def brute_force_edges(
    positions: NDArray[np.float64], cell: NDArray[np.float64], pbc: NDArray[np.bool_], rcut: float
) -> set[Edge]:
    """Every (dst, src, S) with ``0 < |(x_src + S·cell) − x_dst| ≤ rcut``, in float64, by
    enumerating for each pair all lattice shifts its fractional offset allows (so positions
    need not be wrapped): along periodic axis a, ``|r·d_a| ≤ rcut·|d_a|`` with ``d_a`` the dual
    vector of the periodic rows."""
    axes = np.flatnonzero(pbc)
    duals = np.linalg.pinv(cell[axes]) if len(axes) else np.zeros((3, 0))  # (3, k)
    frac = positions @ duals
    reach = rcut * np.linalg.norm(duals, axis=0) + 1e-9
    out: set[Edge] = set()
    for i, j in itertools.product(range(len(positions)), repeat=2):
        offset = frac[j] - frac[i]
        ranges = [
            range(int(np.ceil(-o - c)), int(np.floor(-o + c)) + 1)
            for o, c in zip(offset, reach, strict=True)
        ]
        for periodic_shift in itertools.product(*ranges):
            shift = np.zeros(3, dtype=np.int64)
            shift[axes] = periodic_shift
            r = (positions[j] + shift.astype(np.float64) @ cell) - positions[i]
            dist2 = float(r @ r)
            if 0.0 < dist2 <= rcut * rcut:
                out.add((i, j, *(int(s) for s in shift)))  # type: ignore[arg-type]
    return out


def _expected(structures: Structures, rcut: float) -> set[Edge]:
    return brute_force_edges(
        structures.positions.numpy(), structures.cells[0].numpy(), structures.pbc[0].numpy(), rcut
    )


def _skewed(angle_deg: float) -> NDArray[np.float64]:
    t = np.radians(angle_deg)
    return np.array([[3.0, 0.0, 0.0], [3.0 * np.cos(t), 3.0 * np.sin(t), 0.0], [0.5, 0.4, 3.2]])


def _random_inside(cell: NDArray[np.float64], n: int, seed: int) -> NDArray[np.float64]:
    frac: NDArray[np.float64] = np.random.default_rng(seed).uniform(0.0, 1.0, (n, 3))
    return frac @ cell


def _hard_cases() -> list[tuple[str, StructureArrays]]:
    elongated = np.diag([1.0, 1.2, 40.0])
    left = np.diag([4.0, 4.5, 5.2])[[1, 0, 2]]
    open_zero = np.array([[3.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.4, 0.0, 3.5]])
    slab = np.array([[3.1, 0.0, 0.0], [1.0, 2.9, 0.0], [0.0, 0.0, 0.0]])
    on_faces = [[0.0, 0.0, 0.0], [3.0, 1.5, 0.0], [1.5, 3.0, 3.0]]
    return [
        ("on_faces", StructureArrays([8, 1, 1], on_faces, np.eye(3) * 3.0, True)),
        ("one_atom_1.5A_cube", StructureArrays([8], [[0.1, 0.2, 0.3]], np.eye(3) * 1.5, True)),
        (
            "elongated",
            StructureArrays([8, 1], [[0.0, 0.0, 0.0], [0.5, 0.3, 10.0]], elongated, True),
        ),
        ("angle_30", StructureArrays([8, 1, 1], _random_inside(_skewed(30), 3, 1), _skewed(30))),
        ("angle_150", StructureArrays([8, 1, 1], _random_inside(_skewed(150), 3, 2), _skewed(150))),
        ("left_handed", StructureArrays([8, 1, 1], _random_inside(left, 3, 3), left, True)),
        (
            "negated_cell",
            StructureArrays([8, 1], [[0.0, 0.0, 0.0], [1.1, 1.3, 0.7]], -np.eye(3) * 2.7),
        ),
        (
            "TFT_zero_open_vector",
            StructureArrays(
                [8, 1, 1],
                [[0.0, 0.0, 0.0], [1.0, 5.0, 0.5], [0.5, -3.0, 1.0]],
                open_zero,
                [True, False, True],
            ),
        ),
        (
            "slab",
            StructureArrays(
                [8, 1, 1],
                [[0.0, 0.0, 0.0], [1.0, 2.0, 0.5], [0.5, 1.0, 4.0]],
                slab,
                [True, True, False],
            ),
        ),
    ]


HARD_CASES = _hard_cases()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("name", "item"), HARD_CASES, ids=[c[0] for c in HARD_CASES])
def test_hard_cells_match_explicit_images(name: str, item: StructureArrays, backend: str) -> None:
    structures = Structures.from_arrays([item])
    graph = build_graph(structures, RCUT, backend=backend)  # type: ignore[arg-type]
    assert _edge_set(graph) == _expected(structures, RCUT)
    assert graph.n_edges == len(_expected(structures, RCUT))


def _at_cutoff_cases() -> list[tuple[str, StructureArrays, float]]:
    """Pairs whose distance is exactly the cutoff (all arithmetic exact in float64)."""
    return [
        ("cube_self_images", StructureArrays([8], [[0.0, 0.0, 0.0]], np.eye(3) * 3.0, True), 6.0),
        ("dimer", StructureArrays([8, 1], [[0.0, 0.0, 0.0], [1.5, 0.0, 0.0]]), 1.5),
        (
            "slab_3_4_5",
            StructureArrays([8], [[0.0, 0.0, 0.0]], np.diag([3.0, 4.0, 0.0]), [True, True, False]),
            5.0,
        ),
    ]


AT_CUTOFF = _at_cutoff_cases()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("name", "item", "rcut"), AT_CUTOFF, ids=[c[0] for c in AT_CUTOFF])
def test_pairs_exactly_at_the_cutoff_are_edges(
    name: str, item: StructureArrays, rcut: float, backend: str
) -> None:
    """The contract is ``|r| ≤ rcut`` in every backend (vesin's own test is strict)."""
    structures = Structures.from_arrays([item])
    graph = build_graph(structures, rcut, backend=backend)  # type: ignore[arg-type]
    expected = _expected(structures, rcut)
    assert _edge_set(graph) == expected
    assert graph.n_edges == len(expected)


def test_backends_agree_bit_for_bit_on_lattices_at_the_cutoff() -> None:
    structures = Structures.from_arrays([item for _, item, _ in AT_CUTOFF[:1]] * 2)
    graphs = [build_graph(structures, 6.0, backend=b) for b in BACKENDS]  # type: ignore[arg-type]
    for graph in graphs[1:]:
        for a, b in zip(graphs[0].tensors(), graph.tensors(), strict=True):
            assert torch.equal(a, b)


def test_a_zero_lattice_vector_on_a_periodic_axis_is_refused() -> None:
    cell = np.array([[3.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 3.5]])
    item = StructureArrays([8, 1], [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]], cell, [True, True, True])
    with pytest.raises(InvalidStructureError) as info:
        Structures.from_arrays([item])
    assert info.value.code == "singular_cell" and info.value.field == "structures[0].cell"
    assert "periodic axis 1 is zero" in info.value.message


@pytest.mark.parametrize(
    ("positions", "cell", "code"),
    [
        ([[0, 0, 0], [np.nan, 0, 0]], None, "non_finite_positions"),
        ([[0, 0, 0], [np.inf, 0, 0]], None, "non_finite_positions"),
        ([[0, 0, 0], [1, 0, 0]], [[3.0, 0, 0], [0, np.inf, 0], [0, 0, 3.0]], "non_finite_cell"),
    ],
)
def test_non_finite_input_is_refused(
    positions: list[list[float]], cell: list[list[float]] | None, code: str
) -> None:
    with pytest.raises(InvalidStructureError) as info:
        Structures.from_arrays([StructureArrays([8, 1], positions, cell)])
    assert info.value.code == code and info.value.index == 0


def test_canonical_order_sorts_huge_shifts_lexicographically() -> None:
    """Shifts of millions of cells (unwrapped positions ~1e6 Å away in a small cell) must not
    overflow the packed sort key: ``(s0, s1, s2)`` packed in base ``2R+1`` exceeds int64 once
    R ≥ 2^21, and the pair straddling 2^63 below would sort backwards."""
    reach = 2**21
    base = 2 * reach + 1
    top = 2**63 - 1
    digits = [top // base // base, (top // base) % base, top % base]
    s0, s1, s2 = (d - reach for d in digits)
    shifts = torch.tensor([[s0, s1, s2 + 1], [s0, s1, s2], [reach, 0, 0]])
    pairs = canonical_order(torch.zeros(3, dtype=torch.int64), torch.tensor([0, 0, 1]), shifts,
                            n_atoms=2)  # fmt: skip
    assert pairs.shifts.tolist() == [[s0, s1, s2], [s0, s1, s2 + 1], [reach, 0, 0]]


# End to end with the shipped model


@cache
def _potential(precision: str = "fp32") -> Potential:
    return load_potential(device="cpu", precision=precision, capture=False)


def _predict(
    items: Sequence[StructureArrays], precision: str = "fp32"
) -> dict[str, NDArray[np.float64]]:
    out = _potential(precision).predict(
        Structures.from_arrays(items), ("energy", "forces", "stress")
    )
    assert out.forces is not None and out.stress is not None
    return {
        "energy": out.energy.numpy(),
        "forces": out.forces.numpy(),
        "stress": out.stress.numpy(),
    }


def test_unwrapped_positions_give_the_wrapped_edges_and_energy() -> None:
    cell = np.array([[3.1, 0.0, 0.0], [0.6, 3.3, 0.0], [0.4, -0.3, 3.5]])
    wrapped = _random_inside(cell, 3, 11)
    lattice = np.random.default_rng(12).integers(-1000, 1001, (3, 3))
    far = wrapped + lattice @ cell
    numbers = [8, 1, 1]
    near_s = Structures.from_arrays([StructureArrays(numbers, wrapped, cell, True)])
    far_s = Structures.from_arrays([StructureArrays(numbers, far, cell, True)])
    # r = x_j + S·cell − x_i is the same vector when S' = S + n_i − n_j.
    moved = {
        (i, j, *(np.array(s) + lattice[i] - lattice[j]).tolist())
        for i, j, *s in _edge_set(build_graph(near_s, RCUT, backend="torch"))
    }
    for backend in BACKENDS:
        assert _edge_set(build_graph(far_s, RCUT, backend=backend)) == moved  # type: ignore[arg-type]
    near, away = (_predict([StructureArrays(numbers, x, cell, True)]) for x in (wrapped, far))
    np.testing.assert_allclose(away["energy"], near["energy"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(away["forces"], near["forces"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(away["stress"], near["stress"], rtol=0, atol=1e-7)


@pytest.mark.parametrize("offset", [1e4, 1e6])
def test_molecule_far_from_the_origin_keeps_its_energy(offset: float) -> None:
    """Edge vectors are formed in float64 before the fp32 model sees them: a molecule 1e4 or
    1e6 Å from the origin is the same molecule."""
    x = np.array([[0, 0, 0], [0.96, 0, 0], [-0.24, 0.93, 0], [2.5, 0.3, 0.2], [3.3, 0.5, 0.6]])
    numbers = [8, 1, 1, 8, 1]
    here, there = (_predict([StructureArrays(numbers, x + o)]) for o in (0.0, offset))
    np.testing.assert_allclose(there["energy"], here["energy"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(there["forces"], here["forces"], rtol=0, atol=1e-5)


def test_isolated_atoms_have_reference_energies_and_no_forces() -> None:
    alone = [_predict([StructureArrays([z], [[0.0, 0.0, 0.0]])])["energy"][0] for z in (8, 1)]
    molecule = _predict([StructureArrays([8, 1], [[0.0, 0.0, 0.0], [RCUT + 1e-9, 0.0, 0.0]])])
    box = _predict(
        [StructureArrays([8, 1], [[0.0, 0.0, 0.0], [8.0, 0.0, 0.0]], np.eye(3) * 16.0, True)]
    )
    for out in (molecule, box):
        np.testing.assert_allclose(out["energy"], [sum(alone)], rtol=0, atol=1e-6)
        assert not out["forces"].any()
    assert np.isnan(molecule["stress"]).all()
    assert not box["stress"].any()


def test_per_structure_results_do_not_depend_on_the_batch() -> None:
    cell = np.array([[3.1, 0.0, 0.0], [0.6, 3.3, 0.0], [0.4, -0.3, 3.5]])
    items = [
        StructureArrays([8, 1, 1], _random_inside(cell, 3, 21), cell, True),
        StructureArrays([8, 1, 1], [[0.0, 0.0, 0.0], [0.96, 0.0, 0.0], [-0.24, 0.93, 0.0]]),
        StructureArrays([8], [[0.1, 0.2, 0.3]], np.eye(3) * 1.5, True),
        StructureArrays([1, 8], [[0.0, 0.0, 0.0], [1.0, 0.3, 0.0]], np.diag([3.0, 0.0, 3.0]),
                        [True, False, True]),
    ]  # fmt: skip
    alone = [_predict([item]) for item in items]
    for order in ([2, 0, 3, 1], [3, 1, 0, 2]):
        batch = _predict([items[k] for k in order])
        start = 0
        for slot, k in enumerate(order):
            n = len(items[k].numbers)  # type: ignore[arg-type]
            np.testing.assert_allclose(batch["energy"][slot], alone[k]["energy"][0], atol=1e-5)
            forces = batch["forces"][start : start + n]
            np.testing.assert_allclose(forces, alone[k]["forces"], rtol=0, atol=1e-5)
            np.testing.assert_allclose(batch["stress"][slot], alone[k]["stress"][0], atol=1e-6)
            start += n


def _finite_difference_check(
    numbers: list[int], x: NDArray[np.float64], cell: NDArray[np.float64]
) -> None:
    """Forces and stress of the fp64 model against central differences of its energy."""

    def energy(positions: NDArray[np.float64], lattice: NDArray[np.float64]) -> float:
        out = _potential("fp64").predict(
            Structures.from_arrays([StructureArrays(numbers, positions, lattice, True)]),
            ("energy",),
        )
        return float(out.energy[0])

    got = _predict([StructureArrays(numbers, x, cell, True)], "fp64")
    h = 1e-4
    forces = np.zeros_like(x)
    for i, k in itertools.product(range(len(numbers)), range(3)):
        step = np.zeros_like(x)
        step[i, k] = h
        forces[i, k] = -(energy(x + step, cell) - energy(x - step, cell)) / (2 * h)
    strain_grad = np.zeros((3, 3))
    for a, b in itertools.product(range(3), repeat=2):
        eps = np.zeros((3, 3))
        eps[a, b] = h
        plus, minus = np.eye(3) + eps, np.eye(3) - eps
        strain_grad[a, b] = (energy(x @ plus, cell @ plus) - energy(x @ minus, cell @ minus)) / (
            2 * h
        )
    sym = 0.5 * (strain_grad + strain_grad.T) / abs(np.linalg.det(cell))
    voigt = sym[[0, 1, 2, 1, 0, 0], [0, 1, 2, 2, 2, 1]]
    np.testing.assert_allclose(got["forces"], forces, rtol=0, atol=1e-6)
    np.testing.assert_allclose(got["stress"][0], voigt, rtol=0, atol=1e-7)


def test_forces_and_stress_in_a_cell_far_smaller_than_the_cutoff() -> None:
    cell = np.array([[2.0, 0.0, 0.0], [0.3, 1.8, 0.0], [0.2, 0.1, 2.1]])
    _finite_difference_check([8, 1], _random_inside(cell, 2, 31), cell)


@pytest.mark.slow
def test_forces_and_stress_in_a_left_handed_skewed_cell() -> None:
    cell = _skewed(150)[[1, 0, 2]]
    assert np.linalg.det(cell) < 0
    _finite_difference_check([8, 1, 1], _random_inside(cell, 3, 32), cell)


# Edge frames at the poles and tiny edges


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_frames_of_polar_and_tiny_edges(dtype: torch.dtype) -> None:
    eps = 1e-7
    vec = torch.tensor(
        [[0, 0, 1.0], [0, 0, -1.0], [0, 0, 5.9], [0, 0, -5.9], [1e-4, 0, 0], [0, 0, 1e-4],
         [0, 0, -1e-4], [1e-30, 0, -1.0], [-1e-30, 0, -1.0], [0, 1e-30, -1.0]],
        dtype=dtype, requires_grad=True,
    )  # fmt: skip
    length = torch.sqrt((vec * vec).sum(-1) + eps * eps)
    quat = edge_quaternion(vec, length, eps)
    unit = vec / torch.linalg.vector_norm(vec, dim=1, keepdim=True)
    rotated = quaternion_to_rotation(quat) @ unit.unsqueeze(-1)
    plus_z = torch.tensor([0.0, 0.0, 1.0], dtype=dtype).expand(len(vec), 3)
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(rotated.squeeze(-1), plus_z, atol=tol, rtol=0)
    d = wigner_d(quat, 4)
    eye = torch.eye(25, dtype=dtype).expand_as(d)
    torch.testing.assert_close(d @ d.transpose(1, 2), eye, atol=10 * tol, rtol=0)
    (grad,) = torch.autograd.grad(d.sum() + quat.sum(), vec)
    assert bool(torch.isfinite(grad).all())


def test_a_rounding_tie_at_the_coincidence_threshold_does_not_fail_the_direct_search(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """When only the kernel's arithmetic puts a pair below ``min_distance`` (a distance within
    rounding of it, which host validation and the cell list accept), the request gets the cell
    list's graph, not a RuntimeError (an HTTP 500)."""
    from service.graph import pair_search

    monkeypatch.setattr(pair_search, "direct_pairs", lambda *args, **kwargs: None)
    structures = Structures.from_arrays([HARD_CASES[0][1]])
    direct = build_graph(structures, RCUT, backend="direct")
    reference = build_graph(structures, RCUT, backend="torch")
    for a, b in zip(direct.tensors(), reference.tensors(), strict=True):
        assert torch.equal(a, b)
