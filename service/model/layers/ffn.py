"""Equivariant feed-forward blocks (model-dpa4.md §4.3, §5).

* :class:`GatedGLUFFN` — plain GLU: ``h = W1 x`` split ``[val | gate]``; l=0 gets
  ``val₀·SiLU(gate₀)``, each l≥1 row gets ``val_l·σ(gate₀ @ Wg)[l-1]``; then ``W2`` (zero-init).
  With ``lmax=0`` this is the readout GLU.
* :class:`S2GridGLUFFN` — S2-Lebedev GLU: ``h = W1 x`` split ``[a | b]``; the product of ``a``
  and ``b`` on the grid is projected back, gated by ``σ([a₀,b₀] @ Wsg)`` on every row, and
  ``SiLU(a₀)·b₀`` is added to l=0; then ``W2`` (zero-init).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from service.model.layers.linear import DegreeLinear, degree_of_packed_rows
from service.model.layers.sphere import s2_grid_projectors


class GatedGLUFFN(nn.Module):
    """Plain gated GLU FFN on packed ``(N, D, C)`` features; ``gate_weight (H, L·H)``."""

    gate_group: Tensor

    def __init__(self, lmax: int, channels: int, hidden: int):
        super().__init__()
        self.lmax = lmax
        self.hidden = hidden
        self.linear_in = DegreeLinear(lmax, channels, 2 * hidden)
        self.gate_weight = (
            nn.Parameter(torch.randn(hidden, lmax * hidden) * 0.01) if lmax > 0 else None
        )
        self.linear_out = DegreeLinear(lmax, hidden, channels, zero_init=True)
        # Row r ≥ 1 reads gate group l(r)-1.
        self.register_buffer("gate_group", degree_of_packed_rows(lmax)[1:] - 1, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        h = self.linear_in(x)
        val, gate = h[..., : self.hidden], h[..., self.hidden :]
        out0 = val[:, :1] * F.silu(gate[:, :1])
        if self.gate_weight is None:
            result: Tensor = self.linear_out(out0)
            return result
        sig = torch.sigmoid(gate[:, 0] @ self.gate_weight).view(-1, self.lmax, self.hidden)
        rest = val[:, 1:] * sig.index_select(1, self.gate_group)
        gated: Tensor = self.linear_out(torch.cat([out0, rest], dim=1))
        return gated


class S2GridGLUFFN(nn.Module):
    """S2-Lebedev grid GLU FFN on packed ``(N, D, C)`` features; ``scalar_gate (2H, H)``."""

    to_grid: Tensor
    from_grid: Tensor
    scalar_row: Tensor

    def __init__(self, lmax: int, channels: int, hidden: int):
        super().__init__()
        self.hidden = hidden
        self.linear_in = DegreeLinear(lmax, channels, 2 * hidden)
        self.scalar_gate = nn.Parameter(torch.randn(2 * hidden, hidden) * 0.01)
        self.linear_out = DegreeLinear(lmax, hidden, channels, zero_init=True)
        to_grid, from_grid = s2_grid_projectors(lmax)
        self.register_buffer("to_grid", torch.from_numpy(to_grid).float(), persistent=False)
        self.register_buffer("from_grid", torch.from_numpy(from_grid).float(), persistent=False)
        scalar_row = (degree_of_packed_rows(lmax) == 0).float()[:, None]  # (D, 1)
        self.register_buffer("scalar_row", scalar_row, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        h = self.linear_in(x)  # (N, D, 2H)
        scalars = h[:, 0]  # (N, 2H)
        grid = self.to_grid.to(h.dtype) @ h  # (N, G, 2H)
        product = grid[..., : self.hidden] * grid[..., self.hidden :]
        out = self.from_grid.to(h.dtype) @ product  # (N, D, H)
        gate = torch.sigmoid(scalars @ self.scalar_gate)[:, None, :]
        glu0 = F.silu(scalars[:, : self.hidden]) * scalars[:, self.hidden :]
        # The scalar GLU joins the l=0 row through the (D, 1) indicator instead of a slice + cat.
        out = torch.addcmul(glu0[:, None, :] * self.scalar_row.to(h.dtype), out, gate)
        projected: Tensor = self.linear_out(out)
        return projected


def make_ffn(kind: str, lmax: int, channels: int, hidden: int) -> nn.Module:
    """The block FFN of a config's flavour (``plain`` | ``s2``)."""
    if kind == "s2":
        return S2GridGLUFFN(lmax, channels, hidden)
    return GatedGLUFFN(lmax, channels, hidden)
