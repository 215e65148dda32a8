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

from service.model.layers.derived import derived_weights


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

    def row_weight(self, *, live: bool = True) -> Tensor:
        """The weight repeated per order, ``(D, Cin, Cout)`` (cached unless ``live``)."""
        return derived_weights(
            self, "row_weight", (self.weight,),
            lambda: self.weight.index_select(0, self.row_degree), live=live,
        )  # fmt: skip

    def forward(self, x: Tensor, *, live: bool = True) -> Tensor:
        """``x (N, (L+1)², Cin) → (N, (L+1)², Cout)``; ``live=False`` reuses the row-expanded
        weight of frozen parameters.

        The result is a view of a degree-major ``(D, N, Cout)`` product (unit channel stride):
        elementwise ops and batched matmuls read it in place, so no copy is made here; a consumer
        that needs node-major rows makes them contiguous itself."""
        if self.lmax == 0:
            return x @ self.weight[0]
        # One batched matmul over rows with the weight repeated per order (D, Cin, Cout), instead
        # of a matmul per degree plus a concatenation: a launch each way, and a backward without
        # per-slice zero-filled gradient buffers.
        return torch.einsum("ndi,dio->ndo", x, self.row_weight(live=live))


class FocusLinear(nn.Module):
    """Per-focus channel mixing; ``weight (Cin, F·Cout)`` viewed ``(Cin, F, Cout)``.

    Holds the weight only: its users fold it with neighbouring maps (see
    ``service.model.layers.so2conv.Attention.node_projection``)."""

    def __init__(self, in_channels: int, out_channels: int, n_focus: int):
        super().__init__()
        self.n_focus = n_focus
        self.out_channels = out_channels
        self.weight = nn.Parameter(
            _fan_in_normal(in_channels, n_focus * out_channels, fan_in=in_channels)
        )

    def per_focus(self) -> Tensor:
        """The weight as ``(F, Cin, Cout)``."""
        per_focus = self.weight.view(self.weight.shape[0], self.n_focus, self.out_channels)
        return per_focus.transpose(0, 1)


class Dense(nn.Module):
    """``y = x @ matrix (+ bias)``."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False):
        super().__init__()
        self.matrix = nn.Parameter(_fan_in_normal(in_features, out_features, fan_in=in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        if self.bias is None:
            return x @ self.matrix
        # The bias rides in the GEMM's epilogue instead of a separate broadcast add.
        y = torch.addmm(self.bias, x.flatten(0, -2), self.matrix)
        return y.view(*x.shape[:-1], y.shape[-1])


class MLP(nn.Module):
    """Bias-free dense layers ``widths[0] → … → widths[-1]`` with SiLU after every hidden layer."""

    def __init__(self, widths: list[int]):
        super().__init__()
        self.layers = nn.ModuleList(Dense(a, b) for a, b in itertools.pairwise(widths))

    def hidden(self, x: Tensor) -> Tensor:
        """The activations entering the last layer (``x`` itself for a single layer)."""
        if len(self.layers) < 2:
            return x
        return self.hidden_after_first(F.silu(self.layers[0](x)))

    def hidden_after_first(self, opened: Tensor) -> Tensor:
        """:meth:`hidden` given ``opened = SiLU(first layer(x))`` (two or more layers): callers
        that open several MLPs on one input run their first layers as one GEMM."""
        if len(self.layers) < 2:
            raise ValueError("an MLP with a single layer has no opening activation")
        for layer in self.layers[1:-1]:
            opened = F.silu(layer(opened))
        return opened

    def dense(self, index: int) -> Dense:
        """Layer ``index`` (negative counts from the end)."""
        layer = self.layers[index]
        assert isinstance(layer, Dense)
        return layer

    @property
    def last(self) -> Dense:
        return self.dense(-1)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.last(self.hidden(x))
        return out
