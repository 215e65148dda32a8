"""Data loading: DeePMD npy systems and ASE files agree; malformed data fails naming the file."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.calculators.singlepoint import SinglePointCalculator
from ase.io import write

from service.graph.structures import Structures
from service.model.config import preset
from service.model.dpa4 import DPA4Model
from service.model.potential import Potential
from service.training.data import (
    DataError,
    Frame,
    FrameDataset,
    collate,
    load_ase_file,
    load_dataset,
    load_deepmd_system,
)
from service.training.md_check import atoms_from_frame
from tests.conftest import shared_path
from tests.training.synthetic import truncate_sets, write_water_system


@pytest.fixture(scope="module")
def water0() -> Path:
    return shared_path("data", "water", "data_0")


@pytest.fixture(scope="module")
def molecules() -> Path:
    return shared_path("data", "combustion-nopbc")


def _copy_system(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _to_atoms(frame: Frame, *, stress: bool = False) -> Atoms:
    atoms = Atoms(
        numbers=frame.numbers,
        positions=frame.positions,
        cell=frame.cell if frame.cell is not None else np.zeros((3, 3)),
        pbc=frame.pbc,
    )
    results: dict[str, object] = {"energy": frame.energy, "forces": frame.forces}
    if stress:
        assert frame.virial is not None
        results["stress"] = -frame.virial / atoms.get_volume()
    atoms.calc = SinglePointCalculator(atoms, **results)
    return atoms


def test_deepmd_water_system(water0: Path) -> None:
    frames = load_deepmd_system(water0)
    assert len(frames) == 80
    first = frames[0]
    assert first.n_atoms == 192
    assert (first.numbers == 8).sum() == 64 and (first.numbers == 1).sum() == 128
    assert first.cell is not None and first.pbc.all()
    assert first.energy == pytest.approx(-29943.906, abs=1e-2)
    assert first.forces is not None and first.forces.shape == (192, 3)
    assert first.virial is None
    raw = np.load(water0 / "set.000" / "coord.npy")[0].reshape(192, 3)
    np.testing.assert_array_equal(first.positions, raw.astype(np.float64))


def test_nopbc_molecules_and_folder_search(molecules: Path) -> None:
    dataset = load_dataset([molecules])
    assert len(dataset.sources) == 2
    assert dataset.elements == ["H", "C", "O"]
    frame = dataset[0]
    assert frame.cell is None and not frame.pbc.any()
    assert len(dataset) == 1577


def test_extxyz_roundtrip_agrees_with_npy(water0: Path, tmp_path: Path) -> None:
    frames = load_deepmd_system(water0)[:5]
    path = tmp_path / "water.extxyz"
    write(path, [_to_atoms(f) for f in frames], format="extxyz")
    reloaded = load_ase_file(path)
    assert len(reloaded) == len(frames)
    for ours, theirs in zip(frames, reloaded, strict=True):
        np.testing.assert_array_equal(ours.numbers, theirs.numbers)
        np.testing.assert_allclose(theirs.positions, ours.positions, atol=1e-6)
        assert theirs.cell is not None and ours.cell is not None
        np.testing.assert_allclose(theirs.cell, ours.cell, atol=1e-6)
        assert theirs.energy == pytest.approx(ours.energy, abs=1e-6)
        np.testing.assert_allclose(theirs.forces, ours.forces, atol=1e-6)  # type: ignore[arg-type]
        np.testing.assert_array_equal(theirs.pbc, ours.pbc)


def test_mixed_dataset_and_stress_to_virial(water0: Path, molecules: Path, tmp_path: Path) -> None:
    frame = load_deepmd_system(water0)[0]
    virial = np.array([[1.0, 0.2, 0.1], [0.2, -0.5, 0.3], [0.1, 0.3, 0.7]])
    labelled = Frame(**{**frame.__dict__, "virial": virial})
    path = tmp_path / "one.extxyz"
    write(path, [_to_atoms(labelled, stress=True)], format="extxyz")
    dataset = load_dataset([path, molecules / "C4H3O1"])
    assert dataset.elements == ["H", "C", "O"]
    assert dataset.has_virial
    np.testing.assert_allclose(dataset[0].virial, virial, atol=1e-9)  # type: ignore[arg-type]
    batch = collate([dataset[0], dataset[1], dataset[2]])
    assert batch.structures.n_structures == 3
    assert batch.labels.virial_mask.tolist() == [True, False, False]
    assert batch.labels.forces.shape == (192 + 8 + 8, 3)
    assert batch.labels.n_atoms.tolist() == [192.0, 8.0, 8.0]
    assert batch.labels.energy.dtype == torch.float64


def test_split_is_reproducible_and_disjoint(molecules: Path) -> None:
    dataset = load_dataset([molecules / "C4H3O1"])
    train_a, valid_a = dataset.split(0.2, seed=3)
    train_b, valid_b = dataset.split(0.2, seed=3)
    _, valid_c = dataset.split(0.2, seed=4)
    key = lambda ds: [f.positions.tobytes() for f in ds]  # noqa: E731
    assert key(valid_a) == key(valid_b) and key(train_a) == key(train_b)
    assert key(valid_a) != key(valid_c)
    assert len(valid_a) == 3 and len(train_a) == 12
    assert not set(key(valid_a)) & set(key(train_a))


def test_frame_dataset_grouping(molecules: Path) -> None:
    dataset = load_dataset([molecules])
    groups = dataset.by_source()
    assert [len(g) for g in groups.values()] == [1562, 15]
    assert isinstance(dataset.subset([0, 5]), FrameDataset)


def _expect(path: Path, fragment: str, name: str) -> None:
    with pytest.raises(DataError) as info:
        load_dataset([path])
    message = str(info.value)
    assert name in message and fragment in message, message


def test_missing_box(water0: Path, tmp_path: Path) -> None:
    system = _copy_system(water0, tmp_path / "sys")
    (system / "set.000" / "box.npy").unlink()
    _expect(system, "missing", "box.npy")


def test_force_shape_mismatch(water0: Path, tmp_path: Path) -> None:
    system = _copy_system(water0, tmp_path / "sys")
    forces = np.load(system / "set.000" / "force.npy")
    np.save(system / "set.000" / "force.npy", forces[:, :-3])
    _expect(system, "values per frame", "force.npy")


def test_frame_count_mismatch(water0: Path, tmp_path: Path) -> None:
    system = _copy_system(water0, tmp_path / "sys")
    energy = np.load(system / "set.000" / "energy.npy")
    np.save(system / "set.000" / "energy.npy", energy[:-1])
    _expect(system, "frames", "energy.npy")


def test_nan_coordinates(water0: Path, tmp_path: Path) -> None:
    system = _copy_system(water0, tmp_path / "sys")
    coords = np.load(system / "set.000" / "coord.npy")
    coords[3, 7] = np.nan
    np.save(system / "set.000" / "coord.npy", coords)
    _expect(system, "NaN", "coord.npy")


def test_type_index_out_of_range(water0: Path, tmp_path: Path) -> None:
    system = _copy_system(water0, tmp_path / "sys")
    (system / "type.raw").write_text("0\n" * 191 + "2\n")
    _expect(system, "out of range", "type.raw")


def test_missing_type_map(water0: Path, tmp_path: Path) -> None:
    system = _copy_system(water0, tmp_path / "sys")
    (system / "type_map.raw").unlink()
    _expect(system, "missing", "type_map.raw")
    assert len(load_deepmd_system(system, type_map=["O", "H"])) == 80


def test_unknown_element_symbol(water0: Path, tmp_path: Path) -> None:
    system = _copy_system(water0, tmp_path / "sys")
    (system / "type_map.raw").write_text("O\nQq\n")
    _expect(system, "unknown element", "type_map.raw")


def test_not_a_system_folder(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    _expect(tmp_path / "empty", "no DeePMD system", "empty")


def test_unreadable_ase_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.extxyz"
    path.write_text("3\nnot a comment line with = broken\nH 0 0\n")
    _expect(path, "ASE could not read it", "broken.extxyz")


def test_ase_stress_on_molecule(tmp_path: Path) -> None:
    atoms = Atoms("H2", positions=[[0, 0, 0], [0.74, 0, 0]])
    atoms.info["stress"] = np.zeros(6)
    path = tmp_path / "h2.extxyz"
    write(path, atoms, format="extxyz")
    _expect(path, "not fully periodic", "h2.extxyz")


def test_ase_wrong_force_shape(tmp_path: Path) -> None:
    atoms = Atoms("H2", positions=[[0, 0, 0], [0.74, 0, 0]])
    atoms.info["energy"] = -1.0
    atoms.arrays["forces"] = np.zeros((2, 3))
    path = tmp_path / "h2.extxyz"
    write(path, atoms, format="extxyz")
    text = path.read_text().replace("forces:R:3", "forces:R:2")
    lines = text.splitlines()
    lines[2:] = [" ".join(line.split()[:-1]) for line in lines[2:]]
    path.write_text("\n".join(lines) + "\n")
    _expect(path, "forces: expected shape", "h2.extxyz")


def test_training_requires_energy(tmp_path: Path) -> None:
    path = tmp_path / "h2.extxyz"
    write(path, Atoms("H2", positions=[[0, 0, 0], [0.74, 0, 0]]), format="extxyz")
    assert load_dataset([path])[0].energy is None
    with pytest.raises(DataError, match="no energy label"):
        load_dataset([path], require_energy=True)


def test_empty_set_names_the_file(tmp_path: Path) -> None:
    """A set with 0 frames is a DataError naming its coord.npy, not a numpy reshape error."""
    system = write_water_system(tmp_path / "sys", 2)
    truncate_sets(system, 0)
    _expect(system, "0 frames", "set.000/coord.npy")


def test_empty_label_file_names_the_file(tmp_path: Path) -> None:
    """An empty energy.npy next to a filled coord.npy names energy.npy."""
    system = write_water_system(tmp_path / "sys", 2)
    np.save(system / "set.000" / "energy.npy", np.zeros(0))
    _expect(system, "0 frames", "energy.npy")


def test_a_system_reached_twice_is_refused(tmp_path: Path) -> None:
    """A system listed itself and through its folder would be loaded twice, and the random
    validation split would put copies of one frame on both sides: refused, naming it."""
    folder = tmp_path / "data"
    write_water_system(folder / "a", 2)
    write_water_system(folder / "b", 2, seed=1)
    for paths in ([folder, folder / "b"], [folder / "b", folder / "b"]):
        with pytest.raises(DataError, match="in the data twice") as info:
            load_dataset(paths)
        assert info.value.path == str(folder / "b")


def test_folder_search_follows_symbolic_links(tmp_path: Path) -> None:
    """A folder search finds systems behind symbolic links (``Path.rglob`` skipped them); a link
    back up the tree does not loop; the order is sorted."""
    write_water_system(tmp_path / "elsewhere" / "linked", 2)
    folder = tmp_path / "data"
    write_water_system(folder / "b", 2, seed=1)
    (folder / "a_link").symlink_to(tmp_path / "elsewhere" / "linked")
    (folder / "b" / "loop").symlink_to(folder)
    dataset = load_dataset([folder])
    assert dataset.sources == [str(folder / "a_link"), str(folder / "b")]
    assert len(dataset) == 4


def test_stress_label_is_loaded_as_the_model_virial(tmp_path: Path) -> None:
    """An ASE stress label, ``σ = (1/V) ∂E/∂ε``, is loaded as the virial the model predicts and
    the loss compares it with. The label is built from finite differences of a tiny model's
    energy under strain, not from the loader's ``W = −V·σ``."""
    system = write_water_system(tmp_path / "sys", 1, molecules=3, periodic=True)
    atoms = atoms_from_frame(load_deepmd_system(system)[0])
    potential = Potential(DPA4Model(preset("tiny", ["H", "O"])), device="cpu",
                          path="reference", precision="fp64")  # fmt: skip

    def energy(strain: np.ndarray) -> float:
        strained = atoms.copy()
        strained.set_cell(atoms.cell.array @ strain, scale_atoms=False)
        strained.positions = atoms.positions @ strain
        structures = Structures.from_atoms([strained])
        return float(potential.predict(structures, ("energy",)).energy[0])

    h = 1e-5
    de_dstrain = np.zeros((3, 3))
    for i in range(3):
        for j in range(3):
            step = np.zeros((3, 3))
            step[i, j] = h
            de_dstrain[i, j] = (energy(np.eye(3) + step) - energy(np.eye(3) - step)) / (2 * h)
    stress = 0.5 * (de_dstrain + de_dstrain.T) / atoms.get_volume()
    atoms.calc = SinglePointCalculator(atoms, energy=energy(np.eye(3)), stress=stress)
    path = tmp_path / "labelled.extxyz"
    write(path, atoms, format="extxyz")
    loaded = load_ase_file(path)[0].virial
    predicted = potential.predict(Structures.from_atoms([atoms]), ("energy", "virial")).virial
    assert predicted is not None and loaded is not None
    scale = float(np.abs(loaded).max())
    assert scale > 1e-4  # the check has something to compare
    np.testing.assert_allclose(loaded, predicted[0].numpy(), atol=1e-4 * scale)
