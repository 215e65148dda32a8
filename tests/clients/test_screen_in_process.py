"""``so2serve screen`` without a service: the engine in this process, on one or several devices."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import ase.io
import numpy as np
import pytest
import torch

import service.engine.kernel_sets as kernel_sets
import service.model.potential as potential_module
from clients.screen import SUMMARY_FILE, ScreenAborted, ScreenOptions, screen
from service.graph.structures import Structures
from tests.service.fakes import PairPotential, rattled_copper, small_molecule


def summary_rows(out: Path) -> list[dict[str, str]]:
    with (out / SUMMARY_FILE).open() as f:
        return list(csv.DictReader(f))


def test_a_structure_too_large_for_memory_fails_alone_in_process(tmp_path: Path) -> None:
    """The engine bisects an out-of-memory batch: the one structure that does not fit alone
    fails with out_of_memory, the others of its batch get their results."""
    frames = [small_molecule("H2O", seed=k) for k in range(5)]
    frames.insert(2, rattled_copper(2, seed=0))  # 32 atoms
    path = tmp_path / "in.extxyz"
    ase.io.write(path, frames)
    out = tmp_path / "out"
    pot = PairPotential(oom_above_atoms=20)
    report = screen([path], ScreenOptions(output_dir=out, progress=False), evaluator=pot)
    assert (report.succeeded, report.failed) == (5, 1)
    rows = summary_rows(out)
    assert [r["status"] for r in rows] == ["ok", "ok", "failed", "ok", "ok", "ok"]
    assert rows[2]["error_code"] == "out_of_memory" and "does not fit" in rows[2]["error"]


def test_in_process_screen_spreads_over_several_devices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--device cuda:0,cuda:1`` in process: a model copy per device behind one queue (two
    fakes stand in for the GPUs), each with its recorded kernels preloaded; results equal one
    model's, in input order."""
    lanes: list[PairPotential] = []

    def two_devices(spec: str) -> list[torch.device]:
        assert spec == "cuda:0,cuda:1"
        return [torch.device("cpu"), torch.device("cpu")]

    def fake_model(model: Any, *, device: torch.device) -> PairPotential:
        lanes.append(PairPotential(delay_s=0.01))
        return lanes[-1]

    def fake_models(model: Any, *, devices: str) -> list[PairPotential]:
        return [fake_model(model, device=d) for d in potential_module.resolve_devices(devices)]

    preloaded: list[object] = []
    monkeypatch.setattr(potential_module, "resolve_devices", two_devices)
    monkeypatch.setattr(potential_module, "load_potentials", fake_models)
    monkeypatch.setattr(kernel_sets, "preload_recorded_kernels", preloaded.append)
    frames = [small_molecule("H2O", seed=k) for k in range(24)]
    path = tmp_path / "in.extxyz"
    ase.io.write(path, frames)
    out = tmp_path / "out"
    options = ScreenOptions(output_dir=out, progress=False, device="cuda:0,cuda:1")
    report = screen([path], options)
    assert (report.succeeded, report.failed) == (24, 0)
    assert len(lanes) == 2 and all(p.calls for p in lanes)
    assert (
        preloaded == lanes
    )  # each device's recorded kernels compiled once, before the first batch
    as_read = ase.io.read(path, ":")  # the file's rounding of the positions
    expected = PairPotential().predict(Structures.from_atoms(as_read), ("energy",)).energy
    energies = [float(r["energy_eV"]) for r in summary_rows(out)]
    np.testing.assert_allclose(energies, expected.numpy(), rtol=1e-9)


def test_an_unknown_device_aborts_the_run(tmp_path: Path) -> None:
    path = tmp_path / "in.extxyz"
    ase.io.write(path, [small_molecule("H2O")])
    options = ScreenOptions(output_dir=tmp_path / "out", progress=False, device="cuda:0,cuda:0")
    with pytest.raises(ScreenAborted):
        screen([path], options)
