"""``so2serve train`` / ``so2serve eval`` stopped by what the user cannot fix in the config:
Ctrl-C, the GPU out of memory, a full disk, a Triton kernel that does not compile. One line
that says what to do (whether ``--resume`` has a checkpoint to continue from), a non-zero exit
code (130 = 128 + SIGINT for Ctrl-C), no traceback."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
from triton.runtime.errors import OutOfResources
from typer.testing import CliRunner

from service.cli import app
from service.model.errors import HostMemoryError
from service.training.config import CHECKPOINT_NAME, TrainConfig
from tests.training.synthetic import tiny_run_config_file, write_water_system


def _one_error_line(args: list[str], code: int) -> str:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == code and isinstance(result.exception, SystemExit), result.output
    assert result.output.startswith("error: ") and result.output.count("\n") == 1, result.output
    return result.output


def failed_train(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException, code: int = 2
) -> str:
    """The output of ``so2serve train`` when ``error`` is raised during the training."""

    def fail(config: TrainConfig) -> None:
        raise error

    monkeypatch.setattr("service.training.loop.train", fail)
    config = tiny_run_config_file(tmp_path, write_water_system(tmp_path / "sys", 4))
    return _one_error_line(["train", str(config)], code)


def test_train_interrupted_after_a_checkpoint_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / CHECKPOINT_NAME).write_bytes(b"")
    output = failed_train(tmp_path, monkeypatch, KeyboardInterrupt(), code=130)
    assert output.startswith("error: interrupted")
    assert "--resume" in output and str(tmp_path / "run" / CHECKPOINT_NAME) in output


def test_train_interrupted_before_any_checkpoint_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    output = failed_train(tmp_path, monkeypatch, KeyboardInterrupt(), code=130)
    assert output.startswith("error: interrupted")
    assert "no checkpoint" in output and "--resume" not in output


CUDA_OOM = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
DISK_FULL = OSError(errno.ENOSPC, "No space left on device", "run/checkpoint.pt.tmp")
HOST_FULL = HostMemoryError("evaluating 9,000,000 edges on the CPU needs about 150.0 GiB")
# Triton's errors derive from triton.errors.TritonError, not from RuntimeError or ValueError.
NO_SHARED_MEMORY = OutOfResources(98304, 65536, "shared memory")


@pytest.mark.parametrize(
    ("error", "fragments"),
    [
        (CUDA_OOM, ("out of GPU memory: lower data.batch_size (now 1)", "then resume")),
        (HOST_FULL, ("150.0 GiB", ": lower data.batch_size (now 1)", "then resume")),
        (DISK_FULL, ("No space left on device", "no checkpoint")),
        (NO_SHARED_MEMORY, ("run.path=reference", "OutOfResources", "shared memory")),
    ],
)
def test_train_stopped_by_the_machine_is_one_error_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    error: BaseException,
    fragments: tuple[str, ...],
) -> None:
    output = failed_train(tmp_path, monkeypatch, error)
    assert all(fragment in output for fragment in fragments), output


@pytest.mark.parametrize(
    ("error", "fragments"),
    [
        (CUDA_OOM, ("out of GPU memory: lower --batch-size (now 8)",)),
        (HOST_FULL, ("150.0 GiB", ": lower --batch-size (now 8)")),
        (DISK_FULL, ("No space left on device",)),
        (NO_SHARED_MEMORY, ("--path reference", "shared memory")),
    ],
)
def test_eval_stopped_by_the_machine_is_one_error_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    error: BaseException,
    fragments: tuple[str, ...],
) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr("service.training.evaluate.evaluate_model", fail)
    output = _one_error_line(["eval", "default", str(tmp_path)], 2)
    assert all(fragment in output for fragment in fragments), output
