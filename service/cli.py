"""The ``so2serve`` command line: one typer app, each command a thin wrapper over a module."""

from __future__ import annotations

import errno
import math
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import orjson
import typer
from pydantic import ValidationError
from pydantic_core import ErrorDetails
from rich.markup import escape

from service.cli_output import cli_fail, stderr_console

if TYPE_CHECKING:
    from service.api.settings import ServiceSettings
    from service.engine import Evaluator

app = typer.Typer(
    name="so2serve",
    help="GPU-resident calculator service for an SO(2)-convolution interatomic potential.",
    no_args_is_help=True,
    add_completion=False,
)


def _positive(value: float) -> float:
    if not 0 < value < math.inf:  # nan too
        raise typer.BadParameter(f"must be a number above 0, got {value}")
    return value


def _print_json(document: Any) -> None:
    typer.echo(orjson.dumps(document, option=orjson.OPT_INDENT_2, default=str).decode())


@app.command()
def serve(
    model: Annotated[
        Path | None, typer.Option(help="model file (default the shipped model)")
    ] = None,
    device: Annotated[
        str | None,
        typer.Option(help="auto | cpu | cuda | cuda:N | cuda:all | cuda:0,cuda:1,... (one queue)"),
    ] = None,
    execution: Annotated[
        str | None, typer.Option("--path", help="auto | fused | reference value path")
    ] = None,
    precision: Annotated[
        str | None,
        typer.Option(help="fp32 (default) | fp64 (reference) | fp16x3 (fast stack GEMMs, fused)"),
    ] = None,
    host: Annotated[
        str | None, typer.Option(help="address to listen on (default 127.0.0.1)")
    ] = None,
    port: Annotated[int | None, typer.Option(help="TCP port (default 8000)")] = None,
    api_key: Annotated[
        str | None, typer.Option(help="require this key (X-API-Key or Bearer); or SO2SERVE_API_KEY")
    ] = None,
    insecure: Annotated[
        bool, typer.Option("--insecure", help="allow a non-loopback host without an API key")
    ] = False,
    max_atoms: Annotated[int | None, typer.Option(help="atoms per structure; above → 413")] = None,
    max_request_atoms: Annotated[
        int | None, typer.Option(help="atoms of all structures of one request; above → 413")
    ] = None,
    max_batch_atoms: Annotated[int | None, typer.Option(help="atom budget per device pass")] = None,
    max_batch_edges: Annotated[int | None, typer.Option(help="edge budget per device pass")] = None,
    batch_window_ms: Annotated[
        float | None, typer.Option(help="longest wait to fill a batch")
    ] = None,
    max_queue: Annotated[int | None, typer.Option(help="queued requests; above → 503")] = None,
    inline_max_atoms: Annotated[
        int | None,
        typer.Option(help="largest lone request run on the event loop (0: always the worker)"),
    ] = None,
    max_body_mb: Annotated[float | None, typer.Option(help="largest request body")] = None,
    no_warm_up: Annotated[bool, typer.Option("--no-warm-up", help="skip the warm-up pass")] = False,
    log_level: Annotated[
        str | None, typer.Option(help="critical, error, warning, info (default), debug")
    ] = None,
) -> None:
    """Serve the model over HTTP (settings: flags > SO2SERVE_* environment > defaults)."""
    from service.api.app import serve as run_service
    from service.api.settings import ServiceSettings

    given: dict[str, Any] = {
        "model": model,
        "device": device,
        "execution": execution,
        "precision": precision,
        "host": host,
        "port": port,
        "api_key": api_key,
        "max_atoms": max_atoms,
        "max_request_atoms": max_request_atoms,
        "max_batch_atoms": max_batch_atoms,
        "max_batch_edges": max_batch_edges,
        "batch_window_ms": batch_window_ms,
        "max_queue": max_queue,
        "inline_max_atoms": inline_max_atoms,
        "max_body_mb": max_body_mb,
        "log_level": log_level,
        "insecure": insecure or None,
        "warm_up": False if no_warm_up else None,
    }
    flags = {k: v for k, v in given.items() if v is not None}
    try:
        settings = ServiceSettings(**flags)
    except ValidationError as exc:
        raise cli_fail("; ".join(_setting_problem(e, flags) for e in exc.errors())) from None
    _check_can_listen(settings.host, settings.port)  # before the model loads and warms up
    run_service(settings, _load_models(settings))


_FLAG_NAMES = {"execution": "--path", "warm_up": "--no-warm-up"}


def _setting_problem(error: ErrorDetails, flags: dict[str, Any]) -> str:
    """One pydantic error about a setting, named the way the user gave it: the flag, or the
    ``SO2SERVE_*`` variable with its value (else nothing says which of the two is wrong)."""
    message = str(error["msg"]).removeprefix("Value error, ")
    if not error["loc"]:  # a check across settings: its message names them
        return message
    field = str(error["loc"][0])
    if field in flags:
        return f"{_FLAG_NAMES.get(field, '--' + field.replace('_', '-'))}: {message}"
    value = "" if field == "api_key" else f"={error['input']!r}"  # a secret stays off logs
    return f"SO2SERVE_{field.upper()}{value}: {message}"


def _load_models(settings: ServiceSettings) -> list[Evaluator]:
    """The model on each device, or the reason it cannot be (a file that is no model, a device
    this machine lacks, a precision or path the model cannot run) as a one-line error."""
    from service.api.app import load_evaluators
    from service.model.errors import ModelFileError

    try:
        return load_evaluators(settings)
    except (ModelFileError, ValueError) as exc:
        raise cli_fail(str(exc)) from None


def _check_can_listen(host: str, port: int) -> None:
    """Refuse a port in use (or a host that is no address here) before the model loads and
    warms up, as uvicorn would only after that: bind each address as asyncio's server does
    (SO_REUSEADDR, IPv6 sockets v6-only), then let go."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in addresses:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                try:
                    probe.bind(address)
                except OSError as exc:
                    if exc.errno != errno.EADDRNOTAVAIL:  # asyncio skips a disabled family
                        raise
    except OSError as exc:
        reason = "address already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
        raise cli_fail(f"cannot listen on {host}:{port}: {reason or exc}") from None


@app.command()
def screen(
    inputs: Annotated[
        list[Path],
        typer.Argument(exists=True, dir_okay=False, help="structure files (any ASE format)"),
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="output folder")] = Path("screen-out"),
    url: Annotated[str | None, typer.Option(help="service URL; without it: in process")] = None,
    model: Annotated[
        Path | None, typer.Option(help="in process: model file (default shipped)")
    ] = None,
    api_key: Annotated[str | None, typer.Option(envvar="SO2SERVE_API_KEY")] = None,
    device: Annotated[
        str, typer.Option(help="in process: auto | cpu | cuda[:N] | cuda:all | cuda:0,cuda:1,...")
    ] = "auto",
    concurrency: Annotated[int, typer.Option(min=1, help="requests in flight")] = 4,
    batch_atoms: Annotated[int, typer.Option(min=1, help="atoms per request")] = 4096,
    batch_structures: Annotated[int, typer.Option(min=1, help="structures per request")] = 64,
    retries: Annotated[int, typer.Option(min=0, help="retries of transient failures")] = 4,
    timeout: Annotated[float, typer.Option(callback=_positive, help="seconds per request")] = 600.0,
    retry_failed: Annotated[
        bool, typer.Option(help="re-run structures that failed before")
    ] = False,
    progress: Annotated[bool, typer.Option(help="show a progress bar")] = True,
) -> None:
    """Evaluate every structure of INPUTS into OUT/results.extxyz and OUT/summary.csv;
    an interrupted run resumes where it stopped."""
    from clients.screen import ScreenAborted, ScreenOptions
    from clients.screen import screen as run_screen
    from service.model.errors import ModelConfigError, ModelFileError

    if url is not None and (model is not None or device != "auto"):
        raise cli_fail(
            "give --url (a running service) or --model/--device (in process), not both: the "
            "service runs on the devices it was started with"
        )
    options = ScreenOptions(
        output_dir=out,
        url=url,
        api_key=api_key,
        model=model,
        device=device,
        concurrency=concurrency,
        batch_atoms=batch_atoms,
        batch_structures=batch_structures,
        retries=retries,
        timeout_s=timeout,
        retry_failed=retry_failed,
        progress=progress,
    )
    try:
        report = run_screen(inputs, options)
    except (ScreenAborted, ModelFileError, ModelConfigError, OSError) as exc:
        raise cli_fail(str(exc)) from None
    except KeyboardInterrupt:  # 128 + SIGINT, as a shell reports it
        raise cli_fail("interrupted: run the same command again to resume", code=130) from None
    stderr_console.print(
        f"{report.total} structures: {report.succeeded} evaluated, {report.failed} failed, "
        f"{report.skipped} already done, in {report.seconds:.1f} s → "
        f"{escape(str(report.output))}, {escape(str(report.summary))}",
        soft_wrap=True,
    )


@app.command()
def info(
    url: Annotated[str | None, typer.Option(help="ask a running service")] = None,
    api_key: Annotated[str | None, typer.Option(envvar="SO2SERVE_API_KEY")] = None,
    model: Annotated[
        Path | None, typer.Option(help="describe this model file (default shipped)")
    ] = None,
) -> None:
    """Print the model's metadata (from a service with --url, else from the model file)."""
    if url is not None:
        from ase.calculators.calculator import CalculationFailed

        from clients.http import SO2Calculator

        try:  # ValueError: a URL that is not http(s)://host[:port]
            with SO2Calculator(url, api_key=api_key, retries=0) as calc:
                document = calc.info()
        except (CalculationFailed, ValueError) as exc:
            raise cli_fail(str(exc)) from None
        _print_json(document)
        return
    from service.model.errors import ModelConfigError, ModelFileError
    from service.model.potential import load_potential

    try:
        potential = load_potential(model, device="cpu")
    except (ModelFileError, ModelConfigError, OSError) as exc:
        raise cli_fail(str(exc)) from None
    _print_json(potential.info())


@app.command("import-deepmd")
def import_deepmd(
    checkpoint: Annotated[Path, typer.Argument(help="DeePMD-kit DPA4 checkpoint (.pt)")],
    output: Annotated[Path, typer.Option("-o", "--output", help="model file to write")],
) -> None:
    """Convert a DeePMD-kit DPA4 checkpoint into an so2serve model file (no pickled code runs)."""
    from service.model.deepmd_import import import_deepmd_checkpoint
    from service.model.errors import ModelFileError, UnsupportedCheckpointError

    if output.is_dir():  # refused before converting: the rename onto it would fail at the end
        raise cli_fail(
            f"{output} is a folder: give the model file to write, e.g. {output}/model.safetensors"
        )
    try:
        config = import_deepmd_checkpoint(checkpoint, output)
    except (ModelFileError, UnsupportedCheckpointError, FileNotFoundError) as exc:
        raise cli_fail(str(exc)) from None
    except OSError as exc:  # the checkpoint was read: writing the model file failed
        raise cli_fail(f"cannot write {output}: {exc}") from None
    symbols = ", ".join(config.type_map)
    stderr_console.print(f"wrote {escape(str(output))} ({symbols}; rcut {config.rcut} Å)")


def _register_training_commands() -> None:
    from service.training.cli import eval_command, train_command

    app.command("train")(train_command)
    app.command("eval")(eval_command)


_register_training_commands()

if __name__ == "__main__":
    app()
