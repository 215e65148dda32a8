"""Typer-ready commands for ``so2serve train`` and ``so2serve eval``.

Both are plain functions whose parameters carry their typer metadata, so ``service/cli.py``
registers each in one line: ``app.command("train")(train_command)``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated

import typer

from service.cli_output import cli_fail
from service.model.errors import HostMemoryError, ModelFileError
from service.training.config import (
    CHECKPOINT_NAME,
    ConfigError,
    TrainConfig,
    TrainResult,
    load_config,
)

# The training loop, data and evaluation import torch (seconds): the commands that run them
# import them, so that every other ``so2serve`` command starts fast.

__all__ = ["eval_command", "train_command"]


def _configure_logging(verbose: bool) -> None:
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("so2serve").setLevel(logging.DEBUG if verbose else logging.INFO)


def train_command(
    config: Annotated[Path, typer.Argument(help="Training config (TOML or JSON).")],
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="Override a config key, TOML value: --set run.steps=2000 --set optim.lr=5e-4",
        ),
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue from the run's checkpoint if present.")
    ] = False,
    output_dir: Annotated[
        Path | None, typer.Option("--output-dir", "-o", help="Overrides run.output_dir.")
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> TrainResult:
    """Train a model as the config says; writes the model file, checkpoint and logs."""
    import torch
    from triton.errors import TritonError

    from service.training.loop import train
    from service.training.metrics import finite_or_none

    _configure_logging(verbose)
    overrides = list(set_ or [])
    if resume:
        overrides.append("run.resume=true")
    if output_dir is not None:
        overrides.append(f"run.output_dir={json.dumps(str(output_dir))}")
    try:
        run_config = load_config(config, overrides)
    except ConfigError as exc:
        raise cli_fail(str(exc)) from exc
    try:
        result = train(run_config)
    except FloatingPointError as exc:
        raise cli_fail(f"{exc}; lower optim.lr (or set optim.clip_norm), then resume from "
                       f"the last checkpoint: {_resumable(run_config)}") from exc  # fmt: skip
    except torch.OutOfMemoryError as exc:
        data = run_config.data
        advice = (
            f"out of GPU memory: lower data.batch_size (now {data.batch_size}) or "
            f"data.valid_batch_size (now {data.valid_batch_size}), then resume; "
            f"{_resumable(run_config)}"
        )
        raise cli_fail(_with_detail(advice, exc)) from exc
    except HostMemoryError as exc:
        data = run_config.data
        advice = (
            f"{exc}: lower data.batch_size (now {data.batch_size}) or data.valid_batch_size "
            f"(now {data.valid_batch_size}), then resume; {_resumable(run_config)}"
        )
        raise cli_fail(advice) from exc
    except TritonError as exc:
        advice = "the fused path's Triton kernels failed: --set run.path=reference avoids them"
        raise cli_fail(_with_detail(f"{advice}; {_resumable(run_config)}", exc)) from exc
    # A full disk or a file system gone away, while writing checkpoints, logs or the model.
    except OSError as exc:
        raise cli_fail(f"{exc}; {_resumable(run_config)}") from exc
    # ConfigError, DataError, ModelConfigError, ModelFileError, and a model architecture the
    # chosen run.path cannot run: all ValueErrors.
    except ValueError as exc:
        raise cli_fail(str(exc)) from exc
    except KeyboardInterrupt:  # 128 + SIGINT, as a shell reports it
        raise cli_fail(f"interrupted; {_resumable(run_config)}", code=130) from None
    typer.echo(
        json.dumps(
            {
                "model": str(result.model_path),
                "finished": result.finished,
                "steps": result.steps,
                "exported_step": result.exported_step,
                "wall_s": round(result.wall_s, 1),
                "execution": result.execution,
                "validation": finite_or_none(result.validation),
                "log": str(result.log_csv),
            },
            indent=2,
        )
    )
    return result


def _with_detail(advice: str, exc: BaseException) -> str:
    """The advice, then the exception's own message: long ones (CUDA's, Triton's) are cut short
    by ``cli_fail``, and the advice must survive that."""
    return f"{advice} ({type(exc).__name__}: {exc})"


def _resumable(config: TrainConfig) -> str:
    """What ``--resume`` would continue from after an interrupted run."""
    checkpoint = Path(config.run.output_dir) / CHECKPOINT_NAME
    if checkpoint.is_file():
        return f"--resume continues from {checkpoint}"
    return f"no checkpoint in {checkpoint.parent} yet (one every run.checkpoint_every steps)"


def eval_command(
    model: Annotated[
        str, typer.Argument(help="Model file (.safetensors), or 'default' for the shipped model.")
    ],
    data: Annotated[
        list[Path], typer.Argument(help="DeePMD systems / folders of systems / ASE files.")
    ],
    json_output: Annotated[
        Path | None, typer.Option("--json", help="Write the report as JSON here.")
    ] = None,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="Write energy/force parity plots (PNG) here.")
    ] = None,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda | cuda:N")] = "auto",
    path: Annotated[str, typer.Option(help="Execution path: auto | fused | reference")] = "auto",
    precision: Annotated[
        str, typer.Option(help="fp32 | fp64 (reference path) | fp16x3 (fused stack tier)")
    ] = "fp32",
    batch_size: Annotated[int, typer.Option(min=1, help="Frames per evaluation batch.")] = 8,
    type_map: Annotated[
        list[str] | None,
        typer.Option(
            "--type-map",
            help="Element symbols in type-index order for DeePMD systems without type_map.raw: "
            "--type-map O,H (or --type-map O --type-map H). Default: the model's type map.",
        ),
    ] = None,
) -> None:
    """Energy/force/virial RMSE and MAE per system and overall (+ parity plot, JSON)."""
    import torch
    from triton.errors import TritonError

    from service.training.data import DataError
    from service.training.evaluate import evaluate_model

    _configure_logging(False)
    try:
        report = evaluate_model(
            None if model == "default" else Path(model),
            data,
            device=device,
            path=path,
            precision=precision,
            batch_size=batch_size,
            parity_plot=plot,
            json_output=json_output,
            type_map=None if type_map is None else _split_symbols(type_map),
        )
    except torch.OutOfMemoryError as exc:
        advice = f"out of GPU memory: lower --batch-size (now {batch_size})"
        raise cli_fail(_with_detail(advice, exc)) from exc
    except HostMemoryError as exc:
        raise cli_fail(f"{exc}: lower --batch-size (now {batch_size})") from exc
    except TritonError as exc:
        advice = "the fused path's Triton kernels failed: --path reference avoids them"
        raise cli_fail(_with_detail(advice, exc)) from exc
    except (DataError, ModelFileError, ValueError, OSError) as exc:
        raise cli_fail(str(exc)) from exc
    typer.echo(report.to_json())


def _split_symbols(values: list[str]) -> list[str]:
    """``["O,H", "C"]`` → ``["O", "H", "C"]``: the option may be repeated or comma-separated."""
    return [symbol.strip() for value in values for symbol in value.split(",") if symbol.strip()]
