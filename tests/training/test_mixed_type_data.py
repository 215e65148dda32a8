"""DeePMD mixed-type systems (dpdata's ``deepmd/npy/mixed``): per-frame types from
``set.*/real_atom_types.npy``, virtual atoms (type -1) dropped; ``so2serve eval --type-map``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from ase import Atoms
from ase.calculators.singlepoint import SinglePointCalculator
from ase.data import atomic_numbers, chemical_symbols
from ase.io import write
from typer.testing import CliRunner

from service.cli import app
from service.training.config import load_config
from service.training.data import DataError, Frame, collate, load_dataset, load_deepmd_system
from service.training.evaluate import evaluate_model
from service.training.loop import fit_energy_reference, prepare_data, train
from tests.training.synthetic import tiny_run_overrides, write_water_system

TYPE_MAP = ("O", "H", "C")
SPACING = 1.4  # Å between neighbouring atoms of the synthetic chains


def _z(types: np.ndarray, type_map: Sequence[str] = TYPE_MAP) -> np.ndarray:
    return np.array([atomic_numbers[type_map[t]] for t in types], dtype=np.int64)


def write_mixed_system(
    folder: Path,
    set_types: Sequence[np.ndarray],
    *,
    type_map: Sequence[str] | None = TYPE_MAP,
    periodic: bool = False,
    seed: int = 0,
) -> list[Frame]:
    """A mixed-type system with one ``set.00k`` per entry of ``set_types`` (frames, atoms) as
    dpdata writes it: ``type.raw`` all 0, virtual atoms (-1) at zero coordinates and forces.

    Returns the frames it holds, built here from the arrays (virtual atoms left out).
    """
    rng = np.random.default_rng(seed)
    n_atoms = set_types[0].shape[1]
    folder.mkdir(parents=True)
    np.savetxt(folder / "type.raw", np.zeros(n_atoms, dtype=int), fmt="%d")
    if type_map is not None:
        (folder / "type_map.raw").write_text("\n".join(type_map) + "\n")
    if not periodic:
        (folder / "nopbc").write_text("")
    line = np.arange(n_atoms)[:, None] * np.array([SPACING, 0.0, 0.0]) + 2.0
    frames = []
    for k, types in enumerate(set_types):
        set_dir = folder / f"set.{k:03d}"
        set_dir.mkdir()
        n_frames = types.shape[0]
        real = types >= 0
        coords = line[None] + 0.05 * rng.standard_normal((n_frames, n_atoms, 3))
        forces = rng.standard_normal((n_frames, n_atoms, 3))
        coords[~real], forces[~real] = 0.0, 0.0
        energies = -10.0 * real.sum(axis=1) + rng.standard_normal(n_frames)
        np.save(set_dir / "coord.npy", coords.reshape(n_frames, -1))
        np.save(set_dir / "force.npy", forces.reshape(n_frames, -1))
        np.save(set_dir / "energy.npy", energies)
        np.save(set_dir / "real_atom_types.npy", types)
        if periodic:
            box = 4.0 * SPACING * n_atoms * np.eye(3).ravel()
            np.save(set_dir / "box.npy", np.tile(box, (n_frames, 1)))
        for f in range(n_frames):
            frames.append(
                Frame(
                    numbers=_z(types[f][real[f]], type_map or TYPE_MAP),
                    positions=coords[f][real[f]],
                    cell=box.reshape(3, 3) if periodic else None,
                    pbc=np.full(3, periodic),
                    energy=float(energies[f]),
                    forces=forces[f][real[f]],
                    virial=None,
                    source=str(folder),
                )
            )
    return frames


def _assert_frames_equal(got: Sequence[Frame], expected: Sequence[Frame]) -> None:
    assert len(got) == len(expected)
    for k, (a, b) in enumerate(zip(got, expected, strict=True)):
        np.testing.assert_array_equal(a.numbers, b.numbers, err_msg=f"frame {k}")
        np.testing.assert_array_equal(a.positions, b.positions, err_msg=f"frame {k}")
        np.testing.assert_array_equal(a.forces, b.forces, err_msg=f"frame {k}")
        assert a.energy == b.energy and a.source == b.source
        assert (a.cell is None) == (b.cell is None)
        if a.cell is not None:
            np.testing.assert_array_equal(a.cell, b.cell)


SETS = [
    np.array([[0, 1, 1, 2], [1, 1, 1, 1]]),  # O H H C, then H4
    np.array([[2, 2, 1, 1]]),  # C2H2
]
PADDED = [np.array([[0, 1, 1, -1, -1], [2, -1, 1, 1, -1]])]  # H2O + 2 virtual, CH2 + 2 virtual


def test_frames_take_their_own_types(tmp_path: Path) -> None:
    """Each frame's elements come from its row of real_atom_types.npy (not from the placeholder
    type.raw), over every set in order, with their coordinates, forces and energies."""
    expected = write_mixed_system(tmp_path / "sys", SETS, periodic=True)
    frames = load_deepmd_system(tmp_path / "sys")
    _assert_frames_equal(frames, expected)
    assert [f.numbers.tolist() for f in frames] == [[8, 1, 1, 6], [1, 1, 1, 1], [6, 6, 1, 1]]


def test_virtual_atoms_are_dropped_with_their_rows(tmp_path: Path) -> None:
    """Type -1 (dpdata's padding) is not an atom: it goes, with its coordinate and force rows,
    also from the middle of a frame; frames of one system then differ in size and still batch."""
    expected = write_mixed_system(tmp_path / "sys", PADDED)
    dataset = load_dataset([tmp_path / "sys"])
    _assert_frames_equal(list(dataset), expected)
    assert [f.n_atoms for f in dataset] == [3, 3]
    assert collate(list(dataset)).structures.atom_counts == (3, 3)


def test_a_uniform_mixed_system_reads_as_the_plain_one(tmp_path: Path) -> None:
    """A plain system rewritten as mixed type (type.raw zeroed, its types per frame) gives the
    same frames."""
    plain = write_water_system(tmp_path / "sys", 3, molecules=2, periodic=True)
    before = load_deepmd_system(plain)
    types = np.loadtxt(plain / "type.raw", dtype=int)
    np.save(plain / "set.000" / "real_atom_types.npy", np.tile(types, (3, 1)))
    np.savetxt(plain / "type.raw", np.zeros_like(types), fmt="%d")
    _assert_frames_equal(load_deepmd_system(plain), before)


def test_per_frame_compositions_reach_the_dataset(tmp_path: Path) -> None:
    """Elements, per-source grouping and the energy reference fit see every frame's own
    composition: energies made of per-element constants are fitted exactly."""
    write_mixed_system(tmp_path / "sys", SETS)
    dataset = load_dataset([tmp_path / "sys"])
    assert dataset.elements == ["H", "C", "O"]
    assert list(dataset.by_source()) == [str(tmp_path / "sys")]
    per_element = {"H": -13.6, "C": -1030.0, "O": -2040.0}
    exact = np.array([sum(per_element[s] for s in _symbols(f)) for f in dataset])
    fitted = fit_energy_reference(dataset, ["H", "C", "O"], exact)
    np.testing.assert_allclose(fitted, list(per_element.values()), rtol=1e-10)


def _symbols(frame: Frame) -> list[str]:
    return [chemical_symbols[z] for z in frame.numbers]


def _break(system: Path, name: str, value: np.ndarray) -> None:
    np.save(system / "set.000" / name, value)


@pytest.mark.parametrize(
    ("array", "fragment"),
    [
        (np.array([[0.0, 1.0, 1.0, 2.0], [1.0, 1.0, 1.0, 1.0]]), "integer type indices"),
        (np.array([[0, 1, 1, 2]]), "shape (1, 4), expected (frames, atoms) = (2, 4)"),
        (np.array([[0, 1, 1], [1, 1, 1]]), "shape (2, 3), expected (frames, atoms) = (2, 4)"),
        (np.array([0, 1, 1, 2, 1, 1, 1, 1]), "shape (8,)"),
        (np.array([[0, 1, 1, 3], [1, 1, 1, 1]]), "out of range [0, 3)"),
        (np.array([[0, 1, 1, -2], [1, 1, 1, 1]]), "[-2]"),
        (np.array([[0, 1, 1, 2], [-1, -1, -1, -1]]), "frame 1: every atom is virtual"),
    ],
)
def test_bad_real_atom_types_name_the_file(
    tmp_path: Path, array: np.ndarray, fragment: str
) -> None:
    system = tmp_path / "sys"
    write_mixed_system(system, SETS)
    _break(system, "real_atom_types.npy", array)
    with pytest.raises(DataError) as info:
        load_deepmd_system(system)
    assert info.value.path == str(system / "set.000" / "real_atom_types.npy")
    assert fragment in info.value.problem


def test_unreadable_real_atom_types_names_the_file(tmp_path: Path) -> None:
    system = tmp_path / "sys"
    write_mixed_system(system, SETS)
    (system / "set.000" / "real_atom_types.npy").write_bytes(b"not an npy file")
    with pytest.raises(DataError, match="unreadable npy file") as info:
        load_deepmd_system(system)
    assert info.value.path == str(system / "set.000" / "real_atom_types.npy")


def test_a_set_without_real_atom_types_in_a_mixed_system_is_refused(tmp_path: Path) -> None:
    """As in DeePMD-kit, all sets of a system are mixed-type or none: a set left without
    real_atom_types.npy would silently take the placeholder types."""
    system = tmp_path / "sys"
    write_mixed_system(system, SETS)
    (system / "set.001" / "real_atom_types.npy").unlink()
    with pytest.raises(DataError, match=r"missing, but set\.000 has one") as info:
        load_deepmd_system(system)
    assert info.value.path == str(system / "set.001" / "real_atom_types.npy")


def test_mixed_system_without_type_map(tmp_path: Path) -> None:
    """Without type_map.raw the indices need a given type map, as for plain systems."""
    system = tmp_path / "sys"
    write_mixed_system(system, SETS, type_map=None)
    with pytest.raises(DataError, match="missing, and no type_map was given"):
        load_deepmd_system(system)
    frames = load_deepmd_system(system, type_map=["C", "H", "O"])
    assert frames[0].numbers.tolist() == [6, 1, 1, 8]  # O H H C under C, H, O


def test_train_on_a_mixed_type_system(tmp_path: Path) -> None:
    """A tiny CPU run trains on a mixed-type system (with virtual atoms) and exports a model
    for every element of it."""
    types = np.array([[0, 1, 1, -1], [2, 1, 1, 1], [0, 1, 1, 1], [1, 1, -1, -1]] * 2)
    write_mixed_system(tmp_path / "sys", [types], periodic=True)
    config = load_config(
        None, tiny_run_overrides(tmp_path / "sys", tmp_path / "run", "run.steps=2")
    )
    data = prepare_data(config.data)
    assert data.type_map == ["H", "C", "O"] and len(data.train) + len(data.validation) == 8
    result = train(config)
    assert result.steps == 2 and result.model_path.is_file()
    assert result.validation["forces_rmse"] > 0


def _as_traj(frames: Sequence[Frame], path: Path) -> Path:
    images = []
    for frame in frames:
        atoms = Atoms(numbers=frame.numbers, positions=frame.positions, pbc=False)
        atoms.calc = SinglePointCalculator(atoms, energy=frame.energy, forces=frame.forces)
        images.append(atoms)
    write(path, images, format="traj")
    return path


def test_eval_on_a_mixed_type_system(tmp_path: Path) -> None:
    """``evaluate_model`` on a mixed-type system (H/O only, as the default model knows, with
    virtual atoms) reports what it reports for the same frames as an ASE trajectory."""
    types = np.array([[0, 1, 1, -1, -1], [0, 1, 1, 0, 1], [1, 1, -1, 0, 1]])
    expected = write_mixed_system(tmp_path / "sys", [types])
    reference = _as_traj(expected, tmp_path / "same.traj")
    got = evaluate_model(None, [tmp_path / "sys"], device="cpu")
    want = evaluate_model(None, [reference], device="cpu")
    assert got.overall == want.overall and got.overall["frames"] == 3
    assert got.systems[str(tmp_path / "sys")] == want.systems[str(reference)]


def _eval_overall(*args: str) -> dict[str, object]:
    result = CliRunner().invoke(app, ["eval", "default", *args, "--device", "cpu"])
    assert result.exit_code == 0, result.output
    overall: dict[str, object] = json.loads(result.stdout)["overall"]
    return overall


def test_eval_type_map_option(tmp_path: Path) -> None:
    """``--type-map O,H`` (or repeated) reads a system without type_map.raw as O/H; without it
    the model's type map (H, O) applies and the same indices mean other elements."""
    labelled = write_water_system(tmp_path / "a", 2, molecules=3, periodic=True)
    bare = write_water_system(tmp_path / "b", 2, molecules=3, periodic=True, type_map=False)
    expected = _eval_overall(str(labelled))
    assert _eval_overall(str(bare), "--type-map", "O,H") == expected
    assert _eval_overall(str(bare), "--type-map", "O", "--type-map", "H") == expected
    assert _eval_overall(str(bare)) != expected  # fallback: 0 = H, 1 = O


@pytest.mark.parametrize(
    ("value", "fragment"),
    [("O,Xx", "unknown element symbol(s) ['Xx']"), ("O,H,O", "listed twice"), (",", "empty")],
)
def test_eval_bad_type_map_is_a_clean_error(tmp_path: Path, value: str, fragment: str) -> None:
    bare = write_water_system(tmp_path / "b", 1, periodic=True, type_map=False)
    result = CliRunner().invoke(app, ["eval", "default", str(bare), "--type-map", value])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert fragment in result.output
