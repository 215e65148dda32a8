"""Gated SO(2) activation of one mixing layer: ``so2kernels::gated_act``.

Layout contract.
``z`` is a focus-major pre-activation ``(F, E, ROW)`` with ``ROW = (3L+1)·Cf`` in the m-major
reduced order of :mod:`so2kernels._layout`: columns ``[0, Cf)`` are the ``l = 0`` scalar row,
``[Cf, M0)`` the ``m = 0`` rows of degrees ``1..L``, ``[M0, M0+LG)`` the ``m = -1`` rows and
``[M0+LG, ROW)`` the ``m = +1`` rows (``M0 = (L+1)·Cf``, ``LG = L·Cf``).

``gw`` ``(F, Cf, LG)`` is the per-focus gate projection in (in, out) storage: the sigmoid gate of
degree ``l`` occupies columns ``[(l-1)·Cf, l·Cf)`` of ``sigmoid(z_scalar @ gw)``. ``gwt``
``(F, LG, Cf)`` must equal ``gw.transpose(1, 2)``: it only spares the backward a transposing copy
and receives no gradient of its own (every gate-weight gradient is returned on ``gw``).

Semantics (per focus stream and edge)::

    q   = z_scalar @ gw                     (LG,)   gate logits
    out[scalar]      = SiLU(z_scalar)
    out[m=0, l>=1]   = z * sigmoid(q)       (one gate per degree, broadcast over Cf)
    out[m=±1, l>=1]  = z * sigmoid(q)       (the same gate for both signs)

The gate is driven by the raw pre-activation scalar, never by its SiLU. Every degree-l row is
scaled by an l=0 quantity, so the operator commutes with rotations about the local z axis.

Contents: eager references (forward, closed-form backward, closed-form second order), then the
launchers over the shared Triton kernels of :mod:`so2kernels.mixing_stack_kernels`, then the op
registration (fake, autograd).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
from torch import Tensor
from torch.library import wrap_triton

from so2kernels._dispatch import require_fp32, use_triton
from so2kernels._layout import block_widths, check_regime, row_width
from so2kernels.mixing_stack_kernels import (
    StackPrecision,
    TileConfig,
    gate_bwd_kernel,
    gate_fwd_kernel,
    scalar_bwd_kernel,
    tile_config,
)

__all__ = [
    "gated_act",
    "gated_act_backward",
    "gated_act_backward_reference",
    "gated_act_double_backward_reference",
    "gated_act_reference",
]


# Operand checks


def check_gated_act_operands(op: str, z: Tensor, gw: Tensor, lmax: int, focus_dim: int) -> None:
    """Shapes must follow the layout contract; raises ``ValueError`` with the offending shape."""
    row = row_width(lmax, focus_dim)
    gate_width = lmax * focus_dim
    if z.dim() != 3 or z.shape[2] != row:
        raise ValueError(
            f"so2kernels.{op}: z must be (F, E, ROW={row}) for lmax={lmax}, focus_dim={focus_dim};"
            f" got {tuple(z.shape)}"
        )
    if tuple(gw.shape) != (z.shape[0], focus_dim, gate_width):
        raise ValueError(
            f"so2kernels.{op}: gw must be (F={z.shape[0]}, Cf={focus_dim}, LG={gate_width}); "
            f"got {tuple(gw.shape)}"
        )


# Eager references (any dtype, differentiable by plain autograd)


def _gate_dtype(dtype: torch.dtype) -> torch.dtype:
    """Gate logits are formed in at least fp32: reduced-precision sigmoids would quantise gates."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def gated_act_reference(z: Tensor, gw: Tensor, gwt: Tensor, lmax: int, focus_dim: int) -> Tensor:
    """Eager ground truth of :func:`gated_act`: ``z (F, E, ROW)``, ``gw (F, Cf, LG)``.

    ``gwt`` is accepted for signature parity with the fused op and is not read.
    """
    del gwt
    m0 = block_widths(lmax, focus_dim)[0]
    scalar = z[:, :, :focus_dim]
    cdt = _gate_dtype(z.dtype)
    gate = torch.sigmoid(torch.bmm(scalar.to(cdt), gw.to(cdt))).to(z.dtype)
    return torch.cat(
        [
            scalar * torch.sigmoid(scalar.to(cdt)).to(z.dtype),
            z[:, :, focus_dim:m0] * gate,
            z[:, :, m0:] * gate.repeat(1, 1, 2),
        ],
        dim=-1,
    )


def gated_act_backward_reference(
    grad: Tensor, z: Tensor, gw: Tensor, lmax: int, focus_dim: int
) -> tuple[Tensor, Tensor]:
    """Closed-form vector-Jacobian product of :func:`gated_act_reference` with respect to ``z``.

    Returns ``(grad_z (F, E, ROW), grad_logit (F, E, LG))`` where ``grad_logit`` is the cotangent
    of the gate logits ``q = z_scalar @ gw`` (the gate weight's gradient is
    ``z_scalarᵀ @ grad_logit``). ``grad_z`` already contains the route through the gate logits
    into the scalar rows. Differentiable by autograd (plain ATen).
    """
    gate_width = block_widths(lmax, focus_dim)[2]
    scalar = z[:, :, :focus_dim]
    gate = torch.sigmoid(torch.bmm(scalar, gw))
    swish_gate = torch.sigmoid(scalar)
    silu_slope = swish_gate * (1.0 + scalar * (1.0 - swish_gate))
    rows = (*z.shape[:2], 3, gate_width)
    g_rows = grad[:, :, focus_dim:].reshape(rows)
    z_rows = z[:, :, focus_dim:].reshape(rows)
    grad_logit = (g_rows * z_rows).sum(2) * gate * (1.0 - gate)
    grad_scalar = grad[:, :, :focus_dim] * silu_slope + torch.bmm(grad_logit, gw.transpose(1, 2))
    grad_rows = (g_rows * gate.unsqueeze(2)).reshape(z.shape[0], z.shape[1], 3 * gate_width)
    return torch.cat([grad_scalar, grad_rows], dim=-1), grad_logit


def gated_act_double_backward_reference(
    h_grad_z: Tensor | None,
    h_grad_logit: Tensor | None,
    grad: Tensor,
    z: Tensor,
    gw: Tensor,
    lmax: int,
    focus_dim: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Closed-form second order: the VJP of :func:`gated_act_backward_reference`.

    With cotangents ``h_grad_z (F, E, ROW)`` on ``grad_z`` and ``h_grad_logit (F, E, LG)`` on
    ``grad_logit`` (either may be ``None``), returns the gradients with respect to
    ``(grad (F, E, ROW), z (F, E, ROW), gw (F, Cf, LG))``.

    Per edge, with s the scalar row, a = s·gw, σ = sigmoid(a), φ = sigmoid(s), P = Σ_rows g·z and
    q = P·σ(1−σ): the first order is ``gz_s = g_s·silu'(s) + q·gwᵀ``, ``gz_r = g_r·σ``. Its
    adjoint collects ``hq = h_q + h_s·gw`` (``q`` feeds ``gz_s``), then
    ``hσ = Σ_r h_r·g_r + hq·P·(1−2σ)`` and ``ha = hσ·σ(1−σ)``.
    """
    gate_width = block_widths(lmax, focus_dim)[2]
    n_focus, n_edge, row = z.shape
    scalar = z[:, :, :focus_dim]
    gate = torch.sigmoid(torch.bmm(scalar, gw))
    gate_slope = gate * (1.0 - gate)
    swish_gate = torch.sigmoid(scalar)
    silu_slope = swish_gate * (1.0 + scalar * (1.0 - swish_gate))
    silu_curv = swish_gate * (1.0 - swish_gate) * (2.0 + scalar * (1.0 - 2.0 * swish_gate))
    shape_rows = (n_focus, n_edge, 3, gate_width)
    g_rows = grad[:, :, focus_dim:].reshape(shape_rows)
    z_rows = z[:, :, focus_dim:].reshape(shape_rows)
    grad_logit = (g_rows * z_rows).sum(2) * gate_slope

    h_scalar = h_grad_z[:, :, :focus_dim] if h_grad_z is not None else None
    h_logit = torch.zeros_like(gate)
    if h_grad_logit is not None:
        h_logit = h_logit + h_grad_logit
    if h_scalar is not None:
        h_logit = h_logit + torch.bmm(h_scalar, gw)
    h_rows = h_grad_z[:, :, focus_dim:].reshape(shape_rows) if h_grad_z is not None else None

    # Cotangent of the gate: through the gated rows (h_r·g_r) and through q = P·σ(1−σ).
    hq_slope = h_logit * gate_slope
    h_gate = h_logit * (g_rows * z_rows).sum(2) * (1.0 - 2.0 * gate)
    if h_rows is not None:
        h_gate = h_gate + (h_rows * g_rows).sum(2)
    h_gate_logit = h_gate * gate_slope

    # d/d grad
    grad_rows_wrt_g = hq_slope.unsqueeze(2) * z_rows
    if h_rows is not None:
        grad_rows_wrt_g = grad_rows_wrt_g + h_rows * gate.unsqueeze(2)
    grad_scalar_wrt_g = h_scalar * silu_slope if h_scalar is not None else torch.zeros_like(scalar)
    d_grad = torch.cat(
        [grad_scalar_wrt_g, grad_rows_wrt_g.reshape(n_focus, n_edge, row - focus_dim)], dim=-1
    )

    # d/d z
    d_scalar = torch.bmm(h_gate_logit, gw.transpose(1, 2))
    if h_scalar is not None:
        d_scalar = d_scalar + h_scalar * grad[:, :, :focus_dim] * silu_curv
    d_rows = hq_slope.unsqueeze(2) * g_rows
    d_z = torch.cat([d_scalar, d_rows.reshape(n_focus, n_edge, row - focus_dim)], dim=-1)

    # d/d gw: the logit route (sᵀ·ha) and the contraction gz_s ∋ q·gwᵀ (h_sᵀ·q, transposed).
    d_gw = torch.bmm(scalar.transpose(1, 2), h_gate_logit)
    if h_scalar is not None:
        d_gw = d_gw + torch.bmm(h_scalar.transpose(1, 2), grad_logit)
    return d_grad, d_z, d_gw


# Launchers (Triton kernels live in so2kernels.mixing_stack_kernels, shared with the stack)


def _gate_grid(n_edge: int, width: int, n_focus: int, cfg: TileConfig) -> tuple[int, int]:
    return triton.cdiv(n_edge, cfg.block_m) * triton.cdiv(width, cfg.block_n), n_focus


def _gated_act_fused(z: Tensor, gw: Tensor, lmax: int, focus_dim: int) -> Tensor:
    """Triton forward; ``z`` and ``gw`` contiguous fp32. One gate-GEMM launch writes every row."""
    n_focus, n_edge, _ = z.shape
    out = torch.empty_like(z)
    if n_edge == 0:
        return out
    cfg = tile_config("gate", focus_dim, lmax, StackPrecision.EXACT, z.device)
    gate_width = lmax * focus_dim
    wrap_triton(gate_fwd_kernel)[_gate_grid(n_edge, gate_width, n_focus, cfg)](
        z, gw, gw, z, z, out, n_edge, 0,
        L=lmax, FD=focus_dim, HAS_RES=False, ALL_ROWS=True, STORE_SIG=False, FAST=False,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def _gated_act_bwd_fused(
    grad: Tensor, z: Tensor, gw: Tensor, gwt: Tensor, lmax: int, focus_dim: int
) -> tuple[Tensor, Tensor]:
    """Triton first order: gated rows and logit cotangent, then the scalar rows (needs ``q``)."""
    n_focus, n_edge, _ = z.shape
    gate_width = lmax * focus_dim
    grad_z = torch.empty_like(z)
    grad_logit = z.new_empty((n_focus, n_edge, gate_width))
    if n_edge == 0:
        return grad_z, grad_logit
    cfg = tile_config("gate", focus_dim, lmax, StackPrecision.EXACT, z.device)
    tiles = {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k}
    launch = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    wrap_triton(gate_bwd_kernel)[_gate_grid(n_edge, gate_width, n_focus, cfg)](
        z, gw, gw, grad, grad_z, grad_logit, z, z, n_edge, 0,
        L=lmax, FD=focus_dim, RECOVER=False, FAST=False, **tiles, **launch,
    )  # fmt: skip
    wrap_triton(scalar_bwd_kernel)[_gate_grid(n_edge, focus_dim, n_focus, cfg)](
        grad_logit, gwt, gwt, z, grad, grad_z, z, z, n_edge, 0,
        L=lmax, FD=focus_dim, RECOVER=False, FAST=False, **tiles, **launch,
    )  # fmt: skip
    return grad_z, grad_logit


# Op registration


def _check_gwt(op: str, gw: Tensor, gwt: Tensor) -> None:
    if tuple(gwt.shape) != (gw.shape[0], gw.shape[2], gw.shape[1]):
        raise ValueError(
            f"so2kernels.{op}: gwt must be gw.transpose(1, 2) with shape "
            f"{(gw.shape[0], gw.shape[2], gw.shape[1])}; got {tuple(gwt.shape)}"
        )


@torch.library.triton_op("so2kernels::gated_act", mutates_args=())
def _gated_act_op(z: Tensor, gw: Tensor, gwt: Tensor, lmax: int, focus_dim: int) -> Tensor:
    check_gated_act_operands("gated_act", z, gw, lmax, focus_dim)
    _check_gwt("gated_act", gw, gwt)
    if not use_triton(z, gw, gwt):
        return gated_act_reference(z, gw, gwt, lmax, focus_dim)
    check_regime("gated_act", lmax, focus_dim)
    require_fp32("gated_act", z=z, gw=gw)
    return _gated_act_fused(z.contiguous(), gw.contiguous(), lmax, focus_dim)


@_gated_act_op.register_fake  # type: ignore[untyped-decorator]
def _gated_act_fake(z: Tensor, gw: Tensor, gwt: Tensor, lmax: int, focus_dim: int) -> Tensor:
    return torch.empty_like(z, memory_format=torch.contiguous_format)


@torch.library.triton_op("so2kernels::gated_act_bwd", mutates_args=())
def _gated_act_bwd_op(
    grad: Tensor, z: Tensor, gw: Tensor, gwt: Tensor, lmax: int, focus_dim: int
) -> tuple[Tensor, Tensor]:
    check_gated_act_operands("gated_act_bwd", z, gw, lmax, focus_dim)
    if not use_triton(grad, z, gw, gwt):
        grad_z, grad_logit = gated_act_backward_reference(grad, z, gw, lmax, focus_dim)
        return grad_z.contiguous(), grad_logit.contiguous()
    require_fp32("gated_act_bwd", grad=grad, z=z, gw=gw, gwt=gwt)
    return _gated_act_bwd_fused(
        grad.contiguous(), z.contiguous(), gw.contiguous(), gwt.contiguous(), lmax, focus_dim
    )


@_gated_act_bwd_op.register_fake  # type: ignore[untyped-decorator]
def _gated_act_bwd_fake(
    grad: Tensor, z: Tensor, gw: Tensor, gwt: Tensor, lmax: int, focus_dim: int
) -> tuple[Tensor, Tensor]:
    n_focus, n_edge, _ = z.shape
    return (
        torch.empty_like(z, memory_format=torch.contiguous_format),
        z.new_empty((n_focus, n_edge, lmax * focus_dim)),
    )


def _gated_act_setup_context(
    ctx: Any,
    inputs: tuple[Tensor, Tensor, Tensor, int, int],
    output: Tensor,
) -> None:
    z, gw, gwt, lmax, focus_dim = inputs
    ctx.save_for_backward(z, gw, gwt)
    ctx.lmax, ctx.focus_dim = lmax, focus_dim


def _gated_act_backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None, None, None]:
    z, gw, gwt = ctx.saved_tensors
    focus_dim = ctx.focus_dim
    grad_z, grad_logit = _gated_act_bwd_op(grad.contiguous(), z, gw, gwt, ctx.lmax, focus_dim)
    # The gate weight reduces over every edge: a bmm (cuBLAS on GPU), differentiable as ATen.
    grad_gw = torch.bmm(z[:, :, :focus_dim].transpose(1, 2), grad_logit)
    return grad_z, grad_gw, None, None, None


def _gated_act_bwd_setup_context(
    ctx: Any,
    inputs: tuple[Tensor, Tensor, Tensor, Tensor, int, int],
    output: tuple[Tensor, Tensor],
) -> None:
    grad, z, gw, _gwt, lmax, focus_dim = inputs
    ctx.save_for_backward(grad, z, gw)
    ctx.lmax, ctx.focus_dim = lmax, focus_dim


def _gated_act_bwd_backward(
    ctx: Any, h_grad_z: Tensor | None, h_grad_logit: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, None, None, None]:
    """Closed-form second order; ``gwt`` is a layout copy of ``gw`` and gets no gradient."""
    grad, z, gw = ctx.saved_tensors
    d_grad, d_z, d_gw = gated_act_double_backward_reference(
        h_grad_z,
        h_grad_logit,
        grad,
        z,
        gw,
        ctx.lmax,
        ctx.focus_dim,
    )
    return d_grad, d_z, d_gw, None, None, None


_gated_act_op.register_autograd(_gated_act_backward, setup_context=_gated_act_setup_context)
_gated_act_bwd_op.register_autograd(
    _gated_act_bwd_backward, setup_context=_gated_act_bwd_setup_context
)


def gated_act(z: Tensor, gw: Tensor, gwt: Tensor, lmax: int, focus_dim: int) -> Tensor:
    """``torch.ops.so2kernels.gated_act``: the gated SO(2) activation of one layer.

    ``z (F, E, ROW)``, ``gw (F, Cf, LG)``, ``gwt = gw.transpose(1, 2)`` ``(F, LG, Cf)`` →
    ``(F, E, ROW)``. Triton on CUDA (or under ``TRITON_INTERPRET=1``), fp32 only there; the eager
    reference elsewhere. Differentiable twice (closed forms); ``gwt`` receives no gradient.
    """
    out: Tensor = _gated_act_op(z, gw, gwt, int(lmax), int(focus_dim))
    return out


def gated_act_backward(
    grad: Tensor, z: Tensor, gw: Tensor, gwt: Tensor, lmax: int, focus_dim: int
) -> tuple[Tensor, Tensor]:
    """``torch.ops.so2kernels.gated_act_bwd``: ``(grad_z (F, E, ROW), grad_logit (F, E, LG))``."""
    grads: tuple[Tensor, Tensor] = _gated_act_bwd_op(grad, z, gw, gwt, int(lmax), int(focus_dim))
    return grads
