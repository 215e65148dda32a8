"""Labelled frames for training and evaluation: DeePMD npy systems and ASE-readable files.

A *frame* is one labelled structure (numbers, positions, cell, pbc, energy, forces, virial).
Frames from any number of sources are pooled into a :class:`FrameDataset`; elements are matched
by symbol (each DeePMD system's ``type_map.raw`` is translated to atomic numbers), so systems with
different type orders mix freely. Every frame carries its own ``numbers``: in DeePMD's "mixed
type" systems the composition changes from frame to frame.

Units are ASE's: Å, eV, eV/Å. The virial is DeePMD's (eV, ``W = -V·σ`` with σ the stress in
eV/Å³), i.e. the quantity ``Prediction.virial`` of the model holds. ASE stresses are converted
on load, and only periodic frames with a cell carry one.

Malformed input raises :class:`DataError` naming the file and what is wrong with it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import ase.io
import numpy as np
import torch
from ase import Atoms
from ase.data import atomic_numbers, chemical_symbols
from ase.stress import voigt_6_to_full_3x3_stress

from service.graph.errors import InvalidStructureError
from service.graph.structures import StructureArrays, Structures

__all__ = [
    "DataError",
    "Frame",
    "FrameDataset",
    "LabelBatch",
    "TrainingBatch",
    "collate",
    "is_deepmd_system",
    "iterate_batches",
    "load_ase_file",
    "load_dataset",
    "load_deepmd_system",
]


class DataError(ValueError):
    """Training or evaluation data that cannot be used; ``path`` names the offending file."""

    def __init__(self, path: Path | str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem


@dataclass(frozen=True)
class Frame:
    """One labelled structure of ``n`` atoms (float64 numpy arrays)."""

    numbers: np.ndarray  # (n,) int64 atomic numbers
    positions: np.ndarray  # (n, 3) Å
    cell: np.ndarray | None  # (3, 3) Å, rows are lattice vectors; None for molecules
    pbc: np.ndarray  # (3,) bool
    energy: float | None  # eV (total)
    forces: np.ndarray | None  # (n, 3) eV/Å
    virial: np.ndarray | None  # (3, 3) eV
    source: str  # the system folder or file the frame came from (per-system metrics)

    @property
    def n_atoms(self) -> int:
        return int(self.numbers.shape[0])


class FrameDataset(Sequence[Frame]):
    """An ordered collection of frames; sources keep their frames contiguous and in file order."""

    def __init__(self, frames: Iterable[Frame]) -> None:
        self._frames: list[Frame] = list(frames)

    def __len__(self) -> int:
        return len(self._frames)

    def __getitem__(self, index: int) -> Frame:  # type: ignore[override]
        return self._frames[index]

    def __iter__(self) -> Iterator[Frame]:
        return iter(self._frames)

    def subset(self, indices: Sequence[int]) -> FrameDataset:
        return FrameDataset(self._frames[i] for i in indices)

    @property
    def sources(self) -> list[str]:
        """Distinct sources in first-appearance order."""
        return list(dict.fromkeys(f.source for f in self._frames))

    def by_source(self) -> dict[str, FrameDataset]:
        groups: dict[str, list[Frame]] = {}
        for frame in self._frames:
            groups.setdefault(frame.source, []).append(frame)
        return {name: FrameDataset(frames) for name, frames in groups.items()}

    @property
    def elements(self) -> list[str]:
        """Element symbols present, ordered by atomic number."""
        present = set[int]()
        for frame in self._frames:
            present.update(int(z) for z in np.unique(frame.numbers))
        return [chemical_symbols[z] for z in sorted(present)]

    @property
    def n_atoms(self) -> int:
        return sum(f.n_atoms for f in self._frames)

    @property
    def has_virial(self) -> bool:
        return any(f.virial is not None for f in self._frames)

    def split(self, valid_fraction: float, seed: int) -> tuple[FrameDataset, FrameDataset]:
        """Random frame-level split ``(train, validation)``, reproducible for a given seed.

        At least one frame goes to validation when ``valid_fraction > 0`` and there are two or
        more frames. Both parts keep the dataset's frame order.
        """
        if not 0.0 <= valid_fraction < 1.0:
            raise ValueError(f"valid_fraction must be in [0, 1), got {valid_fraction}")
        n = len(self._frames)
        n_valid = 0 if valid_fraction == 0.0 or n < 2 else max(1, round(valid_fraction * n))
        generator = torch.Generator().manual_seed(seed)
        order = torch.randperm(n, generator=generator).tolist()
        valid = sorted(order[:n_valid])
        train = sorted(order[n_valid:])
        return self.subset(train), self.subset(valid)


# DeePMD npy systems


REAL_ATOM_TYPES = "real_atom_types.npy"  # per-frame types of a mixed-type set
VIRTUAL_ATOM = -1  # the type dpdata gives padding atoms in mixed-type systems


def is_deepmd_system(path: Path) -> bool:
    """A DeePMD system is a folder holding ``type.raw`` and at least one ``set.*`` folder."""
    return path.is_dir() and (path / "type.raw").is_file() and any(path.glob("set.*"))


def _read_type_map(system: Path, override: Sequence[str] | None) -> list[str]:
    path = system / "type_map.raw"
    if path.is_file():
        symbols = path.read_text().split()
    elif override:
        symbols = list(override)
    else:
        raise DataError(path, "missing, and no type_map was given to map type indices to elements")
    unknown = [s for s in symbols if s not in atomic_numbers]
    if unknown:
        raise DataError(path, f"unknown element symbol(s) {unknown}")
    return symbols


def _read_types(system: Path, n_types: int) -> np.ndarray:
    path = system / "type.raw"
    try:
        types = np.loadtxt(path, dtype=np.int64, ndmin=1)
    except ValueError as exc:
        raise DataError(path, f"not a list of integer type indices ({exc})") from exc
    if types.size == 0:
        raise DataError(path, "no atoms")
    if types.min() < 0 or types.max() >= n_types:
        raise DataError(
            path, f"type index out of range [0, {n_types}) of type_map.raw: {np.unique(types)}"
        )
    return types


def _read_npy(path: Path) -> np.ndarray:
    try:
        array: np.ndarray = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise DataError(path, f"unreadable npy file ({exc})") from exc
    return array


def _load_npy(path: Path, n_frames: int | None, width: int | None) -> np.ndarray:
    """Load a (frames, width) float array, checking shape and finiteness."""
    array = _read_npy(path)
    if not np.issubdtype(array.dtype, np.number):
        raise DataError(path, f"numeric data expected, got dtype {array.dtype}")
    if array.ndim and array.shape[0] == 0:
        raise DataError(path, "0 frames (an empty set: remove it or fill it)")
    array = array.astype(np.float64).reshape(array.shape[0], -1) if array.ndim else array
    if array.ndim != 2:
        raise DataError(path, f"expected a (frames, values) array, got shape {array.shape}")
    if n_frames is not None and array.shape[0] != n_frames:
        raise DataError(path, f"{array.shape[0]} frames, but coord.npy has {n_frames}")
    if width is not None and array.shape[1] != width:
        raise DataError(path, f"{array.shape[1]} values per frame, expected {width}")
    if not np.isfinite(array).all():
        raise DataError(path, "contains NaN or infinite values")
    return array


def load_deepmd_system(path: Path | str, *, type_map: Sequence[str] | None = None) -> list[Frame]:
    """All frames of one DeePMD npy system folder (every ``set.*``, in sorted order).

    ``type_map`` is only used when the system has no ``type_map.raw``. ``energy.npy`` is optional
    per set (frames without it carry ``energy=None``), as are ``force.npy`` and ``virial.npy``.

    DeePMD's "mixed type" systems (dpdata's ``deepmd/npy/mixed``) are read too: every set holds
    ``real_atom_types.npy`` (frames, atoms), each frame's type indices into the type map, and
    ``type.raw`` only fixes the atom count. Type ``-1`` marks a virtual atom (dpdata pads systems
    to a common atom count with them, at zero coordinates and forces); it is dropped from its
    frame with its coordinate and force rows, as dpdata and DeePMD-kit leave them out.
    """
    system = Path(path)
    if not system.is_dir():
        raise DataError(system, "not a directory (expected a DeePMD system folder)")
    sets = sorted(p for p in system.glob("set.*") if p.is_dir())
    if not sets:
        raise DataError(system, "no set.* folders")
    mixed = _is_mixed_type(sets)
    symbols = _read_type_map(system, type_map)
    types = _read_types(system, len(symbols))
    elements = np.array([atomic_numbers[s] for s in symbols], dtype=np.int64)
    periodic = not (system / "nopbc").exists()
    frames: list[Frame] = []
    for set_dir in sets:
        frames.extend(_load_deepmd_set(set_dir, elements, types, mixed, periodic, str(system)))
    return frames


def _is_mixed_type(sets: Sequence[Path]) -> bool:
    """Whether the sets are mixed-type; all of them or none must be (as DeePMD-kit demands)."""
    has_types = [(s / REAL_ATOM_TYPES).is_file() for s in sets]
    if any(has_types) and not all(has_types):
        with_types = sets[has_types.index(True)].name
        without = sets[has_types.index(False)]
        raise DataError(
            without / REAL_ATOM_TYPES,
            f"missing, but {with_types} has one: in a mixed-type system every set needs it",
        )
    return all(has_types)


def _read_real_atom_types(path: Path, n_frames: int, n_atoms: int, n_types: int) -> np.ndarray:
    """A set's per-frame type indices, (frames, atoms) int64, checked against coord.npy and
    the type map; ``-1`` (a virtual atom) is kept for the caller to drop."""
    types = _read_npy(path)
    if not np.issubdtype(types.dtype, np.integer):
        raise DataError(path, f"integer type indices expected, got dtype {types.dtype}")
    if types.shape != (n_frames, n_atoms):
        raise DataError(
            path,
            f"shape {types.shape}, expected (frames, atoms) = ({n_frames}, {n_atoms}) "
            "as coord.npy and type.raw give",
        )
    types = types.astype(np.int64)
    bad = np.unique(types[(types < VIRTUAL_ATOM) | (types >= n_types)])
    if bad.size:
        raise DataError(
            path,
            f"type index out of range [0, {n_types}) of the type map (or -1 for a virtual "
            f"atom): {bad.tolist()}",
        )
    empty = np.flatnonzero((types == VIRTUAL_ATOM).all(axis=1))
    if empty.size:
        raise DataError(path, f"frame {int(empty[0])}: every atom is virtual (type -1)")
    return types


def _load_deepmd_set(
    set_dir: Path,
    elements: np.ndarray,
    types: np.ndarray,
    mixed: bool,
    periodic: bool,
    source: str,
) -> list[Frame]:
    """Frames of one set; ``elements`` (T,) are the type map's atomic numbers, ``types`` (n,)
    those of type.raw (per frame from real_atom_types.npy instead when ``mixed``)."""
    n_atoms = types.shape[0]
    coord_path = set_dir / "coord.npy"
    if not coord_path.is_file():
        raise DataError(coord_path, "missing")
    coords = _load_npy(coord_path, None, 3 * n_atoms)
    n_frames = coords.shape[0]
    if mixed:
        frame_types = _read_real_atom_types(
            set_dir / REAL_ATOM_TYPES, n_frames, n_atoms, elements.shape[0]
        )
    else:
        frame_types = np.broadcast_to(types, (n_frames, n_atoms))
    boxes = _optional_npy(set_dir / "box.npy", n_frames, 9)
    if periodic and boxes is None:
        raise DataError(set_dir / "box.npy", "missing (the system has no 'nopbc' marker)")
    energies = _optional_npy(set_dir / "energy.npy", n_frames, 1)
    forces = _optional_npy(set_dir / "force.npy", n_frames, 3 * n_atoms)
    virials = _optional_npy(set_dir / "virial.npy", n_frames, 9)
    if virials is not None and not periodic:
        raise DataError(set_dir / "virial.npy", "virial labels on a non-periodic ('nopbc') system")
    frames = []
    for k in range(n_frames):
        cell = boxes[k].reshape(3, 3) if periodic and boxes is not None else None
        if cell is not None and abs(np.linalg.det(cell)) < 1e-6:
            raise DataError(set_dir / "box.npy", f"frame {k}: singular cell {cell.tolist()}")
        real = frame_types[k] != VIRTUAL_ATOM
        frames.append(
            Frame(
                numbers=elements[frame_types[k][real]],
                positions=coords[k].reshape(n_atoms, 3)[real],
                cell=cell,
                pbc=np.full(3, periodic),
                energy=None if energies is None else float(energies[k, 0]),
                forces=None if forces is None else forces[k].reshape(n_atoms, 3)[real],
                virial=None if virials is None else virials[k].reshape(3, 3),
                source=source,
            )
        )
    return frames


def _optional_npy(path: Path, n_frames: int, width: int) -> np.ndarray | None:
    return _load_npy(path, n_frames, width) if path.is_file() else None


# ASE-readable files


def load_ase_file(path: Path | str) -> list[Frame]:
    """Frames of any ASE-readable file (extxyz, ...), labels from its calculator or info/arrays.

    Energy: the calculator's ``energy`` or ``info['energy']``; forces: calculator or
    ``arrays['forces']``; stress (Voigt 6 or 3×3, eV/Å³; converted to the virial) or
    ``info['virial']`` (3×3 or 9, eV) for fully periodic frames.
    """
    file = Path(path)
    if not file.is_file():
        raise DataError(file, "no such file")
    try:
        images = ase.io.read(file, index=":")
    except Exception as exc:  # ASE raises many unrelated types for a bad file
        raise DataError(file, f"ASE could not read it ({type(exc).__name__}: {exc})") from exc
    atoms_list: list[Atoms] = images if isinstance(images, list) else [images]
    if not atoms_list:
        raise DataError(file, "no structures")
    return [_frame_from_atoms(atoms, file, k) for k, atoms in enumerate(atoms_list)]


def _frame_from_atoms(atoms: Atoms, file: Path, k: int) -> Frame:
    where = f"structure {k}"
    n = len(atoms)
    if n == 0:
        raise DataError(file, f"{where}: no atoms")
    results = dict(atoms.calc.results) if atoms.calc is not None else {}
    energy = results.get("energy", atoms.info.get("energy"))
    forces = results.get("forces", atoms.arrays.get("forces"))
    stress = results.get("stress", atoms.info.get("stress"))
    virial = atoms.info.get("virial")
    pbc = np.asarray(atoms.pbc, dtype=bool)
    cell = np.asarray(atoms.cell.array, dtype=np.float64)
    has_cell = bool(pbc.any()) or abs(np.linalg.det(cell)) > 1e-6
    positions = _finite_array(atoms.positions, (n, 3), file, f"{where}: positions")
    energy_value = None
    if energy is not None:
        energy_value = float(_finite_array(energy, (), file, f"{where}: energy"))
    forces_array = (
        None if forces is None else _finite_array(forces, (n, 3), file, f"{where}: forces")
    )
    virial_array = _virial_from_labels(stress, virial, atoms, file, where)
    return Frame(
        numbers=np.asarray(atoms.numbers, dtype=np.int64),
        positions=positions,
        cell=cell if has_cell else None,
        pbc=pbc,
        energy=energy_value,
        forces=forces_array,
        virial=virial_array,
        source=str(file),
    )


def _virial_from_labels(
    stress: object, virial: object, atoms: Atoms, file: Path, where: str
) -> np.ndarray | None:
    if stress is None and virial is None:
        return None
    if not atoms.pbc.all():
        raise DataError(
            file, f"{where}: stress/virial label on a structure that is not fully periodic"
        )
    if virial is not None:
        return _finite_array(virial, (3, 3), file, f"{where}: virial")
    values = np.asarray(stress, dtype=np.float64)
    if values.shape == (6,):
        values = voigt_6_to_full_3x3_stress(values)
    full = _finite_array(values, (3, 3), file, f"{where}: stress")
    return -float(atoms.get_volume()) * full


def _finite_array(value: object, shape: tuple[int, ...], file: Path, what: str) -> np.ndarray:
    try:
        array = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise DataError(file, f"{what}: not numeric ({exc})") from exc
    if array.size == math.prod(shape):
        array = array.reshape(shape)
    if array.shape != shape:
        raise DataError(file, f"{what}: expected shape {shape}, got {array.shape}")
    if not np.isfinite(array).all():
        raise DataError(file, f"{what}: contains NaN or infinite values")
    return array


# Mixed datasets


def load_dataset(
    paths: Sequence[Path | str],
    *,
    type_map: Sequence[str] | None = None,
    require_energy: bool = False,
) -> FrameDataset:
    """Pool frames from DeePMD systems and ASE files, in the order given.

    A folder is a DeePMD system if it holds ``type.raw`` and ``set.*``; a folder that is not a
    system is searched recursively for systems (e.g. ``water/`` → ``data_0..2``), following
    symbolic links. Anything else is read with ASE. A system or file reached twice (listed
    itself and through its folder, say) is refused: its frames would be counted twice, and a
    random split would put copies of a frame on both sides. Each frame is validated as a
    structure here, so bad geometry fails with its file name before training starts.
    """
    if not paths:
        raise DataError("<data>", "no data paths given")
    frames: list[Frame] = []
    entry_of: dict[Path, Path] = {}  # resolved source → the data path that brought it in
    for raw in paths:
        path = Path(raw)
        is_folder = path.is_dir()
        for source in _deepmd_systems_under(path) if is_folder else [path]:
            _claim_source(source, path, entry_of)
            if is_folder:
                frames.extend(load_deepmd_system(source, type_map=type_map))
            else:
                frames.extend(load_ase_file(source))
    for source_frames in FrameDataset(frames).by_source().values():
        _check_frames(list(source_frames), require_energy=require_energy)
    return FrameDataset(frames)


def _claim_source(source: Path, entry: Path, entry_of: dict[Path, Path]) -> None:
    """Record that the data path ``entry`` brings in ``source``, refusing a second time."""
    key = source.resolve()
    if key in entry_of:
        raise DataError(
            source,
            f"in the data twice (through the data paths {entry_of[key]} and {entry}): "
            "give each system or file once",
        )
    entry_of[key] = entry


def _deepmd_systems_under(folder: Path) -> list[Path]:
    """The DeePMD systems in ``folder`` or below, sorted. Symbolic links to folders are
    followed (``Path.rglob`` skips them), each real folder visited once so a link back up the
    tree ends the walk there."""
    if is_deepmd_system(folder):
        return [folder]
    systems: list[Path] = []
    visited: set[Path] = set()
    for root, subfolders, _ in os.walk(folder, followlinks=True):
        real = Path(root).resolve()
        if real in visited:
            subfolders.clear()
            continue
        visited.add(real)
        # Visited in name order: which of two links to one folder is kept does not depend on
        # the file system's listing order.
        subfolders.sort()
        if is_deepmd_system(Path(root)):
            systems.append(Path(root))
    if not systems:
        raise DataError(folder, "a folder with no DeePMD system (type.raw + set.*) in it")
    return sorted(systems)


def _check_frames(frames: list[Frame], *, require_energy: bool) -> None:
    """Validate one source's frames as structures in a single batched call."""
    for k, frame in enumerate(frames):
        if require_energy and frame.energy is None:
            raise DataError(frame.source, f"frame {k} has no energy label (needed for training)")
    try:
        Structures.from_arrays([_structure_arrays(f) for f in frames])
    except InvalidStructureError as exc:
        where = "" if exc.index is None else f"frame {exc.index}: "
        raise DataError(frames[0].source, f"{where}invalid structure ({exc})") from exc


def _structure_arrays(frame: Frame) -> StructureArrays:
    return StructureArrays(
        numbers=frame.numbers, positions=frame.positions, cell=frame.cell, pbc=frame.pbc
    )


# Batching


@dataclass(frozen=True)
class LabelBatch:
    """Labels of B frames with N atoms in all (float64). Masks mark which labels exist."""

    energy: torch.Tensor  # (B,) eV; 0 where unlabelled
    energy_mask: torch.Tensor  # (B,) bool
    forces: torch.Tensor  # (N, 3) eV/Å; 0 where unlabelled
    forces_mask: torch.Tensor  # (N,) bool
    virial: torch.Tensor  # (B, 3, 3) eV; 0 where unlabelled
    virial_mask: torch.Tensor  # (B,) bool
    n_atoms: torch.Tensor  # (B,) float64 atom counts (per-atom normalisation)

    def to(self, device: torch.device | str) -> LabelBatch:
        return LabelBatch(
            **{name: getattr(self, name).to(device) for name in self.__dataclass_fields__}
        )


@dataclass(frozen=True)
class TrainingBatch:
    structures: Structures
    labels: LabelBatch

    def to(self, device: torch.device | str) -> TrainingBatch:
        return TrainingBatch(self.structures.to(device), self.labels.to(device))


def collate(frames: Sequence[Frame]) -> TrainingBatch:
    """Batch frames into one validated :class:`Structures` plus their labels (on CPU)."""
    structures = Structures.from_arrays([_structure_arrays(f) for f in frames])
    zeros3 = np.zeros((3, 3))
    labels = LabelBatch(
        energy=_f64([0.0 if f.energy is None else f.energy for f in frames]),
        energy_mask=torch.tensor([f.energy is not None for f in frames]),
        forces=_f64(
            np.concatenate(
                [np.zeros((f.n_atoms, 3)) if f.forces is None else f.forces for f in frames]
            )
        ),
        forces_mask=torch.tensor(
            np.concatenate([np.full(f.n_atoms, f.forces is not None) for f in frames])
        ),
        virial=_f64(np.stack([zeros3 if f.virial is None else f.virial for f in frames])),
        virial_mask=torch.tensor([f.virial is not None for f in frames]),
        n_atoms=_f64([f.n_atoms for f in frames]),
    )
    return TrainingBatch(structures, labels)


def _f64(values: object) -> torch.Tensor:
    return torch.as_tensor(np.asarray(values, dtype=np.float64))


def iterate_batches(dataset: FrameDataset, batch_size: int) -> Iterator[TrainingBatch]:
    """Consecutive batches in dataset order (evaluation; the last batch may be smaller)."""
    if batch_size < 1:
        raise ValueError(f"batch size must be ≥ 1, got {batch_size}")
    for start in range(0, len(dataset), batch_size):
        yield collate([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
