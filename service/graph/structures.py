"""Validated batches of atomic structures: the input of every evaluation.

A request arrives as raw arrays (:class:`StructureArrays`, lists or numpy) or ``ase.Atoms``;
:meth:`Structures.from_arrays` / :meth:`Structures.from_atoms` check them (shapes, finiteness,
known elements, a usable cell on periodic axes, the atom limit, coincident atoms) and pack them
into one flat batch. Every problem raises :class:`InvalidStructureError` naming the structure and
field. Checks are numpy per structure plus one vectorised coincidence search over the batch (a sort
along a projection, a grid of 2·1e-4 Å bins where that does not separate the atoms; see
:func:`first_coincident_pair`), so validating a 1k-atom request costs well under a millisecond
on the host. :meth:`Structures.concat` merges already validated batches without re-validating
(dynamic batching in the engine).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np
import torch
from ase.geometry import minkowski_reduce
from numpy.typing import ArrayLike, NDArray
from torch import Tensor

from service.graph.cell_list import COINCIDENT_DISTANCE, atom_batch_index
from service.graph.errors import (
    InvalidStructureError,
    coincident_atoms_error,
)

MAX_ATOMIC_NUMBER = 118

MIN_CELL_HEIGHT = 0.5
"""Å. A periodic axis thinner than this, in the given basis and in its reduced basis, puts every
atom within 0.5 Å of its own image (nothing physical) and would make the image enumeration
explode; such cells are rejected as singular. A thin axis of a skewed basis alone is not: the
reduced basis of that lattice is used instead."""

MAX_NUMBER_DENSITY = 10.0
"""Atoms per Å³: fifty times diamond's (0.18), the densest solid, so that even a relaxation or a
compression run that squeezes a cell far past anything physical is still answered. A structure
denser than this (in its ``occupied_volume``) is a unit mistake (a cell in nm around positions
in Å is ~1000× too dense), whose neighbour count would be as many times too large."""

OPEN_AXIS_ROOM = 1.0
"""Å. Room an atom takes along a direction with no lattice vector: a structure's extent there
plus this is its size for ``occupied_volume``. An H2 molecule at a 0.3 Å bond then measures 1.5
atoms/Å³, far below ``MAX_NUMBER_DENSITY``, while a slab or a cluster whose positions were
given in the wrong unit (or squeezed onto one another) still measures above it."""

MAX_COORDINATE = 1.0e7
"""Å. Largest accepted |coordinate| of a position or a lattice vector. Far beyond any physical
system, yet small enough that float64 keeps positions and their differences to ~1e-9 Å, and
that the neighbour searches' bin and image counts stay finite (a coordinate near 1e300 made
their grid arithmetic overflow)."""

_MIN_RELATIVE_VOLUME = 1e-8
"""Volume of the periodic lattice vectors relative to the product of their lengths, below which
they count as linearly dependent."""


@dataclass(frozen=True)
class StructureArrays:
    """One raw structure as received, before validation.

    ``numbers``: (n,) atomic numbers or element symbols; ``positions``: (n, 3) Å;
    ``cell``: (3, 3) lattice vectors as rows, (3,) orthorhombic lengths, or None;
    ``pbc``: (3,) bools, one bool, or None (None → periodic on all axes if a cell is given,
    otherwise not periodic).
    """

    numbers: Sequence[int] | Sequence[str] | ArrayLike
    positions: Sequence[Sequence[float]] | ArrayLike
    cell: Sequence[Sequence[float]] | Sequence[float] | ArrayLike | None = None
    pbc: Sequence[bool] | bool | ArrayLike | None = None


def symbols_to_numbers(
    symbols: Sequence[str] | ArrayLike, *, field: str = "numbers"
) -> NDArray[np.int64]:
    """(n,) int64 atomic numbers of element symbols ('H', 'He', ...; case-sensitive like ASE)."""
    from ase.data import atomic_numbers

    out = np.empty(len(symbols), dtype=np.int64)  # type: ignore[arg-type]
    for k, symbol in enumerate(symbols):  # type: ignore[arg-type]
        number = atomic_numbers.get(str(symbol))
        if number is None or not 1 <= number <= MAX_ATOMIC_NUMBER:
            raise InvalidStructureError(
                "unknown_element", f"unknown element symbol {symbol!r} at atom {k}", field=field
            )
        out[k] = number
    return out


@dataclass(frozen=True)
class Structures:
    """A validated batch of ``B`` structures with ``N`` atoms in all (flat, structure-major).

    Attributes:
        numbers: (N,) int64 atomic numbers in 1..118.
        positions: (N, 3) float64, Å.
        cells: (B, 3, 3) float64, lattice vectors as rows; zeros where there is no cell.
        pbc: (B, 3) bool.
        ptr: (B+1,) int64 atom offsets: structure ``b`` is atoms ``ptr[b]:ptr[b+1]``.
    """

    numbers: Tensor
    positions: Tensor
    cells: Tensor
    pbc: Tensor
    ptr: Tensor

    # construction
    @classmethod
    def from_arrays(
        cls,
        items: Sequence[StructureArrays],
        *,
        max_atoms: int | None = None,
        check_coincident: bool = True,
        field_prefix: str = "structures",
    ) -> Structures:
        """Validate raw structures and pack them into one batch (on the CPU).

        Args:
            items: the structures of one request.
            max_atoms: limit on the total atom count of ``items`` (``'too_many_atoms'``).
            check_coincident: reject atoms closer than 1e-4 Å to another atom or to their own
                periodic image (``'coincident_atoms'``).
            field_prefix: name used in error fields, ``f"{field_prefix}[{index}].positions"``.
        """
        if len(items) == 0:
            raise InvalidStructureError("empty_batch", "no structures given", field=field_prefix)
        numbers, positions, cells, pbcs = [], [], [], []
        total = 0
        for index, item in enumerate(items):
            field = f"{field_prefix}[{index}]"
            z = _validate_numbers(item.numbers, field, index)
            x = _validate_positions(item.positions, len(z), field, index)
            cell, pbc = _validate_cell_pbc(item.cell, item.pbc, field, index)
            _check_density(len(z), occupied_volume(x, cell, pbc), pbc, field, index)
            total += len(z)
            if max_atoms is not None and total > max_atoms:
                raise InvalidStructureError(
                    "too_many_atoms",
                    f"more than {max_atoms} atoms in total (limit reached at structure {index})",
                    field=field,
                    index=index,
                )
            numbers.append(z)
            positions.append(x)
            cells.append(cell)
            pbcs.append(pbc)
        # The validated arrays are fresh copies: one structure is packed without copying again
        # (only made C-ordered, which a copy of a Fortran-ordered input is not).
        if len(items) == 1:
            packed = (numbers[0], positions[0], cells[0][None], pbcs[0][None])
        else:
            packed = (
                np.concatenate(numbers),
                np.concatenate(positions),
                np.stack(cells),
                np.stack(pbcs),
            )
        ptr = np.cumsum([0] + [len(z) for z in numbers], dtype=np.int64)
        numbers_t, positions_t, cells_t, pbc_t = (
            torch.from_numpy(np.ascontiguousarray(a)) for a in packed
        )
        structures = cls(
            numbers=numbers_t,
            positions=positions_t,
            cells=cells_t,
            pbc=pbc_t,
            ptr=torch.from_numpy(ptr),
        )
        if check_coincident:
            structures.check_coincident(field_prefix=field_prefix)
        return structures

    @classmethod
    def from_atoms(
        cls,
        atoms: Sequence[object],
        *,
        max_atoms: int | None = None,
        check_coincident: bool = True,
    ) -> Structures:
        """Validate ``ase.Atoms`` objects (a cell of zeros with no pbc means no cell)."""
        items = []
        for a in atoms:
            cell = np.asarray(a.cell.array, dtype=np.float64)  # type: ignore[attr-defined]
            pbc = np.array(a.pbc, dtype=np.bool_)  # type: ignore[attr-defined]
            has_cell = bool(np.any(cell != 0.0)) or bool(pbc.any())
            items.append(
                StructureArrays(
                    numbers=a.numbers,  # type: ignore[attr-defined]
                    positions=a.positions,  # type: ignore[attr-defined]
                    cell=cell if has_cell else None,
                    pbc=pbc,
                )
            )
        return cls.from_arrays(items, max_atoms=max_atoms, check_coincident=check_coincident)

    @classmethod
    def concat(cls, parts: Sequence[Structures]) -> Structures:
        """One batch from already validated batches (same device), in order; no re-validation."""
        if len(parts) == 0:
            raise ValueError("Structures.concat needs at least one part")
        if len(parts) == 1:
            return parts[0]
        totals = torch.stack([p.ptr[-1] for p in parts])
        starts = torch.cumsum(totals, 0) - totals
        ptr = torch.cat(
            [parts[0].ptr[:1]] + [p.ptr[1:] + s for p, s in zip(parts, starts, strict=True)]
        )
        return cls(
            numbers=torch.cat([p.numbers for p in parts]),
            positions=torch.cat([p.positions for p in parts]),
            cells=torch.cat([p.cells for p in parts]),
            pbc=torch.cat([p.pbc for p in parts]),
            ptr=ptr,
        )

    def to(self, device: torch.device | str) -> Structures:
        """The same batch on ``device`` (non-blocking copies from pinned memory are the caller's
        business)."""
        return replace(
            self,
            numbers=self.numbers.to(device),
            positions=self.positions.to(device),
            cells=self.cells.to(device),
            pbc=self.pbc.to(device),
            ptr=self.ptr.to(device),
        )

    # derived quantities
    @property
    def n_structures(self) -> int:
        return int(self.ptr.numel()) - 1

    @property
    def n_atoms(self) -> int:
        return int(self.positions.shape[0])

    @property
    def device(self) -> torch.device:
        return self.positions.device

    @cached_property
    def atom_counts(self) -> tuple[int, ...]:
        """Atoms per structure, on the host (one device sync, then cached)."""
        return tuple(int(c) for c in (self.ptr[1:] - self.ptr[:-1]).tolist())

    @cached_property
    def atom_batch(self) -> Tensor:
        """(N,) int64 structure index of every atom."""
        return atom_batch_index(self.ptr, self.n_atoms)

    # checks that need the whole batch
    def check_coincident(
        self, min_distance: float = COINCIDENT_DISTANCE, *, field_prefix: str = "structures"
    ) -> None:
        """Raise ``'coincident_atoms'`` if two atoms (or an atom and its image) are closer than
        ``min_distance`` Å (which must be far below ``MIN_CELL_HEIGHT``). Numpy on the host."""
        ptr = self.ptr.cpu().numpy()
        pair = first_coincident_pair(
            self.positions.detach().cpu().numpy(),
            self.cells.detach().cpu().numpy(),
            self.pbc.cpu().numpy(),
            ptr,
            min_distance,
        )
        if pair is None:
            return
        b = pair.structure
        raise coincident_atoms_error(
            b, (pair.first - int(ptr[b]), pair.second - int(ptr[b])), pair.shift, pair.distance,
            min_distance, field_prefix,
        )  # fmt: skip


# per-structure validation (numpy, host)
def _validate_numbers(raw: object, field: str, index: int) -> NDArray[np.int64]:
    name = f"{field}.numbers"
    try:
        arr = np.asarray(raw)
    except ValueError as exc:
        raise InvalidStructureError(
            "ragged_numbers", f"numbers must be a flat list: {exc}", field=name, index=index
        ) from None
    if arr.ndim != 1:
        raise InvalidStructureError(
            "ragged_numbers", f"numbers must be 1-D, got shape {arr.shape}", field=name, index=index
        )
    if arr.dtype.kind in "USO":
        try:
            return symbols_to_numbers(arr, field=name)
        except InvalidStructureError as exc:
            raise InvalidStructureError(exc.code, exc.message, field=name, index=index) from None
    if arr.dtype.kind == "b" or arr.dtype.kind not in "iuf":
        raise InvalidStructureError(
            "unknown_element",
            f"atomic numbers must be integers, got {arr.dtype}",
            field=name,
            index=index,
        )
    if arr.dtype.kind == "f" and not np.all(np.isfinite(arr) & (arr == np.round(arr))):
        raise InvalidStructureError(
            "unknown_element", "atomic numbers must be integers", field=name, index=index
        )
    # Range-checked before the cast: a uint64 of 2^64 − 1 would wrap to −1 in int64.
    bad = np.flatnonzero((arr < 1) | (arr > MAX_ATOMIC_NUMBER))
    if bad.size:
        value = arr[bad[0]].item()
        raise InvalidStructureError(
            "unknown_element",
            f"atomic number {value:g} at atom {bad[0]} is not an element (1..118)"
            if isinstance(value, float)
            else f"atomic number {value} at atom {bad[0]} is not an element (1..118)",
            field=name,
            index=index,
        )
    return arr.astype(np.int64)


def _validate_positions(raw: object, n_atoms: int, field: str, index: int) -> NDArray[np.float64]:
    name = f"{field}.positions"
    if n_atoms == 0:
        raise InvalidStructureError(
            "empty_structure", "a structure needs at least one atom", field=name, index=index
        )
    try:
        x = np.array(raw, dtype=np.float64)
    except (ValueError, TypeError) as exc:
        raise InvalidStructureError(
            "ragged_positions",
            f"positions must be an (n, 3) array of numbers: {exc}",
            field=name,
            index=index,
        ) from None
    if x.ndim != 2 or x.shape[1] != 3:
        raise InvalidStructureError(
            "ragged_positions",
            f"positions must have shape (n, 3), got {x.shape}",
            field=name,
            index=index,
        )
    if x.shape[0] != n_atoms:
        raise InvalidStructureError(
            "shape_mismatch",
            f"{x.shape[0]} positions for {n_atoms} atomic numbers",
            field=name,
            index=index,
        )
    finite = np.isfinite(x).all(axis=1)
    if not finite.all():
        atom = int(np.flatnonzero(~finite)[0])
        raise InvalidStructureError(
            "non_finite_positions",
            f"position of atom {atom} is not finite: {x[atom].tolist()}",
            field=name,
            index=index,
        )
    far = np.abs(x).max(axis=1) > MAX_COORDINATE
    if far.any():
        atom = int(np.flatnonzero(far)[0])
        raise InvalidStructureError(
            "positions_out_of_range",
            f"position of atom {atom} is {x[atom].tolist()} Å; coordinates are limited to "
            f"±{MAX_COORDINATE:.0e} Å",
            field=name,
            index=index,
        )
    return x


def _validate_cell_pbc(
    raw_cell: object, raw_pbc: object, field: str, index: int
) -> tuple[NDArray[np.float64], NDArray[np.bool_]]:
    cell = _parse_cell(raw_cell, field, index)
    pbc = _parse_pbc(raw_pbc, has_cell=cell is not None, field=field, index=index)
    if cell is None:
        if pbc.any():
            raise InvalidStructureError(
                "bad_pbc",
                "periodic boundary conditions need a cell",
                field=f"{field}.pbc",
                index=index,
            )
        return np.zeros((3, 3)), pbc
    if pbc.any():
        cell = _usable_lattice(cell, pbc, field, index)
    return cell, pbc


def _check_density(
    n_atoms: int, volume: float, pbc: NDArray[np.bool_], field: str, index: int
) -> None:
    """Refuse a structure denser than ``MAX_NUMBER_DENSITY`` in its ``occupied_volume``."""
    density = n_atoms / volume
    if density <= MAX_NUMBER_DENSITY:
        return
    if pbc.all():
        where, question, name = "cell", "are the cell and positions both in Å?", "cell"
    else:
        where = f"region (their extent plus {OPEN_AXIS_ROOM:g} Å along each open direction)"
        question, name = "are the positions in Å?", "positions"
    raise InvalidStructureError(
        "unphysical_density",
        f"{n_atoms} atoms in a {volume:.3g} Å³ {where} is {density:.3g} atoms/Å³, above "
        f"{MAX_NUMBER_DENSITY} (fifty times diamond's); {question}",
        field=f"{field}.{name}",
        index=index,
    )


def occupied_volume(
    positions: NDArray[np.float64], cell: NDArray[np.float64], pbc: NDArray[np.bool_]
) -> float:
    """Å³ one structure fills: the volume (area, length) its periodic lattice vectors span, times
    its atoms' extent plus ``OPEN_AXIS_ROOM`` along each direction they leave open.

    positions (n, 3) Å, cell (3, 3) rows, pbc (3,); the lattice of a periodic axis is usable
    (validated). With no periodic axis the open directions are x, y and z; otherwise they are
    orthonormal to the periodic vectors (a slab's normal, a wire's cross-section).
    """
    if pbc.all():
        return lattice_volume(cell.tolist())
    lattice = cell[pbc]
    if len(lattice) == 0:
        extent = positions.max(axis=0) - positions.min(axis=0)
        return float(open_box_volumes(extent))
    # The last 3 − k columns of a complete QR of the (3, k) lattice span its complement.
    open_directions = np.linalg.qr(lattice.T, mode="complete")[0][:, len(lattice) :]
    across = positions @ open_directions
    return _gram_base(lattice) * float(open_box_volumes(across.max(axis=0) - across.min(axis=0)))


def lattice_volume(rows: list[list[float]]) -> float:
    """|det| of a 3 × 3 cell given as rows, on Python floats: for one cell numpy's per-call
    overhead would cost ten times the arithmetic."""
    return float(abs(sum(a * f for a, f in zip(rows[0], _cross3(rows[1], rows[2]), strict=True))))


def open_box_volumes(extent: NDArray[np.float64]) -> NDArray[np.float64]:
    """Room of atoms spread over ``extent`` (Å) along open directions: the product of
    ``extent + OPEN_AXIS_ROOM`` over the last axis. (..., k) → (...)."""
    volumes: NDArray[np.float64] = np.prod(extent + OPEN_AXIS_ROOM, axis=-1)
    return volumes


def _parse_cell(raw: object, field: str, index: int) -> NDArray[np.float64] | None:
    if raw is None:
        return None
    name = f"{field}.cell"
    try:
        cell = np.array(raw, dtype=np.float64)
    except (ValueError, TypeError) as exc:
        raise InvalidStructureError(
            "bad_cell", f"cell must be a (3, 3) array of numbers: {exc}", field=name, index=index
        ) from None
    if cell.shape == (3,):
        cell = np.diag(cell)
    if cell.shape != (3, 3):
        raise InvalidStructureError(
            "bad_cell",
            f"cell must have shape (3, 3) or (3,), got {cell.shape}",
            field=name,
            index=index,
        )
    if not np.isfinite(cell).all():
        raise InvalidStructureError(
            "non_finite_cell", "cell contains NaN or inf", field=name, index=index
        )
    if np.abs(cell).max() > MAX_COORDINATE:
        raise InvalidStructureError(
            "bad_cell",
            f"cell entries are limited to ±{MAX_COORDINATE:.0e} Å, got {np.abs(cell).max():.3g}",
            field=name,
            index=index,
        )
    return cell


def _parse_pbc(raw: object, *, has_cell: bool, field: str, index: int) -> NDArray[np.bool_]:
    if raw is None:
        return np.full(3, has_cell)
    pbc = np.asarray(raw)
    if pbc.ndim == 0:
        pbc = np.repeat(pbc, 3)
    if pbc.shape != (3,) or pbc.dtype.kind not in "biu" or not ((pbc == 0) | (pbc == 1)).all():
        raise InvalidStructureError(
            "bad_pbc",
            f"pbc must be three booleans, got {np.asarray(raw).tolist()!r}",
            field=f"{field}.pbc",
            index=index,
        )
    return pbc.astype(bool)


@dataclass(frozen=True)
class _LatticeDefect:
    """Why the periodic axes of a cell cannot be used; ``thin``: a height between the basis's
    lattice planes is below ``MIN_CELL_HEIGHT`` (in another basis of the lattice it may not be)."""

    thin: bool
    message: str


def _usable_lattice(
    cell: NDArray[np.float64], pbc: NDArray[np.bool_], field: str, index: int
) -> NDArray[np.float64]:
    """``cell`` when its periodic axes pass :func:`_lattice_defect`, else the same lattice in a
    reduced basis when that one passes. A skewed basis of an ordinary lattice (variable-cell MD
    shears the cell without re-reducing it) can have basis heights far below the lattice's own
    plane spacing. Energy, forces, virial and volume are the same in every basis of a lattice,
    and the positions are left as they are."""
    defect = _lattice_defect(cell, pbc)
    if defect is None:
        return cell
    if defect.thin:
        reduced = _reduced_basis(cell, pbc)
        if reduced is not None and _lattice_defect(reduced, pbc) is None:
            return reduced
    raise InvalidStructureError("singular_cell", defect.message, field=f"{field}.cell", index=index)


def _reduced_basis(cell: NDArray[np.float64], pbc: NDArray[np.bool_]) -> NDArray[np.float64] | None:
    """Minkowski-reduced basis of the periodic rows, the others untouched; None when ASE gives up
    on the reduction or would move a non-periodic row."""
    try:
        with np.errstate(all="raise"):
            _, op = minkowski_reduce(cell, pbc=pbc)
    except (RuntimeError, ArithmeticError, ValueError):  # ASE gave up, or the floats did
        return None
    op = np.asarray(op, dtype=np.int64)
    fixed = ~pbc
    if not np.array_equal(op[fixed], np.eye(3, dtype=np.int64)[fixed]) or op[pbc][:, fixed].any():
        return None
    reduced: NDArray[np.float64] = op.astype(np.float64) @ cell
    return reduced


def _lattice_defect(cell: NDArray[np.float64], pbc: NDArray[np.bool_]) -> _LatticeDefect | None:
    """Periodic lattice vectors must be independent and no periodic height below 0.5 Å."""
    axes = np.flatnonzero(pbc)
    if len(axes) == 3:  # the common case
        lengths, gram_volume, bases = _full_lattice_measures(cell.tolist())
    else:
        rows = cell[axes]
        lengths = np.linalg.norm(rows, axis=1).tolist()
        gram_volume = float(np.sqrt(max(np.linalg.det(rows @ rows.T), 0.0)))
        bases = [_gram_base(np.delete(rows, k, axis=0)) for k in range(len(axes))]
    # A periodic vector shorter than the minimum height is rejected before the volume tests:
    # products of tiny lengths underflow to 0 and would slip through them.
    short = [axis for axis, length in zip(axes.tolist(), lengths, strict=True) if length == 0.0]
    if short:
        return _LatticeDefect(
            False,
            f"the lattice vector of periodic axis {short[0]} is zero (set pbc false on that "
            "axis or give it a vector)",
        )
    if gram_volume < _MIN_RELATIVE_VOLUME * math.prod(lengths):
        return _LatticeDefect(
            False,
            f"lattice vectors of the periodic axes {axes.tolist()} are linearly dependent",
        )
    for axis, length in zip(axes.tolist(), lengths, strict=True):
        if length < MIN_CELL_HEIGHT:  # then some height is this thin in every basis
            return _LatticeDefect(
                False,
                f"periodic lattice vector {axis} is only {length:.3g} Å long "
                f"(minimum {MIN_CELL_HEIGHT} Å)",
            )
    for axis, base in zip(axes.tolist(), bases, strict=True):
        height = gram_volume / base
        if not height >= MIN_CELL_HEIGHT:  # NaN-safe
            return _LatticeDefect(
                True,
                f"periodic axis {axis} is only {height:.3g} Å thick (minimum {MIN_CELL_HEIGHT} Å)",
            )
    return None


def _full_lattice_measures(
    rows: list[list[float]],
) -> tuple[list[float], float, list[float]]:
    """Lengths of the three lattice vectors, the cell volume and the areas of the faces
    opposite each vector (|b × c|, |c × a|, |a × b|), in closed form on Python floats: for
    one 3 × 3 cell numpy's per-call overhead would cost ten times the arithmetic."""
    faces = [_cross3(rows[(k + 1) % 3], rows[(k + 2) % 3]) for k in range(3)]
    volume = abs(sum(a * f for a, f in zip(rows[0], faces[0], strict=True)))
    return [math.hypot(*r) for r in rows], volume, [math.hypot(*f) for f in faces]


def _cross3(a: list[float], b: list[float]) -> list[float]:
    return [a[1] * b[2] - a[2] * b[1], a[2] * b[0] - a[0] * b[2], a[0] * b[1] - a[1] * b[0]]


def _gram_base(rows: NDArray[np.float64]) -> float:
    """Volume spanned by ``rows`` (k, 3), k ≤ 2 (1 for none)."""
    return float(np.sqrt(np.linalg.det(rows @ rows.T))) if len(rows) else 1.0


# coincident atoms (numpy, host)
@dataclass(frozen=True)
class CoincidentPair:
    """Atoms ``first`` and ``second`` (batch indices) of ``structure`` are ``distance`` Å apart
    when ``second`` is moved by the integer lattice ``shift``."""

    structure: int
    first: int
    second: int
    shift: list[int]
    distance: float


_MAX_BIN_OCCUPANCY = 64
"""Bins are cubes of side 2d. Cut one into 4³ sub-cubes of diagonal √3·d/2 < d: among any 65
atoms of a bin two share a sub-cube and are closer than d. So comparing each atom with the next
64 in bin order finds a close pair in every bin that has one, at bounded cost."""

_MAX_SLAB_POINTS = 16
"""Sweep depth of the projection search before it hands over to the grid search."""

_PROJECTION = np.array([1.0, np.sqrt(2.0), np.sqrt(3.0)]) / np.sqrt(6.0)
"""Sweep direction: irrational components, so no low-index lattice plane is perpendicular to it
and the atoms of a crystal project to distinct, well separated values."""

_ALL_SHIFTS = np.stack(np.meshgrid(*(np.arange(-1, 2),) * 3, indexing="ij"), -1).reshape(-1, 3)
_NONZERO_SHIFTS = _ALL_SHIFTS[np.any(_ALL_SHIFTS != 0, axis=1)]
_GRID_OFFSETS = _ALL_SHIFTS[np.all(_ALL_SHIFTS >= 0, axis=1)]


def first_coincident_pair(
    positions: NDArray[np.float64],
    cells: NDArray[np.float64],
    pbc: NDArray[np.bool_],
    ptr: NDArray[np.int64],
    min_distance: float,
) -> CoincidentPair | None:
    """The first pair (lowest structure, then atoms) nearer than ``min_distance``, over periodic
    images; None if there is none. O(N log N), no cutoff-sized work.

    Atoms are wrapped into their cell; atoms within ``2·min_distance`` (fractionally) of a
    periodic face also get image copies across it, so every close pair is a close pair of points
    in plain space. Those are found by one sort along a fixed direction and a short sweep; should
    a thin slab across it be crowded, by the exact grid search instead: two points closer than
    d differ by ≤ d per axis, so on one of the 8 grids of bin side 2d offset by 0 or d per axis
    they share a bin, and bins are found by sorting.

    Args:
        positions: (N, 3) Å; cells: (B, 3, 3) rows; pbc: (B, 3); ptr: (B+1,) atom offsets.
        min_distance: Å, far below the thinnest accepted periodic height.
    """
    batch = np.repeat(np.arange(len(ptr) - 1), np.diff(ptr))
    frames = _binning_frames(cells, pbc)
    inverse = np.linalg.inv(frames)
    frac = np.einsum("na,nab->nb", positions, inverse[batch])
    wrap = np.where(pbc[batch], np.floor(frac), 0.0)
    frac -= wrap
    wrapped = positions - np.einsum("na,nab->nb", wrap, frames[batch])
    # Height of the frame along each axis is 1/|column of the inverse|.
    margin = 2.0 * min_distance * np.linalg.norm(inverse, axis=1)[batch]
    points, atom, shift = _with_face_images(wrapped, frac, margin, pbc[batch], frames, batch)
    # Point = original position + image·frame, counting the wrap.
    image = shift - wrap.astype(np.int64)[atom]
    structure = batch[atom]
    hits = _close_pairs_by_projection(points, structure, min_distance)
    if hits is None:  # too many points in one thin slab: the exact grid search decides
        hits = [
            hit
            for offset in _GRID_OFFSETS
            for hit in _close_pairs_in_bins(points, structure, offset, min_distance)
        ]
    if not hits:
        return None
    return min((_as_pair(p, q, points, atom, image, structure) for p, q in hits), key=_order)


def _order(pair: CoincidentPair) -> tuple[int, int, int]:
    return pair.structure, pair.first, pair.second


def _binning_frames(cells: NDArray[np.float64], pbc: NDArray[np.bool_]) -> NDArray[np.float64]:
    """(B, 3, 3) invertible frames: lattice vectors on periodic axes, an orthonormal complement
    of their span on open axes (a slab's third vector may be zero or anything)."""
    frames = np.where(pbc[:, :, None], cells, np.eye(3))
    for b in np.flatnonzero(pbc.any(axis=1) & ~pbc.all(axis=1)):
        periodic = cells[b][pbc[b]]
        # Left singular vectors past the periodic rank span the orthogonal complement.
        u, _, _ = np.linalg.svd(periodic.T)
        frames[b][~pbc[b]] = u[:, periodic.shape[0] :].T
    return frames


def _with_face_images(
    wrapped: NDArray[np.float64],
    frac: NDArray[np.float64],
    margin: NDArray[np.float64],
    periodic: NDArray[np.bool_],
    frames: NDArray[np.float64],
    batch: NDArray[np.int64],
) -> tuple[NDArray[np.float64], NDArray[np.int64], NDArray[np.int64]]:
    """Wrapped atoms plus, for those near a periodic face, their images across it.

    Returns points (P, 3), the atom each point is (P,), and its shift from the wrapped atom
    (P, 3), in lattice vectors."""
    near_low = periodic & (frac < margin)
    near_high = periodic & (frac > 1.0 - margin)
    n_atoms = wrapped.shape[0]
    candidates = np.flatnonzero((near_low | near_high).any(axis=1))
    identity = np.zeros((n_atoms, 3), dtype=np.int64)
    if candidates.size == 0:
        return wrapped, np.arange(n_atoms), identity
    s = _NONZERO_SHIFTS[None]
    allowed = (
        (s == 0)
        | ((s == 1) & near_low[candidates][:, None])
        | ((s == -1) & near_high[candidates][:, None])
    ).all(axis=2)
    image_atom, which = np.nonzero(allowed)
    image_atom = candidates[image_atom]
    image_shift = _NONZERO_SHIFTS[which]
    image_points = wrapped[image_atom] + np.einsum(
        "na,nab->nb", image_shift.astype(np.float64), frames[batch[image_atom]]
    )
    return (
        np.concatenate([wrapped, image_points]),
        np.concatenate([np.arange(n_atoms), image_atom]),
        np.concatenate([identity, image_shift]),
    )


def _close_pairs_by_projection(
    points: NDArray[np.float64], structure: NDArray[np.int64], min_distance: float
) -> list[tuple[int, int]] | None:
    """Point pairs closer than ``min_distance``, found by sorting along one direction (a close
    pair is at most ``min_distance`` apart along it); None when a slab of that width holds more
    than ``_MAX_SLAB_POINTS`` points of one structure (only contrived input), where the sweep
    would stop being linear."""
    along = points @ _PROJECTION
    order = np.lexsort((along, structure))
    along, same = along[order], structure[order]
    hits: list[tuple[int, int]] = []
    for gap in range(1, _MAX_SLAB_POINTS + 1):
        # Sorted order: if no pair `gap` apart is within reach, no pair further apart is.
        reach = (along[gap:] - along[:-gap] <= min_distance) & (same[gap:] == same[:-gap])
        if not reach.any():
            return hits
        hits.extend(_closer_than(points, order[:-gap][reach], order[gap:][reach], min_distance))
    return None


def _close_pairs_in_bins(
    points: NDArray[np.float64],
    structure: NDArray[np.int64],
    offset: NDArray[np.int64],
    min_distance: float,
) -> list[tuple[int, int]]:
    """Point pairs closer than ``min_distance`` among points sharing a bin of side
    2·min_distance on the grid offset by ``offset``·min_distance."""
    keys = np.floor((points + offset * min_distance) / (2.0 * min_distance))
    order = np.lexsort((keys[:, 2], keys[:, 1], keys[:, 0], structure))
    sorted_keys = np.column_stack((structure[order], keys[order]))
    same_as_next = (sorted_keys[1:] == sorted_keys[:-1]).all(axis=1)
    if not same_as_next.any():
        return []
    run = np.concatenate([[0], np.cumsum(~same_as_next)])
    longest = int(np.bincount(run).max())
    hits: list[tuple[int, int]] = []
    for gap in range(1, min(longest, _MAX_BIN_OCCUPANCY + 1)):
        in_bin = run[:-gap] == run[gap:]
        hits.extend(_closer_than(points, order[:-gap][in_bin], order[gap:][in_bin], min_distance))
    return hits


def _closer_than(
    points: NDArray[np.float64], a: NDArray[np.int64], b: NDArray[np.int64], min_distance: float
) -> list[tuple[int, int]]:
    d2 = np.sum((points[a] - points[b]) ** 2, axis=1)
    close = np.flatnonzero(d2 < min_distance * min_distance)
    return list(zip(a[close].tolist(), b[close].tolist(), strict=True))


def _as_pair(
    p: int,
    q: int,
    points: NDArray[np.float64],
    atom: NDArray[np.int64],
    image: NDArray[np.int64],
    structure: NDArray[np.int64],
) -> CoincidentPair:
    """Points ``p`` and ``q`` as atoms: the lower-numbered one unshifted, the other moved."""
    if atom[q] < atom[p]:
        p, q = q, p
    return CoincidentPair(
        structure=int(structure[p]),
        first=int(atom[p]),
        second=int(atom[q]),
        shift=(image[q] - image[p]).tolist(),
        distance=float(np.linalg.norm(points[q] - points[p])),
    )
