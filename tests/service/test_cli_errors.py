"""The so2serve command line as a user meets it: a wrong file, flag, environment variable,
port or URL ends in one ``error: …`` line and a nonzero exit code, before any slow work."""

from __future__ import annotations

import http.server
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import ase.io
import pytest
import torch
from typer.testing import CliRunner, Result

from clients.screen import JOURNAL_FILE, SUMMARY_FILE, _EngineBackend
from service.api import ServiceSettings, create_app
from service.cli import app
from tests.service.fakes import (
    PairPotential,
    free_port_socket,
    running_server,
    small_molecule,
)
from tests.service.test_cli import assert_one_line_error


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Replaces the uvicorn run of ``serve``: a refusal must come before it (no model load)."""
    calls: list[object] = []
    monkeypatch.setattr("service.api.app.serve", lambda *args: calls.append(args))
    return calls


def serve(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(app, ["serve", "--device", "cpu", *args], env=env)


def test_serve_refuses_a_port_in_use_before_loading_the_model(served: list[object]) -> None:
    with free_port_socket() as busy:
        busy.listen()
        port = busy.getsockname()[1]
        result = serve("--port", str(port))
    assert_one_line_error(result, f"cannot listen on 127.0.0.1:{port}", "in use")
    assert served == []


@pytest.mark.parametrize("content", [b"not a model", b""])
def test_serve_refuses_a_file_that_is_no_model(
    tmp_path: Path, served: list[object], content: bytes
) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    assert_one_line_error(serve("--model", str(path)), str(path))
    assert served == []


def test_serve_refuses_a_folder_as_model(tmp_path: Path, served: list[object]) -> None:
    assert_one_line_error(serve("--model", str(tmp_path)), "not found", str(tmp_path))
    assert served == []


def test_serve_refuses_a_model_named_by_the_environment(
    tmp_path: Path, served: list[object]
) -> None:
    missing = tmp_path / "missing.safetensors"
    result = serve(env={"SO2SERVE_MODEL": str(missing)})
    assert_one_line_error(result, str(missing))
    assert served == []


def test_serve_refuses_a_precision_the_model_cannot_run_here(served: list[object]) -> None:
    """fp16x3 runs in the fused kernels only: on the CPU the model load refuses it, which
    ``serve`` now does before uvicorn (it was a traceback from the app's start-up)."""
    assert_one_line_error(serve("--precision", "fp16x3"), "fp16x3")
    assert served == []


@pytest.mark.parametrize("variable", ["SO2SERVE_MAX_BODY_MB", "SO2SERVE_BATCH_WINDOW_MS"])
def test_serve_refuses_an_infinite_limit(variable: str, served: list[object]) -> None:
    assert_one_line_error(serve(env={variable: "inf"}), variable)
    assert served == []


def test_serve_hands_the_loaded_model_to_the_server(served: list[object]) -> None:
    result = serve()
    assert result.exit_code == 0, result.output
    ((_settings, evaluators),) = served
    assert [e.execution.device for e in evaluators] == ["cpu"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_serve_refuses_a_device_this_machine_lacks(served: list[object]) -> None:
    result = CliRunner().invoke(app, ["serve", "--device", "cuda:0"])
    assert_one_line_error(result, "cuda:0", "CUDA is not available")
    assert served == []


@pytest.mark.parametrize(
    ("variable", "value", "fragment"),
    [
        ("SO2SERVE_PORT", "abc", "valid integer"),
        ("SO2SERVE_MAX_ATOMS", "-1", "greater than 0"),
        ("SO2SERVE_WARM_UP", "maybe", "valid boolean"),
        ("SO2SERVE_BODY_TIMEOUT_S", "0", "greater than 0"),
        ("SO2SERVE_DEVICE", "gpu", "device must be"),
    ],
)
def test_a_bad_environment_variable_is_named(
    served: list[object], variable: str, value: str, fragment: str
) -> None:
    result = CliRunner().invoke(app, ["serve"], env={variable: value})
    assert_one_line_error(result, f"{variable}={value!r}", fragment)
    assert "Value error," not in result.output
    assert served == []


def test_a_misspelt_environment_variable_is_refused_not_ignored(served: list[object]) -> None:
    # pydantic-settings ignores variables it does not know: the setting stayed at its default.
    result = CliRunner().invoke(app, ["serve"], env={"SO2SERVE_INLINE_MAX_ATOM": "5"})
    assert_one_line_error(result, "SO2SERVE_INLINE_MAX_ATOM", "SO2SERVE_INLINE_MAX_ATOMS?")
    assert served == []


def test_a_bad_flag_is_named_as_typed(served: list[object]) -> None:
    assert_one_line_error(serve("--max-atoms", "-1"), "--max-atoms", "greater than 0")
    assert_one_line_error(
        serve("--max-request-atoms", "0"), "--max-request-atoms", "greater than 0"
    )
    assert_one_line_error(serve("--path", "banana"), "--path", "'auto', 'fused' or 'reference'")


@pytest.fixture
def water(tmp_path: Path) -> Path:
    path = tmp_path / "in.extxyz"
    ase.io.write(path, [small_molecule("H2O", seed=k) for k in range(3)])
    return path


class _QuietFileServer(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass  # not into the output under test


@pytest.fixture
def not_so2serve() -> Iterator[str]:
    """A web server that is something else (Python's file server: HTML 404s, POST → 501)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _QuietFileServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_info_from_another_web_server_is_one_line(not_so2serve: str) -> None:
    result = CliRunner().invoke(app, ["info", "--url", not_so2serve])
    assert_one_line_error(result, "404")


def test_screen_against_a_service_that_is_down_aborts(water: Path, tmp_path: Path) -> None:
    """Every structure would fail the same way: the run stops, records nothing as failed, and
    the same command resumes it once the service is up."""
    out = tmp_path / "out"
    with free_port_socket() as sock:  # bound, not listening: the connection is refused
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        result = CliRunner().invoke(app, ["screen", str(water), "--url", url, "-o", str(out),
                                          "--retries", "1", "--no-progress"])  # fmt: skip
    assert_one_line_error(result, f"so2serve at {url} unreachable", "run the same command")
    journal = out / JOURNAL_FILE
    assert not journal.exists() or "failed" not in journal.read_text()


def test_screen_against_another_web_server_aborts(
    water: Path, tmp_path: Path, not_so2serve: str
) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app, ["screen", str(water), "--url", not_so2serve, "-o", str(out), "--no-progress"]
    )
    assert_one_line_error(result, "501")
    assert "failed" not in (out / JOURNAL_FILE).read_text()


@pytest.mark.parametrize("timeout", ["0", "-1", "nan", "inf"])
def test_screen_rejects_a_timeout_that_is_not_positive(
    water: Path, tmp_path: Path, timeout: str
) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["screen", str(water), "-o", str(out), "--timeout", timeout])
    assert result.exit_code == 2, result.output
    assert "--timeout" in result.output and "Traceback" not in result.output
    assert not out.exists()


@pytest.mark.parametrize("in_process", [["--model", "m.safetensors"], ["--device", "cuda:0"]])
def test_screen_refuses_in_process_options_with_a_url(
    water: Path, tmp_path: Path, in_process: list[str]
) -> None:
    """``--device`` with ``--url`` was silently ignored: the service runs where it was started."""
    out = tmp_path / "out"
    args = ["screen", str(water), "-o", str(out), "--url", "http://127.0.0.1:9", *in_process]
    assert_one_line_error(CliRunner().invoke(app, args), "not both")
    assert not out.exists()


@pytest.mark.parametrize(("name", "reason"), [("missing.extxyz", "does not exist"),
                                              (".", "is a directory")])  # fmt: skip
def test_screen_rejects_an_input_that_is_no_file(tmp_path: Path, name: str, reason: str) -> None:
    """A mistyped name (or a glob that matched nothing) is a usage error, not a failed row."""
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["screen", str(tmp_path / name), "-o", str(out)])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.replace("│", " ").split())  # the error box wraps long paths
    assert "'inputs'" in text and reason in text
    assert "Traceback" not in result.output
    assert not out.exists()


def test_screen_summary_line_is_not_wrapped(
    water: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One line however long the output paths are (logs and grep see all of it)."""
    monkeypatch.setattr(
        "clients.screen._backend", lambda options, evaluator: _EngineBackend([PairPotential()])
    )
    out = tmp_path / ("a-long-folder-name-" * 4)
    result = CliRunner().invoke(app, ["screen", str(water), "-o", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert result.output.count("\n") == 1 and str(out / SUMMARY_FILE) in result.output


def test_ctrl_c_stops_screen_with_one_line_and_the_run_resumes(tmp_path: Path) -> None:
    inputs = tmp_path / "in.extxyz"
    n_structures = 12
    ase.io.write(inputs, [small_molecule("H2O", seed=k) for k in range(n_structures)])
    out = tmp_path / "out"
    potential = PairPotential(delay_s=0.2)
    with running_server(create_app(ServiceSettings(), evaluator=potential)) as url:
        args = ["screen", str(inputs), "--url", url, "-o", str(out), "--concurrency", "1",
                "--batch-structures", "1", "--no-progress"]  # fmt: skip
        repo = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))
        child = subprocess.Popen(
            [sys.executable, "-m", "service.cli", *args],
            env={**os.environ, "PYTHONPATH": path},
            stderr=subprocess.PIPE,
            # A shell without job control starts background jobs (a CI runner's `cmd &`) with
            # SIGINT ignored, and Python then installs no Ctrl-C handler: the signal would be
            # lost, not handled. A terminal's foreground job has the default, as here.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        journal = out / JOURNAL_FILE
        deadline = time.monotonic() + 60
        while not (journal.exists() and len(journal.read_text().splitlines()) >= 2):
            assert child.poll() is None and time.monotonic() < deadline, "no progress"
            time.sleep(0.05)
        child.send_signal(signal.SIGINT)
        _, stderr = child.communicate(timeout=30)
        assert child.returncode == 130, stderr.decode()
        assert stderr.decode() == "error: interrupted: run the same command again to resume\n"
        done = len(journal.read_text().splitlines())
        potential.delay_s = 0.0
        again = CliRunner().invoke(app, args)
    assert again.exit_code == 0, again.output
    assert f"{n_structures - done} evaluated, 0 failed, {done} already done" in again.output


@pytest.fixture
def deepmd_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A checkpoint path whose conversion yields a tiny model (the conversion is not tested)."""
    from service.model.config import preset
    from service.model.dpa4 import DPA4Model

    model = DPA4Model(preset("tiny", ["H", "O"]))
    monkeypatch.setattr(
        "service.model.deepmd_import.load_deepmd_checkpoint", lambda src: (model, {})
    )
    checkpoint = tmp_path / "model.pt"
    checkpoint.write_bytes(b"")
    return checkpoint


def test_import_deepmd_into_a_folder_is_refused_before_converting(
    deepmd_checkpoint: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    result = CliRunner().invoke(app, ["import-deepmd", str(deepmd_checkpoint), "-o", str(folder)])
    assert_one_line_error(result, str(folder), "folder")
    assert list(tmp_path.iterdir()) == [deepmd_checkpoint, folder]  # no .partial left behind
    assert list(folder.iterdir()) == []


def test_import_deepmd_below_a_file_is_one_line(deepmd_checkpoint: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    target = blocker / "model.safetensors"
    result = CliRunner().invoke(app, ["import-deepmd", str(deepmd_checkpoint), "-o", str(target)])
    assert_one_line_error(result, f"cannot write {target}")
