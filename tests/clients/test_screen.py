"""The screening CLI: through the service and in process, bad structures, retries, resume."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import ase.io
import numpy as np
import pytest
from ase import Atoms
from typer.testing import CliRunner

from clients.screen import JOURNAL_FILE, RESULTS_FILE, SUMMARY_FILE, ScreenOptions, screen
from service.api import ServiceSettings, create_app
from service.cli import app
from service.graph.structures import Structures
from tests.service.fakes import PairPotential, rattled_copper, running_server, small_molecule

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def inputs(tmp_path: Path) -> list[Path]:
    """Two readable files (the second with one structure the model cannot do) and a broken one."""
    good = [rattled_copper(1, seed=k) for k in range(4)] + [
        small_molecule(name, seed=1) for name in ("CH4", "CH3OH")
    ]
    mixed = [
        small_molecule("H2O"),
        Atoms("HU", positions=[[0, 0, 0], [2, 0, 0]]),
        rattled_copper(1),
    ]
    ase.io.write(tmp_path / "good.extxyz", good)
    ase.io.write(tmp_path / "mixed.xyz", mixed)
    (tmp_path / "broken.xyz").write_text("3\nnot an xyz file\nH 0 0\n")
    return [tmp_path / "good.extxyz", tmp_path / "mixed.xyz", tmp_path / "broken.xyz"]


def summary_rows(out: Path) -> list[dict[str, str]]:
    with (out / SUMMARY_FILE).open() as f:
        return list(csv.DictReader(f))


def check_outputs(out: Path, inputs: list[Path]) -> None:
    """Every structure once, in the right state, with the potential's numbers."""
    rows = summary_rows(out)
    expected_ids = [f"{inputs[0]}@{k}" for k in range(6)] + [f"{inputs[1]}@{k}" for k in range(3)]
    assert [r["id"] for r in rows] == [*expected_ids, f"{inputs[2]}@0"]
    failed = {r["id"]: r["error_code"] for r in rows if r["status"] == "failed"}
    assert failed == {f"{inputs[1]}@1": "unknown_element", f"{inputs[2]}@0": "unreadable"}
    frames = ase.io.read(out / RESULTS_FILE, index=":")
    assert sorted(f.info["screen_id"] for f in frames) == sorted(set(expected_ids) - set(failed))
    originals = {
        f"{path}@{k}": a for path in inputs[:2] for k, a in enumerate(ase.io.read(path, ":"))
    }
    reference = PairPotential()
    for frame in frames:
        source = originals[frame.info["screen_id"]]
        direct = reference.predict(Structures.from_atoms([source]), {"energy", "forces", "stress"})
        assert direct.forces is not None and direct.stress is not None
        assert frame.get_potential_energy() == pytest.approx(float(direct.energy[0]), rel=1e-12)
        # extxyz stores arrays with 8 decimals
        np.testing.assert_allclose(frame.positions, source.positions, atol=1e-8)
        np.testing.assert_allclose(frame.get_forces(), direct.forces.numpy(), rtol=0, atol=1e-8)
        if frame.pbc.all():
            np.testing.assert_allclose(frame.get_stress(), direct.stress[0].numpy(), atol=1e-12)
        row = next(r for r in rows if r["id"] == frame.info["screen_id"])
        assert float(row["energy_eV"]) == float(direct.energy[0])


@pytest.fixture
def service() -> Iterator[tuple[str, PairPotential]]:
    potential = PairPotential()
    with running_server(create_app(ServiceSettings(), evaluator=potential)) as url:
        yield url, potential


def test_screen_through_the_service(
    inputs: list[Path], tmp_path: Path, service: tuple[str, PairPotential]
) -> None:
    out = tmp_path / "out"
    args = ["screen", *map(str, inputs), "--url", service[0], "--out", str(out), "--no-progress"]
    result = CliRunner().invoke(app, [*args, "--batch-structures", "3"])
    assert result.exit_code == 0, result.output
    assert "10 structures: 8 evaluated, 2 failed, 0 already done" in result.output
    check_outputs(out, inputs)
    again = CliRunner().invoke(app, args)  # everything is done: nothing is recomputed
    assert "0 evaluated, 0 failed, 10 already done" in again.output


def test_screen_in_process(inputs: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    report = screen(
        inputs, ScreenOptions(output_dir=out, progress=False), evaluator=PairPotential()
    )
    assert (report.total, report.succeeded, report.failed, report.skipped) == (10, 8, 2, 0)
    check_outputs(out, inputs)


def test_transient_overload_is_retried(inputs: list[Path], tmp_path: Path) -> None:
    potential = PairPotential(delay_s=0.05)
    app_ = create_app(ServiceSettings(max_queue=1), evaluator=potential)
    with running_server(app_) as url:
        options = ScreenOptions(
            output_dir=tmp_path / "out",
            url=url,
            concurrency=4,
            batch_structures=1,
            retries=8,
            backoff_s=0.02,
            progress=False,
        )
        report = screen(inputs, options)
        rejected = app_.state.service.metrics.registry.get_sample_value(
            "so2serve_rejected_requests_total", {"reason": "queue_full"}
        )
    assert rejected and rejected > 0  # the server did push back ...
    assert (report.succeeded, report.failed) == (8, 2)  # ... and nothing was lost
    check_outputs(tmp_path / "out", inputs)


def test_resume_after_a_killed_run(inputs: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    potential = PairPotential(delay_s=0.25)
    with running_server(create_app(ServiceSettings(), evaluator=potential)) as url:
        command = [
            sys.executable,
            "-m",
            "service.cli",
            "screen",
            *map(str, inputs),
            "--url",
            url,
            "--out",
            str(out),
            "--concurrency",
            "1",
            "--batch-structures",
            "1",
            "--no-progress",
        ]
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path}
        child = subprocess.Popen(command, env=env, cwd=tmp_path, stderr=subprocess.PIPE)
        journal = out / JOURNAL_FILE
        deadline = time.monotonic() + 60
        while not (journal.exists() and len(journal.read_text().splitlines()) >= 3):
            assert child.poll() is None, child.stderr.read().decode() if child.stderr else ""
            assert time.monotonic() < deadline, "the screening run made no progress"
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        # A kill can land mid-write: leave a torn frame and a torn journal line behind.
        with (out / RESULTS_FILE).open("a") as f:
            f.write('4\nLattice="3.6 0 0 0 3.6 0 0 0 3.6" Properties=species:S:1:pos:R:3\nCu 0 0')
        with journal.open("a") as f:
            f.write('{"id": "half a line')
        done_before = {
            line.split('"id": "')[1].split('"')[0] for line in journal.read_text().splitlines()[:-1]
        }
        calls_before = len(potential.calls)
        potential.delay_s = 0.0
        result = CliRunner().invoke(app, command[3:])
        assert result.exit_code == 0, result.output
    check_outputs(out, inputs)
    assert f"{len(done_before)} already done" in result.output
    evaluated_now = sum(n for n, _ in potential.calls[calls_before:])
    done_good = [d for d in done_before if "broken" not in d]
    assert evaluated_now == 8 - len(done_good)  # 8 evaluable structures, none computed twice
