"""The screening CLI: through the service and in process, bad structures, retries, resume."""

from __future__ import annotations

import csv
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import ase.io
import numpy as np
import pytest
from ase import Atoms
from ase.calculators.singlepoint import SinglePointCalculator
from pydantic import SecretStr
from typer.testing import CliRunner

from clients import screen as screen_module
from clients.screen import (
    JOURNAL_FILE,
    READ_CHUNK,
    RESULTS_FILE,
    SUMMARY_FILE,
    ScreenAborted,
    ScreenOptions,
    screen,
)
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


def test_screen_sends_a_non_ascii_api_key(tmp_path: Path) -> None:
    path = tmp_path / "in.extxyz"
    ase.io.write(path, water_frames(2))
    settings = ServiceSettings(api_key=SecretStr("clé-€"))
    with running_server(create_app(settings, evaluator=PairPotential())) as url:
        out = tmp_path / "out"
        options = ScreenOptions(output_dir=out, url=url, api_key="clé-€", progress=False)
        assert screen([path], options).succeeded == 2


def test_screen_in_process(inputs: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    options = ScreenOptions(output_dir=out, progress=False, batch_structures=2)
    report = screen(inputs, options, evaluator=PairPotential())
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


def water_frames(n: int) -> list[Atoms]:
    return [small_molecule("H2O", seed=k) for k in range(n)]


def spoil_coordinate(path: Path, frame: int, text: str = "abc") -> None:
    """Replace the first x coordinate of ``frame`` (3-atom frames: 5 lines each) by ``text``."""
    lines = path.read_text().splitlines(keepends=True)
    atom_line = 5 * frame + 2
    symbol, _, *rest = lines[atom_line].split()
    lines[atom_line] = " ".join([symbol, text, *rest]) + "\n"
    path.write_text("".join(lines))


def screen_locally(inputs: list[Path], out: Path, *, retry_failed: bool = False) -> tuple[int, ...]:
    options = ScreenOptions(output_dir=out, retry_failed=retry_failed, progress=False)
    report = screen(inputs, options, evaluator=PairPotential())
    return report.total, report.succeeded, report.failed, report.skipped


def test_a_file_without_structures_is_reported(tmp_path: Path) -> None:
    """A Markdown file or a blank extxyz reads as zero frames (ASE raises for neither): it ended
    as a finished run of 0 structures, exit code 0, as if a mistyped glob had worked."""
    notes = tmp_path / "notes.md"
    notes.write_text("# Notes\n\nnot a structure file\n")
    empty = tmp_path / "blank.extxyz"
    empty.write_text("\n")
    frames = tmp_path / "two.extxyz"
    ase.io.write(frames, water_frames(2))
    out = tmp_path / "out"
    assert screen_locally([notes, empty, frames], out) == (4, 2, 2, 0)
    failed = {r["id"]: r["error"] for r in summary_rows(out) if r["status"] == "failed"}
    assert set(failed) == {f"{notes}@0", f"{empty}@0"}
    assert all("no structures in" in message for message in failed.values())


def test_a_malformed_frame_fails_alone(tmp_path: Path) -> None:
    path = tmp_path / "six.extxyz"
    ase.io.write(path, water_frames(6))
    spoil_coordinate(path, 2)
    out = tmp_path / "out"
    assert screen_locally([path], out) == (6, 5, 1, 0)
    rows = summary_rows(out)
    assert [r["id"] for r in rows] == [f"{path}@{k}" for k in range(6)]
    assert [r["status"] for r in rows] == ["ok", "ok", "failed", "ok", "ok", "ok"]
    assert rows[2]["error_code"] == "unreadable"
    assert rows[2]["error"] == (
        f"cannot read frame 2 of {path}: ValueError: could not convert string to float: 'abc'"
    )
    frames = ase.io.read(out / RESULTS_FILE, index=":")
    assert sorted(f.info["frame"] for f in frames) == [0, 1, 3, 4, 5]
    # Resume: nothing again; with retry_failed only the bad frame, which fails the same way.
    assert screen_locally([path], out) == (6, 0, 0, 6)
    assert screen_locally([path], out, retry_failed=True) == (6, 0, 1, 5)
    assert [r["status"] for r in summary_rows(out)] == ["ok", "ok", "failed", "ok", "ok", "ok"]


def test_consecutive_malformed_frames_with_one_error_each_fail_alone(tmp_path: Path) -> None:
    """The same parse error twice in a row is still about two frames, not the whole file."""
    path = tmp_path / "five.extxyz"
    ase.io.write(path, water_frames(5))
    for frame in (1, 2, 4):
        spoil_coordinate(path, frame, "*********")
    out = tmp_path / "out"
    assert screen_locally([path], out) == (5, 2, 3, 0)
    rows = summary_rows(out)
    assert [r["status"] for r in rows] == ["ok", "failed", "failed", "ok", "failed"]
    assert [r["error"].split(":")[0] for r in rows if r["status"] == "failed"] == [
        f"cannot read frame {k} of {path}" for k in (1, 2, 4)
    ]


def test_a_file_that_cannot_be_read_apart_is_one_failure(tmp_path: Path) -> None:
    """A broken atom-count line spoils extxyz's frame index, and a single-structure format has
    no next frame: one row for the rest of the file, and the run ends."""
    bad_count = tmp_path / "bad_count.extxyz"
    ase.io.write(bad_count, water_frames(4))
    lines = bad_count.read_text().splitlines(keepends=True)
    lines[10] = "three\n"  # frame 2's atom count
    bad_count.write_text("".join(lines))
    bad_poscar = tmp_path / "POSCAR"
    bad_poscar.write_text("water\n1.0\n10 0 0\n0 10 0\n0 0 10\nO H\n1 two\nCartesian\n")
    out = tmp_path / "out"
    assert screen_locally([bad_count, bad_poscar], out) == (2, 0, 2, 0)
    rows = summary_rows(out)
    assert [r["id"] for r in rows] == [f"{bad_count}@0", f"{bad_poscar}@0"]
    assert rows[0]["error"].startswith(f"cannot read {bad_count} from frame 0 on: XYZError")
    assert rows[1]["error"].startswith(f"cannot read {bad_poscar} from frame 0 on")


@pytest.mark.parametrize("through", ["service", "in process"])
def test_a_rejected_structure_is_named_by_its_own_row(tmp_path: Path, through: str) -> None:
    """After a rejection the rest of the batch goes again, renumbered: a row's message must not
    carry a place in a batch (it used to read 'structure 2' for frame 3)."""
    water = small_molecule("H2O")
    uranium = Atoms("HU", positions=[[0, 0, 0], [2, 0, 0]])
    clash = water.copy()
    clash.positions[1] = clash.positions[0]
    path = tmp_path / "in.extxyz"
    ase.io.write(path, [water, uranium, water, clash, water])
    out = tmp_path / "out"
    potential = PairPotential(refuses_coincident_atoms=True)
    if through == "service":
        with running_server(create_app(ServiceSettings(), evaluator=potential)) as url:
            screen([path], ScreenOptions(output_dir=out, url=url, progress=False))
    else:
        screen([path], ScreenOptions(output_dir=out, progress=False), evaluator=potential)
    errors = {int(r["frame"]): r["error"] for r in summary_rows(out) if r["status"] == "failed"}
    assert set(errors) == {1, 3}
    assert "atoms 0 and 1 (image [0, 0, 0]) are coincident" in errors[3]
    assert "Z=92" in errors[1]
    for message in errors.values():
        assert re.search(r"structures?\W*\d", message) is None, message


def test_an_address_that_is_no_service_url_aborts(tmp_path: Path) -> None:
    path = tmp_path / "in.extxyz"
    ase.io.write(path, water_frames(1))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["screen", str(path), "--url", "localhost", "-o", str(out)])
    assert result.exit_code == 2, result.output
    assert "error: expected an http:// or https:// service URL, got 'localhost'" in result.output
    assert not out.exists()


def test_a_model_that_does_not_load_stops_before_any_output(tmp_path: Path) -> None:
    path = tmp_path / "in.extxyz"
    ase.io.write(path, water_frames(1))
    out = tmp_path / "out"
    missing = tmp_path / "missing.safetensors"
    result = CliRunner().invoke(app, ["screen", str(path), "--model", str(missing), "-o", str(out)])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and "missing.safetensors" in result.output
    assert "Traceback" not in result.output
    assert not out.exists()


def test_an_output_folder_that_is_a_file_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "in.extxyz"
    ase.io.write(path, water_frames(1))
    result = CliRunner().invoke(app, ["screen", str(path), "-o", str(path), "--no-progress"])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and "File exists" in result.output


def test_a_results_file_of_another_tool_is_left_alone(tmp_path: Path) -> None:
    """An output folder holding results.extxyz but no journal was not written by screen:
    resuming would cut every frame off, so the run stops and the file is kept."""
    path = tmp_path / "in.extxyz"
    ase.io.write(path, water_frames(1))
    out = tmp_path / "out"
    out.mkdir()
    theirs = out / RESULTS_FILE
    ase.io.write(theirs, water_frames(3))
    before = theirs.read_bytes()
    result = CliRunner().invoke(app, ["screen", str(path), "-o", str(out), "--no-progress"])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and JOURNAL_FILE in result.output
    assert theirs.read_bytes() == before


def test_input_metadata_is_carried_where_extxyz_holds_it(tmp_path: Path) -> None:
    """A structure's own info and per-atom arrays come along into results.extxyz unchanged,
    its reference energy/forces (in info, or stored by the reader) as ``input_<name>``. What
    ASE's extxyz writer would corrupt is left out: a key with a space or '=', an empty string,
    a backslash, a tab or line break (which made the whole results file unreadable), None, a
    dict. No structure fails for its metadata, so the structures after it are evaluated too (a
    reference ``energy`` used to abort the run)."""
    files = []
    for k in range(3):
        atoms = small_molecule("H2O", seed=k)
        if k == 1:
            atoms.info.update({
                "energy": -1.5, "free_energy": -1.25, "title": "water", "charge": 0,
                "tags_list": [1, 2, 3], "multi": "line one\nline two", "tabbed": "a\tb",
                "empty": "", "path": "C:\\data", "a b": 1, "k=v": 2, "none": None, "meta": {"x": 1},
                "source": "OC20-split-val", "frame": 7,
            })  # fmt: skip
            atoms.set_initial_charges(np.arange(len(atoms), dtype=float))
            atoms.calc = SinglePointCalculator(
                atoms, forces=np.ones((len(atoms), 3)), energies=np.full(len(atoms), 0.5)
            )
        files.append(tmp_path / f"frame{k}.traj")
        ase.io.write(files[-1], atoms)
    out = tmp_path / "out"
    report = screen(files, ScreenOptions(output_dir=out, progress=False), evaluator=PairPotential())
    assert (report.total, report.succeeded, report.failed) == (3, 3, 0)
    frames = {f.info["screen_id"]: f
              for f in ase.io.read(out / RESULTS_FILE, index=":")}  # fmt: skip
    carried = frames[f"{files[1]}@0"]
    ours = ("screen_id", "source", "frame", "model", "model_hash", "model_precision")
    assert [carried.info[k] for k in ours] == [f"{files[1]}@0", str(files[1]), 0, "pair-test",
                                               "sha256:" + "0" * 64, "fp64"]  # fmt: skip
    info = {k: v for k, v in carried.info.items() if k not in ours}
    assert set(info) == {"input_energy", "input_free_energy", "title", "charge", "tags_list",
                         "input_source", "input_frame"}  # fmt: skip
    assert (info["input_source"], info["input_frame"]) == ("OC20-split-val", 7)
    assert (info["input_energy"], info["input_free_energy"]) == (-1.5, -1.25)
    assert info["title"] == "water"
    np.testing.assert_array_equal(info["tags_list"], [1, 2, 3])
    np.testing.assert_array_equal(carried.arrays["input_forces"], 1.0)
    np.testing.assert_array_equal(carried.arrays["input_energies"], 0.5)
    np.testing.assert_array_equal(carried.arrays["initial_charges"], np.arange(len(carried)))
    assert carried.get_potential_energy() != -1.5
    assert all(isinstance(f.get_potential_energy(), float) for f in frames.values())


def test_a_path_given_twice_is_read_once(tmp_path: Path) -> None:
    """Overlapping globs name a file twice: its structures are evaluated and reported once
    (their ids would collide), and summary.csv, results.extxyz and the report agree."""
    path = tmp_path / "x.extxyz"
    ase.io.write(path, [small_molecule("H2O", seed=k) for k in range(3)])
    out = tmp_path / "out"
    options = ScreenOptions(output_dir=out, progress=False)
    report = screen([path, path], options, evaluator=PairPotential())
    assert (report.total, report.succeeded) == (3, 3)
    assert [r["id"] for r in summary_rows(out)] == [f"{path}@{k}" for k in range(3)]
    assert len(ase.io.read(out / RESULTS_FILE, index=":")) == 3


def test_the_first_batches_run_before_the_inputs_are_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "many.extxyz"
    total = 3 * READ_CHUNK
    ase.io.write(path, [small_molecule("H2O", seed=k) for k in range(total)])
    parsed = 0
    read_frames = screen_module._read_frames

    def counted(source: str) -> Iterator[object]:
        nonlocal parsed
        for entry in read_frames(source):
            parsed += 1
            yield entry

    class Probe(PairPotential):
        parsed_at_first_pass: int | None = None

        def predict(self, structures: Structures, properties: Collection[str]) -> Any:
            if self.parsed_at_first_pass is None:
                self.parsed_at_first_pass = parsed
            return super().predict(structures, properties)

    monkeypatch.setattr(screen_module, "_read_frames", counted)
    probe = Probe()
    options = ScreenOptions(output_dir=tmp_path / "out", progress=False, batch_structures=4)
    report = screen([path], options, evaluator=probe)
    assert (report.total, report.succeeded) == (total, total)
    assert probe.parsed_at_first_pass is not None and probe.parsed_at_first_pass < total


def test_an_aborted_resumed_run_writes_its_summary_in_input_order(tmp_path: Path) -> None:
    """A run that stops before it has read all of its inputs (here a key the service refuses)
    still writes summary.csv in input order, with the rows of earlier runs that it had not yet
    read again among the rest (the journal holds them in completion order: an unreadable frame
    is recorded while the frames before it are still being evaluated)."""
    earlier = tmp_path / "earlier.extxyz"
    ase.io.write(earlier, water_frames(3))
    spoil_coordinate(earlier, 2)
    out = tmp_path / "out"
    assert screen_locally([earlier], out) == (3, 2, 1, 0)
    new = tmp_path / "new.extxyz"
    ase.io.write(new, water_frames(12))
    settings = ServiceSettings(api_key=SecretStr("the-right-key"))
    with running_server(create_app(settings, evaluator=PairPotential())) as url:
        options = ScreenOptions(
            output_dir=out,
            url=url,
            api_key="a-wrong-key",
            concurrency=1,
            batch_structures=1,
            progress=False,
        )
        with pytest.raises(ScreenAborted):
            screen([new, earlier], options)
    assert [r["id"] for r in summary_rows(out)] == [f"{earlier}@{k}" for k in range(3)]
