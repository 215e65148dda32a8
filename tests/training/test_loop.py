"""A tiny training run lowers the loss, and a resumed run is bitwise the uninterrupted one."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from service.model.io import load_model
from service.model.potential import Potential
from service.training.cli import train_command
from service.training.config import TrainConfig, load_config
from service.training.data import collate, load_dataset
from service.training.evaluate import evaluate_frames
from service.training.loop import (
    build_model,
    fit_energy_reference,
    initialize_energy_bias,
    prepare_data,
    train,
    validation_loss,
)
from service.training.state import load_checkpoint
from tests.conftest import shared_path

MOLECULES = "data/combustion-nopbc/C4H3O1"  # 15 frames of 8 atoms: fast on CPU


def _config(output_dir: Path, optim: dict[str, Any] | None = None, **run: Any) -> TrainConfig:
    shared_root = shared_path("data").parent
    raw = {
        "data": {
            "roots": [str(shared_root)],
            "train": [MOLECULES],
            "valid_fraction": 0.2,
            "batch_size": 4,
            "valid_batch_size": 8,
        },
        "model": {"preset": "tiny", "overrides": {"n_blocks": 1, "n_radial": 4}},
        "optim": {
            "lr": 3e-3,
            "schedule": "constant",
            "warmup_fraction": 0.0,
            "ema_decay": 0.0,
            **(optim or {}),
        },
        "loss": {"energy_weight": 1.0, "force_weight": 1.0},
        "run": {
            "steps": 9,
            "eval_every": 3,
            "checkpoint_every": 3,
            "output_dir": str(output_dir),
            "device": "cpu",
            "path": "reference",
            "progress": False,
            "export": "final",
            **run,
        },
    }
    return TrainConfig.from_dict(raw)


def _train_loss(model: torch.nn.Module, config: TrainConfig) -> float:
    data = prepare_data(config.data)
    potential = Potential(model, device="cpu", path="reference")
    result = evaluate_frames(potential, data.train, batch_size=8)
    return validation_loss(result.errors, (1.0, 1.0, 0.0))


def test_energy_reference_least_squares() -> None:
    dataset = load_dataset([shared_path("data", "combustion-nopbc")])
    reference = fit_energy_reference(dataset, ["H", "C", "O"])
    counts = np.array([[np.sum(f.numbers == z) for z in (1, 6, 8)] for f in dataset])
    energies = np.array([f.energy for f in dataset])
    residual = counts @ reference - energies
    # normal equations hold: the residual is orthogonal to the composition columns
    np.testing.assert_allclose(counts.T @ residual, 0.0, atol=1e-6 * np.abs(energies).sum())


def test_initial_bias_centres_the_untrained_model(tmp_path: Path) -> None:
    config = _config(tmp_path / "run")
    data = prepare_data(config.data)  # one composition: every frame is C4H3O1
    model = build_model(config, data.type_map)
    initialize_energy_bias(
        model, data.train, data.type_map, device=torch.device("cpu"), path="reference"
    )
    potential = Potential(model, device="cpu", path="reference")
    errors = []
    for frame in data.train:
        structures = collate([frame]).structures
        errors.append(float(potential.predict(structures, ("energy",)).energy[0]) - frame.energy)
    # the net's output is centred per element, and the least-squares residuals sum to zero
    assert abs(np.mean(errors)) < 1e-3


def test_training_lowers_the_loss(tmp_path: Path) -> None:
    config = _config(tmp_path / "run", steps=12)
    data = prepare_data(config.data)
    initial = build_model(config, data.type_map)
    initialize_energy_bias(
        initial, data.train, data.type_map, device=torch.device("cpu"), path="reference"
    )
    before = _train_loss(initial, config)
    result = train(config)
    after = _train_loss(load_model(result.model_path), config)
    assert result.steps == 12 and result.exported_step == 12
    assert after < 0.8 * before, (before, after)
    rows = list(csv.DictReader(result.log_csv.open()))
    assert [int(r["step"]) for r in rows] == [3, 6, 9, 12]
    assert all(float(r["val_forces_rmse"]) > 0 for r in rows)
    assert result.execution["path"] == "reference"


def _tensors(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Flatten a nested checkpoint into {path: tensor} (numbers become 0-d tensors)."""
    flat: dict[str, torch.Tensor] = {}
    if isinstance(state, dict):
        for key, value in state.items():
            flat.update(_tensors(value, f"{prefix}/{key}"))
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            flat.update(_tensors(value, f"{prefix}/{i}"))
    elif isinstance(state, torch.Tensor):
        flat[prefix] = state
    elif isinstance(state, (int, float)):
        flat[prefix] = torch.tensor(state)
    return flat


def test_resume_reproduces_the_uninterrupted_run(tmp_path: Path) -> None:
    # EMA, warm-up + cosine and best-model tracking all take part
    optim = {"ema_decay": 0.9, "schedule": "cosine", "warmup_fraction": 0.2}
    common: dict[str, Any] = {"steps": 6, "eval_every": 2, "checkpoint_every": 2, "export": "best"}
    straight = train(_config(tmp_path / "a", optim, **common))
    config_b = _config(tmp_path / "b", optim, session_steps=3, **common)
    interrupted = train(config_b)
    assert interrupted.steps == 3
    config_path = tmp_path / "b.json"
    config_path.write_text(json.dumps(config_b.to_dict()))
    resumed = train_command(config_path, ["run.session_steps=0"], resume=True)
    assert resumed.steps == 6

    state_a = load_checkpoint(straight.checkpoint_path)
    state_b = load_checkpoint(resumed.checkpoint_path)
    skip = ("/elapsed_s", "/rng/cuda")
    tensors_a = {k: v for k, v in _tensors(state_a).items() if not k.startswith(skip)}
    tensors_b = {k: v for k, v in _tensors(state_b).items() if not k.startswith(skip)}
    assert tensors_a.keys() == tensors_b.keys()
    for key, value in tensors_a.items():
        torch.testing.assert_close(value, tensors_b[key], rtol=0, atol=0, equal_nan=True, msg=key)
    for name, value in load_model(straight.model_path).state_dict().items():
        assert torch.equal(value, load_model(resumed.model_path).state_dict()[name]), name

    def rows(path: Path) -> list[dict[str, str]]:
        return [
            {k: v for k, v in r.items() if k != "elapsed_s"} for r in csv.DictReader(path.open())
        ]

    assert rows(straight.log_csv) == rows(resumed.log_csv)


def test_resume_refuses_a_changed_model(tmp_path: Path) -> None:
    train(_config(tmp_path / "run", steps=2, checkpoint_every=1))
    changed = _config(tmp_path / "run", steps=4, resume=True)
    changed.model.overrides["n_radial"] = 6
    with pytest.raises(ValueError, match=r"model\.overrides"):
        train(changed)


def test_shipped_config_resolves_data() -> None:
    repo = Path(__file__).resolve().parents[2]
    config = load_config(repo / "configs" / "water_small.toml")
    shared_path("data", "water")
    import os

    cwd = Path.cwd()
    try:
        os.chdir(repo)
        data = prepare_data(config.data)
    finally:
        os.chdir(cwd)
    assert len(data.train) == 288 and len(data.validation) == 32
    assert data.type_map == ["H", "O"]


def test_wall_clock_budget_ends_the_run(tmp_path: Path) -> None:
    result = train(_config(tmp_path / "run", steps=1000, max_time_s=1e-6))
    assert result.steps == 1
    rows = list(csv.DictReader(result.log_csv.open()))
    assert [int(r["step"]) for r in rows] == [1]
