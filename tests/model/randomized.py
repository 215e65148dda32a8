"""Random models whose every branch is active (DeePMD zero-initialises several layers)."""

from __future__ import annotations

import math

import torch

from service.model.config import ModelConfig
from service.model.dpa4 import DPA4Model


def randomized_model(config: ModelConfig, seed: int = 0) -> DPA4Model:
    """A model with zero-initialised tensors (post-focus mix, FFN outputs) filled with noise."""
    torch.manual_seed(seed)
    model = DPA4Model(config)
    with torch.no_grad():
        for param in model.parameters():
            if bool((param == 0).all()):
                fan_in = param.shape[-2] if param.dim() >= 2 else 1
                param.copy_(torch.randn_like(param) / math.sqrt(fan_in))
        model.energy_bias.copy_(torch.randn_like(model.energy_bias))
    return model.eval()
