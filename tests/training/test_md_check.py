"""The MD check's machinery (drift fit, O–H geometry, plot) on a cheap stand-in calculator."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import typer
from ase.calculators.emt import EMT
from typer.testing import CliRunner

from service.training import md_check
from service.training.data import load_deepmd_system
from service.training.md_check import atoms_from_frame, plot_energies, run_nve
from tests.conftest import shared_path
from tests.training.synthetic import write_water_system


def test_nve_report_and_plot(tmp_path: Path) -> None:
    frame = load_deepmd_system(shared_path("data", "water", "data_0"))[0]
    atoms = atoms_from_frame(frame)
    report, series = run_nve(atoms, EMT(), steps=6, sample_every=2, temperature_k=300.0)
    assert report.n_atoms == 192 and report.steps == 6
    assert len(series["time_ps"]) == 4
    assert series["time_ps"][-1] == pytest.approx(6 * 0.5e-3)
    slope = np.polyfit(series["time_ps"], 1000 * series["etot"], 1)[0]
    assert report.drift_mev_per_atom_ps == pytest.approx(slope)
    assert 0.8 < report.min_oh_distance < 1.2  # real water geometry at t≈0
    assert report.max_h_to_nearest_o < 1.6
    plot_energies(series, report, tmp_path / "md.png")
    assert (tmp_path / "md.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    ("model", "data", "fragment"),
    [
        ("default", "/nonexistent/system", "/nonexistent/system"),
        ("/nonexistent.safetensors", None, "/nonexistent.safetensors"),
    ],
)
def test_bad_input_is_one_error_line(
    tmp_path: Path, model: str, data: str | None, fragment: str
) -> None:
    """``python -m service.training.md_check`` (MODELS.md) on a missing system or model file:
    ``error: ...`` and exit code 2, no traceback."""
    app = typer.Typer()
    app.command()(md_check.main)
    system = data or str(write_water_system(tmp_path / "sys", 1, molecules=3, periodic=True))
    result = CliRunner().invoke(app, [model, system, "--device", "cpu", "--out", str(tmp_path)])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert "error:" in result.output and fragment in result.output


@pytest.mark.parametrize(
    ("option", "value", "fragment"),
    [
        ("--timestep-fs", "-1", "--timestep-fs must be > 0"),
        ("--sample-every", "0", "--sample-every must be ≥ 1"),
        ("--steps", "0", "--steps must be ≥ 1"),
        ("--out", "a_file", "--out: cannot create folder"),
    ],
)
def test_bad_options_are_refused_before_the_md(
    tmp_path: Path, option: str, value: str, fragment: str
) -> None:
    """Options the MD or the report cannot use (``--out`` a file failed with FileExistsError
    after the whole MD) are one error line, exit code 2, found before the model and data are
    (the missing ones here would be reported otherwise)."""
    (tmp_path / "a_file").write_text("")
    app = typer.Typer()
    app.command()(md_check.main)
    given = str(tmp_path / value) if option == "--out" else value
    out = [] if option == "--out" else ["--out", str(tmp_path / "out")]
    args = ["/nonexistent.safetensors", "/nonexistent/system", option, given, *out]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert result.output.startswith("error: ") and result.output.count("\n") == 1, result.output
    assert fragment in result.output
