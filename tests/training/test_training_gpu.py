"""GPU: the force-loss second order of the fused path matches the reference; a short CUDA run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from service.model.config import preset
from service.model.dpa4 import DPA4Model
from service.model.potential import Potential
from service.training.config import TrainConfig
from service.training.data import collate, load_deepmd_system
from service.training.loop import force_loss_gradients, train
from tests.conftest import shared_path

pytestmark = pytest.mark.gpu


def _randomised_small_model() -> DPA4Model:
    torch.manual_seed(0)
    model = DPA4Model(preset("small", ["H", "O"]))
    with torch.no_grad():  # zero-initialised layers would hide the SO(2) branch
        for parameter in model.parameters():
            if parameter.abs().max() == 0:
                parameter.normal_(0.0, 0.05)
    return model


def test_fused_second_order_matches_reference() -> None:
    frames = load_deepmd_system(shared_path("data", "water", "data_0"))[:2]
    batch = collate(frames).to("cuda")
    model = _randomised_small_model().to("cuda")
    properties = ("energy", "forces")
    reference = Potential(model, device="cuda", path="reference")
    fused = Potential(model, device="cuda", path="fused")
    ref_grad, _ = force_loss_gradients(reference, model, batch, properties)
    fused_grad, _ = force_loss_gradients(fused, model, batch, properties)
    relative = float((fused_grad - ref_grad).norm() / ref_grad.norm())
    assert relative < 1e-4, relative


def test_short_cuda_training_run(tmp_path: Path) -> None:
    config = TrainConfig.from_dict(
        {
            "data": {
                "roots": [str(shared_path("data").parent)],
                "train": ["data/water/data_0"],
                "valid_fraction": 0.1,
                "batch_size": 2,
            },
            "model": {"preset": "small"},
            "run": {
                "steps": 40,
                "eval_every": 20,
                "output_dir": str(tmp_path),
                "device": "cuda",
                "progress": False,
            },
        }
    )
    result = train(config)
    assert result.steps == 40
    assert result.execution["path"] in ("fused", "reference")
    assert result.validation["forces_rmse"] < 2.0
