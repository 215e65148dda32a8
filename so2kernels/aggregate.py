"""``so2_attention_aggregate``: rotate back + l>1 rescale + edge weighting + dst CSR reduction.

Layout contract. Operands (one device; the fused path needs float32 for the float operands):

* ``x_local`` (E, F, ROW) edge-major stack output, ``ROW = (3L+1)·Cf`` m-major reduced rows
  (:mod:`so2kernels._layout`); wide channel ``c = f·Cf + cf``, ``C_wide = F·Cf``.
* ``wigner`` (E, Dw, Dw) global→local Wigner-D with ``Dw ≥ D = (L+1)²``; only the leading block
  is read, through the real strides.
* ``weights`` (E, G) per-edge weight of each channel group, ``G`` dividing ``C_wide``: channel
  ``c`` belongs to group ``c // (C_wide/G)``. Attention passes the softmax weights with
  ``G = F·H`` (group = (focus, head)); the scatter mode passes ``env·inv_sqrt_deg[dst]`` with
  ``G = 1``.
* ``dst_rowptr`` (N+1,) int64: edges are sorted by destination, node ``i`` owns edges
  ``dst_rowptr[i] .. dst_rowptr[i+1]-1``; ``dst_rowptr[0] = 0`` and ``dst_rowptr[N] = E`` (not
  checked here: that needs a device sync; the graph builder guarantees it).

Math, per node i and its edges e, with reduced rows r of degree l(r) and packed row p(r)::

    out[i, q, c] = s(l(q)) · Σ_e weights[e, g(c)] · Σ_{r: l(r)=l(q)} wigner[e, p(r), q] · x[e, r, c]

where ``s(l) = √((2l+1)/3)`` for l > 1 and 1 otherwise (the inverse-rotation rescale for
mmax=1). Only the structural non-zeros of the Wigner block are read (rows m' ∈ {-1, 0, +1} of
each degree, that degree's columns); every other entry has gradient exactly 0. Output
(N, D, C_wide); nodes without edges get 0.

Fused forward: one program per (node, channel block, segment part) walks its part of the
node's edge segment, rotating each edge's rows back in registers (the structural Wigner entries
only, as scalars: ~25 loads and FMAs per edge and channel at lmax 2) and accumulating the
weighted sum in a (D, channels) register tile. The per-edge message (E, D, C_wide) is never
written. With P parts (P > 1 only when the nodes alone leave the GPU idle: small systems, where
a node's ~10² edges would otherwise be one long serial loop in one of too few programs) part p
takes the edges ``⌊len·p/P⌋ .. ⌊len·(p+1)/P⌋`` of the segment and writes a (P, N, D, C_wide)
partial; a sum over P in fixed order finishes it. Either way no atomics, bitwise reproducible
for a given launch shape. Nothing per edge is saved by the forward.

Fused backward: nothing in it reduces over edges. With ``g_e = s ⊙ grad_out[dst(e)]`` an edge's
``grad x_local``, structural ``grad wigner`` entries and ``grad weights`` depend only on ``g_e``
and that edge's own operands, so one program takes ``BLOCK_E`` consecutive edges (coalesced
edge-order reads of ``x_local`` and writes of ``grad x_local``; the edges are sorted by
destination, so neighbouring edges gather the same ``grad_out`` rows from L2). Per degree l the
program holds the degree's reduced rows as (BLOCK_E, channels) tiles and visits the block's
columns q once each, gathering ``g_q`` (pipelined): ``g_local[r] += wigner[e, p(r), q]·g_q`` and
``grad wigner[e, p(r), q] = Σ_c g_q·w·x[r]`` (one channel reduction per entry for the whole
tile). ``grad weights`` reduces each group's channels of ``Σ_r g_local·x`` once per tile.
``dst(e)`` comes from ``dst_rowptr`` on the device (``segment_of_position``, no host sync).
HBM traffic is essentially ``x_local`` read once and ``grad x_local`` written once.

Second order (training): when the backward runs under ``create_graph`` it is composed from
differentiable torch ops (:func:`attention_aggregate_backward_reference`), so a force loss can
be differentiated again; the Triton backward serves the force path.
"""

# Triton kernels take untyped pointer/constexpr arguments and @triton.jit is an untyped decorator.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
from __future__ import annotations

from functools import cache
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from so2kernels._dispatch import UnsupportedInputError, launch_device, require_fp32, use_triton
from so2kernels._layout import (
    SUPPORTED_LMAX,
    channel_rows_to_edge_major,
    device_constant,
    edge_major_to_channel_rows,
    int32_inner_offsets,
    n_coeff,
    n_reduced,
    reduced_to_packed,
    rotate_back_rescale,
)
from so2kernels.rotate_mix import structure_mask, wigner_reduced_rows
from so2kernels.segment import segment_of_position

__all__ = [
    "BwdTiles",
    "attention_aggregate",
    "attention_aggregate_backward_reference",
    "attention_aggregate_reference",
    "check_aggregate_inputs",
    "default_segment_parts",
    "segment_parts",
]

_OP = "so2_attention_aggregate"
# (grad x_local, grad wigner, grad weights)
_Grads = tuple[Tensor, Tensor, Tensor]

# Input checks (shapes and dtypes only: no device synchronisation)


def check_aggregate_inputs(
    x_local: Tensor, wigner: Tensor, weights: Tensor, dst_rowptr: Tensor, lmax: int
) -> None:
    """Raise ``ValueError`` naming the operand whose shape or dtype disagrees with the contract."""
    if lmax < 0:
        raise ValueError(f"so2kernels.{_OP}: lmax must be >= 0, got {lmax}")
    red, dim = n_reduced(lmax), n_coeff(lmax)
    if x_local.dim() != 3 or x_local.shape[2] % red != 0:
        raise ValueError(
            f"so2kernels.{_OP}: x_local must be (E, F, ROW) with ROW a multiple of 3*lmax+1="
            f"{red}, got {tuple(x_local.shape)}"
        )
    n_edge, n_focus, row = x_local.shape
    c_wide = n_focus * (row // red)
    if (
        wigner.dim() != 3
        or wigner.shape[0] != n_edge
        or wigner.shape[1] != wigner.shape[2]
        or wigner.shape[1] < dim
    ):
        raise ValueError(
            f"so2kernels.{_OP}: wigner must be (E={n_edge}, Dw, Dw) with Dw >= {dim}, "
            f"got {tuple(wigner.shape)}"
        )
    if weights.dim() != 2 or weights.shape[0] != n_edge or weights.shape[1] < 1:
        raise ValueError(
            f"so2kernels.{_OP}: weights must be (E={n_edge}, G>=1), got {tuple(weights.shape)}"
        )
    if c_wide % weights.shape[1] != 0:
        raise ValueError(
            f"so2kernels.{_OP}: the {weights.shape[1]} weight groups do not divide C_wide={c_wide}"
        )
    if dst_rowptr.dim() != 1 or dst_rowptr.dtype != torch.int64 or dst_rowptr.shape[0] < 1:
        raise ValueError(f"so2kernels.{_OP}: dst_rowptr must be a 1-D int64 (N+1,) tensor")
    if not (x_local.dtype == wigner.dtype == weights.dtype) or not x_local.is_floating_point():
        raise ValueError(
            f"so2kernels.{_OP}: x_local, wigner and weights must share one floating dtype, got "
            f"{x_local.dtype}, {wigner.dtype}, {weights.dtype}"
        )


def _check_fused_regime(x_local: Tensor, wigner: Tensor, weights: Tensor, lmax: int) -> None:
    if lmax not in SUPPORTED_LMAX:
        raise UnsupportedInputError(
            f"so2kernels.{_OP}: the fused path covers lmax 1..6, got {lmax}"
        )
    require_fp32(_OP, x_local=x_local, wigner=wigner, weights=weights)


def _check_grad_out(grad_out: Tensor, x_local: Tensor, dst_rowptr: Tensor, lmax: int) -> None:
    n_focus, row = x_local.shape[1], x_local.shape[2]
    expected = (dst_rowptr.shape[0] - 1, n_coeff(lmax), n_focus * (row // n_reduced(lmax)))
    if tuple(grad_out.shape) != expected:
        raise ValueError(
            f"so2kernels.{_OP}_bwd: grad_out must be (N, D, C_wide) = {expected}, "
            f"got {tuple(grad_out.shape)}"
        )


# Eager reference (any dtype; differentiable by autograd to any order)


def _channel_weights(weights: Tensor, c_wide: int) -> Tensor:
    """(E, G) → (E, C_wide): each group's weight repeated over its channels."""
    return weights.repeat_interleave(c_wide // weights.shape[1], dim=1)


def attention_aggregate_reference(
    x_local: Tensor, wigner: Tensor, weights: Tensor, dst_rowptr: Tensor, lmax: int
) -> Tensor:
    """Ground truth of ``so2_attention_aggregate``: (N, D, C_wide). Materialises the messages."""
    check_aggregate_inputs(x_local, wigner, weights, dst_rowptr, lmax)
    n_edge = x_local.shape[0]
    rows = edge_major_to_channel_rows(x_local, lmax)
    weighted = rows * _channel_weights(weights, rows.shape[2])[:, None, :]
    d_rows = wigner_reduced_rows(wigner, lmax)  # (E, 3L+1, D)
    scale = rotate_back_rescale(lmax, x_local.device, x_local.dtype)
    message = torch.bmm(d_rows.transpose(1, 2), weighted) * scale[:, None]
    out = message.new_zeros((dst_rowptr.shape[0] - 1, *message.shape[1:]))
    return out.index_add(0, segment_of_position(dst_rowptr, n_edge), message)


@cache
def _reduced_to_packed_selector(lmax: int) -> tuple[tuple[float, ...], ...]:
    """(D, 3L+1) one-hot rows placing each reduced row at its packed row."""
    packed = reduced_to_packed(lmax)
    return tuple(
        tuple(1.0 if packed[r] == p else 0.0 for r in range(n_reduced(lmax)))
        for p in range(n_coeff(lmax))
    )


def attention_aggregate_backward_reference(
    grad_out: Tensor,
    x_local: Tensor,
    wigner: Tensor,
    weights: Tensor,
    dst_rowptr: Tensor,
    lmax: int,
) -> _Grads:
    """``(grad x_local, grad wigner, grad weights)`` written out by hand; differentiable (training).

    With ``g_e = s ⊙ grad_out[dst(e)]`` (rescaled node gradient) and ``ρ`` the structural
    reduced Wigner rows: ``grad x = w_e ⊙ ρ·g_e``; ``grad ρ[r, q] = Σ_c g_e[q, c]·w_e·x[r, c]``;
    ``grad w_e[g] = Σ_{c ∈ g} Σ_r (ρ·g_e)[r, c]·x[r, c]``.
    """
    check_aggregate_inputs(x_local, wigner, weights, dst_rowptr, lmax)
    _check_grad_out(grad_out, x_local, dst_rowptr, lmax)
    n_edge, n_focus = x_local.shape[:2]
    dim = n_coeff(lmax)
    scale = rotate_back_rescale(lmax, x_local.device, x_local.dtype)
    g_edge = (grad_out * scale[:, None]).index_select(0, segment_of_position(dst_rowptr, n_edge))
    d_rows = wigner_reduced_rows(wigner, lmax)  # (E, 3L+1, D), structural zeros applied
    rows = edge_major_to_channel_rows(x_local, lmax)
    c_wide = rows.shape[2]
    w_chan = _channel_weights(weights, c_wide)
    g_local = torch.bmm(d_rows, g_edge)  # (E, 3L+1, C_wide)
    grad_x = channel_rows_to_edge_major(g_local * w_chan[:, None, :], n_focus)
    n_group = weights.shape[1]
    grad_weights = (g_local * rows).sum(1).reshape(n_edge, n_group, c_wide // n_group).sum(2)
    grad_rows = torch.bmm(rows * w_chan[:, None, :], g_edge.transpose(1, 2))  # (E, 3L+1, D)
    grad_rows = grad_rows * structure_mask(lmax, x_local.device, x_local.dtype)
    selector = device_constant(_reduced_to_packed_selector(lmax), x_local.device, x_local.dtype)
    grad_block = torch.einsum("pr,erq->epq", selector, grad_rows)
    pad = wigner.shape[1] - dim
    grad_wigner = torch.nn.functional.pad(grad_block, (0, pad, 0, pad))
    return grad_x, grad_wigner, grad_weights


# Triton kernels. Forward: a (node, channel block, part) program walks its part of the dst
# segment BLOCK_E edges at a time; edge tiles are (BLOCK_E, BLOCK_C) edges × channel lanes
# (masked), the accumulator (DP, BLOCK_C) packed rows (D padded to a power of two) × lanes.
# Backward: an edge-block program; tiles are (BLOCK_E, WP). Every offset that scales with E or N
# is int64.


@triton.jit
def _wigner_entry(w_edge, edge_live, w_sr, w_sc, row, col):
    """``wigner[e, row, col]`` of a block of edges: (BLOCK_E,)."""
    return tl.load(w_edge + row * w_sr + col * w_sc, mask=edge_live, other=0.0)


@triton.jit
def segment_part_range(rowptr_ptr, node, part, n_part):
    """Edges ``[first, stop)`` of part ``part`` of ``n_part`` of a node's CSR segment: edges
    ⌊len·p/P⌋ .. ⌊len·(p+1)/P⌋, so the parts tile the segment exactly whatever its length
    (short segments leave some parts empty)."""
    seg_first = tl.load(rowptr_ptr + node)
    seg_len = tl.load(rowptr_ptr + node + 1) - seg_first
    return seg_first + seg_len * part // n_part, seg_first + seg_len * (part + 1) // n_part


@triton.jit
def _aggregate_fwd_kernel(
    x_ptr, w_ptr, wt_ptr, rowptr_ptr, scale_ptr, out_ptr,
    x_se, w_se, w_sr, w_sc, wt_se, wt_sg,
    L: tl.constexpr, FD: tl.constexpr, WD: tl.constexpr, GW: tl.constexpr,
    DP: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    ROW: tl.constexpr = FD * (3 * L + 1)
    D: tl.constexpr = (L + 1) * L + L + 1
    node = tl.program_id(axis=0).to(tl.int64)
    cvec = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = cvec < WD
    # Channel c = f·FD + cf sits at f·ROW + r·FD + cf inside an edge's (F, ROW) row.
    x_chan = (cvec // FD) * ROW + cvec % FD
    group = cvec // GW
    cols = tl.arange(0, DP)
    part = tl.program_id(2)
    first, stop = segment_part_range(rowptr_ptr, node, part, tl.num_programs(2))
    acc = tl.zeros((DP, BLOCK_C), dtype=tl.float32)
    for k0 in range(first, stop, BLOCK_E):
        edges = k0 + tl.arange(0, BLOCK_E)
        edge_live = edges < stop
        tile_mask = edge_live[:, None] & c_mask[None, :]
        weight = tl.load(
            wt_ptr + (edges * wt_se)[:, None] + (group * wt_sg)[None, :], mask=tile_mask, other=0.0
        )
        x_edge = x_ptr + (edges * x_se)[:, None] + x_chan[None, :]
        w_edge = w_ptr + edges * w_se
        # Only the structural entries: column q of degree l takes rows m' ∈ {0, ±1} of that
        # degree (≤ 3 scalar loads and FMAs per edge and channel; a dense masked (DP,) Wigner row
        # per reduced row would issue DP loads and FMAs each). The row select folds away: the
        # packed-row axis of ``acc`` lies within each thread.
        for l in tl.static_range(L + 1):
            centre = l * l + l
            x_mid = tl.load(x_edge + l * FD, mask=tile_mask, other=0.0) * weight
            if l > 0:
                x_neg = tl.load(x_edge + (L + l) * FD, mask=tile_mask, other=0.0) * weight
                x_pos = tl.load(x_edge + (2 * L + l) * FD, mask=tile_mask, other=0.0) * weight
            for q in tl.static_range(l * l, (l + 1) * (l + 1)):
                d_mid = _wigner_entry(w_edge, edge_live, w_sr, w_sc, centre, q)
                message = d_mid[:, None] * x_mid
                if l > 0:
                    d_neg = _wigner_entry(w_edge, edge_live, w_sr, w_sc, centre - 1, q)
                    d_pos = _wigner_entry(w_edge, edge_live, w_sr, w_sc, centre + 1, q)
                    message += d_neg[:, None] * x_neg + d_pos[:, None] * x_pos
                acc += tl.where(cols[:, None] == q, tl.sum(message, axis=0)[None, :], 0.0)
    scale = tl.load(scale_ptr + cols, mask=cols < D, other=0.0)
    # Partial p of node n is row p·N + n of the (P·N, D, WD) output.
    out_row = part.to(tl.int64) * tl.num_programs(0) + node
    out = out_ptr + out_row * (D * WD) + (cols * WD)[:, None] + cvec[None, :]
    tl.store(out, acc * scale[:, None], mask=(cols < D)[:, None] & c_mask[None, :])


@triton.jit
def _adjoint_entry(
    g_local, grad_entries, g_col, wx_row, w_edge, edge_live, scale, slots,
    w_sr, w_sc, row, side, col, D: tl.constexpr,
):  # fmt: skip
    """Structural entry (packed ``row`` = l²+l+``side``, column ``col``) for a tile of edges:
    adds ``wigner[e, row, col]·g_col`` to ``g_local`` (BLOCK_E, WP) and puts
    ``grad wigner[e, row, col] = s·Σ_c g_col·w·x_row`` into its slot ``(side+1)·D + col`` of
    ``grad_entries`` (BLOCK_E, SP)."""
    entry = tl.load(w_edge + row * w_sr + col * w_sc, mask=edge_live, other=0.0)
    value = tl.sum(g_col * wx_row, axis=1) * scale
    grad_entries = tl.where(slots[None, :] == (side + 1) * D + col, value[:, None], grad_entries)
    return g_local + entry[:, None] * g_col, grad_entries


@triton.jit
def _store_row_grad(gx_row, g_local, x_row, weight, row_mask):
    """Stores ``grad x_local`` of one reduced row, returns its ``grad weights`` summand."""
    tl.store(gx_row, g_local * weight, mask=row_mask)
    return g_local * x_row


@triton.jit
def _store_structural_grads(gw_edge, grad_entries, edge_live, slots, gw_sr, gw_sc,
                            L: tl.constexpr, D: tl.constexpr):  # fmt: skip
    """Scatters the (BLOCK_E, SP) slots to ``grad wigner``: slot ``(side+1)·D + q`` is entry
    (l(q)² + l(q) + side, q); slots past 3D and the m = ∓1 slots of degree 0 hold nothing."""
    col = slots % D
    side = slots // D - 1
    degree = tl.zeros_like(col)
    for k in tl.static_range(1, L + 1):
        degree += (col >= k * k).to(tl.int32)
    row = degree * degree + degree + side
    held = (slots < 3 * D) & ((degree > 0) | (side == 0))
    tl.store(
        gw_edge[:, None] + (row * gw_sr + col * gw_sc)[None, :],
        grad_entries,
        mask=edge_live[:, None] & held[None, :],
    )


# n_edge only bounds the last tile: one compilation serves every edge count.
@triton.jit(do_not_specialize=["n_edge"])
def _aggregate_bwd_kernel(
    gout_ptr, x_ptr, w_ptr, wt_ptr, dst_ptr, scale_ptr,
    gx_ptr, gw_ptr, gwt_ptr,
    n_edge, x_se, w_se, w_sr, w_sc, wt_se, wt_sg, gw_se, gw_sr, gw_sc,
    L: tl.constexpr, FD: tl.constexpr, WD: tl.constexpr, GW: tl.constexpr, G: tl.constexpr,
    WP: tl.constexpr, RUN: tl.constexpr, SP: tl.constexpr, BLOCK_E: tl.constexpr,
    COL_STAGES: tl.constexpr,
):  # fmt: skip
    """One program per BLOCK_E consecutive edges; tiles are (BLOCK_E, WP) edges × channels.

    Degrees and their columns are runtime loops, not unrolled: the working set stays one degree
    (about a dozen tiles) whatever lmax, and compile time stays flat in lmax. The m = ∓1 rows of
    degree 0 do not exist; their loads and stores are masked off rather than special-cased. The
    Wigner gradients collect in a (BLOCK_E, SP) register tile stored once: a (BLOCK_E,) store
    per entry would cost a shared-memory layout exchange each.
    """
    ROW: tl.constexpr = FD * (3 * L + 1)
    D: tl.constexpr = (L + 1) * L + L + 1
    edges = tl.arange(0, BLOCK_E) + BLOCK_E * tl.program_id(axis=0).to(tl.int64)
    edge_live = edges < n_edge
    cvec = tl.arange(0, WP)
    c_mask = cvec < WD
    tile_mask = edge_live[:, None] & c_mask[None, :]
    # Channels run contiguously within a focus stream; saying so lets the row loads and stores
    # vectorise and puts a warp's lanes along channels (intra-warp channel reductions).
    x_chan = tl.max_contiguous(tl.multiple_of((cvec // FD) * ROW + cvec % FD, RUN), RUN)[None, :]
    group = cvec // GW
    weight = tl.load(
        wt_ptr + (edges * wt_se)[:, None] + (group * wt_sg)[None, :], mask=tile_mask, other=0.0
    )
    # Row offsets stay (BLOCK_E,) and meet the channel offsets at each access: hoisted 2-D
    # 64-bit pointer tiles would hold ~2 registers per element for the whole kernel.
    gout_base = tl.load(dst_ptr + edges, mask=edge_live, other=0) * (D * WD)
    x_base = edges * x_se
    w_edge = w_ptr + edges * w_se
    slots = tl.arange(0, SP)
    grad_entries = tl.zeros((BLOCK_E, SP), dtype=tl.float32)
    products = tl.zeros((BLOCK_E, WP), dtype=tl.float32)
    for l in range(L + 1):
        centre = l * l + l
        side_live = edge_live & (l > 0)
        side_mask = tile_mask & (l > 0)
        x_mid = tl.load(x_ptr + (x_base + l * FD)[:, None] + x_chan, mask=tile_mask, other=0.0)
        x_neg = tl.load(
            x_ptr + (x_base + (L + l) * FD)[:, None] + x_chan, mask=side_mask, other=0.0
        )
        x_pos = tl.load(
            x_ptr + (x_base + (2 * L + l) * FD)[:, None] + x_chan, mask=side_mask, other=0.0
        )
        # The rescale s(l) is applied to the results, not to every gathered column.
        scale = tl.load(scale_ptr + l * l)
        g_mid = tl.zeros((BLOCK_E, WP), dtype=tl.float32)
        g_neg = tl.zeros((BLOCK_E, WP), dtype=tl.float32)
        g_pos = tl.zeros((BLOCK_E, WP), dtype=tl.float32)
        # Pipelined (COL_STAGES > 1): the next columns' gathers are in flight during this one.
        for col in tl.range(l * l, centre + l + 1, num_stages=COL_STAGES):
            g_col = tl.load(
                gout_ptr + (gout_base + col * WD)[:, None] + cvec, mask=tile_mask, other=0.0
            )
            g_mid, grad_entries = _adjoint_entry(
                g_mid, grad_entries, g_col, x_mid * weight, w_edge, edge_live, scale, slots,
                w_sr, w_sc, centre, 0, col, D,
            )  # fmt: skip
            g_neg, grad_entries = _adjoint_entry(
                g_neg, grad_entries, g_col, x_neg * weight, w_edge, side_live, scale, slots,
                w_sr, w_sc, centre - 1, -1, col, D,
            )  # fmt: skip
            g_pos, grad_entries = _adjoint_entry(
                g_pos, grad_entries, g_col, x_pos * weight, w_edge, side_live, scale, slots,
                w_sr, w_sc, centre + 1, 1, col, D,
            )  # fmt: skip
        products += _store_row_grad(
            gx_ptr + (x_base + l * FD)[:, None] + x_chan, g_mid * scale, x_mid, weight, tile_mask
        )
        products += _store_row_grad(
            gx_ptr + (x_base + (L + l) * FD)[:, None] + x_chan, g_neg * scale, x_neg, weight,
            side_mask,
        )  # fmt: skip
        products += _store_row_grad(
            gx_ptr + (x_base + (2 * L + l) * FD)[:, None] + x_chan, g_pos * scale, x_pos, weight,
            side_mask,
        )  # fmt: skip
    _store_structural_grads(gw_ptr + edges * gw_se, grad_entries, edge_live, slots, gw_sr, gw_sc,
                            L, D)  # fmt: skip
    # Padded lanes hold 0 in ``products``, so their out-of-range group index never matters.
    for k in tl.static_range(G):
        grad_weight = tl.sum(tl.where((group == k)[None, :], products, 0.0), axis=1)
        tl.store(gwt_ptr + edges * G + k, grad_weight, mask=edge_live)


# Launchers

_INTERPRETER_BLOCK_E = 128
"""Under TRITON_INTERPRET the cost is programs × ops (~10² per edge block: a few per structural
Wigner entry): one edge block per node segment (~10² edges)."""

_INTERPRETER_BWD_BLOCK_E = 128
"""The backward's edge blocks run ~10² interpreted ops each, whatever their height."""


def _block_e(device: torch.device) -> int:
    """Forward edge step. On the GPU one edge per step: 32 registers (ptxas, sm_90, lmax 2,
    C 128, strides as specialised at run time; 48 at lmax 3), and the segment parts give each
    SM enough programs to hide the loads' latency."""
    return 1 if device.type == "cuda" else _INTERPRETER_BLOCK_E


class BwdTiles(NamedTuple):
    """Launch shape of the edge-parallel backward."""

    block_e: int
    """Edges per program (BLOCK_E)."""
    num_warps: int
    col_stages: int
    """Software-pipeline depth of the grad_out column gathers (1: not pipelined)."""


_BWD_TILE_ELEMS_PER_THREAD = 4
"""fp32 values per thread of one (BLOCK_E, WP) backward tile: one 16-byte vector, a warp per
edge at 128 lanes. About a dozen tiles stay live in the column loop (weight, x and w·x of three
rows, their g_local, a grad_out column, the grad-weights products): at 4 values each the kernel
needs ~80-95 registers (ptxas, sm_90), five or six 4-warp programs per SM; at 8 about 150."""

_BWD_COL_STAGES = 1
"""Software-pipelining depth of the column loop (each column gathers grad_out rows). Measured on
the H200 (`benchmarks/kernels_aggregate.py`, lmax 2, C_wide 128): at 1.05M edges 4.20 ms without
pipelining vs 4.79 ms with 3 stages (cp.async), at 17k edges 0.355 vs 0.347 ms; the ~16 other
programs per SM already hide the gather latency, so the default does not pipeline."""


def _bwd_tiles(device: torch.device, lanes: int) -> BwdTiles:
    """Default backward launch shape for ``lanes`` (WP) channel lanes."""
    if device.type != "cuda":
        return BwdTiles(_INTERPRETER_BWD_BLOCK_E, 4, 1)
    num_warps = 4 if lanes <= 128 else 8
    block_e = _BWD_TILE_ELEMS_PER_THREAD * 32 * num_warps // lanes
    return BwdTiles(max(1, min(32, block_e)), num_warps, _BWD_COL_STAGES)


def _num_warps(dp: int, lanes: int) -> int:
    """Enough warps that a (DP, lanes) fp32 tile takes ≤ ~32 registers per thread."""
    warps: int = triton.next_power_of_2(-(-dp * lanes // (32 * 32)))
    return min(16, max(4, warps))


def _contiguous_run(focus_dim: int, lanes: int) -> int:
    """Largest power of two dividing Cf, at most ``lanes``: channel offsets are contiguous in
    runs of this length, each starting at a multiple of it."""
    return min(focus_dim & -focus_dim, lanes)


def _structural_slots(lmax: int) -> int:
    """SP: register slots for one edge's Wigner gradients, ``(m'+1)·D + q`` for m' ∈ {-1,0,1}."""
    return int(triton.next_power_of_2(3 * n_coeff(lmax)))


def _shape(x_local: Tensor, weights: Tensor, lmax: int) -> tuple[int, int, int, int]:
    """``(C_wide, Cf, group width, DP)``."""
    focus_dim = x_local.shape[2] // n_reduced(lmax)
    c_wide = x_local.shape[1] * focus_dim
    return c_wide, focus_dim, c_wide // weights.shape[1], triton.next_power_of_2(n_coeff(lmax))


SEGMENT_PROGRAMS_PER_SM = 16
"""Node-segment kernels (this forward, ``segment_outer_sum``'s backward) cut segments into parts
until they have about this many programs per SM: at 4 warps each that is the SM's full warp
complement, enough independent load chains to hide latency. 0 never cuts (benchmarks)."""

_MIN_PART_EDGES = 8
"""A segment part keeps at least this many edges on average: shorter parts would cost more in
per-part overhead (partial tiles, loop set-up) than they hide."""

_MAX_PARTS = 32


def segment_parts(n_node: int, n_edge: int, programs_per_node: int, sm_count: int) -> int:
    """Parts P per node segment for a kernel with ``programs_per_node`` programs per (node, part)
    over ``n_node`` nodes and ``n_edge`` edges on a GPU of ``sm_count`` SMs: 1 once the nodes
    alone fill the GPU (large systems keep one pass per segment), else enough for
    ~``SEGMENT_PROGRAMS_PER_SM`` programs per SM, bounded by the mean segment length."""
    programs = max(1, n_node * programs_per_node)
    wanted = -(-sm_count * SEGMENT_PROGRAMS_PER_SM // programs)
    longest_useful = n_edge // max(1, n_node * _MIN_PART_EDGES)
    return max(1, min(wanted, longest_useful, _MAX_PARTS))


@cache
def _sm_count(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def default_segment_parts(
    device: torch.device, n_node: int, n_edge: int, programs_per_node: int
) -> int:
    """GPU: :func:`segment_parts`. The interpreter costs programs × ops: one part."""
    if device.type != "cuda":
        return 1
    return segment_parts(n_node, n_edge, programs_per_node, _sm_count(device))


def launch_aggregate_fwd(
    x_local: Tensor,
    wigner: Tensor,
    weights: Tensor,
    dst_rowptr: Tensor,
    lmax: int,
    n_part: int | None = None,
    block_e: int | None = None,
) -> Tensor:
    """Forward kernel; ``x_local`` contiguous. ``n_part`` (segment parts; default
    :func:`segment_parts` on the GPU, 1 elsewhere) and ``block_e`` (edges per step, a power of
    two; default 1 on the GPU) override the launch shape (tests, benchmark sweeps)."""
    n_node = dst_rowptr.shape[0] - 1
    c_wide, focus_dim, group_width, dp = _shape(x_local, weights, lmax)
    if n_node == 0 or c_wide == 0:
        return x_local.new_empty((n_node, n_coeff(lmax), c_wide))
    block_c = min(triton.next_power_of_2(c_wide), 128)
    c_blocks = triton.cdiv(c_wide, block_c)
    if n_part is None:
        n_part = default_segment_parts(x_local.device, n_node, x_local.shape[0], c_blocks)
    if n_part < 1:
        raise ValueError(f"so2kernels.{_OP}: n_part must be >= 1, got {n_part}")
    # Read through their strides, with int32 offsets inside an edge.
    wigner, weights = int32_inner_offsets(wigner), int32_inner_offsets(weights)
    out = x_local.new_empty((n_part, n_node, n_coeff(lmax), c_wide))
    scale = rotate_back_rescale(lmax, x_local.device, torch.float32)
    grid = (n_node, c_blocks, n_part)
    wrap_triton(_aggregate_fwd_kernel)[grid](
        x_local, wigner, weights, dst_rowptr.contiguous(), scale, out,  # indexed with unit stride
        x_local.stride(0), wigner.stride(0), wigner.stride(1), wigner.stride(2),
        weights.stride(0), weights.stride(1),
        L=lmax, FD=focus_dim, WD=c_wide, GW=group_width, DP=dp, BLOCK_C=block_c,
        BLOCK_E=block_e or _block_e(x_local.device), num_warps=_num_warps(dp, block_c),
    )  # fmt: skip
    # A plain reduction over the leading axis: fixed order, no atomics.
    return out[0] if n_part == 1 else out.sum(0)


def launch_aggregate_bwd(
    grad_out: Tensor,
    x_local: Tensor,
    wigner: Tensor,
    weights: Tensor,
    dst_rowptr: Tensor,
    lmax: int,
    tiles: BwdTiles | None = None,
) -> _Grads:
    """Backward kernel; ``grad_out`` and ``x_local`` contiguous. ``tiles`` overrides the
    default launch shape (tests and the benchmark sweep)."""
    n_edge = x_local.shape[0]
    n_group = weights.shape[1]
    c_wide, focus_dim, group_width, _ = _shape(x_local, weights, lmax)
    grad_x = torch.empty_like(x_local)
    # Zero-filled: the kernel writes only the structural entries.
    grad_wigner = torch.zeros(wigner.shape, device=wigner.device, dtype=wigner.dtype)
    grad_weights = weights.new_empty(weights.shape)
    if n_edge == 0 or c_wide == 0:
        # No channels: edges exist but no message depends on their weights.
        return grad_x, grad_wigner, grad_weights.zero_()
    lanes = triton.next_power_of_2(c_wide)
    block_e, num_warps, col_stages = tiles or _bwd_tiles(x_local.device, lanes)
    wigner, weights = int32_inner_offsets(wigner), int32_inner_offsets(weights)
    scale = rotate_back_rescale(lmax, x_local.device, torch.float32)
    dst = segment_of_position(dst_rowptr, n_edge)
    n_blocks = triton.cdiv(n_edge, block_e)
    wrap_triton(_aggregate_bwd_kernel)[(n_blocks,)](
        grad_out, x_local, wigner, weights, dst, scale,
        grad_x, grad_wigner, grad_weights,
        n_edge, x_local.stride(0), wigner.stride(0), wigner.stride(1), wigner.stride(2),
        weights.stride(0), weights.stride(1),
        grad_wigner.stride(0), grad_wigner.stride(1), grad_wigner.stride(2),
        L=lmax, FD=focus_dim, WD=c_wide, GW=group_width, G=n_group, WP=lanes,
        RUN=_contiguous_run(focus_dim, lanes), SP=_structural_slots(lmax), BLOCK_E=block_e,
        COL_STAGES=col_stages, num_warps=num_warps,
    )  # fmt: skip
    return grad_x, grad_wigner, grad_weights


# Op registration


@triton_op(f"so2kernels::{_OP}", mutates_args=())
def _aggregate_op(
    x_local: Tensor, wigner: Tensor, weights: Tensor, dst_rowptr: Tensor, lmax: int
) -> Tensor:
    check_aggregate_inputs(x_local, wigner, weights, dst_rowptr, lmax)
    if not use_triton(x_local, wigner, weights, dst_rowptr):
        return attention_aggregate_reference(x_local, wigner, weights, dst_rowptr, lmax)
    _check_fused_regime(x_local, wigner, weights, lmax)
    with launch_device(x_local):
        return launch_aggregate_fwd(x_local.contiguous(), wigner, weights, dst_rowptr, lmax)


@_aggregate_op.register_fake
def _aggregate_fake(
    x_local: Tensor, wigner: Tensor, weights: Tensor, dst_rowptr: Tensor, lmax: int
) -> Tensor:
    check_aggregate_inputs(x_local, wigner, weights, dst_rowptr, lmax)
    c_wide = x_local.shape[1] * (x_local.shape[2] // n_reduced(lmax))
    return x_local.new_empty((dst_rowptr.shape[0] - 1, n_coeff(lmax), c_wide))


@triton_op(f"so2kernels::{_OP}_bwd", mutates_args=())
def _aggregate_bwd_op(
    grad_out: Tensor,
    x_local: Tensor,
    wigner: Tensor,
    weights: Tensor,
    dst_rowptr: Tensor,
    lmax: int,
) -> _Grads:
    check_aggregate_inputs(x_local, wigner, weights, dst_rowptr, lmax)
    _check_grad_out(grad_out, x_local, dst_rowptr, lmax)
    if not use_triton(grad_out, x_local, wigner, weights, dst_rowptr):
        return attention_aggregate_backward_reference(
            grad_out, x_local, wigner, weights, dst_rowptr, lmax
        )
    _check_fused_regime(x_local, wigner, weights, lmax)
    require_fp32(f"{_OP}_bwd", grad_out=grad_out)
    with launch_device(grad_out):
        return launch_aggregate_bwd(
            grad_out.contiguous(), x_local.contiguous(), wigner, weights, dst_rowptr, lmax
        )


@_aggregate_bwd_op.register_fake
def _aggregate_bwd_fake(
    grad_out: Tensor,
    x_local: Tensor,
    wigner: Tensor,
    weights: Tensor,
    dst_rowptr: Tensor,
    lmax: int,
) -> _Grads:
    check_aggregate_inputs(x_local, wigner, weights, dst_rowptr, lmax)
    _check_grad_out(grad_out, x_local, dst_rowptr, lmax)
    return (
        x_local.new_empty(x_local.shape),
        wigner.new_empty(wigner.shape),
        weights.new_empty(weights.shape),
    )


def _aggregate_setup_context(
    ctx: Any, inputs: tuple[Tensor, Tensor, Tensor, Tensor, int], output: Tensor
) -> None:
    x_local, wigner, weights, dst_rowptr, lmax = inputs
    ctx.save_for_backward(x_local, wigner, weights, dst_rowptr)
    ctx.lmax = lmax


def _aggregate_backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
    """Triton first order; the differentiable closed form under ``create_graph``."""
    x_local, wigner, weights, dst_rowptr = ctx.saved_tensors
    if torch.is_grad_enabled():
        grads = attention_aggregate_backward_reference(
            grad_out, x_local, wigner, weights, dst_rowptr, ctx.lmax
        )
    else:
        grads = torch.ops.so2kernels.so2_attention_aggregate_bwd(
            grad_out, x_local, wigner, weights, dst_rowptr, ctx.lmax
        )
    needs = ctx.needs_input_grad
    grad_x, grad_wigner, grad_weights = grads
    return (
        grad_x if needs[0] else None,
        grad_wigner if needs[1] else None,
        grad_weights if needs[2] else None,
        None,
        None,
    )


_aggregate_op.register_autograd(_aggregate_backward, setup_context=_aggregate_setup_context)


# Typed Python entry point


def attention_aggregate(
    x_local: Tensor, wigner: Tensor, weights: Tensor, dst_rowptr: Tensor, lmax: int
) -> Tensor:
    """``torch.ops.so2kernels.so2_attention_aggregate``: (N, D, C_wide); see the module docstring.

    Raises:
        ValueError: operand shapes or dtypes disagree with the layout contract.
        UnsupportedInputError: the fused path got a non-float32 operand or lmax outside 1..6.
    """
    out: Tensor = torch.ops.so2kernels.so2_attention_aggregate(
        x_local, wigner, weights, dst_rowptr, int(lmax)
    )
    return out
