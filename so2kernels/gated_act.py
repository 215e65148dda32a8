"""Gated SO(2) activation of one mixing layer: ``so2kernels::gated_act``.

Layout contract.
``z`` holds one pre-activation row of width ``ROW = (3L+1)·Cf`` per (focus stream, edge), i.e.
``(F, E, ROW)`` focus-major, stored in the m-major reduced order of :mod:`so2kernels._layout`:
columns ``[0, Cf)`` are the ``l = 0`` scalar row, ``[Cf, M0)`` the ``m = 0`` rows of degrees
``1..L``, ``[M0, M0+LG)`` the ``m = -1`` rows and ``[M0+LG, ROW)`` the ``m = +1`` rows
(``M0 = (L+1)·Cf``, ``LG = L·Cf``).

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

from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.library import wrap_triton

from so2kernels._dispatch import launch_device, require_fp32, use_triton
from so2kernels._layout import FocusRows, GateWeights, check_regime, row_width
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


class _Dims(NamedTuple):
    """Static geometry of one call: maximum degree and per-focus channel width."""

    lmax: int
    focus_dim: int

    @property
    def gate_width(self) -> int:
        return self.lmax * self.focus_dim


def check_gated_act_operands(op: str, z: Tensor, gw: Tensor, *, lmax: int, focus_dim: int) -> None:
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


def _degree_gates(s: Tensor, proj: Tensor) -> Tensor:
    """``sigmoid(s @ proj)``: one gate per (degree, channel), ``(F, E, LG)``."""
    return torch.bmm(s, proj).sigmoid()


def gated_act_reference(
    z: FocusRows, gw: GateWeights, gwt: Tensor | None, lmax: int, focus_dim: int
) -> FocusRows:
    """Eager ground truth of :func:`gated_act` (``z (F, E, ROW)``, ``gw (F, Cf, LG)``).

    ``gwt`` is only there so the argument list matches the fused op; it is never read.
    """
    del gwt, lmax
    work = _gate_dtype(z.dtype)
    s = z[..., :focus_dim].to(work)
    # One multiplier per column: SiLU's own sigmoid on the scalar row, then the degree gates
    # repeated for the m = 0, m = -1 and m = +1 blocks (each element is a single product).
    factor = torch.cat(
        [s.sigmoid().to(z.dtype), _degree_gates(s, gw.to(work)).to(z.dtype).repeat(1, 1, 3)],
        dim=2,
    )
    return z * factor


def gated_act_backward_reference(
    grad: Tensor, z: Tensor, gw: Tensor, /, lmax: int, focus_dim: int
) -> tuple[Tensor, Tensor]:
    """Vector-Jacobian product of :func:`gated_act_reference` in z, written out by hand.

    Gives ``grad_z (F, E, ROW)`` together with ``grad_logit (F, E, LG)``, the cotangent of the
    gate logits ``q = z_scalar @ gw``; contracting ``z_scalarᵀ @ grad_logit`` yields the gate
    weight's gradient. The path through the logits back into the scalar rows is already part of
    ``grad_z``. Plain ATen, so autograd can differentiate it again.
    """
    n_focus, n_edge, _ = z.shape
    lg = lmax * focus_dim
    s = z[..., :focus_dim]
    sig_s = s.sigmoid()
    gate = _degree_gates(s, gw)
    split = (n_focus, n_edge, 3, lg)
    g_r = grad[..., focus_dim:].reshape(split)
    z_r = z[..., focus_dim:].reshape(split)
    grad_logit = (g_r * z_r).sum(2) * gate * (1.0 - gate)
    d_silu = sig_s * (1.0 + s * (1.0 - sig_s))
    head = grad[..., :focus_dim] * d_silu + torch.bmm(grad_logit, gw.mT)
    tail = (g_r * gate[:, :, None, :]).reshape(n_focus, n_edge, 3 * lg)
    return torch.cat([head, tail], dim=-1), grad_logit


_Triple = tuple[Tensor, Tensor, Tensor]


def gated_act_double_backward_reference(
    h_grad_z: Tensor | None,
    h_grad_logit: Tensor | None,
    grad: Tensor,
    z: Tensor,
    gw: Tensor,
    *,
    lmax: int,
    focus_dim: int,
) -> _Triple:
    """Second order by hand: the VJP of :func:`gated_act_backward_reference`.

    Takes cotangents on its two outputs -- ``h_grad_z (F, E, ROW)`` and ``h_grad_logit
    (F, E, LG)``, each possibly ``None`` -- and gives gradients for ``grad (F, E, ROW)``,
    ``z (F, E, ROW)`` and ``gw (F, Cf, LG)`` in that order.

    Notation per edge: scalar row s, logits a = s·gw, σ = sigmoid(a), φ = sigmoid(s),
    P = Σ_rows g·z and q = P·σ(1−σ). First order: ``gz_s = g_s·silu'(s) + q·gwᵀ`` and
    ``gz_r = g_r·σ``. Going back through it: ``hq = h_q + h_s·gw`` (q enters gz_s),
    ``hσ = Σ_r h_r·g_r + hq·P·(1−2σ)``, ``ha = hσ·σ(1−σ)``.
    """
    n_focus, n_edge, row = z.shape
    fd = focus_dim
    split = (n_focus, n_edge, 3, lmax * fd)
    s = z[..., :fd]
    sig_s = s.sigmoid()
    gate = _degree_gates(s, gw)
    slope = gate * (1.0 - gate)
    g_r = grad[..., fd:].reshape(split)
    z_r = z[..., fd:].reshape(split)
    proj_gz = (g_r * z_r).sum(2)
    grad_logit = proj_gz * slope

    hs = None if h_grad_z is None else h_grad_z[..., :fd]
    hr = None if h_grad_z is None else h_grad_z[..., fd:].reshape(split)
    hq = torch.zeros_like(gate)
    if h_grad_logit is not None:
        hq = hq + h_grad_logit
    if hs is not None:
        hq = hq + torch.bmm(hs, gw)

    # Gate cotangent: from the gated rows (h_r·g_r) and from q = P·σ(1−σ).
    hq_s = hq * slope
    h_sig = hq * proj_gz * (1.0 - 2.0 * gate)
    if hr is not None:
        h_sig = h_sig + (hr * g_r).sum(2)
    ha = h_sig * slope

    # Gradient for grad.
    dg_r = hq_s[:, :, None, :] * z_r
    if hr is not None:
        dg_r = dg_r + hr * gate[:, :, None, :]
    dg_s = torch.zeros_like(s) if hs is None else hs * (sig_s * (1.0 + s * (1.0 - sig_s)))
    d_grad = torch.cat([dg_s, dg_r.reshape(n_focus, n_edge, row - fd)], dim=-1)

    # Gradient for z.
    dz_s = torch.bmm(ha, gw.mT)
    if hs is not None:
        curv = sig_s * (1.0 - sig_s) * (2.0 + s * (1.0 - 2.0 * sig_s))
        dz_s = dz_s + hs * grad[..., :fd] * curv
    dz_r = hq_s[:, :, None, :] * g_r
    d_z = torch.cat([dz_s, dz_r.reshape(n_focus, n_edge, row - fd)], dim=-1)

    # Gradient for gw: logit route sᵀ·ha, plus gz_s ∋ q·gwᵀ contributing h_sᵀ·q (transposed).
    d_gw = torch.bmm(s.mT, ha)
    if hs is not None:
        d_gw = d_gw + torch.bmm(hs.mT, grad_logit)
    return d_grad, d_z, d_gw


# Launchers (Triton kernels live in so2kernels.mixing_stack_kernels, shared with the stack)


def _exact_tiles(dims: _Dims, device: torch.device) -> TileConfig:
    return tile_config("gate", dims.focus_dim, dims.lmax, StackPrecision.EXACT, device)


def _launch_fwd(z: Tensor, gw: Tensor, dims: _Dims) -> Tensor:
    """Triton forward (``z``, ``gw`` contiguous fp32); one gate-GEMM launch fills all rows."""
    n_focus, n_edge, _ = z.shape
    out = torch.empty_like(z)
    if n_edge > 0:
        cfg = _exact_tiles(dims, z.device)
        wrap_triton(gate_fwd_kernel)[cfg.grid(n_edge, dims.gate_width, n_focus)](
            z, gw, gw, z, z, out, n_edge, 0,
            L=dims.lmax, FD=dims.focus_dim, HAS_RES=False, ALL_ROWS=True, STORE_SIG=False,
            FAST=False, **cfg.launch_meta(),
        )  # fmt: skip
    return out


def _launch_bwd(cot: Tensor, z: Tensor, proj: Tensor, proj_t: Tensor, dims: _Dims) -> _Pair:
    """Triton first order in two launches: gated rows plus logit cotangent first, then the
    scalar rows, which consume that cotangent."""
    n_focus, n_edge, _ = z.shape
    d_z = torch.empty_like(z)
    d_logit = z.new_empty((n_focus, n_edge, dims.gate_width))
    if n_edge == 0:
        return d_z, d_logit
    cfg = _exact_tiles(dims, z.device)
    common = {
        "L": dims.lmax, "FD": dims.focus_dim, "RECOVER": False, "FAST": False,
        **cfg.launch_meta(),
    }  # fmt: skip
    wrap_triton(gate_bwd_kernel)[cfg.grid(n_edge, dims.gate_width, n_focus)](
        z, proj, proj, cot, d_z, d_logit, z, z, n_edge, 0, **common
    )
    wrap_triton(scalar_bwd_kernel)[cfg.grid(n_edge, dims.focus_dim, n_focus)](
        d_logit, proj_t, proj_t, z, cot, d_z, z, z, n_edge, 0, **common
    )
    return d_z, d_logit


_Pair = tuple[Tensor, Tensor]


# Op registration


def _check_gwt(op: str, gw: Tensor, gwt: Tensor) -> None:
    expected = (gw.shape[0], gw.shape[2], gw.shape[1])
    if tuple(gwt.shape) != expected:
        raise ValueError(
            f"so2kernels.{op}: gwt must be gw.transpose(1, 2) with shape "
            f"{expected}; got {tuple(gwt.shape)}"
        )


def _check_act_operands(op: str, z: Tensor, gw: Tensor, gwt: Tensor, dims: _Dims) -> None:
    check_gated_act_operands(op, z, gw, lmax=dims.lmax, focus_dim=dims.focus_dim)
    _check_gwt(op, gw, gwt)


@torch.library.triton_op("so2kernels::gated_act", mutates_args=())
def _act_op(z: FocusRows, gw: GateWeights, gwt: Tensor, lmax: int, focus_dim: int) -> FocusRows:
    _check_act_operands("gated_act", z, gw, gwt, _Dims(lmax, focus_dim))
    if not use_triton(z, gw, gwt):  # contiguous, as the fake promises
        return gated_act_reference(z, gw, gwt, lmax, focus_dim).contiguous()
    check_regime("gated_act", lmax, focus_dim)
    require_fp32("gated_act", z=z, gw=gw, gwt=gwt)  # gwt: read by the backward
    with launch_device(z):
        return _launch_fwd(z.contiguous(), gw.contiguous(), _Dims(lmax, focus_dim))


@_act_op.register_fake  # type: ignore[untyped-decorator]
def _act_meta(z: Tensor, *operands: Any) -> Tensor:
    # operands: gw, gwt, lmax, focus_dim
    _check_act_operands("gated_act", z, operands[0], operands[1], _Dims(*operands[2:]))
    return torch.empty_like(z, memory_format=torch.contiguous_format)


def _check_act_bwd_operands(grad: Tensor, operands: tuple[Any, ...]) -> None:
    """``operands``: the forward's (z, gw, gwt, lmax, focus_dim)."""
    z, gw, gwt = operands[:3]
    _check_act_operands("gated_act_bwd", z, gw, gwt, _Dims(*operands[3:]))
    if grad.shape != z.shape:
        raise ValueError(
            f"so2kernels.gated_act_bwd: grad must have z's shape {tuple(z.shape)}; "
            f"got {tuple(grad.shape)}"
        )


@torch.library.triton_op("so2kernels::gated_act_bwd", mutates_args=())
def _act_bwd_op(
    grad: FocusRows, z: FocusRows, gw: GateWeights, gwt: Tensor, lmax: int, focus_dim: int
) -> _Pair:
    _check_act_bwd_operands(grad, (z, gw, gwt, lmax, focus_dim))
    if use_triton(grad, z, gw, gwt):
        check_regime("gated_act_bwd", lmax, focus_dim)
        require_fp32("gated_act_bwd", grad=grad, z=z, gw=gw, gwt=gwt)
        with launch_device(grad):
            return _launch_bwd(
                grad.contiguous(),
                z.contiguous(),
                gw.contiguous(),
                gwt.contiguous(),
                _Dims(lmax, focus_dim),
            )
    d_z, d_logit = gated_act_backward_reference(grad, z, gw, lmax, focus_dim)
    return d_z.contiguous(), d_logit.contiguous()


@_act_bwd_op.register_fake  # type: ignore[untyped-decorator]
def _act_bwd_meta(grad: Tensor, *operands: Any) -> _Pair:
    _check_act_bwd_operands(grad, operands)
    z, gw = operands[:2]
    # gw is (F, Cf, LG): its last extent is the logit width.
    return (
        torch.empty_like(z, memory_format=torch.contiguous_format),
        z.new_empty((z.shape[0], z.shape[1], gw.shape[2])),
    )


def _save_act(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.save_for_backward(*inputs[:3])  # z, gw, gwt
    ctx.dims = _Dims(*inputs[3:])


def _vjp_act(ctx: Any, cot: Tensor) -> tuple[Tensor | None, ...]:
    pre, proj, proj_t = ctx.saved_tensors
    dims: _Dims = ctx.dims
    d_pre, d_logit = _act_bwd_op(cot.contiguous(), pre, proj, proj_t, *dims)
    # The gate-weight gradient sums over all edges: one bmm (cuBLAS on GPU), still ATen and so
    # differentiable.
    d_proj = torch.bmm(pre[..., : dims.focus_dim].mT, d_logit)
    return (d_pre, d_proj) + (None,) * 3


def _save_act_bwd(ctx: Any, inputs: tuple[Any, ...], output: _Pair) -> None:
    # gwt (index 3) is a transposed copy of gw and is not needed for the second order.
    ctx.save_for_backward(*inputs[:3])  # grad, z, gw
    ctx.dims = _Dims(*inputs[4:])


def _vjp_act_bwd(
    ctx: Any, h_grad_z: Tensor | None, h_grad_logit: Tensor | None
) -> tuple[Tensor | None, ...]:
    """Second order in closed form; ``gwt`` only mirrors ``gw`` and receives no gradient."""
    saved = ctx.saved_tensors
    firsts = gated_act_double_backward_reference(
        h_grad_z, h_grad_logit, *saved, **ctx.dims._asdict()
    )
    return firsts + (None,) * 3


_act_op.register_autograd(_vjp_act, setup_context=_save_act)
_act_bwd_op.register_autograd(_vjp_act_bwd, setup_context=_save_act_bwd)


def gated_act(z: FocusRows, gw: GateWeights, gwt: Tensor, lmax: int, focus_dim: int) -> FocusRows:
    """``torch.ops.so2kernels.gated_act``: the gated SO(2) activation of one layer.

    ``z (F, E, ROW)``, ``gw (F, Cf, LG)``, ``gwt = gw.transpose(1, 2)`` ``(F, LG, Cf)`` →
    ``(F, E, ROW)``. Triton on CUDA (or under ``TRITON_INTERPRET=1``), fp32 only there; the eager
    reference elsewhere. Differentiable twice (closed forms); ``gwt`` receives no gradient.
    """
    dims = _Dims(int(lmax), int(focus_dim))
    out: Tensor = _act_op(z, gw, gwt, *dims)
    return out


def gated_act_backward(
    grad: FocusRows, z: FocusRows, gw: GateWeights, gwt: Tensor, lmax: int, focus_dim: int
) -> _Pair:
    """``torch.ops.so2kernels.gated_act_bwd``: ``(grad_z (F, E, ROW), grad_logit (F, E, LG))``."""
    dims = _Dims(int(lmax), int(focus_dim))
    grads: _Pair = _act_bwd_op(grad, z, gw, gwt, *dims)
    return grads
