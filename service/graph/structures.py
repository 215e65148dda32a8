"""Validated batches of atomic structures: the input of every evaluation.

A request arrives as raw arrays (:class:`StructureArrays`, lists or numpy) or ``ase.Atoms``;
:meth:`Structures.from_arrays` / :meth:`Structures.from_atoms` check them (shapes, finiteness,
known elements, a usable cell on periodic axes, the atom limit, coincident atoms) and pack them
into one flat batch. Every problem raises :class:`InvalidStructureError` naming the structure and
field. Checks are numpy per structure plus one vectorised coincidence search over the batch
(the O(N) cell list with a 1e-4 Å cutoff), so a 1k-atom request costs about a millisecond.
:meth:`Structures.concat` / :meth:`Structures.split` merge and split already validated batches
without re-validating (dynamic batching in the engine).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np
import torch
from numpy.typing import ArrayLike, NDArray
from torch import Tensor

from service.graph.cell_list import COINCIDENT_DISTANCE, atom_batch_index, find_pairs
from service.graph.errors import InvalidStructureError

MAX_ATOMIC_NUMBER = 118

MIN_CELL_HEIGHT = 0.5
"""Å. A periodic axis thinner than this puts every atom within 0.5 Å of its own image (nothing
physical) and would make the image enumeration explode; such cells are rejected as singular."""

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

    # -- construction ---------------------------------------------------------------------------
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
        counts = torch.tensor([0] + [len(z) for z in numbers], dtype=torch.int64)
        structures = cls(
            numbers=torch.from_numpy(np.concatenate(numbers)),
            positions=torch.from_numpy(np.concatenate(positions)),
            cells=torch.from_numpy(np.stack(cells)),
            pbc=torch.from_numpy(np.stack(pbcs)),
            ptr=torch.cumsum(counts, 0),
        )
        if check_coincident:
            structures.check_coincident()
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

    # -- derived quantities ---------------------------------------------------------------------
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

    @property
    def volumes(self) -> Tensor:
        """(B,) float64 ``|det(cell)|`` (0 where there is no cell; only meaningful when all
        three axes are periodic)."""
        det: Tensor = torch.linalg.det(self.cells)
        return det.abs()

    # -- splitting results back -----------------------------------------------------------------
    def split(self, per_atom: Tensor) -> list[Tensor]:
        """Split an (N, ...) per-atom tensor into one (n_b, ...) tensor per structure."""
        if per_atom.shape[0] != self.n_atoms:
            raise ValueError(f"expected {self.n_atoms} rows, got {per_atom.shape[0]}")
        return list(torch.split(per_atom, list(self.atom_counts)))

    def split_structures(self, per_structure: Tensor) -> list[Tensor]:
        """Split a (B, ...) per-structure tensor into one (...) tensor per structure."""
        if per_structure.shape[0] != self.n_structures:
            raise ValueError(f"expected {self.n_structures} rows, got {per_structure.shape[0]}")
        return list(per_structure.unbind(0))

    # -- checks that need the whole batch -------------------------------------------------------
    def check_coincident(self, min_distance: float = COINCIDENT_DISTANCE) -> None:
        """Raise ``'coincident_atoms'`` if two atoms (or an atom and its image) are closer than
        ``min_distance`` Å. O(N) cell list; runs on the batch's device."""
        find_pairs(
            self.positions, self.cells, self.pbc, self.ptr, min_distance, min_distance=min_distance
        )


# -- per-structure validation (numpy, host) --------------------------------------------------------
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
    z = arr.astype(np.int64)
    bad = np.flatnonzero((z < 1) | (z > MAX_ATOMIC_NUMBER))
    if bad.size:
        raise InvalidStructureError(
            "unknown_element",
            f"atomic number {z[bad[0]]} at atom {bad[0]} is not an element (1..118)",
            field=name,
            index=index,
        )
    return z


def _validate_positions(raw: object, n_atoms: int, field: str, index: int) -> NDArray[np.float64]:
    name = f"{field}.positions"
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
    if n_atoms == 0:
        raise InvalidStructureError(
            "empty_structure", "a structure needs at least one atom", field=name, index=index
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
        _check_periodic_lattice(cell, pbc, field, index)
    return cell, pbc


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
    return cell


def _parse_pbc(raw: object, *, has_cell: bool, field: str, index: int) -> NDArray[np.bool_]:
    if raw is None:
        return np.full(3, has_cell)
    pbc = np.asarray(raw)
    if pbc.ndim == 0:
        pbc = np.repeat(pbc, 3)
    if pbc.shape != (3,) or pbc.dtype.kind not in "biu" or not np.isin(pbc, (0, 1)).all():
        raise InvalidStructureError(
            "bad_pbc",
            f"pbc must be three booleans, got {np.asarray(raw).tolist()!r}",
            field=f"{field}.pbc",
            index=index,
        )
    return pbc.astype(bool)


def _check_periodic_lattice(
    cell: NDArray[np.float64], pbc: NDArray[np.bool_], field: str, index: int
) -> None:
    """Periodic lattice vectors must be independent and no periodic height below 0.5 Å."""
    name = f"{field}.cell"
    axes = np.flatnonzero(pbc)
    rows = cell[axes]
    lengths = np.linalg.norm(rows, axis=1)
    gram_volume = float(np.sqrt(max(np.linalg.det(rows @ rows.T), 0.0)))
    if lengths.min() == 0.0 or gram_volume < _MIN_RELATIVE_VOLUME * float(np.prod(lengths)):
        raise InvalidStructureError(
            "singular_cell",
            f"lattice vectors of the periodic axes {axes.tolist()} are zero or linearly dependent",
            field=name,
            index=index,
        )
    for k, axis in enumerate(axes):
        others = np.delete(rows, k, axis=0)
        base = float(np.sqrt(np.linalg.det(others @ others.T))) if len(others) else 1.0
        height = gram_volume / base
        if height < MIN_CELL_HEIGHT:
            raise InvalidStructureError(
                "singular_cell",
                f"periodic axis {axis} is only {height:.3g} Å thick (minimum {MIN_CELL_HEIGHT} Å)",
                field=name,
                index=index,
            )
