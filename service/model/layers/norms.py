"""RMS normalisations of the DPA4 backbone (model-dpa4.md §4.1).

* :class:`EquivariantRMSNorm` on packed ``(N, (L+1)², C)`` node features: the l=0 row is centred
  across channels, one degree-balanced variance ``Σ_{l,m,c} x²/((2l+1)(L+1)C)`` is shared by all
  rows (so rotating the l≥1 rows leaves it unchanged), then a per-degree scale and an l=0 bias.
* :class:`ScalarRMSNorm` on ``(N, F, C)`` invariant features, per focus stream.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def degree_of_packed_rows(lmax: int) -> Tensor:
    """Degree l of each packed row ``l²..l²+2l``: ``(D,)`` int64."""
    return torch.repeat_interleave(torch.arange(lmax + 1), torch.arange(lmax + 1) * 2 + 1)


class EquivariantRMSNorm(nn.Module):
    """Degree-balanced equivariant RMS norm; ``scale (L+1, 1, C)``, ``bias (1, C)``."""

    row_degree: Tensor
    balance_weight: Tensor

    def __init__(self, lmax: int, channels: int, *, eps: float):
        super().__init__()
        self.lmax = lmax
        self.channels = channels
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(lmax + 1, 1, channels))
        self.bias = nn.Parameter(torch.zeros(1, channels))
        degree = degree_of_packed_rows(lmax)
        self.register_buffer("row_degree", degree, persistent=False)
        # Each coefficient of degree l weighs 1/((2l+1)(L+1)C): every degree counts equally.
        weight = 1.0 / ((2 * degree + 1).double() * (lmax + 1) * channels)
        self.register_buffer("balance_weight", weight.float(), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        """``x (N, D, C) → (N, D, C)``."""
        x0 = x[:, :1] - x[:, :1].mean(dim=-1, keepdim=True)
        rest = x[:, 1:]
        w = self.balance_weight.to(x.dtype)
        variance = x0.square().sum(dim=(1, 2)) * w[0]
        if rest.shape[1] > 0:
            variance = variance + torch.einsum("ndc,d->n", rest * rest, w[1:])
        inv_rms = torch.rsqrt(variance + self.eps)[:, None, None]
        scale = self.scale[:, 0, :].index_select(0, self.row_degree)  # (D, C)
        out0 = x0 * inv_rms * scale[:1] + self.bias
        if rest.shape[1] == 0:
            return out0
        return torch.cat([out0, rest * inv_rms * scale[1:]], dim=1)


class ScalarRMSNorm(nn.Module):
    """``x·rsqrt(mean_c x² + eps)·scale[f]`` on ``(N, F, C)``; ``scale (F, C)``."""

    def __init__(self, channels: int, n_focus: int, *, eps: float):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(n_focus, channels))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + self.eps) * self.scale
