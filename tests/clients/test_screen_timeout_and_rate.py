"""``so2serve screen`` as a chemist runs it on a slow (CPU) server: a batch that takes longer
than ``--timeout``, and the progress bar's rate and ETA when results arrive a batch at a time."""

from __future__ import annotations

import csv
from pathlib import Path

import ase.io
from rich.progress import Progress, ProgressColumn
from rich.text import Text

from clients import screen as screen_module
from clients.screen import SUMMARY_FILE, ScreenOptions, screen
from tests.clients.test_calculators import NO_ANSWER, scripted
from tests.service.fakes import small_molecule


def test_a_batch_without_an_answer_in_time_is_not_sent_again(tmp_path: Path) -> None:
    """It was sent 1 + retries times (each copy queued behind the one the server was still
    computing) and its structures recorded as ``unreachable`` with the message
    ``ReadTimeout: ``, although the server was reachable and only slow."""
    source = tmp_path / "in.extxyz"
    ase.io.write(source, [small_molecule("H2O", seed=k) for k in range(2)])
    out = tmp_path / "out"
    with scripted([NO_ANSWER]) as server:
        options = ScreenOptions(
            output_dir=out,
            url=server.url,
            concurrency=1,
            retries=3,
            backoff_s=0.01,
            timeout_s=0.3,
            progress=False,
        )
        report = screen([source], options)
        posts = server.attempts
    assert posts == 1
    assert (report.succeeded, report.failed) == (0, 2)
    with (out / SUMMARY_FILE).open() as f:
        rows = list(csv.DictReader(f))
    assert [r["error_code"] for r in rows] == ["timeout", "timeout"]
    assert all("0.3 s" in r["error"] and "--timeout" in r["error"] for r in rows)


def _shown(progress: Progress) -> str:
    """The progress line's text columns, as the terminal shows them."""
    task = progress.tasks[0]
    parts = [column(task) for column in progress.columns if isinstance(column, ProgressColumn)]
    return " ".join(part.plain for part in parts if isinstance(part, Text))


def test_rate_and_eta_are_the_runs_average_not_one_batchs_burst() -> None:
    """A batch's results are recorded within a millisecond; rich's own speed (over its recent
    samples) then showed thousands of structures per second and an ETA of zero: a 30-structure
    CPU screen that took 15 s ended on '2623.8 structures/s'."""
    now = [0.0]
    progress = screen_module._progress(enabled=True)
    progress.get_time = lambda: now[0]
    task = progress.add_task("screen", total=128, failed=0)
    now[0] = 10.0  # the first batch of 64 comes back after 10 s, all at once
    for _ in range(64):
        progress.update(task, advance=1, failed=0)
        now[0] += 1e-5
    line = _shown(progress)
    assert "6.4 structures/s" in line, line
    assert "ETA 0:00:10" in line, line
