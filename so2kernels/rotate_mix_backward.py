"""Backward (first and second order) of ``so2_rotate_mix``.

Layout contract.
``so2kernels::so2_rotate_mix_bwd`` takes ``grad_u``, then the ten operands of ``so2_rotate_mix``
in their order, then ``want_cb``, and returns ``(grad_x, grad_wigner, grad_kc, grad_cb)``:

* ``grad_u`` (F, E, ROW), any strides (the launcher packs it for the kernels).
* ``grad_x`` (N, D, C_wide): per-edge node gradients reduced over the source CSR
  ``(src_order, src_rowptr)`` in CSR order: deterministic, no atomics.
* ``grad_wigner`` (E, Dw, Dw): the structural entries the forward reads (rows m' ∈ {-1, 0, +1}
  of each degree block, that block's columns); every other entry is exactly 0.
* ``grad_kc`` shaped like ``kc``; ``grad_cb`` (R, C_wide) when ``want_cb`` and rank ≥ 1, else an
  empty (0,) tensor (the gradient is not formed at all; rank 0 does not read ``cb``).

Fused schedules (``LaunchTiles.variant``, picked per shape by the tile table):

* ``"csr"`` (the fallback): program p takes the fixed-length chunk ``p·chunk ..`` of the source
  CSR order (``chunk`` follows E, so the program count does too, however few the nodes) and
  walks the node segments inside it, ``block_e`` edges per step. Edges of one segment share the
  node's feature rows; the rotated rows are recomputed in registers (nothing per edge is saved
  by the forward); the node gradient ``Wᵀ·g_local`` accumulates in registers per edge lane and
  is summed once per segment. A segment cut by a chunk boundary leaves one (D, C_wide) part per
  chunk, which a per-node pass sums in chunk order (it also zero-fills nodes without edges).
  With one warp per program every per-edge channel reduction (Wigner and kernel gradients)
  stays in the warp: shuffles, no shared memory, no barrier.
* ``"node"``: one program per node walks that node's whole segment the same way: no cut
  segments, but only N programs, and as unbalanced as the degrees.
* ``"edge"``: one program per ``block_e`` consecutive edges (coalesced, edge-order reads of
  ``grad_u``/``wigner``/``kc`` and writes of their gradients) does the same per-edge work and
  writes ``Wᵀ·g_local`` as a per-edge node gradient (E, D, C_wide), which the CSR
  ``segment_sum`` over ``(src_order, src_rowptr)`` then reduces: that intermediate's write and
  read for E / block_e independent programs.

All three sum the node gradient and the basis gradient's per-program partials in a fixed order:
deterministic, no atomics.

Second order: the op is linear in each of (x, wigner, kc, cb) and so is its output in the
cotangent, so the backward of the backward is a sum of forward and backward launches, each with
one operand replaced by the incoming cotangent (closed form; no nested autograd).
"""

# Triton kernels grow register tuples by concatenation: its frontend has no starred unpacking.
# ruff: noqa: RUF005

# Triton kernels take untyped pointer/constexpr arguments and @triton.jit is an untyped decorator.
# Row tuples grow inside tl.static_range loops (tuple[()] → tuple[Any, ...]).
# mypy: disable-error-code="no-untyped-def,untyped-decorator,assignment"
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from so2kernels._dispatch import launch_device, require_fp32, use_triton
from so2kernels._layout import n_coeff, n_reduced, reduced_to_packed_tensor
from so2kernels.rotate_mix import (
    _gather_edge_tile,
    _kernel_edge_stride,
    _kernel_entry,
    _load_basis,
    _mix_by_degree,
    _mix_low_rank,
    _rotate_to_local,
    check_fused_regime,
    check_rotate_mix_inputs,
    degree_index,
    fold_mixing_blocks,
    from_focus_major,
    kernel_operands,
    mixing_blocks,
    placed_basis,
    structure_mask,
    wigner_reduced_rows,
)
from so2kernels.segment import _launch_segment_sum, segment_sum_reference
from so2kernels.tiles import LaunchTiles, csr_chunk, rotate_mix_tiles

# Eager closed-form reference (any dtype)


def rotate_mix_backward_reference(
    grad_u: Tensor, *operands: Any, want_cb: bool = True
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(grad_x, grad_wigner, grad_kc, grad_cb)`` of ``<grad_u, rotate_mix(*operands)>`` in
    closed form; ``operands`` are the ten forward operands in the op's order."""
    check_rotate_mix_inputs(*operands)
    feats, src, order, rowptr, rot, kern, basis, lmax, _, rank = operands
    rows = wigner_reduced_rows(rot, lmax)  # (E, RED, D)
    gathered = feats.index_select(0, src)  # (E, D, WD)
    local = torch.bmm(rows, gathered)  # (E, RED, WD)
    g_mixed = from_focus_major(grad_u, n_reduced(lmax))  # (E, RED, WD)
    if rank > 0:
        blocks = mixing_blocks(kern, lmax, rank)  # (E, RED, RED, R)
        # Letters: n edge, a input row, b output row, k rank, w channel.
        g_local = torch.einsum("nabk,nbw,kw->naw", blocks, g_mixed, basis)
        g_blocks = torch.einsum("nbw,naw,kw->nabk", g_mixed, local, basis)
        grad_kc = fold_mixing_blocks(g_blocks, lmax).reshape(kern.shape)
    else:
        by_degree = degree_index(lmax, feats.device)
        g_local = g_mixed * kern.index_select(1, by_degree)
        grad_kc = torch.zeros_like(kern).index_add(1, by_degree, g_mixed * local)
    if want_cb and rank > 0:
        grad_cb = torch.einsum("nabk,naw,nbw->kw", blocks, local, g_mixed)
    else:
        grad_cb = basis.new_zeros((0,))
    # Wigner: only the structural entries of the reduced rows, scattered back to packed rows.
    g_rows = torch.bmm(g_local, gathered.transpose(1, 2))
    g_rows = g_rows * structure_mask(lmax, rot.device, rot.dtype)  # (E, RED, D)
    n_packed = n_coeff(lmax)
    scattered = g_rows.new_zeros((src.shape[0], n_packed, n_packed))
    scattered = scattered.index_copy(1, reduced_to_packed_tensor(lmax, rot.device), g_rows)
    grad_wigner = torch.zeros_like(rot, memory_format=torch.contiguous_format)
    grad_wigner[:, :n_packed, :n_packed] = scattered
    per_edge = torch.bmm(rows.mT, g_local)  # per-edge node gradient (E, D, WD)
    return segment_sum_reference(per_edge, order, rowptr), grad_wigner, grad_kc, grad_cb


# Triton kernels. Every schedule runs the same per-edge-block body (`_local_gradient`, then
# `_adjoint_column` per packed column); they differ in which edges one program takes and in where
# the node gradient is reduced. grad_kc / grad_wigner / grad_x / grad_u are contiguous, so their
# inner strides are constants.


@triton.jit
def _store_kernel_grads_by_degree(gy, xr, gkc_edge, cvec, tile_mask, L: tl.constexpr,
                                  WD: tl.constexpr):  # fmt: skip
    """Rank 0: ``grad kc[e, l, :] = Σ_{rows r of degree l} gy[r] ⊙ xr[r]``."""
    for l in tl.static_range(L + 1):
        t = gy[l] * xr[l]
        if l > 0:
            t += gy[L + l] * xr[L + l] + gy[2 * L + l] * xr[2 * L + l]
        tl.store(gkc_edge[:, None] + l * WD + cvec[None, :], t, mask=tile_mask)


@triton.jit
def _accumulate_basis_grad(cb_acc, t, kc_edge, edge_live, slot: tl.constexpr, RANK: tl.constexpr):
    """``cb_acc[r] += kc[e, slot·R + r] · t[e, :]`` for every r, kept per edge lane: the sum over
    the edge axis is taken once per program (``_store_basis_partial``), not once per step."""
    updated = ()
    for r in tl.static_range(RANK):
        updated = updated + (cb_acc[r] + t * _kernel_entry(kc_edge, edge_live, slot, r, RANK),)
    return updated


@triton.jit
def _project_slot(gkc_edge, slot: tl.constexpr, t, basis, edge_live, RANK: tl.constexpr):
    """``grad kc[e, slot·R + k] = Σ_c cb[k, c]·t[e, c]`` for k = 0 .. R-1."""
    slot_row = gkc_edge + slot * RANK
    for k in tl.static_range(RANK):
        projected = tl.sum(t * basis[k], axis=1)
        tl.store(slot_row + k, projected, mask=edge_live)


@triton.jit
def _store_kernel_grads_low_rank(
    gy, xr, gkc_edge, kc_edge, edge_live, basis, cb_acc,
    L: tl.constexpr, RANK: tl.constexpr, WANT_CB: tl.constexpr,
):  # fmt: skip
    """Rank R ≥ 1. Each kernel slot (i, o) gets ``t_io = gy[o] ⊙ xr[i]`` projected on the basis
    rows (``_project_slot``); the |m|=1 slots are shared by the m=-1 and m=+1 copies, so their
    ``t`` adds both. The basis gradient ``Σ_e Σ_slot kc[e, slot, r]·t`` is kept per program."""
    S: tl.constexpr = L + 1
    for i in tl.static_range(S):
        for o in tl.static_range(S):
            t = gy[o] * xr[i]
            _project_slot(gkc_edge, i * S + o, t, basis, edge_live, RANK)
            if WANT_CB:
                cb_acc = _accumulate_basis_grad(cb_acc, t, kc_edge, edge_live, i * S + o, RANK)
    # |m| = 1 slots follow the S·S m = 0 slots; the m=-1 rows start at S, the m=+1 rows at S + L.
    for i in tl.static_range(L):
        for o in tl.static_range(L):
            t = gy[S + o] * xr[S + i] + gy[S + L + o] * xr[S + L + i]
            _project_slot(gkc_edge, S * S + i * L + o, t, basis, edge_live, RANK)
            if WANT_CB:
                cb_acc = _accumulate_basis_grad(cb_acc, t, kc_edge, edge_live, S * S + i * L + o,
                                                RANK)  # fmt: skip
    return cb_acc


@triton.jit
def _adjoint_column(
    g_local, xv, w_col, gw_col, edge_live,
    l: tl.constexpr, L: tl.constexpr, W_SR: tl.constexpr, GW_SR: tl.constexpr,
):  # fmt: skip
    """One packed column j of degree block l (``w_col``/``gw_col`` point at column j of each
    edge's block, ``xv`` is x[s, j, :]): store the Wigner gradients of the column's structural
    entries (rows m' = -1, 0, +1) and return the per-edge node gradient
    ``Σ_r wigner[e, p(r), j] · g_local[r]`` of that column, (BLOCK_E, WP)."""
    centre = l * l + l
    w0 = tl.load(w_col + centre * W_SR, mask=edge_live, other=0.0)
    contrib = w0[:, None] * g_local[l]
    tl.store(gw_col + centre * GW_SR, tl.sum(g_local[l] * xv, axis=1), mask=edge_live)
    if l > 0:
        g_neg = g_local[L + l]
        g_pos = g_local[2 * L + l]
        w_neg = tl.load(w_col + (centre - 1) * W_SR, mask=edge_live, other=0.0)
        w_pos = tl.load(w_col + (centre + 1) * W_SR, mask=edge_live, other=0.0)
        contrib += w_neg[:, None] * g_neg + w_pos[:, None] * g_pos
        tl.store(gw_col + (centre - 1) * GW_SR, tl.sum(g_neg * xv, axis=1), mask=edge_live)
        tl.store(gw_col + (centre + 1) * GW_SR, tl.sum(g_pos * xv, axis=1), mask=edge_live)
    return contrib


@triton.jit
def _local_gradient(
    x_tile, x_mask, w_edge, kc_edge, gkc_edge, gu_tile, edge_live, tile_mask, cvec, basis, cb_acc,
    L: tl.constexpr, FD: tl.constexpr, WD: tl.constexpr, WP: tl.constexpr, RANK: tl.constexpr,
    WANT_CB: tl.constexpr, BLOCK_E: tl.constexpr, W_SR: tl.constexpr,
):  # fmt: skip
    """Shared per-edge-block body of every schedule: recompute the rotated rows, store the kernel
    gradients (and add the basis gradient to ``cb_acc``), and return ``(g_local, cb_acc)`` with
    ``g_local`` the 3L+1 reduced-row gradients before the rotation, each (BLOCK_E, WP)."""
    xr = _rotate_to_local(x_tile, x_mask, w_edge, edge_live, L, BLOCK_E, WP, WD, W_SR)
    gy = ()
    for row in tl.static_range(3 * L + 1):
        gy = gy + (tl.load(gu_tile + row * FD, mask=tile_mask, other=0.0),)
    if RANK == 0:
        _store_kernel_grads_by_degree(gy, xr, gkc_edge, cvec, tile_mask, L, WD)
        # The per-degree multiply is diagonal, hence its own adjoint.
        g_local = _mix_by_degree(gy, kc_edge, cvec, tile_mask, L, WD)
    else:
        cb_acc = _store_kernel_grads_low_rank(gy, xr, gkc_edge, kc_edge, edge_live, basis, cb_acc,
                                              L, RANK, WANT_CB)  # fmt: skip
        g_local = _mix_low_rank(gy, kc_edge, edge_live, basis, L, RANK, BLOCK_E, WP, True)
    return g_local, cb_acc


@triton.jit
def _zero_tiles(COUNT: tl.constexpr, BLOCK_E: tl.constexpr, WP: tl.constexpr):
    """A tuple of COUNT (BLOCK_E, WP) fp32 zero accumulators."""
    tiles = ()
    for _ in tl.static_range(COUNT):
        tiles = tiles + (tl.zeros((BLOCK_E, WP), dtype=tl.float32),)
    return tiles


@triton.jit
def _store_basis_partial(gcb_ptr, program, cb_acc, cvec, c_mask, RANK: tl.constexpr,
                         WD: tl.constexpr):  # fmt: skip
    """This program's basis-gradient partial (its edge lanes summed) into row ``program`` of
    (P, R, WD)."""
    gcb_row = gcb_ptr + program * (RANK * WD) + cvec
    for k in tl.static_range(RANK):
        lane_sum = tl.sum(cb_acc[k], axis=0)
        tl.store(gcb_row + k * WD, lane_sum, mask=c_mask)


@triton.jit
def _store_node_rows(dest, rows, cvec, write, NROWS: tl.constexpr, WD: tl.constexpr):
    """Write the NROWS (WP,) rows of one node gradient to ``dest``, a contiguous (NROWS, WD)
    block."""
    for k in tl.static_range(NROWS):
        tl.store(dest + k * WD + cvec, rows[k], mask=write)


@triton.jit
def _walk_source_segment(
    gu_ptr, x_ptr, w_ptr, kc_ptr, order_ptr, gw_ptr, gkc_ptr,
    node, lo, hi, n_edge, x_sn, w_se, cvec, c_mask, basis, cb_acc,
    L: tl.constexpr, FD: tl.constexpr, WD: tl.constexpr, WP: tl.constexpr,
    RANK: tl.constexpr, WANT_CB: tl.constexpr, BLOCK_E: tl.constexpr,
    W_SR: tl.constexpr, GW_SR: tl.constexpr,
):  # fmt: skip
    """CSR positions ``lo .. hi`` of ``node``'s source segment, BLOCK_E edges per step: store
    each edge's Wigner and kernel gradients and return ``(rows, cb_acc)``, ``rows`` the N_COEF
    (WP,) rows of ``Σ_edges Wᵀ·g_local``. Every edge starts at ``node``, so its feature rows are
    one shared (1, WP) tile per packed row; the node gradient stays per edge lane in registers
    and is summed over the lanes once, after the walk (no per-step cross-lane reduction)."""
    ROW_LEN: tl.constexpr = FD * (3 * L + 1)
    N_COEF: tl.constexpr = (1 + L) * (1 + L)
    kc_stride: tl.constexpr = _kernel_edge_stride(L, WD, RANK)
    x_tile = x_ptr + node * x_sn + cvec[None, :]
    x_mask = c_mask[None, :]
    gu_chan = ((cvec // FD).to(tl.int64) * n_edge * ROW_LEN + cvec % FD)[None, :]
    gx_acc = _zero_tiles(N_COEF, BLOCK_E, WP)
    for k0 in range(lo, hi, BLOCK_E):
        pos = k0 + tl.arange(0, BLOCK_E)
        edge_live = pos < hi
        edges = tl.load(order_ptr + pos, mask=edge_live, other=0)
        tile_mask = edge_live[:, None] & c_mask[None, :]
        w_edge = w_ptr + edges * w_se
        g_local, cb_acc = _local_gradient(
            x_tile, x_mask, w_edge, kc_ptr + edges * kc_stride, gkc_ptr + edges * kc_stride,
            gu_ptr + gu_chan + (edges * ROW_LEN)[:, None], edge_live, tile_mask, cvec, basis,
            cb_acc,
            L, FD, WD, WP, RANK, WANT_CB, BLOCK_E, W_SR,
        )  # fmt: skip
        updated = ()
        gw_edge = gw_ptr + edges * (GW_SR * GW_SR)
        for l in tl.static_range(L + 1):
            for col in tl.static_range(2 * l + 1):
                x_col = tl.load(x_tile + (l * l + col) * WD, mask=x_mask, other=0.0)
                contrib = _adjoint_column(
                    g_local, x_col, w_edge + (l * l + col), gw_edge + (l * l + col), edge_live,
                    l, L, W_SR, GW_SR,
                )  # fmt: skip
                # Indexed by the literal expression: Triton does not fold a named index here.
                updated = updated + (gx_acc[l * l + col] + contrib,)
        gx_acc = updated
    rows = ()
    for d in tl.static_range(N_COEF):
        rows = rows + (tl.sum(gx_acc[d], axis=0),)
    return rows, cb_acc


# n_edge only bounds the last tile: one compilation serves every edge count.
@triton.jit(do_not_specialize=("n_edge",))
def _rotate_mix_bwd_kernel(
    gu_ptr, x_ptr, w_ptr, kc_ptr, cb_ptr, order_ptr, rowptr_ptr,
    gx_ptr, gw_ptr, gkc_ptr, gcb_ptr,
    n_edge, x_sn, w_se,
    L: tl.constexpr, FD: tl.constexpr, WD: tl.constexpr, WP: tl.constexpr,
    RANK: tl.constexpr, WANT_CB: tl.constexpr, BLOCK_E: tl.constexpr,
    W_SR: tl.constexpr, GW_SR: tl.constexpr,
):  # fmt: skip
    """Node variant: one program per node, its whole source segment."""
    N_COEF: tl.constexpr = (1 + L) * (1 + L)
    node = tl.program_id(axis=0).to(tl.int64)
    cvec = tl.arange(0, WP)
    c_mask = cvec < WD
    basis = _load_basis(cb_ptr, cvec, c_mask, RANK, WD)
    rows, cb_acc = _walk_source_segment(
        gu_ptr, x_ptr, w_ptr, kc_ptr, order_ptr, gw_ptr, gkc_ptr,
        node, tl.load(rowptr_ptr + node), tl.load(rowptr_ptr + node + 1), n_edge, x_sn, w_se,
        cvec, c_mask, basis, _zero_tiles(RANK if WANT_CB else 0, BLOCK_E, WP),
        L, FD, WD, WP, RANK, WANT_CB, BLOCK_E, W_SR, GW_SR,
    )  # fmt: skip
    _store_node_rows(gx_ptr + node * (N_COEF * WD), rows, cvec, c_mask, N_COEF, WD)
    if WANT_CB:
        _store_basis_partial(gcb_ptr, node, cb_acc, cvec, c_mask, RANK, WD)


# n_edge only bounds the last tile: one compilation serves every edge count.
@triton.jit(do_not_specialize=("n_edge",))
def _rotate_mix_bwd_csr_kernel(
    gu_ptr, x_ptr, src_ptr, w_ptr, kc_ptr, cb_ptr, order_ptr, rowptr_ptr,
    gx_ptr, part_ptr, gw_ptr, gkc_ptr, gcb_ptr,
    n_edge, chunk, x_sn, w_se,
    L: tl.constexpr, FD: tl.constexpr, WD: tl.constexpr, WP: tl.constexpr,
    RANK: tl.constexpr, WANT_CB: tl.constexpr, BLOCK_E: tl.constexpr,
    W_SR: tl.constexpr, GW_SR: tl.constexpr,
):  # fmt: skip
    """CSR variant: program p takes the ``chunk`` CSR positions ``p·chunk ..`` and walks the
    source segments they cut, node by node. A node whose segment lies inside the chunk is
    stored to ``grad_x``; the part of a segment cut by a chunk boundary goes to
    ``part[p, 0]`` (the chunk's first node, begun in an earlier chunk) or ``part[p, 1]`` (its
    last node, continued in a later chunk) for ``_finish_split_nodes_kernel``. Nodes without
    edges are left to that kernel as well."""
    N_COEF: tl.constexpr = (1 + L) * (1 + L)
    program = tl.program_id(axis=0).to(tl.int64)
    start = program * chunk
    stop = tl.minimum(start + chunk, n_edge)
    cvec = tl.arange(0, WP)
    c_mask = cvec < WD
    basis = _load_basis(cb_ptr, cvec, c_mask, RANK, WD)
    cb_acc = _zero_tiles(RANK if WANT_CB else 0, BLOCK_E, WP)
    # Sources are non-decreasing along the CSR order: the chunk covers this node range.
    first_node = tl.load(src_ptr + tl.load(order_ptr + start))
    last_node = tl.load(src_ptr + tl.load(order_ptr + stop - 1))
    part_first = part_ptr + program * (2 * N_COEF * WD)
    for node in range(first_node, last_node + 1):
        seg_begin = tl.load(rowptr_ptr + node)
        seg_end = tl.load(rowptr_ptr + node + 1)
        lo = tl.maximum(seg_begin, start)
        hi = tl.minimum(seg_end, stop)
        rows, cb_acc = _walk_source_segment(
            gu_ptr, x_ptr, w_ptr, kc_ptr, order_ptr, gw_ptr, gkc_ptr,
            node, lo, hi, n_edge, x_sn, w_se, cvec, c_mask, basis, cb_acc,
            L, FD, WD, WP, RANK, WANT_CB, BLOCK_E, W_SR, GW_SR,
        )  # fmt: skip
        dest = gx_ptr + node * (N_COEF * WD)
        if seg_begin < start:
            dest = part_first
        elif seg_end > stop:
            dest = part_first + N_COEF * WD
        _store_node_rows(dest, rows, cvec, c_mask & (hi > lo), N_COEF, WD)
    if WANT_CB:
        _store_basis_partial(gcb_ptr, program, cb_acc, cvec, c_mask, RANK, WD)


@triton.jit
def _finish_split_nodes_kernel(
    gx_ptr, part_ptr, rowptr_ptr, chunk,
    DIM: tl.constexpr, DP: tl.constexpr, WD: tl.constexpr, WP: tl.constexpr,
):  # fmt: skip
    """One program per node, after the CSR variant: a segment cut across chunks
    ``first .. last`` sums ``part[first, 1] + part[first+1, 0] + … + part[last, 0]`` in that
    fixed order; a node without edges gets zeros; any other node is already stored."""
    node = tl.program_id(axis=0).to(tl.int64)
    seg_begin = tl.load(rowptr_ptr + node)
    seg_end = tl.load(rowptr_ptr + node + 1)
    first = seg_begin // chunk
    last = tl.maximum(seg_end - 1, seg_begin) // chunk
    split = last > first
    block = tl.arange(0, DP)[:, None] * WD + tl.arange(0, WP)[None, :]
    in_block = (tl.arange(0, DP)[:, None] < DIM) & (tl.arange(0, WP)[None, :] < WD)
    total = tl.load(part_ptr + (2 * first + 1) * (DIM * WD) + block, mask=in_block & split,
                    other=0.0)  # fmt: skip
    for p in range(first + 1, last + 1):
        total += tl.load(part_ptr + 2 * p * (DIM * WD) + block, mask=in_block, other=0.0)
    no_edges = seg_end == seg_begin
    tl.store(gx_ptr + node * (DIM * WD) + block, total, mask=in_block & (split | no_edges))


# n_edge only bounds the last tile: one compilation serves every edge count.
@triton.jit(do_not_specialize=("n_edge",))
def _rotate_mix_bwd_edge_kernel(
    gu_ptr, x_ptr, src_ptr, w_ptr, kc_ptr, cb_ptr,
    gxe_ptr, gw_ptr, gkc_ptr, gcb_ptr,
    n_edge, x_sn, w_se,
    L: tl.constexpr, FD: tl.constexpr, WD: tl.constexpr, WP: tl.constexpr,
    RANK: tl.constexpr, WANT_CB: tl.constexpr, BLOCK_E: tl.constexpr,
    W_SR: tl.constexpr, GW_SR: tl.constexpr,
):  # fmt: skip
    """Edge variant: one program per BLOCK_E consecutive edges; the node gradient is written per
    edge into ``gxe`` (E, D, WD) for the CSR segment sum."""
    ROW_LEN: tl.constexpr = FD * (3 * L + 1)
    N_COEF: tl.constexpr = (1 + L) * (1 + L)
    program = tl.program_id(axis=0).to(tl.int64)
    edges, edge_live, cvec, c_mask, tile_mask, x_tile = _gather_edge_tile(
        x_ptr, src_ptr, program * BLOCK_E, n_edge, x_sn, BLOCK_E, WP, WD
    )
    gu_chan = ((cvec // FD).to(tl.int64) * n_edge * ROW_LEN + cvec % FD)[None, :]
    kc_stride: tl.constexpr = _kernel_edge_stride(L, WD, RANK)
    basis = _load_basis(cb_ptr, cvec, c_mask, RANK, WD)
    cb_acc = _zero_tiles(RANK if WANT_CB else 0, BLOCK_E, WP)
    w_edge = w_ptr + edges * w_se
    g_local, cb_acc = _local_gradient(
        x_tile, tile_mask, w_edge, kc_ptr + edges * kc_stride, gkc_ptr + edges * kc_stride,
        gu_ptr + gu_chan + (edges * ROW_LEN)[:, None], edge_live, tile_mask, cvec, basis, cb_acc,
        L, FD, WD, WP, RANK, WANT_CB, BLOCK_E, W_SR,
    )  # fmt: skip
    gw_edge = gw_ptr + edges * (GW_SR * GW_SR)
    gxe_tile = gxe_ptr + (edges * (N_COEF * WD))[:, None] + cvec[None, :]
    for l in tl.static_range(L + 1):
        for col in tl.static_range(2 * l + 1):
            x_col = tl.load(x_tile + (l * l + col) * WD, mask=tile_mask, other=0.0)
            contrib = _adjoint_column(g_local, x_col, w_edge + (l * l + col),
                                      gw_edge + (l * l + col), edge_live, l, L, W_SR,
                                      GW_SR)  # fmt: skip
            tl.store(gxe_tile + (l * l + col) * WD, contrib, mask=tile_mask)
    if WANT_CB:
        _store_basis_partial(gcb_ptr, program, cb_acc, cvec, c_mask, RANK, WD)


# Launcher


@dataclass(frozen=True)
class _BackwardLaunch:
    """Operands of one backward launch in kernel layouts, its outputs written in place by every
    schedule, and the kernels' compile-time constants."""

    grad_u: Tensor
    x: Tensor
    src: Tensor
    src_order: Tensor
    src_rowptr: Tensor
    wigner: Tensor
    kc: Tensor
    cb: Tensor
    grad_wigner: Tensor
    grad_kc: Tensor
    want_cb: bool
    consts: dict[str, Any]

    def basis_partials(self, n_programs: int) -> Tensor:
        """(P, R, C_wide) per-program basis-gradient partials, or (0,) when not wanted."""
        shape = (n_programs, self.cb.shape[0], self.x.shape[2]) if self.want_cb else (0,)
        return torch.empty(shape, device=self.x.device, dtype=torch.float32)


def _run_node_schedule(run: _BackwardLaunch, tiles: LaunchTiles) -> tuple[Tensor, Tensor]:
    """Node variant: one program per node writes that node's gradient. -> (grad_x, partials)."""
    grad_x = torch.empty(run.x.shape, device=run.x.device, dtype=run.x.dtype)
    partial_cb = run.basis_partials(run.x.shape[0])
    if run.x.shape[0] > 0:
        wrap_triton(_rotate_mix_bwd_kernel)[(run.x.shape[0],)](
            run.grad_u, run.x, run.wigner, run.kc, run.cb, run.src_order, run.src_rowptr,
            grad_x, run.grad_wigner, run.grad_kc, partial_cb,
            run.src.shape[0], run.x.stride(0), run.wigner.stride(0),
            BLOCK_E=tiles.block_e, num_warps=tiles.num_warps, **run.consts,
        )  # fmt: skip
    return grad_x, partial_cb


def _run_edge_schedule(run: _BackwardLaunch, tiles: LaunchTiles) -> tuple[Tensor, Tensor]:
    """Edge variant: per-edge node gradients (E, D, C_wide), then the CSR segment sum (one
    program per node, in CSR order: deterministic). -> (grad_x, partials)."""
    n_edge = run.src.shape[0]
    n_programs = triton.cdiv(n_edge, tiles.block_e)
    edge_rows = torch.empty((n_edge, *run.x.shape[1:]), device=run.x.device, dtype=run.x.dtype)
    partial_cb = run.basis_partials(n_programs)
    if n_programs > 0:
        wrap_triton(_rotate_mix_bwd_edge_kernel)[(n_programs,)](
            run.grad_u, run.x, run.src, run.wigner, run.kc, run.cb,
            edge_rows, run.grad_wigner, run.grad_kc, partial_cb,
            n_edge, run.x.stride(0), run.wigner.stride(0),
            BLOCK_E=tiles.block_e, num_warps=tiles.num_warps, **run.consts,
        )  # fmt: skip
    return _launch_segment_sum(edge_rows, run.src_order, run.src_rowptr), partial_cb


def _run_csr_schedule(run: _BackwardLaunch, tiles: LaunchTiles) -> tuple[Tensor, Tensor]:
    """CSR variant: fixed-length chunks of the source CSR order, then one program per node
    finishes the segments cut by chunk boundaries and zero-fills nodes without edges.
    -> (grad_x, partials)."""
    n_node, dim, c_wide = run.x.shape
    n_edge = run.src.shape[0]
    chunk = csr_chunk(n_edge, tiles)
    n_programs = triton.cdiv(n_edge, chunk)
    grad_x = torch.empty(run.x.shape, device=run.x.device, dtype=run.x.dtype)
    # Slot 0: the chunk's first node begun earlier; slot 1: its last node continued later.
    cut_parts = torch.empty((n_programs, 2, dim, c_wide), device=run.x.device, dtype=run.x.dtype)
    partial_cb = run.basis_partials(n_programs)
    if n_programs > 0:
        wrap_triton(_rotate_mix_bwd_csr_kernel)[(n_programs,)](
            run.grad_u, run.x, run.src, run.wigner, run.kc, run.cb, run.src_order,
            run.src_rowptr, grad_x, cut_parts, run.grad_wigner, run.grad_kc, partial_cb,
            n_edge, chunk, run.x.stride(0), run.wigner.stride(0),
            BLOCK_E=tiles.block_e, num_warps=tiles.num_warps, **run.consts,
        )  # fmt: skip
    if n_node > 0:
        wrap_triton(_finish_split_nodes_kernel)[(n_node,)](
            grad_x, cut_parts, run.src_rowptr, chunk,
            DIM=dim, DP=triton.next_power_of_2(dim), WD=c_wide, WP=run.consts["WP"],
            num_warps=4,
        )  # fmt: skip
    return grad_x, partial_cb


_SCHEDULES = {"node": _run_node_schedule, "edge": _run_edge_schedule, "csr": _run_csr_schedule}


def launch_rotate_mix_bwd(
    grad_u: Tensor,
    feats: Tensor,
    src: Tensor,
    order: Tensor,
    rowptr: Tensor,
    rot: Tensor,
    kern: Tensor,
    basis: Tensor,
    lmax: int,
    n_focus: int,
    mix_rank: int,
    want_cb: bool,
    tiles: LaunchTiles,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Run the backward schedule ``tiles.variant`` ("csr", "node" or "edge") with explicit
    tiles. Operands as in the op (``feats`` = x, ``order``/``rowptr`` = the source CSR,
    ``rot`` = wigner, ``kern`` = kc, ``basis`` = cb)."""
    width = feats.shape[2]
    want_cb = want_cb and mix_rank > 0
    grad_kc = torch.empty(kern.shape, device=kern.device, dtype=kern.dtype)
    # Zero-filled: only the structural entries are written by the kernels.
    grad_wigner = torch.zeros(rot.shape, device=rot.device, dtype=rot.dtype)
    feats, rot, kern, basis = kernel_operands(feats, rot, kern, basis)
    consts: dict[str, Any] = {
        "L": lmax, "FD": width // n_focus, "WD": width, "WP": triton.next_power_of_2(width),
        "RANK": mix_rank, "WANT_CB": want_cb, "W_SR": rot.stride(1), "GW_SR": grad_wigner.shape[2],
    }  # fmt: skip
    # The kernels index the graph with unit stride (an edge-table column is a strided view).
    graph = (src.contiguous(), order.contiguous(), rowptr.contiguous())
    run = _BackwardLaunch(grad_u.contiguous(), feats, *graph, rot, kern, basis,
                          grad_wigner, grad_kc, want_cb, consts)  # fmt: skip
    grad_x, partial_cb = _SCHEDULES[tiles.variant](run, tiles)
    # Per-program partials summed in a fixed order: deterministic, no atomics.
    grad_cb = partial_cb.sum(0) if want_cb else basis.new_zeros((0,))
    return grad_x, grad_wigner, grad_kc, grad_cb


# The layout contract's shape-named operand aliases, imported below the kernels: Triton keys a
# compiled kernel on its source line, and the shipped kernel sets name those keys.
from so2kernels._layout import (  # noqa: E402
    ChannelBasis,
    EdgeNodes,
    EdgeWigner,
    FocusRows,
    NodeFeatures,
    NodeOffsets,
    RadialKernel,
)

RotateMixGrads = tuple[NodeFeatures, EdgeWigner, RadialKernel, ChannelBasis]
"""``(grad_x, grad_wigner, grad_kc, grad_cb)`` of the rotate-mix backward."""

# Op registration: the backward op, its second order, and the forward op's autograd.


def _validate_bwd(
    grad_u: Tensor, feats: Tensor, graph: tuple[Tensor, ...], floats: tuple[Tensor, ...],
    shape: tuple[int, int, int],
) -> None:  # fmt: skip
    """Operand checks of the forward, plus ``grad_u`` against the (F, E, ROW) output shape.
    ``graph`` = (src, src_order, src_rowptr), ``floats`` = (wigner, kc, cb),
    ``shape`` = (lmax, n_focus, rank)."""
    check_rotate_mix_inputs(feats, *graph, *floats, *shape)
    lmax, n_focus, _ = shape
    expected = (n_focus, graph[0].shape[0], n_reduced(lmax) * (feats.shape[2] // n_focus))
    if tuple(grad_u.shape) != expected:
        raise ValueError(
            f"so2kernels.so2_rotate_mix_bwd: grad_u must be (F, E, ROW) = {expected}, "
            f"got {tuple(grad_u.shape)}"
        )


@triton_op("so2kernels::so2_rotate_mix_bwd", mutates_args=())
def _rotate_mix_bwd_op(
    grad_u: FocusRows,
    x: NodeFeatures,
    src: EdgeNodes,
    src_order: EdgeNodes,
    src_rowptr: NodeOffsets,
    wigner: EdgeWigner,
    kc: RadialKernel,
    cb: ChannelBasis,
    lmax: int,
    n_focus: int,
    rank: int,
    want_cb: bool,
) -> RotateMixGrads:
    graph = (src, src_order, src_rowptr)
    floats = (wigner, kc, placed_basis(cb, x, rank))
    shape = (lmax, n_focus, rank)
    _validate_bwd(grad_u, x, graph, floats, shape)
    if not use_triton(grad_u, x, *graph, *floats):  # contiguous, as the fake promises
        grads = rotate_mix_backward_reference(grad_u, x, *graph, *floats, *shape, want_cb=want_cb)
        return tuple(g.contiguous() for g in grads)  # type: ignore[return-value]
    check_fused_regime(x, *floats, shape)
    require_fp32("so2_rotate_mix_bwd", grad_u=grad_u)
    tiles = rotate_mix_tiles("bwd", x.shape[2], lmax, rank, x.device)
    with launch_device(x):
        return launch_rotate_mix_bwd(grad_u, x, *graph, *floats, *shape, want_cb, tiles)


@_rotate_mix_bwd_op.register_fake
def _rotate_mix_bwd_fake(grad_u: Tensor, *operands: Any) -> RotateMixGrads:
    # operands: the ten forward operands, then want_cb.
    feats, rot, kern, basis = operands[0], operands[4], operands[5], operands[6]
    *shape, want_cb = operands[7:]
    _validate_bwd(grad_u, feats, operands[1:4], (rot, kern, basis), tuple(shape))
    rank = shape[2]
    cb_shape = (rank, feats.shape[2]) if want_cb and rank > 0 else (0,)
    outs = (feats.new_empty(feats.shape), rot.new_empty(rot.shape))
    cb_like = placed_basis(basis, feats, rank)  # rank 0: beside x, wherever cb was kept
    return (*outs, kern.new_empty(kern.shape), cb_like.new_empty(cb_shape))


# Saved for both autograd formulas: the operand tensors in ctx.saved_tensors, the trailing
# int/bool operands in ctx.config (``inputs`` is the op's argument tuple).
def _save_rotate_mix(
    ctx: torch.autograd.function.FunctionCtx, inputs: tuple[Any, ...], output: Tensor
) -> None:
    ctx.save_for_backward(*inputs[:7])
    ctx.config = tuple(inputs[7:])  # type: ignore[attr-defined]


def _save_rotate_mix_bwd(
    ctx: torch.autograd.function.FunctionCtx, inputs: tuple[Any, ...], output: object
) -> None:
    ctx.save_for_backward(*inputs[:8])
    ctx.config = tuple(inputs[8:])  # type: ignore[attr-defined]


def _rotate_mix_vjp(
    ctx: torch.autograd.function.FunctionCtx, grad_u: Tensor
) -> tuple[Tensor | None, ...]:
    config = ctx.config  # type: ignore[attr-defined]
    # Operand 6 is the basis cb; rank 0 never reads it.
    want_cb = config[2] > 0 and bool(ctx.needs_input_grad[6])  # type: ignore[attr-defined]
    saved = ctx.saved_tensors  # type: ignore[attr-defined]
    g_x, g_wigner, g_kc, g_cb = torch.ops.so2kernels.so2_rotate_mix_bwd(
        grad_u, *saved, *config, want_cb
    )
    return (g_x, None, None, None, g_wigner, g_kc, g_cb if want_cb else None,
            None, None, None)  # fmt: skip


def _accumulate(total: Tensor | None, term: Tensor) -> Tensor:
    return term if total is None else total + term


def _rotate_mix_bwd_vjp(
    ctx: torch.autograd.function.FunctionCtx,
    h_x: Tensor | None,
    h_wigner: Tensor | None,
    h_kc: Tensor | None,
    h_cb: Tensor | None,
) -> tuple[Tensor | None, ...]:
    """Second order. With s = <grad_u, f(x, W, kc, cb)> multilinear and the op returning
    (∂s/∂x, ∂s/∂W, ∂s/∂kc, ∂s/∂cb), the contracted scalar Σ_a <h_a, ∂s/∂a> equals
    Σ_a s(…, a := h_a, …). Its gradient in grad_u is Σ_a f(a := h_a), and in an operand b it is
    Σ_{a≠b} (∂s/∂b)(a := h_a): one forward and one backward launch per incoming cotangent."""
    g_in, feats, src, order, rowptr, rot, kern, basis = ctx.saved_tensors  # type: ignore[attr-defined]
    lmax, n_focus, rank, want_cb = ctx.config  # type: ignore[attr-defined]
    needs = ctx.needs_input_grad  # type: ignore[attr-defined]
    graph = (src, order, rowptr)
    shape = (lmax, n_focus, rank)
    # The four multilinear operands (slot 0..3) and their op argument positions (1, 5, 6, 7).
    operands = [feats, rot, kern, basis]
    cotangents = [h_x, h_wigner, h_kc, h_cb if want_cb and rank > 0 else None]
    operand_needs = [bool(needs[1]), bool(needs[5]), bool(needs[6]), bool(needs[7]) and rank > 0]
    grads: list[Tensor | None] = [None, None, None, None]
    grad_grad_u: Tensor | None = None
    for slot, cotangent in enumerate(cotangents):
        if cotangent is None:
            continue
        swapped = list(operands)
        swapped[slot] = cotangent
        if needs[0]:
            term_u = torch.ops.so2kernels.so2_rotate_mix(swapped[0], *graph, *swapped[1:], *shape)
            grad_grad_u = _accumulate(grad_grad_u, term_u)
        others = [b for b in range(4) if b != slot and operand_needs[b]]
        if not others:
            continue
        terms = torch.ops.so2kernels.so2_rotate_mix_bwd(
            g_in, swapped[0], *graph, *swapped[1:], *shape, 3 in others
        )
        for b in others:
            grads[b] = _accumulate(grads[b], terms[b])
    return (grad_grad_u, grads[0], None, None, None, grads[1], grads[2], grads[3],
            None, None, None, None)  # fmt: skip


torch.library.register_autograd(
    "so2kernels::so2_rotate_mix", _rotate_mix_vjp, setup_context=_save_rotate_mix
)
_rotate_mix_bwd_op.register_autograd(_rotate_mix_bwd_vjp, setup_context=_save_rotate_mix_bwd)


def rotate_mix_backward(
    grad_u: FocusRows,
    x: NodeFeatures,
    src: EdgeNodes,
    src_order: EdgeNodes,
    src_rowptr: NodeOffsets,
    wigner: EdgeWigner,
    kc: RadialKernel,
    cb: ChannelBasis,
    lmax: int,
    n_focus: int,
    rank: int,
    want_cb: bool = True,
) -> RotateMixGrads:
    """``torch.ops.so2kernels.so2_rotate_mix_bwd``: (grad_x, grad_wigner, grad_kc, grad_cb)."""
    graph = (src, src_order, src_rowptr)
    out: RotateMixGrads = torch.ops.so2kernels.so2_rotate_mix_bwd(
        grad_u, x, *graph, wigner, kc, cb, lmax, n_focus, rank, want_cb
    )
    return out
