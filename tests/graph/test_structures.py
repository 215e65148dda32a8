"""Validation of raw structures (typed errors) and the batching helpers."""

from __future__ import annotations

import pickle
import time
from typing import Any

import numpy as np
import pytest
import torch
from ase.build import bulk, molecule

from service.graph.errors import InvalidStructureError
from service.graph.structures import (
    OPEN_AXIS_ROOM,
    StructureArrays,
    Structures,
    occupied_volume,
    symbols_to_numbers,
)

WATER = np.array([[0.0, 0.0, 0.0], [0.96, 0.0, 0.0], [-0.24, 0.93, 0.0]])
CELL = np.diag([5.0, 5.0, 5.0])
# 50 atoms in a 0.6 Å cube: a slab or a cluster given in nm (~230 atoms/Å³).
SQUEEZED = np.random.default_rng(0).uniform(0.0, 0.6, (50, 3))


def _item(**changes: Any) -> StructureArrays:
    base: dict[str, Any] = {"numbers": [8, 1, 1], "positions": WATER, "cell": CELL, "pbc": None}
    base.update(changes)
    return StructureArrays(**base)


def _error(items: list[StructureArrays], **kwargs: Any) -> InvalidStructureError:
    with pytest.raises(InvalidStructureError) as info:
        Structures.from_arrays(items, **kwargs)
    return info.value


@pytest.mark.parametrize(
    ("changes", "code", "field"),
    [
        ({"positions": [[0, 0, 0], [1, 0], [0, 1, 0]]}, "ragged_positions", "positions"),
        ({"positions": [[0, 0, 0, 1]] * 3}, "ragged_positions", "positions"),
        ({"positions": [[0, 0, 0], [1, "a", 0], [0, 1, 0]]}, "ragged_positions", "positions"),
        (
            {"positions": [[0, 0, 0], [np.nan, 0, 0], [0, 1, 0]]},
            "non_finite_positions",
            "positions",
        ),
        (
            {"positions": [[0, 0, 0], [np.inf, 0, 0], [0, 1, 0]]},
            "non_finite_positions",
            "positions",
        ),
        (
            {"positions": [[0, 0, 0], [1e308, 0, 0], [0, 1, 0]]},
            "positions_out_of_range",
            "positions",
        ),
        (
            {"positions": [[0, 0, 0], [0, 0, -2e7], [0, 1, 0]]},
            "positions_out_of_range",
            "positions",
        ),
        ({"positions": WATER[:2]}, "shape_mismatch", "positions"),
        ({"numbers": [], "positions": np.zeros((0, 3))}, "empty_structure", "positions"),
        ({"numbers": [8, 1, 119]}, "unknown_element", "numbers"),
        ({"numbers": [8, 1, 0]}, "unknown_element", "numbers"),
        ({"numbers": ["O", "H", "Xx"]}, "unknown_element", "numbers"),
        ({"numbers": [8, 1, 1.5]}, "unknown_element", "numbers"),
        ({"numbers": [[8, 1, 1]]}, "ragged_numbers", "numbers"),
        ({"cell": np.zeros((3, 3))}, "singular_cell", "cell"),
        ({"cell": [[5, 0, 0], [10, 0, 0], [0, 0, 5]]}, "singular_cell", "cell"),
        ({"cell": np.diag([5.0, 5.0, 0.3])}, "singular_cell", "cell"),
        ({"cell": [[5, 0, 0], [0, np.nan, 0], [0, 0, 5]]}, "non_finite_cell", "cell"),
        # products of tiny lengths underflow to 0, of huge ones overflow: neither may slip through
        ({"cell": np.diag([1e-200] * 3)}, "singular_cell", "cell"),
        ({"cell": np.diag([5.0, 5.0, 1e-200])}, "singular_cell", "cell"),
        ({"cell": np.diag([1e200] * 3)}, "bad_cell", "cell"),
        ({"cell": np.diag([0.6, 0.6, 0.5])}, "unphysical_density", "cell"),  # a cell in nm
        (
            {
                "numbers": [1] * 50,
                "positions": SQUEEZED,
                "cell": np.diag([0.6, 0.6, 10.0]),
                "pbc": [True, True, False],
            },
            "unphysical_density",
            "positions",
        ),
        (
            {"numbers": [1] * 50, "positions": SQUEEZED, "cell": None},
            "unphysical_density",
            "positions",
        ),
        ({"numbers": np.array([8, 1, 2**64 - 1], dtype=np.uint64)}, "unknown_element", "numbers"),
        ({"cell": [[5, 0], [0, 5]]}, "bad_cell", "cell"),
        ({"cell": None, "pbc": True}, "bad_pbc", "pbc"),
        ({"pbc": [True, False]}, "bad_pbc", "pbc"),
        ({"pbc": [1, 2, 0]}, "bad_pbc", "pbc"),
        (
            {"positions": [[0, 0, 0], [0.96, 0, 0], [0.96, 0, 5e-5]]},
            "coincident_atoms",
            "positions",
        ),
        ({"positions": [[0, 0, 0], [0.96, 0, 0], [5.0, 0, 0]]}, "coincident_atoms", "positions"),
    ],
)
def test_invalid_input(changes: dict[str, Any], code: str, field: str) -> None:
    err = _error([_item(), _item(**changes)])
    assert err.code == code
    assert err.index == 1
    assert err.field == f"structures[1].{field}"
    assert str(err)


def test_occupied_volume_of_each_periodicity() -> None:
    """The lattice's volume, area or length along periodic axes, times the atoms' extent plus
    ``OPEN_AXIS_ROOM`` along the open directions (a slab's normal, a wire's cross-section)."""
    x = np.array([[0.0, 0.0, 0.0], [1.5, 0.2, 0.4], [0.3, 2.0, -1.0]])
    cell = np.array([[5.0, 0.0, 0.0], [2.0, 4.0, 0.0], [0.0, 0.0, 6.0]])
    room = OPEN_AXIS_ROOM
    assert occupied_volume(x, cell, np.ones(3, bool)) == pytest.approx(120.0)
    slab = occupied_volume(x, cell, np.array([True, True, False]))
    assert slab == pytest.approx(20.0 * (1.4 + room))  # |a × b| times the thickness along z
    wire = occupied_volume(x, cell, np.array([False, False, True]))
    assert wire == pytest.approx(6.0 * (1.5 + room) * (2.0 + room))
    cluster = occupied_volume(x, np.zeros((3, 3)), np.zeros(3, bool))
    assert cluster == pytest.approx((1.5 + room) * (2.0 + room) * (1.4 + room))
    # A slab's measure follows it when turned: it does not depend on the frame.
    turn = np.linalg.qr(np.random.default_rng(1).normal(size=(3, 3)))[0]  # orthogonal
    for pbc in ([True, True, False], [True, True, True]):
        mask = np.array(pbc)
        assert occupied_volume(x @ turn.T, cell @ turn.T, mask) == pytest.approx(
            occupied_volume(x, cell, mask)
        )


def test_molecules_at_short_bonds_are_not_too_dense() -> None:
    """A dissociation scan's shortest bonds and a lone atom stay well inside the density limit."""
    for positions in ([[0.0, 0.0, 0.0], [0.3, 0.0, 0.0]], [[0.0, 0.0, 0.0]]):
        structures = Structures.from_arrays(
            [
                StructureArrays(
                    numbers=[1] * len(positions), positions=positions, cell=None, pbc=None
                )
            ]
        )
        assert structures.n_structures == 1


@pytest.mark.parametrize(
    ("pbc", "skew"),
    [
        ((True, True, True), [[1, 7, 0], [0, 1, 0], [0, 0, 1]]),
        ((True, True, True), [[1, 0, 0], [0, 1, 9], [0, 0, 1]]),
        ((False, True, True), [[1, 0, 0], [0, 1, 9], [0, 0, 1]]),
        ((True, True, False), [[1, 7, 0], [0, 1, 0], [0, 0, 1]]),
    ],
)
def test_a_skewed_basis_is_replaced_by_the_reduced_basis_of_its_lattice(
    pbc: tuple[bool, ...], skew: list[list[int]]
) -> None:
    """A basis with a plane spacing under 0.5 Å whose lattice is ordinary (here 3 × 3.2 × 3.4 Å)
    is evaluated in the lattice's reduced basis: same lattice (an integer unimodular change of
    the periodic rows), same volume, non-periodic rows untouched, positions untouched."""
    cell = np.array(skew, dtype=float) @ np.diag([3.0, 3.2, 3.4])
    packed = Structures.from_arrays([_item(cell=cell, pbc=pbc)])
    reduced = packed.cells[0].numpy()
    change = reduced @ np.linalg.inv(cell)
    np.testing.assert_allclose(change, np.round(change), atol=1e-12)
    assert abs(round(np.linalg.det(change))) == 1
    fixed = ~np.array(pbc)
    np.testing.assert_array_equal(reduced[fixed], cell[fixed])
    np.testing.assert_allclose(np.sort(np.abs(reduced).max(axis=1)[~fixed]),
                               np.sort(np.diag([3.0, 3.2, 3.4])[~fixed].max(axis=1)))  # fmt: skip
    np.testing.assert_array_equal(packed.positions.numpy(), WATER)


def test_a_thin_lattice_is_rejected_in_every_basis() -> None:
    """Reduction cannot rescue a lattice whose own plane spacing is below 0.5 Å."""
    thin = np.array([[1, 7, 0], [0, 1, 0], [0, 0, 1]], dtype=float) @ np.diag([5.0, 0.3, 5.0])
    assert _error([_item(cell=thin)]).code == "singular_cell"


def test_density_limit_applies_to_fully_periodic_cells_only() -> None:
    """A slab's cell volume says nothing about its density; a bulk cell's does."""
    dense = np.diag([0.6, 0.6, 0.5])
    assert "atoms/Å³" in _error([_item(cell=dense)]).message
    slab = Structures.from_arrays([_item(cell=dense, pbc=[True, True, False])])
    assert slab.n_atoms == 3
    limit = Structures.from_arrays([_item(cell=np.diag([0.6, 0.5, 1.0]))])  # exactly 10 atoms/Å³
    assert limit.n_atoms == 3


def test_huge_atomic_numbers_are_reported_unwrapped() -> None:
    numbers = np.array([8, 1, 2**64 - 1], dtype=np.uint64)
    assert "18446744073709551615" in _error([_item(numbers=numbers)]).message


def test_too_many_atoms() -> None:
    err = _error([_item(), _item()], max_atoms=5)
    assert (err.code, err.index) == ("too_many_atoms", 1)
    assert Structures.from_arrays([_item(), _item()], max_atoms=6).n_atoms == 6


def test_empty_batch_and_error_pickles() -> None:
    err = _error([])
    assert err.code == "empty_batch"
    again = pickle.loads(pickle.dumps(err))
    assert (again.code, again.field, again.index, str(again)) == (
        err.code,
        err.field,
        err.index,
        str(err),
    )
    assert err.to_dict()["code"] == "empty_batch"


def test_slab_with_singular_open_axis_is_fine() -> None:
    cell = [[5.0, 0, 0], [0, 5.0, 0], [0, 0, 0]]
    s = Structures.from_arrays([_item(cell=cell, pbc=[True, True, False])])
    assert s.pbc.tolist() == [[True, True, False]]


def test_defaults_and_dtypes() -> None:
    s = Structures.from_arrays([_item(), _item(cell=None), _item(cell=[4.0, 5.0, 6.0])])
    assert s.pbc.tolist() == [[True] * 3, [False] * 3, [True] * 3]
    assert s.numbers.dtype == torch.int64 and s.positions.dtype == torch.float64
    assert s.cells.dtype == torch.float64 and s.pbc.dtype == torch.bool
    assert s.ptr.tolist() == [0, 3, 6, 9] and s.n_structures == 3 and s.n_atoms == 9
    assert s.atom_batch.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert float(s.cells[1].abs().sum()) == 0.0


def test_symbols() -> None:
    assert symbols_to_numbers(["H", "He", "O", "Og"]).tolist() == [1, 2, 8, 118]
    s = Structures.from_arrays([_item(numbers=["O", "H", "H"])])
    assert s.numbers.tolist() == [8, 1, 1]


def test_from_atoms() -> None:
    si = bulk("Si", "diamond", a=5.43)
    h2o = molecule("H2O")
    s = Structures.from_atoms([si, h2o])
    assert s.numbers.tolist() == [14, 14, 8, 1, 1]
    assert s.pbc.tolist() == [[True] * 3, [False] * 3]
    assert torch.allclose(s.cells[0], torch.from_numpy(si.cell.array))
    assert torch.allclose(s.positions[2:], torch.from_numpy(h2o.positions))


def test_concat() -> None:
    a = Structures.from_arrays([_item(), _item(cell=None)])
    b = Structures.from_arrays([_item(numbers=[8, 1, 2])])
    merged = Structures.concat([a, b])
    assert merged.ptr.tolist() == [0, 3, 6, 9]
    assert merged.numbers.tolist() == [8, 1, 1, 8, 1, 1, 8, 1, 2]
    assert merged.pbc.tolist() == [[True] * 3, [False] * 3, [True] * 3]
    assert Structures.concat([a]) is a
    moved = merged.to("cpu")
    assert torch.equal(moved.positions, merged.positions)


def test_validation_is_fast() -> None:
    rng = np.random.default_rng(0)
    grid = np.stack(np.meshgrid(*[np.arange(10)] * 3, indexing="ij"), -1).reshape(-1, 3) * 1.5
    item = _item(
        numbers=rng.integers(1, 9, 1000),
        positions=grid + rng.uniform(0, 0.3, grid.shape),
        cell=np.eye(3) * 15.0,
    )
    Structures.from_arrays([item])
    start = time.perf_counter()
    Structures.from_arrays([item])
    assert time.perf_counter() - start < 0.25  # ~3 ms on one core; generous for loaded CI


# coincident atoms: the host search against the cell-list search of the graph layer
D = 1e-4


def _random_structure(rng: np.random.Generator, kind: str, n: int) -> StructureArrays:
    """Uniformly random atoms (an accidental pair within 1e-4 Å is vanishingly unlikely);
    ``kind`` picks the periodicity."""
    cells = {
        "molecule": (None, None),
        "bulk": (np.diag([6.0, 7.0, 5.5]) + rng.uniform(-1.5, 1.5, (3, 3)), [True] * 3),
        "slab": (np.array([[6.0, 0, 0], [2.5, 6.5, 0], [0, 0, 0]]), [True, True, False]),
        "wire": (np.array([[5.0, 1.0, 0], [0, 0, 0], [0, 0, 0]]), [True, False, False]),
    }
    cell, pbc = cells[kind]
    frame = np.where(np.array(pbc or [False] * 3)[:, None], cell if cell is not None else 0, 0)
    frac = rng.uniform(-0.2, 1.2, (n, 3))
    positions = frac @ frame + rng.uniform(0, 8.0, (n, 3)) * (frame == 0).all(axis=1)
    return StructureArrays(numbers=[1] * n, positions=positions, cell=cell, pbc=pbc)


def _plant(rng: np.random.Generator, item: StructureArrays, lattice_shift: bool) -> None:
    """Move atom 1 within D/2 of atom 0 (or of one of its periodic images)."""
    x = np.asarray(item.positions)
    target = x[0].copy()
    if lattice_shift and item.cell is not None:
        shift = rng.integers(-2, 3, 3) * np.asarray(item.pbc)
        target = target + shift @ np.asarray(item.cell)
    step = rng.normal(size=3)
    x[1] = target + 0.5 * D * rng.uniform() * step / np.linalg.norm(step)


def _graph_layer_verdict(structures: Structures) -> int | None:
    """Structure index the cell-list search rejects, or None."""
    from service.graph.cell_list import find_pairs

    try:
        find_pairs(
            structures.positions,
            structures.cells,
            structures.pbc,
            structures.ptr,
            D,
            min_distance=D,
        )
    except InvalidStructureError as exc:
        return exc.index
    return None


@pytest.mark.parametrize("seed", range(12))
def test_coincident_search_agrees_with_cell_list(seed: int) -> None:
    rng = np.random.default_rng(seed)
    items = [
        _random_structure(rng, kind, int(rng.integers(2, 60)))
        for kind in ("molecule", "bulk", "slab", "wire")
    ]
    planted = int(rng.integers(0, len(items)))
    _plant(rng, items[planted], lattice_shift=bool(seed % 2))
    unchecked = Structures.from_arrays(items, check_coincident=False)
    assert _graph_layer_verdict(unchecked) == planted
    err = _error(items)
    assert (err.code, err.index, err.field) == (
        "coincident_atoms",
        planted,
        f"structures[{planted}].positions",
    )
    assert "atoms 0 and 1" in err.message
    clean = [item for k, item in enumerate(items) if k != planted]
    assert Structures.from_arrays(clean).n_structures == len(items) - 1


def test_coincident_across_a_face_of_a_triclinic_cell() -> None:
    cell = np.array([[5.0, 0, 0], [2.0, 5.0, 0], [1.0, 1.0, 5.0]])
    x = np.array([[0.0, 0.0, 0.0], [1.0, 2.0, 2.0], cell.sum(axis=0) - [3e-5, 0, 2e-5]])
    err = _error([_item(positions=x, cell=cell)])
    assert err.code == "coincident_atoms" and "atoms 0 and 2 (image [-1, -1, -1])" in err.message
    x[2] -= 1e-3
    Structures.from_arrays([_item(positions=x, cell=cell)])


def test_crowded_slab_falls_back_to_the_exact_grid_search() -> None:
    # 30 atoms on one plane perpendicular to the sweep direction, 0.4 Å apart: the sweep gives
    # up and the grid search must still find (and only find) the planted pair.
    from service.graph.structures import _PROJECTION

    u = _PROJECTION
    e1 = np.cross(u, [0.0, 0.0, 1.0])
    e1 /= np.linalg.norm(e1)
    e2 = np.cross(u, e1)
    grid = np.stack(np.meshgrid(np.arange(6), np.arange(5), indexing="ij"), -1).reshape(-1, 2)
    x = 0.4 * (grid[:, :1] * e1 + grid[:, 1:] * e2)
    item = StructureArrays(numbers=[1] * len(x), positions=x.copy())
    Structures.from_arrays([item])
    x[7] = x[3] + 0.3 * D * e1
    err = _error([StructureArrays(numbers=[1] * len(x), positions=x)])
    assert err.code == "coincident_atoms" and "atoms 3 and 7" in err.message
