"""The MD check's machinery (drift fit, O–H geometry, plot) on a cheap stand-in calculator."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from ase.calculators.emt import EMT

from service.training.data import load_deepmd_system
from service.training.md_check import atoms_from_frame, plot_energies, run_nve
from tests.conftest import shared_path


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
