"""``so2serve train`` / ``so2serve eval``: unusable input ends in ``error: ...`` and exit code 2.

No traceback for anything the user can fix: a bad config value, a missing model file, data that
changed under a checkpoint, a bad batch size, an output path that cannot be written (checked
before any work is done).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from service.cli import app
from service.training.config import load_config
from service.training.loop import Trainer, build_model, prepare_data
from service.training.state import save_checkpoint
from tests.training.synthetic import tiny_run_config_file, truncate_sets, write_water_system


def _cli(*args: str) -> tuple[int, str, BaseException | None]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output, result.exception


def _assert_clean_error(code: int, output: str, exception: BaseException | None) -> None:
    assert code == 2 and isinstance(exception, SystemExit), f"{exception!r}\n{output}"
    assert "error" in output.lower() and "Traceback" not in output, output


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ('run.device="gpu"', "run.device"),
        ('run.device="cuda:99"', "run.device"),  # no such device here (CPU-only or fewer GPUs)
        ('model.init_from="/nonexistent/model.safetensors"', "/nonexistent/model.safetensors"),
        ("model.overrides.no_such_field=3", "no_such_field"),
        ("optim.betas=[1.5, 0.999]", "optim.betas"),
    ],
)
def test_train_bad_config_is_a_clean_error(tmp_path: Path, override: str, fragment: str) -> None:
    """A config the training cannot use names the offending key or file, exit code 2."""
    system = write_water_system(tmp_path / "sys", 4)
    config = tiny_run_config_file(tmp_path, system)
    code, output, exception = _cli("train", str(config), "--set", override)
    _assert_clean_error(code, output, exception)
    assert fragment in output


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        # An architecture outside the fused kernels' regime on the fused path (found once the
        # model is placed, after the data loaded).
        (('run.path="fused"', "model.overrides.mixing_layers=1"), "fused"),
        # A diverging run: the loss turns NaN at its second step.
        (("optim.lr=1e30", "optim.clip_norm=0"), "lower optim.lr"),
    ],
)
def test_train_failures_found_while_training_are_clean_errors(
    tmp_path: Path, overrides: tuple[str, ...], fragment: str
) -> None:
    system = write_water_system(tmp_path / "sys", 4)
    config = tiny_run_config_file(tmp_path, system)
    sets = [arg for override in overrides for arg in ("--set", override)]
    code, output, exception = _cli("train", str(config), *sets)
    _assert_clean_error(code, output, exception)
    assert fragment in output


def test_train_on_an_empty_set_is_a_clean_error(tmp_path: Path) -> None:
    """A set with 0 frames is reported with its file name, exit code 2."""
    system = write_water_system(tmp_path / "sys", 2)
    truncate_sets(system, 0)
    code, output, exception = _cli("train", str(tiny_run_config_file(tmp_path, system)))
    _assert_clean_error(code, output, exception)
    assert "coord.npy" in output


def test_train_resume_after_the_data_changed_is_a_clean_error(tmp_path: Path) -> None:
    """``--resume`` on a data set that lost frames says the frame counts differ, exit code 2."""
    system = write_water_system(tmp_path / "sys", 5)
    config_path = tiny_run_config_file(tmp_path, system)
    config = load_config(config_path)
    data = prepare_data(config.data)
    trainer = Trainer(config, data, build_model(config, data.type_map))
    (tmp_path / "run").mkdir()
    save_checkpoint(tmp_path / "run" / "checkpoint.pt", trainer.state_dict())
    truncate_sets(system, 4)
    code, output, exception = _cli("train", str(config_path), "--resume")
    _assert_clean_error(code, output, exception)
    assert "cannot resume" in output and "training frames" in output


def test_train_unusable_output_dir_is_a_clean_error(tmp_path: Path) -> None:
    """``-o`` below a regular file fails before the data is loaded, naming run.output_dir."""
    system = write_water_system(tmp_path / "sys", 4)
    config = tiny_run_config_file(tmp_path, system)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    code, output, exception = _cli("train", str(config), "-o", str(blocker / "run"))
    _assert_clean_error(code, output, exception)
    assert "run.output_dir" in output


@pytest.mark.parametrize(
    ("export_path", "fragment"),
    [("folder", "it is a folder"), ("newdir/", "ends with a path separator")],
)
def test_train_unusable_export_path_is_refused_up_front(
    tmp_path: Path, export_path: str, fragment: str
) -> None:
    """An export_path that is a folder (IsADirectoryError after the whole run) or ends with a
    separator (a file named like the folder) is refused before any data is loaded."""
    (tmp_path / "folder").mkdir()
    config = tiny_run_config_file(tmp_path, tmp_path / "no_data_needed")
    target = f"{tmp_path}/{export_path}"
    code, output, exception = _cli("train", str(config), "--set", f"run.export_path='{target}'")
    _assert_clean_error(code, output, exception)
    assert "run.export_path" in output and fragment in output


def test_a_fresh_run_refuses_a_folder_holding_a_run(tmp_path: Path) -> None:
    """Without --resume, a second ``so2serve train`` into the same folder would truncate its
    logs and replace its checkpoint and model: refused, saying how to continue instead."""
    config = tiny_run_config_file(tmp_path, write_water_system(tmp_path / "sys", 4))
    code, output, _ = _cli("train", str(config))
    assert code == 0, output
    log_csv = (tmp_path / "run" / "log.csv").read_text()
    code, output, exception = _cli("train", str(config))
    _assert_clean_error(code, output, exception)
    assert "holds a run (checkpoint.pt at step 2)" in output and "--resume" in output
    assert (tmp_path / "run" / "log.csv").read_text() == log_csv


@pytest.mark.parametrize("batch_size", ["0", "-1"])
def test_eval_rejects_a_non_positive_batch_size(tmp_path: Path, batch_size: str) -> None:
    """``--batch-size`` must be ≥ 1 (exit code 2, the option named)."""
    system = write_water_system(tmp_path / "sys", 2, molecules=3, periodic=True)
    code, output, _ = _cli("eval", "default", str(system), "--device", "cpu",
                           "--batch-size", batch_size)  # fmt: skip
    assert code == 2, output
    assert "batch-size" in output, output


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_eval_unwritable_output_is_a_clean_error(tmp_path: Path, option: str) -> None:
    """``--json``/``--plot`` below a regular file fail before anything is evaluated."""
    system = write_water_system(tmp_path / "sys", 1, molecules=3, periodic=True)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    target = str(blocker / "out")
    code, output, exception = _cli(
        "eval", "default", str(system), "--device", "cpu", option, target
    )
    _assert_clean_error(code, output, exception)
    assert target in output


def test_eval_of_a_model_predicting_nan_is_a_clean_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A NaN energy used to read as a missing label: ``"rmse": null`` and exit code 0."""
    from service.model.potential import Potential

    predict = Potential.predict

    def broken(self: Potential, *args: Any, **kwargs: Any) -> Any:
        prediction = predict(self, *args, **kwargs)
        return dataclasses.replace(prediction, energy=prediction.energy * math.nan)

    monkeypatch.setattr(Potential, "predict", broken)
    system = write_water_system(tmp_path / "sys", 2, molecules=3, periodic=True)
    code, output, exception = _cli("eval", "default", str(system), "--device", "cpu")
    _assert_clean_error(code, output, exception)
    assert "non-finite energy" in output


def test_eval_plot_without_matplotlib_is_refused_up_front(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """matplotlib is the ``plot`` extra: without it --plot is refused before any evaluation."""
    import service.training.evaluate as evaluate
    from service.model.potential import Potential

    def never_called(self: Potential, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("evaluated before the plot was refused")

    monkeypatch.setattr(evaluate, "can_plot", lambda: False)
    monkeypatch.setattr(Potential, "predict", never_called)
    system = write_water_system(tmp_path / "sys", 2, molecules=3, periodic=True)
    code, output, exception = _cli("eval", "default", str(system), "--device", "cpu",
                                   "--plot", str(tmp_path / "parity.png"))  # fmt: skip
    _assert_clean_error(code, output, exception)
    assert "so2serve[plot]" in output


def test_eval_plot_path_must_be_png(tmp_path: Path) -> None:
    """Refused before any evaluation (it failed after the whole run, in matplotlib)."""
    system = write_water_system(tmp_path / "sys", 2, molecules=3, periodic=True)
    code, output, exception = _cli("eval", "default", str(system), "--device", "cpu",
                                   "--plot", str(tmp_path / "parity.xyz"))  # fmt: skip
    _assert_clean_error(code, output, exception)
    assert ".png" in output
