"""What keeps a screening run's outputs trustworthy when its surroundings go wrong: a service
that stays unavailable, a second run into the same folder, a resumed run against another
model, an ``http_proxy`` in the environment, a log file instead of a terminal; and the summary's
max force on constrained structures."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import ase.io
import numpy as np
import pytest
from ase.constraints import FixAtoms
from rich.console import Console

from clients import screen as screen_module
from clients.screen import (
    JOURNAL_FILE,
    SUMMARY_FILE,
    ScreenAborted,
    ScreenOptions,
    _ResultStore,
    screen,
)
from service.api import ServiceSettings, create_app
from tests.clients.test_calculators import scripted
from tests.service.fakes import FakeExecution, PairPotential, running_server, small_molecule


def _waters(path: Path, count: int) -> Path:
    ase.io.write(path, [small_molecule("H2O", seed=k) for k in range(count)])
    return path


BAD_GATEWAY = (502, {"code": "bad_gateway", "message": "upstream restarting"}, {})


def test_a_service_unavailable_through_every_retry_aborts_and_journals_nothing(
    tmp_path: Path,
) -> None:
    # A proxy answering 502 while the service restarts is no structure's fault: journalled as
    # failed, every structure was skipped on the rerun (only --retry-failed brought them back,
    # with the structures that really failed).
    source = _waters(tmp_path / "in.extxyz", 3)
    out = tmp_path / "out"
    with scripted([BAD_GATEWAY]) as server:
        options = ScreenOptions(
            output_dir=out, url=server.url, retries=2, backoff_s=0.01, progress=False
        )
        with pytest.raises(ScreenAborted, match=r"502.*after 2 retries.*resume"):
            screen([source], options)
    assert (out / JOURNAL_FILE).read_text() == ""
    with running_server(create_app(ServiceSettings(), evaluator=PairPotential())) as url:
        report = screen([source], ScreenOptions(output_dir=out, url=url, progress=False))
    assert (report.succeeded, report.skipped, report.failed) == (3, 0, 0)


def test_a_second_run_into_the_same_folder_is_refused(tmp_path: Path) -> None:
    first = _ResultStore(tmp_path / "out")
    try:
        with pytest.raises(ScreenAborted, match="another so2serve screen is writing to"):
            _ResultStore(tmp_path / "out")
    finally:
        first.close()
    _ResultStore(tmp_path / "out").close()  # free again once the first run ends


class _Retrained(PairPotential):
    def info(self) -> dict[str, Any]:
        return {**super().info(), "name": "pair-retrained", "sha256": "1" * 64}


def test_a_run_resumed_against_another_model_stops_before_mixing_results(
    tmp_path: Path,
) -> None:
    source = _waters(tmp_path / "in.extxyz", 4)
    out = tmp_path / "out"
    options = ScreenOptions(output_dir=out, progress=False)
    screen([source], options, evaluator=PairPotential())
    journal = [json.loads(line) for line in (out / JOURNAL_FILE).read_text().splitlines()]
    assert {e["model"]["name"] for e in journal} == {"pair-test"}
    more = _waters(tmp_path / "more.extxyz", 2)
    label = r"model pair-test \(sha256 000000000000, precision fp64\)"
    with pytest.raises(ScreenAborted, match=label + r".*pair-retrained \(sha256 111111111111"):
        screen([source, more], options, evaluator=_Retrained())
    assert len((out / JOURNAL_FILE).read_text().splitlines()) == 4
    report = screen([source, more], options, evaluator=PairPotential())
    assert (report.succeeded, report.skipped) == (2, 4)


def test_an_http_proxy_in_the_environment_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Even 127.0.0.1 went to the proxy (httpx's default), as the calculator's requests do not.
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # the discard port: nobody answers
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    source = _waters(tmp_path / "in.extxyz", 2)
    with running_server(create_app(ServiceSettings(), evaluator=PairPotential())) as url:
        options = ScreenOptions(output_dir=tmp_path / "out", url=url, retries=0, progress=False)
        assert screen([source], options).succeeded == 2


def test_a_log_file_gets_progress_lines_while_the_run_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # rich draws its bar into a non-terminal once, at the end: a batch job's log stayed empty.
    log = io.StringIO()
    to_log = Console(file=log, force_terminal=False, width=200)
    monkeypatch.setattr(screen_module, "Console", lambda **_: to_log)
    monkeypatch.setattr(screen_module, "PLAIN_PROGRESS_S", 0.05)
    source = _waters(tmp_path / "in.extxyz", 6)
    options = ScreenOptions(output_dir=tmp_path / "out", batch_structures=1, concurrency=1)
    screen([source], options, evaluator=PairPotential(delay_s=0.1))
    lines = [line for line in log.getvalue().splitlines() if line.startswith("screening: ")]
    assert lines, log.getvalue()
    assert all(" failed" in line and "ETA" in line for line in lines)
    assert any("/6 done" in line for line in lines)


def test_the_summary_max_force_leaves_out_fixed_atoms(tmp_path: Path) -> None:
    # As ASE's optimisers measure fmax: on a slab with a fixed bottom layer the fixed atoms'
    # forces dominated the column.
    atoms = small_molecule("CH3OH", seed=3)
    atoms.set_constraint(FixAtoms(indices=[0, 1]))
    source = tmp_path / "in.traj"
    ase.io.write(source, atoms)
    out = tmp_path / "out"
    screen([source], ScreenOptions(output_dir=out, progress=False), evaluator=PairPotential())
    forces = ase.io.read(out / "results.extxyz").get_forces(apply_constraint=False)
    with (out / SUMMARY_FILE).open() as f:
        (row,) = csv.DictReader(f)
    free = np.linalg.norm(forces[2:], axis=1).max()
    assert float(row["fmax_eV_per_A"]) == pytest.approx(free, rel=1e-6)
    assert np.linalg.norm(forces[:2], axis=1).max() > free  # the fixed atoms would have won


def test_a_broken_device_aborts_an_in_process_run_resumably(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Journalled per structure, a GPU that broke down would have failed every structure left.
    from service.engine import Worker
    from tests.service.test_engine_device_faults import IllegalAddress

    monkeypatch.setattr(Worker, "_device_responds", lambda self: False)
    source = _waters(tmp_path / "in.extxyz", 3)
    out = tmp_path / "out"
    with pytest.raises(ScreenAborted, match=r"device cpu failed.*resume"):
        screen([source], ScreenOptions(output_dir=out, progress=False), evaluator=IllegalAddress())
    assert (out / JOURNAL_FILE).read_text() == ""


def test_a_folder_on_a_file_system_without_locks_is_screened_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Lustre mounted noflock or NFSv3 without lockd answer ENOLCK/ENOSYS: the run never began.
    import errno
    import fcntl

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    source = _waters(tmp_path / "in.extxyz", 2)
    with pytest.warns(RuntimeWarning, match="takes no file locks"):
        report = screen(
            [source], ScreenOptions(output_dir=tmp_path / "out", progress=False),
            evaluator=PairPotential(),
        )  # fmt: skip
    assert report.succeeded == 2


def test_a_refused_folder_is_not_left_locked(tmp_path: Path) -> None:
    # The exception may outlive the call (a notebook keeps the last one): the folder stayed
    # locked behind it after the user had moved the foreign file away.
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.extxyz").write_text("someone else's frames\n")
    with pytest.raises(ScreenAborted, match="not written by so2serve screen") as refused:
        _ResultStore(out)
    (out / "results.extxyz").rename(tmp_path / "moved.extxyz")
    _ResultStore(out).close()
    del refused


def test_a_run_resumed_at_another_precision_stops_before_mixing_results(tmp_path: Path) -> None:
    # fp64 answers differ from fp32 ones in their last digits: one folder holds one precision.
    source = _waters(tmp_path / "in.extxyz", 2)
    options = ScreenOptions(output_dir=tmp_path / "out", progress=False)
    screen([source], options, evaluator=PairPotential())
    fp32 = PairPotential(execution=FakeExecution(precision="fp32"))
    more = _waters(tmp_path / "more.extxyz", 2)
    with pytest.raises(ScreenAborted, match=r"precision fp64\).*precision fp32\)"):
        screen([source, more], options, evaluator=fp32)
    report = screen([source, more], options, evaluator=PairPotential())
    assert (report.succeeded, report.skipped) == (2, 2)


class _SameModelRenamed(PairPotential):
    def info(self) -> dict[str, Any]:  # the same file staged under another name
        return {**super().info(), "name": "pair-test-copy"}


def test_a_resume_with_the_same_model_under_another_name_goes_on(tmp_path: Path) -> None:
    source = _waters(tmp_path / "in.extxyz", 2)
    more = _waters(tmp_path / "more.extxyz", 2)
    options = ScreenOptions(output_dir=tmp_path / "out", progress=False)
    screen([source], options, evaluator=PairPotential())
    report = screen([source, more], options, evaluator=_SameModelRenamed())
    assert (report.succeeded, report.skipped) == (2, 2)
