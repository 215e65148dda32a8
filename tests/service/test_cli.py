"""The so2serve command line (serve's refusals, info); screen is tested in tests/clients."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import SecretStr
from typer.testing import CliRunner

from service.api import ServiceSettings, create_app
from service.cli import app
from tests.service.fakes import PairPotential, running_server


def test_serve_refuses_an_exposed_host_without_a_key() -> None:
    result = CliRunner().invoke(app, ["serve", "--host", "0.0.0.0", "--port", "1"])
    assert result.exit_code == 2
    assert "refusing to listen on 0.0.0.0 without an API key" in result.output


def test_serve_reports_bad_settings() -> None:
    result = CliRunner().invoke(app, ["serve", "--device", "gpu7"])
    assert result.exit_code == 2
    assert "device must be auto, cpu, cuda or cuda:N" in result.output


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
