"""The ``so2serve`` command line: one typer app, each command a thin wrapper over a module."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import orjson
import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape

app = typer.Typer(
    name="so2serve",
    help="GPU-resident calculator service for an SO(2)-convolution interatomic potential.",
    no_args_is_help=True,
    add_completion=False,
)
_err = Console(stderr=True)


def _fail(message: str, code: int = 2) -> typer.Exit:
    # Escaped: messages carry paths and fields like "structures[2]" that rich reads as markup.
    # One unwrapped line, so that logs and grep see the whole message.
    _err.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    return typer.Exit(code)


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
    try:
        settings = ServiceSettings(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}" for e in exc.errors()
        )
        raise _fail(problems) from None
    run_service(settings)


@app.command()
def screen(
    inputs: Annotated[list[Path], typer.Argument(help="structure files (any ASE format)")],
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
    timeout: Annotated[float, typer.Option(help="seconds per request")] = 600.0,
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

    if url is not None and model is not None:
        raise _fail("give --url (a running service) or --model (in process), not both")
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
        raise _fail(str(exc)) from None
    _err.print(
        f"{report.total} structures: {report.succeeded} evaluated, {report.failed} failed, "
        f"{report.skipped} already done, in {report.seconds:.1f} s → "
        f"{escape(str(report.output))}, {escape(str(report.summary))}"
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
            raise _fail(str(exc)) from None
        _print_json(document)
        return
    from service.model.errors import ModelConfigError, ModelFileError
    from service.model.potential import load_potential

    try:
        potential = load_potential(model, device="cpu")
    except (ModelFileError, ModelConfigError, OSError) as exc:
        raise _fail(str(exc)) from None
    _print_json(potential.info())


@app.command("import-deepmd")
def import_deepmd(
    checkpoint: Annotated[Path, typer.Argument(help="DeePMD-kit DPA4 checkpoint (.pt)")],
    output: Annotated[Path, typer.Option("-o", "--output", help="model file to write")],
) -> None:
    """Convert a DeePMD-kit DPA4 checkpoint into an so2serve model file (no pickled code runs)."""
    from service.model.deepmd_import import import_deepmd_checkpoint
    from service.model.errors import ModelFileError, UnsupportedCheckpointError

    try:
        config = import_deepmd_checkpoint(checkpoint, output)
    except (ModelFileError, UnsupportedCheckpointError, FileNotFoundError) as exc:
        raise _fail(str(exc)) from None
    _err.print(f"wrote {escape(str(output))} ({', '.join(config.type_map)}; rcut {config.rcut} Å)")


def _register_training_commands() -> None:
    from service.training.cli import eval_command, train_command

    app.command("train")(train_command)
    app.command("eval")(eval_command)


_register_training_commands()

if __name__ == "__main__":
    app()
