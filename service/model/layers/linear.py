"""Bias-free linear maps in DeePMD's (in, out) storage (``y = x @ W``).

* :class:`DegreeLinear` — one ``(Cin, Cout)`` matrix per degree l, shared by the ``2l+1`` orders
  of that degree (DeePMD ``SO3Linear``), on packed ``(N, (L+1)², Cin)`` features.
* :class:`FocusLinear` — one matrix per focus stream on ``(N, F, Cin)``.
* :class:`MLP` — dense layers with SiLU between them (optionally with bias).
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F


def degree_of_packed_rows(lmax: int) -> Tensor:
    """Degree l of each packed row ``l²..l²+2l``: ``(D,)`` int64."""
    return torch.repeat_interleave(torch.arange(lmax + 1), torch.arange(lmax + 1) * 2 + 1)


def _fan_in_normal(*shape: int, fan_in: int) -> Tensor:
    return torch.randn(*shape) / math.sqrt(max(fan_in, 1))


class DegreeLinear(nn.Module):
    """Per-degree mixing ``y[:, (l,m)] = x[:, (l,m)] @ weight[l]``; ``weight (L+1, Cin, Cout)``."""

    row_degree: Tensor

    def __init__(self, lmax: int, in_channels: int, out_channels: int, *, zero_init: bool = False):
        super().__init__()
        self.lmax = lmax
        init = torch.zeros(lmax + 1, in_channels, out_channels)
        if not zero_init:
            init = _fan_in_normal(lmax + 1, in_channels, out_channels, fan_in=in_channels)
        self.weight = nn.Parameter(init)
        self.register_buffer("row_degree", degree_of_packed_rows(lmax), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        """``x (N, (L+1)², Cin) → (N, (L+1)², Cout)`` contiguous."""
        if self.lmax == 0:
            return x @ self.weight[0]
        # One batched matmul over rows with the weight repeated per order (D, Cin, Cout), instead
        # of a matmul per degree plus a concatenation: a launch each way, and a backward without
        # per-slice zero-filled gradient buffers.
        row_weight = self.weight.index_select(0, self.row_degree)
        return torch.einsum("ndi,dio->ndo", x, row_weight).contiguous()


class FocusLinear(nn.Module):
    """Per-focus channel mixing; ``weight (Cin, F·Cout)`` viewed ``(Cin, F, Cout)``."""

    def __init__(self, in_channels: int, out_channels: int, n_focus: int):
        super().__init__()
        self.n_focus = n_focus
        self.out_channels = out_channels
        self.weight = nn.Parameter(
            _fan_in_normal(in_channels, n_focus * out_channels, fan_in=in_channels)
        )

    def forward(self, x: Tensor) -> Tensor:
        """``x (N, F, Cin) → (N, F, Cout)``."""
        w = self.weight.view(self.weight.shape[0], self.n_focus, self.out_channels)
        return torch.einsum("nfi,ifo->nfo", x, w)


class Dense(nn.Module):
    """``y = x @ matrix (+ bias)``."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False):
        super().__init__()
        self.matrix = nn.Parameter(_fan_in_normal(in_features, out_features, fan_in=in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        y = x @ self.matrix
        return y if self.bias is None else y + self.bias


class MLP(nn.Module):
    """Bias-free dense layers ``widths[0] → … → widths[-1]`` with SiLU after every hidden layer."""

    def __init__(self, widths: list[int]):
        super().__init__()
        self.layers = nn.ModuleList(Dense(a, b) for a, b in itertools.pairwise(widths))

    def forward(self, x: Tensor) -> Tensor:
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < last:
                x = F.silu(x)
        return x
