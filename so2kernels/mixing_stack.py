"""The SO(2) mixing stack of one convolution: ``so2kernels::so2_mixing_stack``.

Layout contract.
``u0 (F, E, ROW)`` is the focus-major, m-major activation of :mod:`so2kernels._layout` (``ROW =
(3L+1)·Cf``; the first ``M0 = (L+1)·Cf`` columns are the m=0 block, the remaining ``M1 = 2L·Cf``
the ``[m=-1 | m=+1]`` block). Weights are stacked per layer in (in, out) storage, ``y = x @ W``:

* ``w0_all (n, F, M0, M0)``: m=0 block of every layer (cross-degree mixing allowed);
* ``w1_all (n, F, M1, M1)``: the assembled ``[[W_u, W_v], [-W_v, W_u]]`` |m|=1 block;
* ``gw_all (n-1, F, Cf, LG)``: gate projections of the ``n-1`` gated layers (``LG = L·Cf``);
* ``alpha (E, F)``: focus-competition weight, strictly positive (``≥ 0.02/F``), used only when
  ``apply_alpha``.

Semantics, per focus stream ``f`` (every layer has its own weights per focus)::

    u = u0
    for k in 0..n-2:                        # gated layers
        z_k = [u_m0 @ W0[k] | u_m1 @ W1[k]]
        u   = u + gated_act(z_k, Wg[k])     # see so2kernels.gated_act
    u_final = u                             # input of the final identity layer
    out = u + [u_m0 @ W0[n-1] | u_m1 @ W1[n-1]]
    x_local[e, f] = alpha[e, f] * out[f, e] if apply_alpha else out[f, e]

Outputs: ``x_local (E, F, ROW)`` edge-major, ``z_all (n-1, F, E, ROW)`` the stacked gated
pre-activations, ``u_final (F, E, ROW)`` the input of the final identity layer (before the final
layer and before alpha). The backward recovers every gated layer's input from ``u_final`` by
``u_k = u_{k+1} - act(z_k)`` instead of storing it.

Contents: operand checks → eager reference → launcher over the Triton kernels of
:mod:`so2kernels.mixing_stack_kernels` → op registration (fake, autograd; the backward lives in
:mod:`so2kernels.mixing_stack_backward`).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
from torch import Tensor
from torch.library import wrap_triton

from so2kernels._dispatch import UnsupportedInputError, require_fp32, use_triton
from so2kernels._layout import block_widths, check_regime, row_width
from so2kernels.gated_act import gated_act, gated_act_backward, gated_act_reference
from so2kernels.mixing_stack_backward import mixing_stack_backward, stack_backward_composed
from so2kernels.mixing_stack_kernels import (
    StackPrecision,
    block_fwd_kernel,
    gate_fwd_kernel,
    tile_config,
    weight_operands,
)

__all__ = [
    "StackPrecision",
    "check_stack_operands",
    "mixing_stack_reference",
    "so2_mixing_stack",
]


# Operand checks


def check_stack_operands(
    op: str,
    u0: Tensor,
    alpha: Tensor,
    w0_all: Tensor,
    w1_all: Tensor,
    gw_all: Tensor,
    lmax: int,
    focus_dim: int,
) -> None:
    """Shapes must follow the layout contract; raises ``ValueError`` naming the operand."""
    m0, m1, gate_width = block_widths(lmax, focus_dim)
    row = row_width(lmax, focus_dim)
    if u0.dim() != 3 or u0.shape[2] != row:
        raise ValueError(
            f"so2kernels.{op}: u0 must be (F, E, ROW={row}) for lmax={lmax}, "
            f"focus_dim={focus_dim}; got {tuple(u0.shape)}"
        )
    n_focus, n_edge, _ = u0.shape
    n_layers = w0_all.shape[0] if w0_all.dim() == 4 else -1
    expected = {
        "alpha": (alpha, (n_edge, n_focus)),
        "w0_all": (w0_all, (n_layers, n_focus, m0, m0)),
        "w1_all": (w1_all, (n_layers, n_focus, m1, m1)),
        "gw_all": (gw_all, (n_layers - 1, n_focus, focus_dim, gate_width)),
    }
    if n_layers < 1:
        raise ValueError(
            f"so2kernels.{op}: w0_all must be (n_layers>=1, F, M0, M0); got {tuple(w0_all.shape)}"
        )
    for name, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"so2kernels.{op}: {name} must have shape {shape} (n_layers={n_layers}, "
                f"F={n_focus}, E={n_edge}, lmax={lmax}, focus_dim={focus_dim}); "
                f"got {tuple(tensor.shape)}"
            )


# Eager reference (any dtype, differentiable by plain autograd)


def _block_linear(u: Tensor, w0: Tensor, w1: Tensor, m0: int) -> Tensor:
    """``[u_m0 @ w0 | u_m1 @ w1]`` per focus: ``w0 (F, M0, M0)``, ``w1 (F, M1, M1)``."""
    return torch.cat([torch.bmm(u[:, :, :m0], w0), torch.bmm(u[:, :, m0:], w1)], dim=-1)


def mixing_stack_reference(
    u0: Tensor,
    alpha: Tensor,
    w0_all: Tensor,
    w1_all: Tensor,
    gw_all: Tensor,
    lmax: int,
    focus_dim: int,
    apply_alpha: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Eager ground truth of ``so2_mixing_stack``; returns ``(x_local, z_all, u_final)``.

    Shapes: ``x_local (E, F, ROW)``, ``z_all (n-1, F, E, ROW)``, ``u_final (F, E, ROW)``. Any
    floating dtype; differentiable (also twice) by autograd.
    """
    check_stack_operands(
        "mixing_stack_reference", u0, alpha, w0_all, w1_all, gw_all, lmax, focus_dim
    )
    m0 = block_widths(lmax, focus_dim)[0]
    n_gated = gw_all.shape[0]
    u = u0
    pre_activations: list[Tensor] = []
    for layer in range(n_gated):
        z = _block_linear(u, w0_all[layer], w1_all[layer], m0)
        pre_activations.append(z)
        gw = gw_all[layer]
        u = u + gated_act_reference(z, gw, gw.transpose(1, 2), lmax, focus_dim)
    u_final = u
    out = u + _block_linear(u, w0_all[n_gated], w1_all[n_gated], m0)
    if apply_alpha:
        out = out * alpha.transpose(0, 1).unsqueeze(-1).to(out.dtype)
    x_local = out.transpose(0, 1).contiguous()
    z_all = torch.stack(pre_activations) if pre_activations else u0.new_empty((0, *u0.shape))
    return x_local, z_all, u_final


# Launcher (kernels in so2kernels.mixing_stack_kernels)


def _mixing_stack_fused(
    u0: Tensor,
    alpha: Tensor,
    w0_all: Tensor,
    w1_all: Tensor,
    gw_all: Tensor,
    lmax: int,
    focus_dim: int,
    apply_alpha: bool,
    precision: StackPrecision,
) -> tuple[Tensor, Tensor, Tensor]:
    """Triton forward; operands contiguous fp32.

    Per gated layer three launches: the m=0 GEMM (stores z, finishes the SiLU scalar rows), the
    gate GEMM (σ from the scalar rows, finishes the l>=1 m=0 rows, leaves σ), the |m|=1 GEMM
    (stores z, applies σ and the residual). The final layer is two GEMMs storing
    ``(u + u@W)·alpha`` edge-major.
    """
    n_focus, n_edge, row = u0.shape
    n_gated = gw_all.shape[0]
    m0, m1, gate_width = block_widths(lmax, focus_dim)
    z_all = u0.new_empty((n_gated, n_focus, n_edge, row))
    x_local = u0.new_empty((n_edge, n_focus, row))
    if n_edge == 0:
        return x_local, z_all, u0.clone()
    fast = precision is StackPrecision.FAST
    gemm = tile_config("fwd", focus_dim, lmax, precision, u0.device)
    gate = tile_config("gate", focus_dim, lmax, precision, u0.device)
    w0 = weight_operands(w0_all, precision)
    w1 = weight_operands(w1_all, precision)
    gws = weight_operands(gw_all, precision)
    shared = {"L": lmax, "FD": focus_dim, "FAST": fast}
    gemm_meta = {
        "BLOCK_M": gemm.block_m, "BLOCK_N": gemm.block_n, "BLOCK_K": gemm.block_k,
        "num_warps": gemm.num_warps, "num_stages": gemm.num_stages, **shared,
    }  # fmt: skip
    gate_meta = {
        "BLOCK_M": gate.block_m, "BLOCK_N": gate.block_n, "BLOCK_K": gate.block_k,
        "num_warps": gate.num_warps, "num_stages": gate.num_stages, **shared,
    }  # fmt: skip

    def grid(width: int, block_m: int, block_n: int) -> tuple[int, int]:
        return triton.cdiv(n_edge, block_m) * triton.cdiv(width, block_n), n_focus

    sig = u0.new_empty((n_focus, n_edge, gate_width))
    u = u0
    for layer in range(n_gated):
        out = torch.empty_like(u0)
        wrap_triton(block_fwd_kernel)[grid(m0, gemm.block_m, gemm.block_n)](
            u, w0[0], w0[1], z_all, sig, alpha, out, n_edge, layer,
            M1_BLOCK=False, FINAL=False, APPLY_ALPHA=False, **gemm_meta,
        )  # fmt: skip
        wrap_triton(gate_fwd_kernel)[grid(gate_width, gate.block_m, gate.block_n)](
            z_all, gws[0], gws[1], u, sig, out, n_edge, layer,
            HAS_RES=True, ALL_ROWS=False, STORE_SIG=True, **gate_meta,
        )  # fmt: skip
        wrap_triton(block_fwd_kernel)[grid(m1, gemm.block_m, gemm.block_n)](
            u, w1[0], w1[1], z_all, sig, alpha, out, n_edge, layer,
            M1_BLOCK=True, FINAL=False, APPLY_ALPHA=False, **gemm_meta,
        )  # fmt: skip
        u = out
    for is_m1, (w, w_lo), width in ((False, w0, m0), (True, w1, m1)):
        wrap_triton(block_fwd_kernel)[grid(width, gemm.block_m, gemm.block_n)](
            u, w, w_lo, z_all, sig, alpha, x_local, n_edge, n_gated,
            M1_BLOCK=is_m1, FINAL=True, APPLY_ALPHA=apply_alpha, **gemm_meta,
        )  # fmt: skip
    u_final = u if n_gated > 0 else u0.clone()
    return x_local, z_all, u_final


# Op registration


@torch.library.triton_op("so2kernels::so2_mixing_stack", mutates_args=())
def _mixing_stack_op(
    u0: Tensor,
    alpha: Tensor,
    w0_all: Tensor,
    w1_all: Tensor,
    gw_all: Tensor,
    lmax: int,
    focus_dim: int,
    apply_alpha: bool,
    precision: str = "ieee",
) -> tuple[Tensor, Tensor, Tensor]:
    tier = StackPrecision.parse(precision)
    check_stack_operands("so2_mixing_stack", u0, alpha, w0_all, w1_all, gw_all, lmax, focus_dim)
    if not use_triton(u0, alpha, w0_all, w1_all, gw_all):
        if tier is not StackPrecision.EXACT:
            raise UnsupportedInputError(
                f"so2kernels.so2_mixing_stack: precision {tier.value!r} needs the Triton path "
                f"(CUDA tensors, or TRITON_INTERPRET=1); got device {u0.device}"
            )
        x_local, z_all, u_final = mixing_stack_reference(
            u0, alpha, w0_all, w1_all, gw_all, lmax, focus_dim, apply_alpha
        )
        # An op output must not alias an input (u_final is u0 itself for a 1-layer stack).
        return x_local, z_all.contiguous(), u_final.clone() if u_final is u0 else u_final
    check_regime("so2_mixing_stack", lmax, focus_dim)
    require_fp32(
        "so2_mixing_stack", u0=u0, alpha=alpha, w0_all=w0_all, w1_all=w1_all, gw_all=gw_all
    )
    return _mixing_stack_fused(
        u0.contiguous(), alpha.contiguous(), w0_all.contiguous(), w1_all.contiguous(),
        gw_all.contiguous(), lmax, focus_dim, apply_alpha, tier,
    )  # fmt: skip


@_mixing_stack_op.register_fake  # type: ignore[untyped-decorator]
def _mixing_stack_fake(
    u0: Tensor,
    alpha: Tensor,
    w0_all: Tensor,
    w1_all: Tensor,
    gw_all: Tensor,
    lmax: int,
    focus_dim: int,
    apply_alpha: bool,
    precision: str = "ieee",
) -> tuple[Tensor, Tensor, Tensor]:
    n_focus, n_edge, row = u0.shape
    return (
        u0.new_empty((n_edge, n_focus, row)),
        u0.new_empty((gw_all.shape[0], n_focus, n_edge, row)),
        u0.new_empty((n_focus, n_edge, row)),
    )


def _mixing_stack_setup_context(
    ctx: Any,
    inputs: tuple[Tensor, Tensor, Tensor, Tensor, Tensor, int, int, bool, str],
    output: tuple[Tensor, Tensor, Tensor],
) -> None:
    u0, alpha, w0_all, w1_all, gw_all, lmax, focus_dim, apply_alpha, precision = inputs
    x_local, z_all, u_final = output
    ctx.save_for_backward(u0, alpha, w0_all, w1_all, gw_all, x_local, z_all, u_final)
    # z_all and u_final usually have no consumer: keep their cotangents None, not zero tensors.
    ctx.set_materialize_grads(False)
    ctx.lmax, ctx.focus_dim = lmax, focus_dim
    ctx.apply_alpha, ctx.precision = apply_alpha, precision


def _mixing_stack_backward(
    ctx: Any,
    grad_out: Tensor | None,
    grad_z: Tensor | None,
    grad_u: Tensor | None,
) -> tuple[Tensor | None, ...]:
    """Fused first order; the composed closed form when the backward itself is differentiated."""
    u0, alpha, w0_all, w1_all, gw_all, x_local, z_all, u_final = ctx.saved_tensors
    lmax, focus_dim = ctx.lmax, ctx.focus_dim
    apply_alpha = ctx.apply_alpha
    needs = ctx.needs_input_grad
    if grad_out is None and grad_z is None and grad_u is None:
        return (None,) * 9
    grad_out = torch.zeros_like(x_local) if grad_out is None else grad_out.contiguous()
    need_weights = any(needs[2:5])
    if torch.is_grad_enabled():
        # create_graph: compose registered ops and bmm so that a force loss can differentiate
        # this backward again through closed forms.
        def act(z: Tensor, gw: Tensor, gwt: Tensor) -> Tensor:
            return gated_act(z, gw, gwt, lmax, focus_dim)

        def act_bwd(g: Tensor, z: Tensor, gw: Tensor, gwt: Tensor) -> tuple[Tensor, Tensor]:
            return gated_act_backward(g, z, gw, gwt.contiguous(), lmax, focus_dim)

        grads = stack_backward_composed(
            grad_out, x_local, z_all, u_final, alpha, u0, w0_all, w1_all, gw_all, grad_z, grad_u,
            lmax, focus_dim, apply_alpha, need_weights, act, act_bwd,
        )  # fmt: skip
    else:
        grads = mixing_stack_backward(
            grad_out, x_local, z_all, u_final, alpha, u0, w0_all, w1_all, gw_all, grad_z, grad_u,
            lmax, focus_dim, apply_alpha, need_weights, ctx.precision,
        )  # fmt: skip
    grad_u0, grad_alpha, grad_w0, grad_w1, grad_gw = grads
    return (
        grad_u0,
        grad_alpha if apply_alpha and needs[1] else None,
        grad_w0 if need_weights else None,
        grad_w1 if need_weights else None,
        grad_gw if need_weights else None,
        None,
        None,
        None,
        None,
    )


_mixing_stack_op.register_autograd(
    _mixing_stack_backward, setup_context=_mixing_stack_setup_context
)


def so2_mixing_stack(
    u0: Tensor,
    alpha: Tensor,
    w0_all: Tensor,
    w1_all: Tensor,
    gw_all: Tensor,
    lmax: int,
    focus_dim: int,
    apply_alpha: bool,
    precision: StackPrecision | str = StackPrecision.EXACT,
) -> tuple[Tensor, Tensor, Tensor]:
    """``torch.ops.so2kernels.so2_mixing_stack``: the whole mixing stack as one op.

    ``u0 (F, E, ROW)``, ``alpha (E, F)``, ``w0_all (n, F, M0, M0)``, ``w1_all (n, F, M1, M1)``,
    ``gw_all (n-1, F, Cf, LG)`` → ``(x_local (E, F, ROW), z_all (n-1, F, E, ROW), u_final (F, E,
    ROW))``. ``precision`` picks the GEMM tier (``"ieee"`` exact fp32, ``"fp16x3"`` fast; the
    fast tier needs the Triton path and is never chosen implicitly). Differentiable twice.
    """
    tier = StackPrecision.parse(precision)
    outputs: tuple[Tensor, Tensor, Tensor] = _mixing_stack_op(
        u0, alpha, w0_all, w1_all, gw_all, int(lmax), int(focus_dim), bool(apply_alpha), tier.value
    )
    return outputs
