"""RMS normalisations of the DPA4 backbone (model-dpa4.md §4.1).

* :class:`EquivariantRMSNorm` on packed ``(N, (L+1)², C)`` node features: the l=0 row is centred
  across channels, one degree-balanced variance ``Σ_{l,m,c} x²/((2l+1)(L+1)C)`` is shared by all
  rows (so rotating the l≥1 rows leaves it unchanged), then a per-degree scale and an l=0 bias.
* :class:`ScalarRMSNorm` on ``(N, F, C)`` invariant features, per focus stream (its scale is
  folded into the projection that follows it; :func:`unit_rms` is the shared normalisation).

Both run as plain differentiable torch ops when their weights are live (training: weight
gradients, second order) or under torch.compile. With frozen weights (``live=False``: the force
path, first order only) they run eagerly as autograd functions whose backward is the closed
form: a norm's autograd graph is a dozen small nodes whose backward is ~18 launches, the closed
form is 8 (equivariant) or 4 (unit RMS). Written with ``n = c·r``,
``r = (Σ_k w_k c_k² + eps)^(-1/2)`` and an incoming gradient ``t`` on ``n``, the backward to
``c`` is ``r·(t − (Σ_k t_k n_k)·w⊙n)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx

from service.model.layers.constants import ExactConstants
from service.model.layers.derived import derived_weights, eager_frozen
from service.model.layers.linear import degree_of_packed_rows


class EquivariantRMSNorm(ExactConstants):
    """Degree-balanced equivariant RMS norm; ``scale (L+1, 1, C)``, ``bias (1, C)``."""

    row_degree: Tensor
    channel_mean: Tensor
    balance_weight: Tensor
    balance_rows: Tensor
    centring: Tensor

    def __init__(self, lmax: int, channels: int, *, eps: float):
        super().__init__()
        self.lmax = lmax
        self.channels = channels
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(lmax + 1, 1, channels))
        self.bias = nn.Parameter(torch.zeros(1, channels))
        degree = degree_of_packed_rows(lmax)
        self.register_buffer("row_degree", degree, persistent=False)
        # Both reductions are mat-vecs: the l=0 channel mean on the row-0 view, the variance over
        # the flattened (D·C) coefficients, each of degree l weighing 1/((2l+1)(L+1)C) so that
        # every degree counts equally.
        balance = 1.0 / ((2 * degree + 1).double() * (lmax + 1) * channels)[:, None]  # (D, 1)
        per_coefficient = balance.expand(-1, channels).flatten()
        self.register_constant("channel_mean", torch.full((channels,), 1.0 / channels))
        self.register_constant("balance_weight", per_coefficient)
        self.register_constant("balance_rows", balance)
        # (D, 1) -1 on the l=0 row: ``x + mean·centring`` centres that row alone in one op.
        self.register_buffer("centring", -(degree == 0).float()[:, None], persistent=False)

    def affine_rows(self, *, live: bool = True) -> tuple[Tensor, Tensor]:
        """``(scale_rows, bias_rows)``, both ``(D, C)``: the per-degree scale repeated per order
        and the bias on the l=0 row (zero elsewhere); cached unless ``live``."""

        def build() -> tuple[Tensor, Tensor]:
            scale_rows = self.scale[:, 0, :].index_select(0, self.row_degree)
            return scale_rows, -self.centring * self.bias

        return derived_weights(self, "affine_rows", (self.scale, self.bias), build, live=live)

    def forward(self, x: Tensor, *, live: bool = True) -> Tensor:
        """``x (N, D, C) → (N, D, C)``; ``live=False`` reuses the affine rows of frozen weights and
        runs the closed-form first-order backward."""
        scale_rows, bias_rows = self.affine_rows(live=live)
        if eager_frozen(live):
            frozen = _FrozenEquivariantRMSNorm.apply
            out: Tensor = frozen(x, scale_rows, bias_rows, self)  # type: ignore[no-untyped-call]
            return out
        normalised, _ = self.normalise(x)
        return torch.addcmul(bias_rows, normalised, scale_rows)

    def normalise(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(n (N, D, C), r (N, 1, 1))``: the centred features times ``r``, the inverse RMS."""
        centred = self.centre(x)
        variance = centred.square().flatten(1) @ self.balance_weight  # (N,)
        inv_rms = torch.rsqrt(variance + self.eps)[:, None, None]
        return centred * inv_rms, inv_rms

    def centre(self, x: Tensor) -> Tensor:
        """The l=0 row minus its channel mean, other rows unchanged (a symmetric projection,
        hence also its own adjoint). The mean is a mat-vec on the row-0 view: no copy whatever
        the layout of ``x`` (gradients arrive degree-major from a DegreeLinear)."""
        return torch.addcmul(x, (x[:, 0] @ self.channel_mean)[:, None, None], self.centring)


def _refuse_second_order() -> None:
    """The closed forms are first order. ``once_differentiable`` is not enough: its error node is
    not always on the path of a later derivative, which then silently misses this term."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            "frozen-weight norms (live_weights=False) have first-order derivatives only; "
            "run with live weights for create_graph (training)"
        )


class _FrozenEquivariantRMSNorm(torch.autograd.Function):
    """:class:`EquivariantRMSNorm` with constant affine rows and a closed-form backward."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, x: Tensor, scale_rows: Tensor, bias_rows: Tensor, norm: Any
    ) -> Tensor:
        normalised, inv_rms = norm.normalise(x)
        ctx.save_for_backward(normalised, inv_rms, scale_rows)
        ctx.norm = norm  # type: ignore[attr-defined]
        return torch.addcmul(bias_rows, normalised, scale_rows)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        _refuse_second_order()
        normalised, inv_rms, scale_rows = ctx.saved_tensors
        norm: EquivariantRMSNorm = ctx.norm
        grad_n = grad * scale_rows
        dot = (grad_n * normalised).sum(dim=(1, 2), keepdim=True)  # (N, 1, 1)
        weighted = normalised * norm.balance_rows
        grad_centred = torch.addcmul(grad_n, weighted, dot, value=-1.0) * inv_rms
        return norm.centre(grad_centred), None, None, None


class ScalarRMSNorm(nn.Module):
    """``x·rsqrt(mean_c x² + eps)·scale[f]`` on ``(N, F, C)``; ``scale (F, C)``.

    Norms of one input share its RMS (:func:`unit_rms`, computed once) and a linear map follows
    each of them, so the scale is folded into that map's weight (:meth:`fold`) instead of being
    an elementwise pass of its own.
    """

    def __init__(self, channels: int, n_focus: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(n_focus, channels))

    def fold(self, weight: Tensor) -> Tensor:
        """``diag(scale[f]) @ weight[f]`` for a per-focus map ``weight (F, C, out)``."""
        return self.scale[:, :, None] * weight


def unit_rms(x: Tensor, eps: float, *, live: bool = True) -> Tensor:
    """``x·rsqrt(mean_c x² + eps)`` on ``(N, F, C)``; ``live=False``: closed-form first-order
    backward."""
    if eager_frozen(live):
        out: Tensor = _FrozenUnitRMS.apply(x, eps)  # type: ignore[no-untyped-call]
        return out
    return _unit_rms(x, eps)[0]


def _unit_rms(x: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(n, r)`` with ``r = rsqrt(mean_c x² + eps)`` ``(N, F, 1)`` and ``n = x·r``."""
    inv_rms = torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps)
    return x * inv_rms, inv_rms


class _FrozenUnitRMS(torch.autograd.Function):
    """:func:`unit_rms` with the closed-form backward (weights ``w_k = 1/C``)."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, eps: float) -> Tensor:
        normalised, inv_rms = _unit_rms(x, eps)
        ctx.save_for_backward(normalised, inv_rms)
        return normalised

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        _refuse_second_order()
        normalised, inv_rms = ctx.saved_tensors
        dot = (grad * normalised).sum(dim=-1, keepdim=True)
        scaled = torch.addcmul(grad, normalised, dot, value=-1.0 / normalised.shape[-1])
        return scaled * inv_rms, None
