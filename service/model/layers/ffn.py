"""Equivariant feed-forward blocks (model-dpa4.md §4.3, §5).

* :class:`GatedGLUFFN` — plain GLU: ``h = W1 x`` split ``[val | gate]``; l=0 gets
  ``val₀·SiLU(gate₀)``, each l≥1 row gets ``val_l·σ(gate₀ @ Wg)[l-1]``; then ``W2`` (zero-init).
  With ``lmax=0`` this is the readout GLU (on ``(N, C)`` scalars).
* :class:`S2GridGLUFFN` — S2-Lebedev GLU: ``h = W1 x`` split ``[a | b]``; the product of ``a``
  and ``b`` on the grid is projected back, gated by ``σ([a₀,b₀] @ Wsg)`` on every row, and
  ``SiLU(a₀)·b₀`` is added to l=0; then ``W2`` (zero-init).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from service.model.layers.constants import ExactConstants
from service.model.layers.linear import DegreeLinear, degree_of_packed_rows
from service.model.layers.pointwise import multiply_add
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

    def forward(self, x: Tensor, *, live: bool = True) -> Tensor:
        # unbind, not slices: the backward joins the halves in one stack instead of zero-filling
        # a full-width buffer per half and adding them.
        h = self.linear_in(x, live=live)
        val, gate = h.view(*h.shape[:-1], 2, self.hidden).unbind(-2)
        if self.gate_weight is None:
            result: Tensor = self.linear_out(val * F.silu(gate), live=live)
            return result
        gate0 = gate[:, :1]
        sig = torch.sigmoid(gate0[:, 0] @ self.gate_weight).view(-1, self.lmax, self.hidden)
        row_gate = torch.cat([F.silu(gate0), sig.index_select(1, self.gate_group)], dim=1)
        gated: Tensor = self.linear_out(val * row_gate, live=live)
        return gated


class S2GridGLUFFN(ExactConstants):
    """S2-Lebedev grid GLU FFN on packed ``(N, D, C)`` features; ``scalar_gate (2H, H)``."""

    scalar_and_grid: Tensor
    from_grid: Tensor

    def __init__(self, lmax: int, channels: int, hidden: int):
        super().__init__()
        self.hidden = hidden
        self.linear_in = DegreeLinear(lmax, channels, 2 * hidden)
        self.scalar_gate = nn.Parameter(torch.randn(2 * hidden, hidden) * 0.01)
        self.linear_out = DegreeLinear(lmax, hidden, channels, zero_init=True)
        to_grid, from_grid = s2_grid_projectors(lmax)
        # (1+G, D): row 0 picks the l=0 coefficients (exactly: a one-hot row), the rest project
        # onto the grid, so the scalars and the grid values come out of one batched product.
        pick_scalar = np.eye(1, to_grid.shape[1])
        self.register_constant(
            "scalar_and_grid", torch.from_numpy(np.concatenate([pick_scalar, to_grid]))
        )
        self.register_constant("from_grid", torch.from_numpy(from_grid))

    def forward(self, x: Tensor, *, live: bool = True) -> Tensor:
        h = self.linear_in(x, live=live)  # (N, D, 2H)
        n_nodes, hid = h.shape[0], self.hidden
        both = torch.matmul(self.scalar_and_grid, h)  # (N, 1+G, 2H)
        # split/unbind views: their backward is one concatenation each, not zero-filled slices.
        scalars, grid = both.split_with_sizes([1, both.shape[1] - 1], dim=1)
        grid_a, grid_b = grid.view(n_nodes, grid.shape[1], 2, hid).unbind(-2)
        out = torch.matmul(self.from_grid, grid_a * grid_b)  # (N, D, H)
        gate = torch.sigmoid(scalars.view(n_nodes, 2 * hid) @ self.scalar_gate)[:, None, :]
        a0, b0 = scalars.view(n_nodes, 2, hid).unbind(1)
        glu0 = F.silu(a0) * b0
        # The scalar GLU joins the l=0 row as a zero-padded (N, D, H) term: its backward is one
        # slice copy, where an indicator product would take a product and a reduction.
        scalar_term = F.pad(glu0[:, None, :], (0, 0, 0, out.shape[1] - 1))
        out = multiply_add(scalar_term, out, gate)
        projected: Tensor = self.linear_out(out, live=live)
        return projected


def make_ffn(kind: str, lmax: int, channels: int, hidden: int) -> nn.Module:
    """The block FFN of a config's flavour (``plain`` | ``s2``)."""
    if kind == "s2":
        return S2GridGLUFFN(lmax, channels, hidden)
    return GatedGLUFFN(lmax, channels, hidden)
