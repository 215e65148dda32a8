"""The SO(2) mixing stack of one convolution: ``so2kernels::so2_mixing_stack``.

Layout contract.
``u0 (F, E, ROW)`` is the focus-major, m-major activation of :mod:`so2kernels._layout` (``ROW =
(3L+1)·Cf``; the first ``M0 = (L+1)·Cf`` columns are the m=0 block, the remaining ``M1 = 2L·Cf``
the ``[m=-1 | m=+1]`` block). Weights are stacked per layer in (in, out) storage, ``y = x @ W``:

* ``w0_all (n, F, M0, M0)``: m=0 block of every layer (cross-degree mixing allowed);
* ``w1_all (n, F, M1, M1)``: the assembled ``[[W_u, W_v], [-W_v, W_u]]`` |m|=1 block;
* ``gw_all (n-1, F, Cf, LG)``: gate projections of the ``n-1`` gated layers (``LG = L·Cf``);
* ``alpha (E, F)``: focus-competition weight (the model's is ``≥ 0.02/F``; any value, 0
  included, is differentiated right), used only when ``apply_alpha``.

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
from torch import Tensor
from torch.library import wrap_triton

from so2kernels._dispatch import launch_device, require_fp32, use_triton
from so2kernels._layout import (
    EdgeFocus,
    FocusRows,
    GateBlocks,
    LayerBlocks,
    block_widths,
    check_regime,
    row_width,
)
from so2kernels.gated_act import gated_act, gated_act_backward, gated_act_reference
from so2kernels.mixing_stack_backward import mixing_stack_backward, stack_backward_composed
from so2kernels.mixing_stack_kernels import (
    StackPrecision,
    block_fwd_desc_kernel,
    block_fwd_kernel,
    desc_block_k,
    gate_fwd_kernel,
    persistent_grid,
    row_descriptor,
    tile_config,
    weight_descriptors,
    weight_operands,
)

StackOutputs = tuple[Tensor, Tensor, Tensor]  # (x_local, z_all, u_final)
_OPERAND_NAMES = ("u0", "alpha", "w0_all", "w1_all", "gw_all")  # the op's tensor operands

__all__ = [
    "StackPrecision",
    "check_stack_operands",
    "mixing_stack_reference",
    "so2_mixing_stack",
]


# Operand checks


def check_stack_operands(
    op: str,
    u0: FocusRows,
    alpha: EdgeFocus,
    w0_all: LayerBlocks,
    w1_all: LayerBlocks,
    gw_all: GateBlocks,
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


def _block_linear(act: Tensor, blocks: tuple[Tensor, Tensor], k: int, split: int) -> Tensor:
    """Layer ``k`` of a block stack, per focus: the first ``split`` columns of ``act`` through
    ``blocks[0][k]`` (m=0), the rest through ``blocks[1][k]`` (|m|=1), concatenated."""
    head = act.narrow(-1, 0, split).bmm(blocks[0][k])
    tail = act.narrow(-1, split, act.shape[-1] - split).bmm(blocks[1][k])
    return torch.cat((head, tail), dim=-1)


def mixing_stack_reference(
    u0: FocusRows,
    alpha: EdgeFocus,
    w0_all: LayerBlocks,
    w1_all: LayerBlocks,
    gw_all: GateBlocks,
    lmax: int,
    focus_dim: int,
    apply_alpha: bool,
    /,
) -> StackOutputs:
    """Plain-ATen evaluation of the layout contract (the op's fallback and its test oracle).

    Gives ``x_local (E, F, ROW)``, ``z_all (n-1, F, E, ROW)`` and ``u_final (F, E, ROW)``, in any
    floating dtype; autograd differentiates it (to second order as well).
    """
    operands = (u0, alpha, w0_all, w1_all, gw_all)
    check_stack_operands("mixing_stack_reference", *operands, lmax, focus_dim)
    split = block_widths(lmax, focus_dim)[0]
    blocks = (w0_all, w1_all)
    depth = gw_all.shape[0]
    zs: list[Tensor] = []
    act = u0
    for k in range(depth):
        zs.append(_block_linear(act, blocks, k, split))
        proj = gw_all[k]
        act = act + gated_act_reference(zs[-1], proj, proj.transpose(1, 2), lmax, focus_dim)
    result = act + _block_linear(act, blocks, depth, split)
    if apply_alpha:
        # alpha is (E, F): lay it out as (F, E, 1) against the focus-major rows.
        result = result * alpha.t()[:, :, None].to(result.dtype)
    stacked = torch.stack(zs) if zs else u0.new_empty((0, *u0.shape))
    return result.movedim(1, 0).contiguous(), stacked, act


# Launcher (kernels in so2kernels.mixing_stack_kernels)


def _mixing_stack_fused(
    operands: tuple[Tensor, ...], lmax: int, focus_dim: int, apply_alpha: bool, tier: StackPrecision
) -> StackOutputs:
    """Triton forward over contiguous fp32 ``operands = (u0, alpha, w0_all, w1_all, gw_all)``.

    A gated layer is three launches: the m=0 block GEMM (writes its z rows and completes the
    scalar SiLU rows), the gate GEMM (sigmoids from the scalar rows; completes the l>=1 m=0 rows
    and keeps the sigmoids), then the |m|=1 block GEMM (writes its z rows, gates them, adds the
    residual). The identity layer is one GEMM per block, storing ``(u + u@W)·alpha`` edge-major.
    The fast tier's block GEMMs run on persistent grids with descriptor-fed operands.
    """
    act, alpha, w0_all, w1_all, gw_all = operands
    n_focus, n_edge, row = act.shape
    depth = gw_all.shape[0]
    m0, m1, gate_width = block_widths(lmax, focus_dim)
    x_local = act.new_empty((n_edge, n_focus, row))
    z_all = act.new_empty((depth, n_focus, n_edge, row))
    if n_edge == 0:
        return x_local, z_all, act.clone()
    lin_tile = tile_config("fwd", focus_dim, lmax, tier, act.device)
    gate_tile = tile_config("gate", focus_dim, lmax, tier, act.device)
    fast = tier is StackPrecision.FAST
    common = {"L": lmax, "FD": focus_dim}

    lin_meta, gate_meta = ({**tile.launch_meta(), **common} for tile in (lin_tile, gate_tile))
    blk0, blk1, proj = (weight_operands(w, tier) for w in (w0_all, w1_all, gw_all))

    linear = wrap_triton(block_fwd_kernel)
    gating = wrap_triton(gate_fwd_kernel)

    def block_gemm(
        src: Tensor, weights: tuple[Tensor, Tensor], out: Tensor, layer: int, upper: bool
    ) -> None:
        """Block GEMM of ``layer`` (m=0, or |m|=1 when ``upper``) with its epilogue."""
        width = m1 if upper else m0
        final = {"M1_BLOCK": upper, "FINAL": layer == depth,
                 "APPLY_ALPHA": apply_alpha and layer == depth}  # fmt: skip
        if not fast:
            linear[lin_tile.grid(n_edge, width, n_focus)](
                src, weights[0], z_all, sig, alpha, out, n_edge, layer, **final, **lin_meta
            )
            return
        block_k = desc_block_k(width, lin_tile)
        n_tiles = lin_tile.grid(n_edge, width, n_focus)[0] * n_focus
        wrap_triton(block_fwd_desc_kernel)[persistent_grid(n_tiles, lin_tile, act.device)](
            row_descriptor(src, lin_tile.block_m, block_k),
            *weight_descriptors(weights, block_k, lin_tile.block_n),
            src, z_all, sig, alpha, out, n_edge, n_focus, layer, **final,
            **{**lin_meta, "BLOCK_K": block_k},
        )  # fmt: skip

    sig = act.new_empty((n_focus, n_edge, gate_width))
    src = act
    k = 0
    while k < depth:
        dst = torch.empty_like(act)
        block_gemm(src, blk0, dst, k, False)
        gating[gate_tile.grid(n_edge, gate_width, n_focus)](
            z_all, proj[0], proj[1], src, sig, dst, n_edge, k,
            HAS_RES=True, ALL_ROWS=False, STORE_SIG=True, FAST=fast, **gate_meta,
        )  # fmt: skip
        block_gemm(src, blk1, dst, k, True)
        src, k = dst, k + 1
    block_gemm(src, blk0, x_local, depth, False)
    block_gemm(src, blk1, x_local, depth, True)
    return x_local, z_all, (src if depth else act.clone())


# Op registration


@torch.library.triton_op("so2kernels::so2_mixing_stack", mutates_args=())
def _mixing_stack_op(
    u0: FocusRows,
    alpha: EdgeFocus,
    w0_all: LayerBlocks,
    w1_all: LayerBlocks,
    gw_all: GateBlocks,
    lmax: int,
    focus_dim: int,
    apply_alpha: bool,
    precision: str = "ieee",
) -> tuple[Tensor, Tensor, Tensor]:
    name = "so2_mixing_stack"
    tensors = (u0, alpha, w0_all, w1_all, gw_all)
    tier = StackPrecision.parse(precision)
    check_stack_operands(name, *tensors, lmax, focus_dim)
    if use_triton(*tensors):
        check_regime(name, lmax, focus_dim)
        require_fp32(name, **dict(zip(_OPERAND_NAMES, tensors, strict=True)))
        dense = tuple(t.contiguous() for t in tensors)
        with launch_device(u0):
            return _mixing_stack_fused(dense, lmax, focus_dim, apply_alpha, tier)
    tier.require_triton(name, u0.device)
    x_local, z_all, u_final = mixing_stack_reference(*tensors, lmax, focus_dim, apply_alpha)
    # Contiguous, as the fake promises; and outputs may not alias inputs (a one-layer stack
    # hands u0 itself back as u_final).
    if u_final is u0:
        u_final = u0.clone(memory_format=torch.contiguous_format)
    return x_local.contiguous(), z_all.contiguous(), u_final.contiguous()


@_mixing_stack_op.register_fake  # type: ignore[untyped-decorator]
def _mixing_stack_fake(u0: Tensor, *rest: Any) -> StackOutputs:
    # rest = (alpha, w0_all, w1_all, gw_all, lmax, focus_dim, apply_alpha[, precision])
    check_stack_operands("so2_mixing_stack", u0, *rest[:6])
    StackPrecision.parse(rest[7] if len(rest) > 7 else StackPrecision.EXACT)
    depth = rest[3].shape[0]
    focus_major = u0.new_empty(u0.shape)
    edge_major = u0.new_empty((u0.shape[1], u0.shape[0], u0.shape[2]))
    return edge_major, u0.new_empty((depth, *u0.shape)), focus_major


def _mixing_stack_setup_context(
    ctx: Any,
    inputs: tuple[Tensor, Tensor, Tensor, Tensor, Tensor, int, int, bool, str],
    output: tuple[Tensor, Tensor, Tensor],
) -> None:
    # Saved order: the five tensor operands, then (z_all, u_final); the backward never reads
    # x_local, so it is not kept alive for it.
    ctx.save_for_backward(*inputs[:5], *output[1:])
    ctx.lmax, ctx.focus_dim, ctx.apply_alpha, ctx.precision = inputs[5:]
    # Cotangents of z_all / u_final are mostly absent: leave them None rather than zero-filled.
    ctx.set_materialize_grads(False)


def _mixing_stack_backward(
    ctx: Any,
    grad_out: Tensor | None,
    grad_z: Tensor | None,
    grad_u: Tensor | None,
) -> tuple[Tensor | None, ...]:
    """Fused first order; the composed closed form when the backward itself is differentiated."""
    u0, alpha, w0_all, w1_all, gw_all, z_all, u_final = ctx.saved_tensors
    lmax, focus_dim = ctx.lmax, ctx.focus_dim
    apply_alpha = ctx.apply_alpha
    needs = ctx.needs_input_grad
    if grad_out is None and grad_z is None and grad_u is None:
        return (None,) * 9
    if grad_out is None:
        grad_out = u0.new_zeros((u0.shape[1], u0.shape[0], u0.shape[2]))
    else:
        grad_out = grad_out.contiguous()
    need_weights = any(needs[2:5])
    if torch.is_grad_enabled():
        # create_graph: compose registered ops and bmm so that a force loss can differentiate
        # this backward again through closed forms. Those run in exact fp32 only: a fast-tier
        # forward is refused here rather than given an exact backward without saying so.
        StackPrecision.parse(ctx.precision).require_exact_double_backward()

        def act(pre: Tensor, proj: Tensor, proj_t: Tensor) -> Tensor:
            return gated_act(pre, proj, proj_t, lmax, focus_dim)

        def act_bwd(
            cot: Tensor, pre: Tensor, proj: Tensor, proj_t: Tensor
        ) -> tuple[Tensor, Tensor]:
            return gated_act_backward(cot, pre, proj, proj_t.contiguous(), lmax, focus_dim)

        grads = stack_backward_composed(
            grad_out, z_all, u_final, alpha, u0, w0_all, w1_all, gw_all, grad_z, grad_u,
            lmax, focus_dim, apply_alpha, need_weights, act, act_bwd,
        )  # fmt: skip
    else:
        grads = mixing_stack_backward(
            grad_out, z_all, u_final, alpha, u0, w0_all, w1_all, gw_all, grad_z, grad_u,
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
    u0: FocusRows,
    alpha: EdgeFocus,
    w0_all: LayerBlocks,
    w1_all: LayerBlocks,
    gw_all: GateBlocks,
    lmax: int,
    focus_dim: int,
    apply_alpha: bool,
    precision: StackPrecision | str = StackPrecision.EXACT,
) -> StackOutputs:
    """``torch.ops.so2kernels.so2_mixing_stack``: the whole mixing stack as one op.

    ``u0 (F, E, ROW)``, ``alpha (E, F)``, ``w0_all (n, F, M0, M0)``, ``w1_all (n, F, M1, M1)``,
    ``gw_all (n-1, F, Cf, LG)`` → ``(x_local (E, F, ROW), z_all (n-1, F, E, ROW), u_final (F, E,
    ROW))``. ``precision`` picks the GEMM tier (``"ieee"`` exact fp32, ``"fp16x3"`` fast; the
    fast tier needs the Triton path and is never chosen implicitly). Differentiable twice in the
    exact tier; the fast tier has a first-order backward only, takes finite weights below 65504
    in magnitude, and activations and cotangents below 2^20 (beyond it, results turn NaN).
    """
    tier = StackPrecision.parse(precision)
    outputs: tuple[Tensor, Tensor, Tensor] = _mixing_stack_op(
        u0, alpha, w0_all, w1_all, gw_all, int(lmax), int(focus_dim), bool(apply_alpha), tier.value
    )
    return outputs
