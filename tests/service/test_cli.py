"""The so2serve command line (serve's refusals, info, errors as one line); screen is tested in
tests/clients."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import SecretStr
from typer.testing import CliRunner, Result

from service.api import ServiceSettings, create_app
from service.cli import app
from tests.service.fakes import (
    PairPotential,
    free_port_socket,
    running_server,
)


def test_serve_refuses_an_exposed_host_without_a_key() -> None:
    result = CliRunner().invoke(app, ["serve", "--host", "0.0.0.0", "--port", "1"])
    assert result.exit_code == 2
    assert "refusing to listen on 0.0.0.0 without an API key" in result.output


def test_serve_reports_bad_settings() -> None:
    result = CliRunner().invoke(app, ["serve", "--device", "gpu7"])
    assert result.exit_code == 2
    assert "device must be auto, cpu, cuda, cuda:N, cuda:all or a list" in result.output


def test_info_from_a_running_service() -> None:
    settings = ServiceSettings(api_key=SecretStr("k"))
    with running_server(create_app(settings, evaluator=PairPotential())) as url:
        result = CliRunner().invoke(app, ["info", "--url", url, "--api-key", "k"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["model"]["name"] == "pair-test" and info["auth_required"] is True


def test_info_from_a_model_file(tmp_path: Path) -> None:
    from service.model.config import preset
    from service.model.dpa4 import DPA4Model
    from service.model.io import save_model

    torch.manual_seed(0)
    path = tmp_path / "tiny.safetensors"
    save_model(DPA4Model(preset("tiny", ["H", "O"])), path)
    result = CliRunner().invoke(app, ["info", "--model", str(path)])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["elements"] == ["H", "O"] and info["rcut"] == pytest.approx(6.0)


def assert_one_line_error(result: Result, *parts: str) -> None:
    """Exit 2 with one ``error: …`` line (no traceback) that contains ``parts``."""
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)
    assert result.output.startswith("error: ") and result.output.count("\n") == 1, result.output
    for part in parts:
        assert part in result.output


def test_info_reports_a_missing_model_file(tmp_path: Path) -> None:
    missing = tmp_path / "missing.safetensors"
    result = CliRunner().invoke(app, ["info", "--model", str(missing)])
    assert_one_line_error(result, "not found", str(missing))


def test_info_reports_a_corrupt_model_file(tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"this is not a safetensors file")
    result = CliRunner().invoke(app, ["info", "--model", str(corrupt)])
    assert_one_line_error(result, str(corrupt))


def test_info_reports_an_unreachable_service() -> None:
    with free_port_socket() as sock:  # bound, not listening: the connection is refused
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        result = CliRunner().invoke(app, ["info", "--url", url])
    assert_one_line_error(result, f"so2serve at {url} unreachable")


def test_info_reports_a_url_that_is_not_http() -> None:
    result = CliRunner().invoke(app, ["info", "--url", "ftp://example.org"])
    assert_one_line_error(result, "expected an http:// or https:// URL, got 'ftp://example.org'")


def test_error_messages_are_not_read_as_markup(tmp_path: Path) -> None:
    missing = tmp_path / "[red]" / "[/x].safetensors"
    result = CliRunner().invoke(app, ["info", "--model", str(missing)])
    assert_one_line_error(result, str(missing))


def test_screen_reports_a_device_this_machine_lacks(tmp_path: Path) -> None:
    inputs = tmp_path / "in.xyz"
    inputs.write_text("1\n\nH 0 0 0\n")
    result = CliRunner().invoke(app, ["screen", str(inputs), "-o", str(tmp_path / "out"),
                                      "--device", "gpu7"])  # fmt: skip
    assert result.exit_code == 2
    assert "device" in result.output
    assert not (tmp_path / "out").exists()


def test_the_cli_starts_without_torch() -> None:
    # `so2serve --help`, `screen --url` and `info --url` need no model: they start in a
    # fraction of a second instead of torch's seconds.
    code = "import sys, service.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
