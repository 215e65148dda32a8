"""``so2serve eval`` reproduces hand-computed errors of a toy model whose predictions are known.

The toy model is a real tiny DPA4 model with its fitting net's output layer zeroed: every atomic
energy is exactly its element's energy bias, so E = Σ bias, F = 0 and W = 0 for any geometry.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import typer
from ase import Atoms
from ase.calculators.singlepoint import SinglePointCalculator
from ase.io import write
from typer.testing import CliRunner

from service.model.config import preset
from service.model.dpa4 import DPA4Model
from service.model.io import read_metadata, save_model
from service.model.potential import load_potential
from service.training.cli import eval_command, train_command
from service.training.data import Frame, load_dataset, load_deepmd_system
from service.training.evaluate import evaluate_model
from tests.conftest import shared_path
from tests.training.synthetic import write_water_system

BIAS = {"H": -13.5, "C": -1030.0, "O": -2040.0}


@pytest.fixture(scope="module")
def toy_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    type_map = list(BIAS)
    # a short cutoff keeps it cheap; the zeroed output makes the predictions independent of it
    model = DPA4Model(preset("tiny", type_map, n_blocks=1, n_radial=4, rcut=2.5))
    with torch.no_grad():
        for parameter in model.fitting.output.parameters():
            parameter.zero_()
        model.energy_bias.copy_(torch.tensor([BIAS[s] for s in type_map], dtype=torch.float64))
    path = tmp_path_factory.mktemp("toy") / "toy.safetensors"
    save_model(model, path, provenance={"test": "toy"})
    return path


@pytest.fixture(scope="module")
def water_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two water frames as extxyz, with made-up stress labels to exercise the virial errors."""
    frames = load_deepmd_system(shared_path("data", "water", "data_0"))[:2]
    rng = np.random.default_rng(0)
    images = []
    for frame in frames:
        assert frame.cell is not None
        atoms = Atoms(numbers=frame.numbers, positions=frame.positions, cell=frame.cell, pbc=True)
        stress = rng.normal(scale=0.01, size=6)
        atoms.calc = SinglePointCalculator(
            atoms, energy=frame.energy, forces=frame.forces, stress=stress
        )
        images.append(atoms)
    path = tmp_path_factory.mktemp("water") / "water2.extxyz"
    write(path, images, format="extxyz")
    return path


def _expected(frames: list[Frame]) -> dict[str, dict[str, float]]:
    energy_err = np.array(
        [(sum(BIAS[s] for s in _symbols(f)) - f.energy) / f.n_atoms for f in frames]  # type: ignore[operator]
    )
    forces = np.concatenate([f.forces.ravel() for f in frames])  # type: ignore[union-attr]
    expected = {
        "energy": {"rmse": np.sqrt(np.mean(energy_err**2)), "mae": np.mean(np.abs(energy_err))},
        "forces": {"rmse": np.sqrt(np.mean(forces**2)), "mae": np.mean(np.abs(forces))},
    }
    virials = [f.virial / f.n_atoms for f in frames if f.virial is not None]
    if virials:
        v = np.concatenate([x.ravel() for x in virials])
        expected["virial"] = {"rmse": np.sqrt(np.mean(v**2)), "mae": np.mean(np.abs(v))}
    return expected


def _symbols(frame: Frame) -> list[str]:
    from ase.data import chemical_symbols

    return [chemical_symbols[z] for z in frame.numbers]


def _check(summary: dict[str, object], expected: dict[str, dict[str, float]]) -> None:
    for name, values in expected.items():
        got = summary[name]
        assert isinstance(got, dict)
        for key, value in values.items():
            assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), (name, key)


def test_eval_matches_hand_computed_errors(
    toy_model: Path, water_file: Path, tmp_path: Path
) -> None:
    molecules = shared_path("data", "combustion-nopbc", "C4H3O1")
    report = evaluate_model(
        toy_model,
        [water_file, molecules],
        device="cpu",
        path="reference",
        batch_size=4,
        parity_plot=tmp_path / "parity.png",
        json_output=tmp_path / "eval.json",
    )
    water = load_dataset([water_file])
    mols = load_dataset([molecules])
    _check(report.systems[str(water_file)], _expected(list(water)))
    _check(report.systems[str(molecules)], _expected(list(mols)))
    _check(report.overall, _expected([*water, *mols]))
    assert report.overall["virial"]["count"] == 2 * 9  # type: ignore[index]
    assert report.overall["frames"] == 17
    saved = json.loads((tmp_path / "eval.json").read_text())
    # The model by identity too: a retrained file at the same path is another model.
    assert saved["model_sha256"] == read_metadata(toy_model)["model_sha256"]
    assert saved["overall"]["forces"]["rmse"] == pytest.approx(report.overall["forces"]["rmse"])  # type: ignore[index]
    assert (tmp_path / "parity.png").stat().st_size > 10_000


def test_commands_register_with_typer(toy_model: Path, tmp_path: Path) -> None:
    app = typer.Typer()
    app.command("train")(train_command)
    app.command("eval")(eval_command)
    runner = CliRunner()
    assert "--set" in runner.invoke(app, ["train", "--help"]).output
    molecules = shared_path("data", "combustion-nopbc", "C4H3O1")
    out = tmp_path / "r.json"
    result = runner.invoke(
        app, ["eval", str(toy_model), str(molecules), "--json", str(out), "--device", "cpu"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["overall"]["frames"] == 15
    bad = runner.invoke(app, ["eval", str(toy_model), str(tmp_path / "nothing")])
    assert bad.exit_code == 2
    assert "no such file" in bad.output


def test_system_without_type_map_uses_the_model_type_map(tmp_path: Path) -> None:
    """A DeePMD system without type_map.raw is read with the model's type map (as ``dp test``
    does): same errors as the same frames with an explicit type_map.raw."""
    with_map = write_water_system(tmp_path / "a", 2, molecules=3, periodic=True)
    # The default model's type_map is (H, O): index 0 = H, 1 = O.
    without = write_water_system(tmp_path / "b", 2, molecules=3, periodic=True, type_map=False)
    np.savetxt(without / "type.raw", np.tile([1, 0, 0], 3), fmt="%d")
    assert load_potential(None, device="cpu").config.type_map == ("H", "O")
    expected = evaluate_model(None, [with_map], device="cpu").overall
    assert evaluate_model(None, [without], device="cpu").overall == expected


def test_non_positive_batch_size_is_refused(tmp_path: Path) -> None:
    """``batch_size`` < 1 is a ValueError before the model is even loaded."""
    system = write_water_system(tmp_path / "a", 1, molecules=3, periodic=True)
    with pytest.raises(ValueError, match="batch size"):
        evaluate_model(tmp_path / "no_model.safetensors", [system], batch_size=0)


def test_data_without_any_reference_is_refused(tmp_path: Path) -> None:
    """Structures with no reference energy, forces or virial leave nothing to compare: a clear
    error (it was an empty report and exit 0)."""
    from service.training.data import DataError

    bare = tmp_path / "bare.extxyz"
    write(bare, [Atoms("OH2", positions=[[0, 0, 0], [0.96, 0, 0], [-0.24, 0.93, 0]])])
    with pytest.raises(DataError, match="no reference energy, forces or virial"):
        evaluate_model(None, [bare], device="cpu")
