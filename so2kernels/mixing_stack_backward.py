"""Backward of ``so2_mixing_stack``: closed-form traversal (ATen) and the fused Triton traversal.

The stack is ``u_{k+1} = u_k + act(z_k)``, ``z_k = [u_k,m0 W0_k | u_k,m1 W1_k]`` for the gated
layers, then ``out = u + [u_m0 W0_last | u_m1 W1_last]`` and ``x_local = alpha·out``. Its
vector-Jacobian product walks the layers backwards:

* final layer: ``h = grad + grad Wᵀ`` (focus-major), ``g = alpha·h``; ``grad_alpha = Σ grad·out =
  Σ u_final·h`` (the transpose moved onto the cotangent; never divided by alpha, so an edge whose
  alpha is 0 gets its gradient too);
* gated layer ``k``: ``(gz_k, q_k) = gated_act_bwd(g, z_k)``, then ``g ← g + gz_k Wᵀ``;
* weights: ``∂W_k = u_kᵀ gz_k``, ``∂Wg_k = s_kᵀ q_k`` (``s_k`` the scalar rows of ``z_k``), with
  layer inputs recovered as ``u_k = u_{k+1} - act(z_k)`` from ``u_final`` (``u_0`` is the
  operand itself, so the bottom layer contracts against the exact value).

Cotangents may also arrive on the forward's other outputs (``z_all``, ``u_final``) when a force
loss differentiates the backward again; they join where the forward produced those tensors.

Two implementations of the same formulas:

* :func:`stack_backward_composed` — ATen ``bmm`` plus injectable gated-activation functions. With
  the ATen gate references it is the eager reference; with the registered ``gated_act`` /
  ``gated_act_bwd`` ops it is the differentiable training path whose second order is closed
  form (``bmm`` VJPs and the hand-derived second order of ``gated_act_bwd``).
* :func:`_stack_backward_exact` / :func:`_stack_backward_fast` — the Triton traversals of the two
  precision tiers, behind the op ``so2kernels::so2_mixing_stack_bwd``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import triton
from torch import Tensor
from torch.library import wrap_triton

from so2kernels._dispatch import launch_device, require_fp32, use_triton
from so2kernels._layout import (
    EdgeFocus,
    EdgeRows,
    FocusRows,
    FocusWidth,
    GateBlocks,
    LayerBlocks,
    LayerStack,
    MaxDegree,
    block_widths,
    check_regime,
)
from so2kernels.gated_act import gated_act_backward_reference, gated_act_reference
from so2kernels.mixing_stack_kernels import (
    ACT_PRESCALE,
    TAIL_SCALE,
    StackPrecision,
    TileConfig,
    block_bwd_desc_kernel,
    block_bwd_kernel,
    desc_block_k,
    edge_major_descriptor,
    gate_bwd_kernel,
    gate_bwd_split_kernel,
    persistent_grid,
    row_descriptor,
    scalar_bwd_kernel,
    scalar_bwd_split_kernel,
    tile_config,
    weight_descriptors,
    weight_operands,
)

__all__ = ["StackBwdArgs", "mixing_stack_backward_reference", "stack_backward_composed"]

ActFn = Callable[[Tensor, Tensor, Tensor], Tensor]
"""``act(z, gw, gwt) -> (F, E, ROW)``: the gated activation of one layer."""
ActBwdFn = Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
"""``act_bwd(g, z, gw, gwt) -> (grad_z, grad_logit)``: its first order."""

StackGrads = tuple[Tensor, Tensor, Tensor, Tensor, Tensor]
"""``(grad_u0 (F,E,ROW), grad_alpha (E,F), grad_w0_all, grad_w1_all, grad_gw_all)``."""


def _block_linear_t(g: Tensor, w0: Tensor, w1: Tensor, m0: int) -> Tensor:
    """Per focus, the m=0 columns of ``g`` times ``w0ᵀ`` beside the |m|=1 columns times ``w1ᵀ``."""
    lo, hi = g[..., :m0], g[..., m0:]
    return torch.cat([lo.bmm(w0.mT), hi.bmm(w1.mT)], dim=-1)


def _block_weight_grads(u: Tensor, gz: Tensor, m0: int) -> tuple[Tensor, Tensor]:
    """Per focus and block, ``uᵀ gz`` summed over the edges (the block weight cotangents)."""
    u_t = u.mT
    return u_t[:, :m0].bmm(gz[..., :m0]), u_t[:, m0:].bmm(gz[..., m0:])


def _gate_weight_grad(z: Tensor, grad_logit: Tensor, focus_dim: int) -> Tensor:
    """Gate projection cotangent: the scalar rows of ``z`` transposed, times the logit cotangent."""
    return z[..., :focus_dim].mT.bmm(grad_logit)


def _empty_weight_grads(like: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return like.new_empty(0), like.new_empty(0), like.new_empty(0)


def _scaled_grad(grad_out: Tensor, alpha: Tensor, apply_alpha: bool) -> Tensor:
    """Cotangent of the final layer's output before the alpha scale; edge first, ``(E, F, ROW)``."""
    return grad_out * alpha.unsqueeze(-1) if apply_alpha else grad_out


def stack_backward_composed(
    grad_out: EdgeRows,
    z_all: LayerStack,
    u_final: FocusRows,
    alpha: EdgeFocus,
    u0: FocusRows,
    w0_all: LayerBlocks,
    w1_all: LayerBlocks,
    gw_all: GateBlocks,
    grad_z: LayerStack | None,
    grad_u: FocusRows | None,
    lmax: MaxDegree,
    focus_dim: FocusWidth,
    apply_alpha: bool,
    need_weights: bool,
    act: ActFn,
    act_bwd: ActBwdFn,
) -> StackGrads:
    """Closed-form VJP of the stack in ATen ``bmm`` and the given gated-activation functions.

    ``grad_out (E, F, ROW)`` is the cotangent of ``x_local``; ``grad_z (n-1, F, E, ROW)`` and
    ``grad_u (F, E, ROW)`` those of ``z_all`` and ``u_final`` (or ``None``). Weight gradients
    are zero-size tensors unless ``need_weights``.
    """
    m0 = block_widths(lmax, focus_dim)[0]
    n_gated = z_all.shape[0]
    grad_t = grad_out.transpose(0, 1)
    g = grad_t + _block_linear_t(grad_t, w0_all[n_gated], w1_all[n_gated], m0)
    if apply_alpha:
        grad_alpha = (u_final * g).sum(-1).T
        g = g * alpha.T.unsqueeze(-1)
    else:
        grad_alpha = torch.zeros_like(alpha)
    if grad_u is not None:
        g = g + grad_u
    grads_w0: list[Tensor] = []
    grads_w1: list[Tensor] = []
    grads_gw: list[Tensor] = []
    if need_weights:
        gz = _scaled_grad(grad_out, alpha, apply_alpha).transpose(0, 1)
        gw0, gw1 = _block_weight_grads(u_final, gz, m0)
        grads_w0.append(gw0)
        grads_w1.append(gw1)
    u_above = u_final  # output of the layer being walked; becomes its input after the step
    for layer in reversed(range(n_gated)):
        gw = gw_all[layer]
        gwt = gw.transpose(1, 2)
        z_k = z_all[layer]
        gz, grad_logit = act_bwd(g, z_k, gw, gwt)
        if grad_z is not None:
            gz = gz + grad_z[layer]
        if need_weights:
            u_in = u_above - act(z_k, gw, gwt) if layer > 0 else u0
            gw0, gw1 = _block_weight_grads(u_in, gz, m0)
            grads_w0.append(gw0)
            grads_w1.append(gw1)
            grads_gw.append(_gate_weight_grad(z_k, grad_logit, focus_dim))
            u_above = u_in
        g = g + _block_linear_t(gz, w0_all[layer], w1_all[layer], m0)
    if not need_weights:
        return (g, grad_alpha, *_empty_weight_grads(g))
    grad_gw_all = torch.stack(grads_gw[::-1]) if grads_gw else gw_all.new_zeros(gw_all.shape)
    return g, grad_alpha, torch.stack(grads_w0[::-1]), torch.stack(grads_w1[::-1]), grad_gw_all


class StackBwdArgs(NamedTuple):
    """Operands of the stack backward, in the op's order (without the precision tier)."""

    grad_out: Tensor
    z_all: Tensor
    u_final: Tensor
    alpha: Tensor
    u0: Tensor
    w0_all: Tensor
    w1_all: Tensor
    gw_all: Tensor
    grad_z: Tensor | None
    grad_u: Tensor | None
    lmax: int
    focus_dim: int
    apply_alpha: bool
    need_weights: bool


def mixing_stack_backward_reference(args: StackBwdArgs) -> StackGrads:
    """Eager closed-form backward (any dtype); see :func:`stack_backward_composed`."""
    lmax, focus_dim = args.lmax, args.focus_dim

    def act(zl: Tensor, proj: Tensor, proj_t: Tensor) -> Tensor:
        return gated_act_reference(zl, proj, proj_t, lmax, focus_dim)

    def act_bwd(cot: Tensor, zl: Tensor, proj: Tensor, _proj_t: Tensor) -> tuple[Tensor, Tensor]:
        return gated_act_backward_reference(cot, zl, proj, lmax, focus_dim)

    return stack_backward_composed(*args, act, act_bwd)


# Fused Triton traversals


class _Launcher:
    """Grid and launch arguments shared by the launches of one kernel family."""

    def __init__(
        self, n_edge: int, n_focus: int, lmax: int, focus_dim: int, cfg: TileConfig, fast: bool
    ):
        self.n_edge, self.n_focus, self.cfg = n_edge, n_focus, cfg
        self.meta = {"L": lmax, "FD": focus_dim, "FAST": fast, **cfg.launch_meta()}

    @classmethod
    def of(cls, kind: str, args: StackBwdArgs, precision: StackPrecision) -> _Launcher:
        n_focus, n_edge = args.u0.shape[:2]
        cfg = tile_config(kind, args.focus_dim, args.lmax, precision, args.u0.device)
        fast = precision is StackPrecision.FAST
        return cls(n_edge, n_focus, args.lmax, args.focus_dim, cfg, fast)

    @property
    def meta_no_fast(self) -> dict[str, Any]:
        """Launch arguments of the kernels that are one tier's only (no ``FAST`` flag)."""
        return {k: v for k, v in self.meta.items() if k != "FAST"}

    def residual(
        self,
        describe: Callable[[Tensor, int, int], Any],
        a: Tensor,
        weights: tuple[Tensor, Tensor],
        width: int,
        layer: int,
        pointers: tuple[Tensor, ...],
        flags: dict[str, bool],
    ) -> None:
        """One fast-tier residual GEMM of :func:`block_bwd_desc_kernel` over a ``width``-wide
        block: A is ``a`` through ``describe(a, block_m, block_k)``; ``pointers`` = (output
        cotangent, g_out, alpha, u_final, partials, g_in)."""
        if self.n_edge == 0:
            return  # a tensor descriptor cannot describe an empty tensor
        cfg = self.cfg
        block_k = desc_block_k(width, cfg)
        n_tiles = self.grid(width)[0] * self.n_focus
        wrap_triton(block_bwd_desc_kernel)[persistent_grid(n_tiles, cfg, a.device)](
            describe(a, cfg.block_m, block_k), *weight_descriptors(weights, block_k, cfg.block_n),
            *pointers, self.n_edge, self.n_focus, layer, **flags,
            **{**self.meta_no_fast, "BLOCK_K": block_k},
        )  # fmt: skip

    def grid(self, width: int) -> tuple[int, int]:
        return self.cfg.grid(self.n_edge, width, self.n_focus)

    def slots(self, m0: int, m1: int) -> int:
        """Column tiles of both blocks: the per-edge partial slots of ``ALPHA_PARTIALS``."""
        return int(triton.cdiv(m0, self.cfg.block_n) + triton.cdiv(m1, self.cfg.block_n))


def _final_layer_weight_grads(args: StackBwdArgs, m0: int) -> tuple[Tensor, Tensor]:
    scaled = _scaled_grad(args.grad_out, args.alpha, args.apply_alpha).transpose(0, 1)
    return _block_weight_grads(args.u_final, scaled, m0)


def _backward_weights(
    args: StackBwdArgs, precision: StackPrecision
) -> tuple[tuple[Tensor, Tensor], ...]:
    """Weights as the backward kernels read them, in the tier's operand form: the transposed
    block weights (w0ᵀ, w1ᵀ), the gate projections and their transposes."""
    return (
        weight_operands(args.w0_all, precision, transposed=True),
        weight_operands(args.w1_all, precision, transposed=True),
        weight_operands(args.gw_all, precision),
        weight_operands(args.gw_all, precision, transposed=True),
    )


def _weight_grad_buffers(args: StackBwdArgs) -> tuple[LayerBlocks, LayerBlocks, GateBlocks]:
    if not args.need_weights:
        return _empty_weight_grads(args.u0)
    return tuple(w.new_empty(w.shape) for w in (args.w0_all, args.w1_all, args.gw_all))  # type: ignore[return-value]


def _alpha_partials(args: StackBwdArgs, n_slots: int, stand_in: Tensor) -> Tensor:
    """``(E, F, n_slots)`` buffer for the final layer's per-column-tile shares of the alpha
    gradient; without alpha there are none, and ``stand_in`` fills the unused pointer."""
    if not args.apply_alpha:
        return stand_in
    return args.alpha.new_empty((*args.alpha.shape, n_slots))


def _summed_alpha_partials(args: StackBwdArgs, partials: Tensor) -> Tensor:
    """alpha's gradient ``(E, F)``: the slots of :func:`_alpha_partials` summed (zero without)."""
    return partials.sum(-1) if args.apply_alpha else torch.zeros_like(args.alpha)


def _stack_backward_exact(args: StackBwdArgs) -> StackGrads:
    """Exact-tier traversal (IEEE fp32 dots). Per gated layer: gate backward, scalar backward,
    two residual GEMMs. Inputs contiguous fp32; activations and cotangents focus first."""
    # The weights themselves are read through _backward_weights.
    (grad_out, z_all, u_final, alpha, u0, *_weights, grad_z, grad_u,
     lmax, focus_dim, apply_alpha, need_weights) = args  # fmt: skip
    n_gated, n_focus, n_edge, _ = z_all.shape
    m0, m1, gate_width = block_widths(lmax, focus_dim)
    precision = StackPrecision.EXACT
    run = _Launcher.of("bwd", args, precision)
    gate_run = _Launcher.of("gbwd", args, precision)
    scalar_run = _Launcher.of("gate", args, precision)
    w0t, w1t, gws, gwts = _backward_weights(args, precision)

    g = torch.empty_like(u_final)
    partials = _alpha_partials(args, run.slots(m0, m1), g)
    for is_m1, (wt, _), width in ((False, w0t, m0), (True, w1t, m1)):
        wrap_triton(block_bwd_kernel)[run.grid(width)](
            grad_out, wt, g, alpha, u_final, partials, g, n_edge, n_gated, M1_BLOCK=is_m1,
            FINAL=True, APPLY_ALPHA=apply_alpha, ALPHA_PARTIALS=apply_alpha, **run.meta_no_fast,
        )  # fmt: skip
    grad_alpha = _summed_alpha_partials(args, partials)
    if grad_u is not None:
        g += grad_u

    grads_w0, grads_w1, grads_gw = _weight_grad_buffers(args)
    if need_weights:
        grads_w0[n_gated], grads_w1[n_gated] = _final_layer_weight_grads(args, m0)

    gz = torch.empty_like(u_final)
    grad_logit = u_final.new_empty((n_focus, n_edge, gate_width))
    g_next = torch.empty_like(u_final)
    u_above = u_final
    for layer in reversed(range(n_gated)):
        recover = need_weights and layer > 0
        u_in = torch.empty_like(u_final) if recover else u0
        wrap_triton(gate_bwd_kernel)[gate_run.grid(gate_width)](
            z_all, gws[0], gws[1], g, gz, grad_logit, u_above, u_in, n_edge, layer,
            RECOVER=recover, **gate_run.meta,
        )  # fmt: skip
        wrap_triton(scalar_bwd_kernel)[scalar_run.grid(focus_dim)](
            grad_logit, gwts[0], gwts[1], z_all, g, gz, u_above, u_in, n_edge, layer,
            RECOVER=recover, **scalar_run.meta,
        )  # fmt: skip
        if grad_z is not None:
            gz += grad_z[layer]
        if need_weights:
            grads_w0[layer], grads_w1[layer] = _block_weight_grads(u_in, gz, m0)
            grads_gw[layer] = _gate_weight_grad(z_all[layer], grad_logit, focus_dim)
            u_above = u_in
        for is_m1, (wt, _), width in ((False, w0t, m0), (True, w1t, m1)):
            wrap_triton(block_bwd_kernel)[run.grid(width)](
                gz, wt, g, alpha, g, g, g_next, n_edge, layer, M1_BLOCK=is_m1, FINAL=False,
                APPLY_ALPHA=False, ALPHA_PARTIALS=False, **run.meta_no_fast,
            )  # fmt: skip
        g, g_next = g_next, g
    return g, grad_alpha, grads_w0, grads_w1, grads_gw


def _stack_backward_fast(args: StackBwdArgs) -> StackGrads:
    """Fast-tier (fp16x3) traversal; same inputs and results as :func:`_stack_backward_exact`.

    Final layer: both residual GEMMs read the edge-major output cotangent and split it in
    registers; they also leave per-tile shares of ``Σ grad·out``, so the alpha gradient costs
    one extra read of ``u_final`` instead of an ATen product and reduction over two full
    activations. Gated layer: the gate and scalar kernels add any ``z_all`` cotangent and store
    ``gz`` already split into fp16 head/tail planes (the bytes of one fp32 copy, exactly the
    split the GEMM would make), so the two residual GEMMs feed those planes to the tensor cores
    as loaded instead of re-splitting ``gz`` once per output-column tile. Every residual GEMM
    runs :func:`block_bwd_desc_kernel` (persistent, operands through tensor descriptors).
    """
    # The weights themselves are read through _backward_weights.
    (grad_out, z_all, u_final, alpha, u0, *_weights, grad_z, grad_u,
     lmax, focus_dim, apply_alpha, need_weights) = args  # fmt: skip
    n_gated, n_focus, n_edge, _ = z_all.shape
    m0, m1, gate_width = block_widths(lmax, focus_dim)
    precision = StackPrecision.FAST
    final_run = _Launcher.of("fbwd", args, precision)
    block_run = _Launcher.of("bwd", args, precision)
    gate_run = _Launcher.of("gbwd", args, precision)
    scalar_run = _Launcher.of("gate", args, precision)
    w0t, w1t, gws, gwts = _backward_weights(args, precision)

    g = torch.empty_like(u_final)
    partials = _alpha_partials(args, final_run.slots(m0, m1), g)
    for is_m1, weights, width in ((False, w0t, m0), (True, w1t, m1)):
        final_run.residual(
            edge_major_descriptor, grad_out, weights, width, n_gated,
            (grad_out, g, alpha, u_final, partials, g),
            {"M1_BLOCK": is_m1, "FINAL": True, "APPLY_ALPHA": apply_alpha,
             "ALPHA_PARTIALS": apply_alpha},
        )  # fmt: skip
    grad_alpha = _summed_alpha_partials(args, partials)
    if grad_u is not None:
        g += grad_u

    grads_w0, grads_w1, grads_gw = _weight_grad_buffers(args)
    if need_weights:
        grads_w0[n_gated], grads_w1[n_gated] = _final_layer_weight_grads(args, m0)

    gz_split = u_final.new_empty((2, *u_final.shape), dtype=torch.float16)
    grad_logit = u_final.new_empty((n_focus, n_edge, gate_width))
    g_next = torch.empty_like(u_final)
    u_above = u_final
    for layer in reversed(range(n_gated)):
        recover = need_weights and layer > 0
        u_in = torch.empty_like(u_final) if recover else u0
        gz_up = z_all if grad_z is None else grad_z  # z_all: an unread stand-in
        wrap_triton(gate_bwd_split_kernel)[gate_run.grid(gate_width)](
            z_all, gws[0], gws[1], g, gz_up, gz_split, grad_logit, u_above, u_in, n_edge, layer,
            HAS_GZ_UP=grad_z is not None, RECOVER=recover, **gate_run.meta_no_fast,
        )  # fmt: skip
        wrap_triton(scalar_bwd_split_kernel)[scalar_run.grid(focus_dim)](
            grad_logit, gwts[0], gwts[1], z_all, g, gz_up, gz_split, u_above, u_in, n_edge, layer,
            HAS_GZ_UP=grad_z is not None, RECOVER=recover, **scalar_run.meta_no_fast,
        )  # fmt: skip
        if need_weights:
            # The planes hold gz to within 2^-22 relative (11 + 11 significant bits), the fast
            # tier's own resolution: the weight gradients contract against their merge.
            gz = (gz_split[0].float() + gz_split[1].float() / TAIL_SCALE) / ACT_PRESCALE
            grads_w0[layer], grads_w1[layer] = _block_weight_grads(u_in, gz, m0)
            grads_gw[layer] = _gate_weight_grad(z_all[layer], grad_logit, focus_dim)
            u_above = u_in
        for is_m1, weights, width in ((False, w0t, m0), (True, w1t, m1)):
            block_run.residual(
                row_descriptor, gz_split, weights, width, layer, (g, g, alpha, g, g, g_next),
                {"M1_BLOCK": is_m1, "FINAL": False, "APPLY_ALPHA": False,
                 "ALPHA_PARTIALS": False},
            )  # fmt: skip
        g, g_next = g_next, g
    return g, grad_alpha, grads_w0, grads_w1, grads_gw


# Op registration: the first-order backward as one op (no autograd of its own: the training
# path that differentiates the backward again goes through stack_backward_composed instead)


def _check_bwd_operands(args: StackBwdArgs) -> None:
    """The forward's operands as the forward checks them, and its outputs and their cotangents
    with the shapes the forward gives them; raises ``ValueError`` naming the tensor."""
    # Imported here: so2kernels.mixing_stack imports this module.
    from so2kernels.mixing_stack import check_stack_operands

    op = "so2_mixing_stack_bwd"
    check_stack_operands(op, args.u0, args.alpha, args.w0_all, args.w1_all, args.gw_all,
                         args.lmax, args.focus_dim)  # fmt: skip
    n_focus, n_edge, row = args.u0.shape
    edge_major, focus_major = (n_edge, n_focus, row), (n_focus, n_edge, row)
    stacked = (args.gw_all.shape[0], *focus_major)
    expected = {
        "grad_out": (args.grad_out, edge_major),
        "z_all": (args.z_all, stacked), "grad_z": (args.grad_z, stacked),
        "u_final": (args.u_final, focus_major), "grad_u": (args.grad_u, focus_major),
    }  # fmt: skip
    for name, (tensor, shape) in expected.items():
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(
                f"so2kernels.{op}: {name} must have shape {shape} (u0 is (F, E, ROW) = "
                f"{focus_major}, {stacked[0]} gated layers); got {tuple(tensor.shape)}"
            )


@torch.library.triton_op("so2kernels::so2_mixing_stack_bwd", mutates_args=())
def _mixing_stack_bwd_op(
    grad_out: EdgeRows,
    z_all: LayerStack,
    u_final: FocusRows,
    alpha: EdgeFocus,
    u0: FocusRows,
    w0_all: LayerBlocks,
    w1_all: LayerBlocks,
    gw_all: GateBlocks,
    grad_z: LayerStack | None,
    grad_u: FocusRows | None,
    lmax: MaxDegree,
    focus_dim: FocusWidth,
    apply_alpha: bool,
    need_weights: bool,
    precision: str,
) -> StackGrads:
    tier = StackPrecision.parse(precision)
    given = StackBwdArgs(
        grad_out, z_all, u_final, alpha, u0, w0_all, w1_all, gw_all, grad_z, grad_u,
        lmax, focus_dim, apply_alpha, need_weights,
    )  # fmt: skip
    _check_bwd_operands(given)
    name = "so2_mixing_stack_bwd"
    named = {
        "grad_out": grad_out, "z_all": z_all, "u_final": u_final,
        "alpha": alpha, "u0": u0, "w0_all": w0_all, "w1_all": w1_all, "gw_all": gw_all,
        **({} if grad_z is None else {"grad_z": grad_z}),
        **({} if grad_u is None else {"grad_u": grad_u}),
    }  # fmt: skip
    if not use_triton(*named.values()):
        tier.require_triton(name, u0.device)
        grads = mixing_stack_backward_reference(given)
        return tuple(t.contiguous() for t in grads)  # type: ignore[return-value]
    check_regime(name, lmax, focus_dim)
    require_fp32(name, **named)

    def packed(t: Tensor) -> Tensor:
        return t.contiguous()

    contiguous = StackBwdArgs(
        packed(grad_out), packed(z_all), packed(u_final), packed(alpha),
        packed(u0), packed(w0_all), packed(w1_all), packed(gw_all),
        None if grad_z is None else packed(grad_z),
        None if grad_u is None else packed(grad_u),
        lmax, focus_dim, apply_alpha, need_weights,
    )  # fmt: skip
    traversal = _stack_backward_fast if tier is StackPrecision.FAST else _stack_backward_exact
    with launch_device(grad_out):
        return traversal(contiguous)


@_mixing_stack_bwd_op.register_fake  # type: ignore[untyped-decorator]
def _mixing_stack_bwd_fake(*operands: Any) -> StackGrads:
    # Same positional operands as the op; the trailing precision string does not shape outputs.
    args = StackBwdArgs(*operands[: len(StackBwdArgs._fields)])
    _check_bwd_operands(args)

    def weight_grad(w: Tensor) -> Tensor:
        return w.new_empty(w.shape) if args.need_weights else w.new_empty(0)

    return (
        args.u0.new_empty(args.u0.shape),
        args.alpha.new_empty(args.alpha.shape),
        weight_grad(args.w0_all),
        weight_grad(args.w1_all),
        weight_grad(args.gw_all),
    )


def mixing_stack_backward(
    grad_out: EdgeRows,
    z_all: LayerStack,
    u_final: FocusRows,
    alpha: EdgeFocus,
    u0: FocusRows,
    w0_all: LayerBlocks,
    w1_all: LayerBlocks,
    gw_all: GateBlocks,
    grad_z: LayerStack | None,
    grad_u: FocusRows | None,
    lmax: MaxDegree,
    focus_dim: FocusWidth,
    apply_alpha: bool,
    need_weights: bool,
    precision: str = StackPrecision.EXACT.value,
) -> StackGrads:
    """``torch.ops.so2kernels.so2_mixing_stack_bwd``: the first-order backward as one op."""
    grads: StackGrads = _mixing_stack_bwd_op(
        grad_out, z_all, u_final, alpha, u0, w0_all, w1_all, gw_all, grad_z, grad_u,
        lmax, focus_dim, apply_alpha, need_weights, precision,
    )  # fmt: skip
    return grads
