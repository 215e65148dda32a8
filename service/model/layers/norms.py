"""RMS normalisations of the DPA4 backbone (model-dpa4.md §4.1).

* :class:`EquivariantRMSNorm` on packed ``(N, (L+1)², C)`` node features: the l=0 row is centred
  across channels, one degree-balanced variance ``Σ_{l,m,c} x²/((2l+1)(L+1)C)`` is shared by all
  rows (so rotating the l≥1 rows leaves it unchanged), then a per-degree scale and an l=0 bias.
* :class:`ScalarRMSNorm` on ``(N, F, C)`` invariant features, per focus stream.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from service.model.layers.linear import degree_of_packed_rows


class EquivariantRMSNorm(nn.Module):
    """Degree-balanced equivariant RMS norm; ``scale (L+1, 1, C)``, ``bias (1, C)``."""

    row_degree: Tensor
    balance_weight: Tensor
    scalar_row: Tensor

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
        # (D, 1) indicator of the l=0 row: centring and bias act on it alone, as whole-tensor
        # ops (no slicing/concatenation, whose backward allocates zero-filled buffers).
        self.register_buffer("scalar_row", (degree == 0).float()[:, None], persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        """``x (N, D, C) → (N, D, C)``."""
        row0 = self.scalar_row.to(x.dtype)
        centred = x - x[:, 0].mean(dim=-1)[:, None, None] * row0
        variance = centred.square().sum(dim=-1) @ self.balance_weight.to(x.dtype)  # (N,)
        inv_rms = torch.rsqrt(variance + self.eps)[:, None, None]
        scale = self.scale[:, 0, :].index_select(0, self.row_degree)  # (D, C)
        return torch.addcmul(self.bias * row0, centred * inv_rms, scale)


class ScalarRMSNorm(nn.Module):
    """``x·rsqrt(mean_c x² + eps)·scale[f]`` on ``(N, F, C)``; ``scale (F, C)``.

    Norms of one input share its RMS: :func:`unit_rms` once, then :meth:`rescale` per norm.
    """

    def __init__(self, channels: int, n_focus: int, *, eps: float):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(n_focus, channels))

    def forward(self, x: Tensor) -> Tensor:
        return self.rescale(unit_rms(x, self.eps))

    def rescale(self, normalised: Tensor) -> Tensor:
        """``unit_rms(x, eps) (N, F, C)`` → this norm's output."""
        return normalised * self.scale


def unit_rms(x: Tensor, eps: float) -> Tensor:
    """``x·rsqrt(mean_c x² + eps)`` on ``(N, F, C)``."""
    return x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps)
