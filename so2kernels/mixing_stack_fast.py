"""Measured error of a mixing-stack precision tier against a float64 reference.

The fast tier (``StackPrecision.FAST``, fp16x3) is opt-in; this is how its accuracy is reported.
Relative error here is normwise per tensor, ``max|x - x_ref| / max|x_ref|``, for the forward
output ``x_local`` and for the force-path gradients ``grad_u0`` and ``grad_alpha`` under a given
output cotangent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from so2kernels._layout import EdgeFocus, FocusRows, GateBlocks, LayerBlocks
from so2kernels.mixing_stack import mixing_stack_reference, so2_mixing_stack
from so2kernels.mixing_stack_kernels import StackPrecision

__all__ = ["StackError", "measure_stack_error", "normwise_rel_error"]


@dataclass(frozen=True)
class StackError:
    """Normwise relative errors of one tier against float64; ``non_finite`` flags NaN/inf output."""

    precision: str
    x_local: float
    grad_u0: float
    grad_alpha: float
    non_finite: bool


def normwise_rel_error(x: Tensor, ref: Tensor) -> float:
    """``max|x - ref| / max|ref|`` in float64 (the absolute error where ``ref`` is all zero)."""
    scale = ref.abs().max().item() if ref.numel() else 0.0
    if scale == 0.0:
        return float((x.double() - ref).abs().max().item()) if x.numel() else 0.0
    return float((x.double() - ref).abs().max().item() / scale)


def measure_stack_error(
    u0: FocusRows,
    alpha: EdgeFocus,
    w0_all: LayerBlocks,
    w1_all: LayerBlocks,
    gw_all: GateBlocks,
    lmax: int,
    focus_dim: int,
    apply_alpha: bool,
    precision: StackPrecision | str,
    grad_out: Tensor | None = None,
) -> StackError:
    """Run ``precision`` (fp32 operands) and the float64 reference on the same inputs; compare.

    ``grad_out (E, F, ROW)`` is the output cotangent for the gradient comparison (random normal
    when omitted). Costs one fp64 forward+backward: use moderate edge counts.
    """
    tier = StackPrecision.parse(precision)
    if grad_out is None:
        grad_out = torch.randn(
            u0.shape[1], u0.shape[0], u0.shape[2], device=u0.device, dtype=torch.float32
        )

    def run(dtype: torch.dtype, fused: bool) -> tuple[Tensor, tuple[Tensor | None, ...]]:
        x0 = u0.detach().to(dtype).requires_grad_()
        a = alpha.detach().to(dtype).requires_grad_()
        w0, w1, gw = (t.detach().to(dtype) for t in (w0_all, w1_all, gw_all))
        if fused:
            out = so2_mixing_stack(x0, a, w0, w1, gw, lmax, focus_dim, apply_alpha, tier)[0]
        else:
            out = mixing_stack_reference(x0, a, w0, w1, gw, lmax, focus_dim, apply_alpha)[0]
        assert grad_out is not None
        cot = grad_out.to(dtype)
        grads = torch.autograd.grad(out, (x0, a), cot, allow_unused=True)
        return out.detach(), grads

    x_local, grads = run(torch.float32, True)
    ref_x, ref_grads = run(torch.float64, False)

    def rel_or_zero(x: Tensor | None, ref: Tensor | None) -> float:
        return 0.0 if x is None or ref is None else normwise_rel_error(x, ref)

    non_finite = not bool(torch.isfinite(x_local).all()) or any(
        g is not None and not bool(torch.isfinite(g).all()) for g in grads
    )
    return StackError(
        precision=tier.value,
        x_local=normwise_rel_error(x_local, ref_x),
        grad_u0=rel_or_zero(grads[0], ref_grads[0]),
        grad_alpha=rel_or_zero(grads[1], ref_grads[1]),
        non_finite=non_finite,
    )
