"""``so2serve train`` stopped with Ctrl-C: one line that says whether ``--resume`` has a
checkpoint to continue from, exit code 130 (128 + SIGINT), no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from service.cli import app
from service.training.config import CHECKPOINT_NAME, TrainConfig
from tests.training.synthetic import tiny_run_config_file, write_water_system


def interrupted_train(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The output of ``so2serve train`` when Ctrl-C lands during the training."""

    def ctrl_c(config: TrainConfig) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("service.training.loop.train", ctrl_c)
    config = tiny_run_config_file(tmp_path, write_water_system(tmp_path / "sys", 4))
    result = CliRunner().invoke(app, ["train", str(config)])
    assert result.exit_code == 130 and isinstance(result.exception, SystemExit), result.output
    assert result.output.startswith("error: interrupted") and result.output.count("\n") == 1
    return result.output


def test_train_interrupted_after_a_checkpoint_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / CHECKPOINT_NAME).write_bytes(b"")
    output = interrupted_train(tmp_path, monkeypatch)
    assert "--resume" in output and str(tmp_path / "run" / CHECKPOINT_NAME) in output


def test_train_interrupted_before_any_checkpoint_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    output = interrupted_train(tmp_path, monkeypatch)
    assert "no checkpoint" in output and "--resume" not in output
