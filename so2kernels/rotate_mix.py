"""``so2_rotate_mix``: gather → Wigner rotation to the edge frame → radial degree mixing → store.

Layout contract.
Operands (all on one device; the fused path needs float32 for the float operands):

* ``x`` (N, D, C_wide) node features, packed (l, m) rows, ``D = (L+1)²``; any strides.
* ``src`` (E,) int64 source node of every edge.
* ``src_order`` (E,) / ``src_rowptr`` (N+1,) int64: the source CSR (stable argsort of ``src``
  and segment offsets). Unused by the forward; the backward reduces the node gradient over it.
* ``wigner`` (E, Dw, Dw) with ``Dw ≥ D``: only the leading (D, D) block is read, through the
  real strides, so a pyramid schedule can pass the wide cache unsliced.
* ``kc``: rank 0: (E, L+1, C_wide) per-degree radial multipliers; rank R ≥ 1: (E, K·R) compact
  degree kernel, ``K = (L+1)² + L²``, entry ``slot·R + r``.
* ``cb`` (R, C_wide) channel basis (rank ≥ 1; ignored for rank 0).

Math, per edge e with s = src[e], reduced m-major rows r (``_layout``), p = reduced_to_packed:

* rotation over the structural non-zeros only:
  ``xr[e, r, c] = Σ_{j in block of l(r)} wigner[e, p(r), j] · x[s, j, c]``;
  every other Wigner entry is treated as the structural zero it is (its gradient is exactly 0).
* rank 0: ``y[e, r, c] = xr[e, r, c] · kc[e, l(r), c]``.
* rank R: ``y[e, o, c] = Σ_r cb[r, c] Σ_i kc[e, slot(i, o), r] · xr[e, i, c]`` with, for the m=0
  rows (i, o in 0..L), ``slot = i·(L+1) + o``, and one shared L×L kernel
  ``slot = (L+1)² + (i-1)·L + (o-1)`` applied separately to the m=-1 and the m=+1 rows (degrees
  i, o in 1..L).
* output ``u0`` (F, E, ROW) focus-major: ``u0[f, e, r·Cf + cf] = y[e, r, f·Cf + cf]``,
  ``ROW = (3L+1)·Cf``, ``Cf = C_wide / F``.

The op is linear in each of ``x``, ``wigner``, ``kc`` and ``cb``; the backward (first and second
order) lives in :mod:`so2kernels.rotate_mix_backward` and is registered from there.
"""

# Triton kernels grow register tuples by concatenation: its frontend has no starred unpacking.
# ruff: noqa: RUF005

# Triton kernels take untyped pointer/constexpr arguments and @triton.jit is an untyped decorator.
# Row tuples grow inside tl.static_range loops (tuple[()] → tuple[Any, ...]).
# mypy: disable-error-code="no-untyped-def,untyped-decorator,assignment"
from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from so2kernels._dispatch import UnsupportedInputError, require_fp32, use_triton
from so2kernels._layout import (
    MAX_RANK,
    check_regime,
    device_constant,
    n_coeff,
    n_kernel_slots,
    n_reduced,
    reduced_row_degree,
    reduced_to_packed_tensor,
)
from so2kernels.tiles import LaunchTiles, rotate_mix_tiles

# Input checks (shapes only: no device synchronisation)


def check_rotate_mix_inputs(
    x: Tensor,
    src: Tensor,
    src_order: Tensor,
    src_rowptr: Tensor,
    wigner: Tensor,
    kc: Tensor,
    cb: Tensor,
    lmax: int,
    n_focus: int,
    rank: int,
) -> None:
    """Raise ``ValueError`` with the offending operand named when the shapes disagree."""
    op = "so2_rotate_mix"
    if lmax < 0:
        raise ValueError(f"so2kernels.{op}: lmax must be >= 0, got {lmax}")
    if not 0 <= rank <= MAX_RANK:
        raise ValueError(f"so2kernels.{op}: rank must be in 0..{MAX_RANK}, got {rank}")
    dim = n_coeff(lmax)
    if x.dim() != 3 or x.shape[1] != dim:
        raise ValueError(
            f"so2kernels.{op}: x must be (N, (lmax+1)^2={dim}, C_wide), got {tuple(x.shape)}"
        )
    n_node, _, c_wide = x.shape
    if n_focus < 1 or c_wide % n_focus != 0:
        raise ValueError(f"so2kernels.{op}: C_wide={c_wide} is not divisible by n_focus={n_focus}")
    for name, index in (("src", src), ("src_order", src_order), ("src_rowptr", src_rowptr)):
        if index.dim() != 1 or index.dtype != torch.int64:
            raise ValueError(f"so2kernels.{op}: {name} must be a 1-D int64 tensor")
    n_edge = src.shape[0]
    if src_order.shape[0] != n_edge or src_rowptr.shape[0] != n_node + 1:
        raise ValueError(
            f"so2kernels.{op}: src_order must be (E={n_edge},) and src_rowptr (N+1={n_node + 1},),"
            f" got {tuple(src_order.shape)} and {tuple(src_rowptr.shape)}"
        )
    if (
        wigner.dim() != 3
        or wigner.shape[0] != n_edge
        or wigner.shape[1] != wigner.shape[2]
        or wigner.shape[1] < dim
    ):
        raise ValueError(
            f"so2kernels.{op}: wigner must be (E={n_edge}, Dw, Dw) with Dw >= {dim}, "
            f"got {tuple(wigner.shape)}"
        )
    if rank == 0:
        if tuple(kc.shape) != (n_edge, lmax + 1, c_wide):
            raise ValueError(
                f"so2kernels.{op}: rank 0 needs kc (E, lmax+1, C_wide) = "
                f"{(n_edge, lmax + 1, c_wide)}, got {tuple(kc.shape)}"
            )
        return
    width = n_kernel_slots(lmax) * rank
    if tuple(kc.shape) != (n_edge, width):
        raise ValueError(
            f"so2kernels.{op}: rank {rank} needs kc (E, K*R) = {(n_edge, width)}, "
            f"got {tuple(kc.shape)}"
        )
    if tuple(cb.shape) != (rank, c_wide):
        raise ValueError(
            f"so2kernels.{op}: cb must be (rank, C_wide) = {(rank, c_wide)}, got {tuple(cb.shape)}"
        )


def check_fused_regime(
    x: Tensor, wigner: Tensor, kc: Tensor, cb: Tensor, lmax: int, n_focus: int, rank: int
) -> None:
    """What the Triton path covers: fp32, lmax 1..6, Cf in {32, 64, 96, 128}."""
    check_regime("so2_rotate_mix", lmax, x.shape[2] // n_focus)
    require_fp32("so2_rotate_mix", x=x, wigner=wigner, kc=kc)
    if rank > 0:
        require_fp32("so2_rotate_mix", cb=cb)


# Eager reference (any dtype; differentiable by autograd to any order)


@cache
def _block_mask_rows(lmax: int) -> tuple[tuple[float, ...], ...]:
    dim = n_coeff(lmax)
    mask = []
    for degree in reduced_row_degree(lmax):
        lo, hi = degree * degree, (degree + 1) ** 2
        mask.append(tuple(1.0 if lo <= j < hi else 0.0 for j in range(dim)))
    return tuple(mask)


def structure_mask(lmax: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """(3L+1, D) 0/1 mask: reduced row r couples only to the columns of its degree block
    (cached device constant)."""
    return device_constant(_block_mask_rows(lmax), device, dtype)


def wigner_reduced_rows(wigner: Tensor, lmax: int) -> Tensor:
    """(E, Dw, Dw) -> (E, 3L+1, D): the rows the rotation reads, off-block entries zeroed."""
    dim = n_coeff(lmax)
    rows = wigner[:, :dim, :dim].index_select(1, reduced_to_packed_tensor(lmax, wigner.device))
    return rows * structure_mask(lmax, wigner.device, wigner.dtype)


def degree_index(lmax: int, device: torch.device) -> Tensor:
    """(3L+1,) int64 degree of every reduced row (cached device constant)."""
    return device_constant(reduced_row_degree(lmax), device, torch.int64)


def mixing_blocks(kc: Tensor, lmax: int, rank: int) -> Tensor:
    """(E, K·R) -> (E, 3L+1, 3L+1, R) block-diagonal kernel ``[e, i, o, r]`` over the reduced rows
    (the m=0 block, then the shared |m|=1 block twice)."""
    n_edge = kc.shape[0]
    n_m0, red = lmax + 1, n_reduced(lmax)
    compact = kc.reshape(n_edge, n_kernel_slots(lmax), rank)
    block_m1 = compact[:, n_m0 * n_m0 :].reshape(n_edge, lmax, lmax, rank)
    blocks = kc.new_zeros((n_edge, red, red, rank))
    blocks[:, :n_m0, :n_m0] = compact[:, : n_m0 * n_m0].reshape(n_edge, n_m0, n_m0, rank)
    blocks[:, n_m0 : n_m0 + lmax, n_m0 : n_m0 + lmax] = block_m1
    blocks[:, n_m0 + lmax :, n_m0 + lmax :] = block_m1
    return blocks


def fold_mixing_blocks(blocks: Tensor, lmax: int) -> Tensor:
    """Adjoint of :func:`mixing_blocks`: (E, 3L+1, 3L+1, R) -> (E, K·R), the two |m|=1 copies
    summed into their shared slots."""
    n_m0 = lmax + 1
    block_m0 = blocks[:, :n_m0, :n_m0]
    block_m1 = (
        blocks[:, n_m0 : n_m0 + lmax, n_m0 : n_m0 + lmax] + blocks[:, n_m0 + lmax :, n_m0 + lmax :]
    )
    return torch.cat([block_m0.flatten(1), block_m1.flatten(1)], dim=1)


def to_focus_major(y: Tensor, n_focus: int) -> Tensor:
    """(E, 3L+1, C_wide) -> (F, E, ROW) with ``ROW = (3L+1)·Cf``, contiguous."""
    n_edge, red, c_wide = y.shape
    focus_dim = c_wide // n_focus
    return (
        y.reshape(n_edge, red, n_focus, focus_dim)
        .permute(2, 0, 1, 3)
        .reshape(n_focus, n_edge, red * focus_dim)
    )


def from_focus_major(u: Tensor, red: int) -> Tensor:
    """(F, E, ROW) -> (E, 3L+1, C_wide), the inverse of :func:`to_focus_major`."""
    n_focus, n_edge, row = u.shape
    focus_dim = row // red
    return (
        u.reshape(n_focus, n_edge, red, focus_dim)
        .permute(1, 2, 0, 3)
        .reshape(n_edge, red, n_focus * focus_dim)
    )


def rotate_to_local_reference(x: Tensor, src: Tensor, wigner: Tensor, lmax: int) -> Tensor:
    """(E, 3L+1, C_wide) rotated reduced rows ``xr``."""
    return torch.bmm(wigner_reduced_rows(wigner, lmax), x.index_select(0, src))


def mix_degrees_reference(xr: Tensor, kc: Tensor, cb: Tensor, lmax: int, rank: int) -> Tensor:
    """(E, 3L+1, C_wide) radial degree mixing of the rotated rows."""
    if rank == 0:
        return xr * kc.index_select(1, degree_index(lmax, xr.device))
    return torch.einsum("eior,eic,rc->eoc", mixing_blocks(kc, lmax, rank), xr, cb)


def rotate_mix_reference(
    x: Tensor,
    src: Tensor,
    src_order: Tensor,
    src_rowptr: Tensor,
    wigner: Tensor,
    kc: Tensor,
    cb: Tensor,
    lmax: int,
    n_focus: int,
    rank: int,
) -> Tensor:
    """Ground truth of ``so2_rotate_mix``: (F, E, ROW). Any dtype; plain autograd to any order.

    ``src_order``/``src_rowptr`` are accepted for operand parity with the op and not read.
    """
    check_rotate_mix_inputs(x, src, src_order, src_rowptr, wigner, kc, cb, lmax, n_focus, rank)
    xr = rotate_to_local_reference(x, src, wigner, lmax)
    return to_focus_major(mix_degrees_reference(xr, kc, cb, lmax, rank), n_focus)


# Triton building blocks shared by the forward and backward kernels.
# A "tile" is (BLOCK_E, WP): BLOCK_E edges × WP = next_pow2(C_wide) channel lanes (masked).
# Strides inside one edge's or one node's block are compile-time constants (the launcher
# normalises layouts), so the many scalar Wigner/kernel loads address as base + immediate
# instead of holding a 64-bit address each. Offsets that scale with E or N are int64.


@triton.jit
def _rotate_to_local(
    x_tile,  # pointers to x[s, 0, c]: (BLOCK_E, WP), or (1, WP) when all edges share one node
    x_mask,  # mask of the same shape as x_tile
    w_edge,  # (BLOCK_E,) pointers to wigner[e, 0, 0]
    edge_live,  # (BLOCK_E,)
    L: tl.constexpr,
    BLOCK_E: tl.constexpr,
    WP: tl.constexpr,
    X_SD: tl.constexpr,  # stride between packed rows of x (channels are unit-stride)
    W_SR: tl.constexpr,  # row stride of the Wigner block (columns are unit-stride)
):
    """The 3L+1 reduced rows of the rotated features, m-major, each a (BLOCK_E, WP) tile.

    Reads only the three rows m' = -1, 0, +1 of each degree block and only that block's columns.
    """
    rows_m0 = ()
    rows_neg = ()
    rows_pos = ()
    for l in tl.static_range(L + 1):
        centre = l * l + l
        acc_m0 = tl.zeros((BLOCK_E, WP), dtype=tl.float32)
        acc_neg = tl.zeros((BLOCK_E, WP), dtype=tl.float32)
        acc_pos = tl.zeros((BLOCK_E, WP), dtype=tl.float32)
        for j in tl.static_range(2 * l + 1):
            xv = tl.load(x_tile + (l * l + j) * X_SD, mask=x_mask, other=0.0)
            w_col = w_edge + (l * l + j)
            acc_m0 += tl.load(w_col + centre * W_SR, mask=edge_live, other=0.0)[:, None] * xv
            if l > 0:
                w_neg = tl.load(w_col + (centre - 1) * W_SR, mask=edge_live, other=0.0)
                w_pos = tl.load(w_col + (centre + 1) * W_SR, mask=edge_live, other=0.0)
                acc_neg += w_neg[:, None] * xv
                acc_pos += w_pos[:, None] * xv
        rows_m0 = rows_m0 + (acc_m0,)
        if l > 0:
            rows_neg = rows_neg + (acc_neg,)
            rows_pos = rows_pos + (acc_pos,)
    return rows_m0 + rows_neg + rows_pos


@triton.jit
def _radial_row(kc_edge, cvec, tile_mask, degree: tl.constexpr, WD: tl.constexpr):
    """Rank-0 multiplier row ``kc[e, degree, :]`` as a tile (kc contiguous (E, L+1, WD))."""
    return tl.load(kc_edge[:, None] + degree * WD + cvec[None, :], mask=tile_mask, other=0.0)


@triton.jit
def _kernel_entry(kc_edge, edge_live, slot: tl.constexpr, r: tl.constexpr, RANK: tl.constexpr):
    """Compact kernel scalar ``kc[e, slot·R + r]`` per edge, as a (BLOCK_E, 1) column."""
    return tl.load(kc_edge + (slot * RANK + r), mask=edge_live, other=0.0)[:, None]


@triton.jit
def _load_basis(cb_ptr, cvec, c_mask, RANK: tl.constexpr, WD: tl.constexpr):
    """The R channel-basis rows (cb contiguous (R, WD)), each (1, WP)."""
    basis = ()
    for r in tl.static_range(RANK):
        row = tl.load(cb_ptr + r * WD + cvec, mask=c_mask, other=0.0)
        basis = basis + (row[None, :],)
    return basis


@triton.jit
def _mix_by_degree(xr, kc_edge, cvec, tile_mask, L: tl.constexpr, WD: tl.constexpr):
    """Rank 0: each reduced row times the radial row of its degree."""
    out_m0 = ()
    out_neg = ()
    out_pos = ()
    for l in tl.static_range(L + 1):
        rad = _radial_row(kc_edge, cvec, tile_mask, l, WD)
        out_m0 = out_m0 + (xr[l] * rad,)
        if l > 0:
            out_neg = out_neg + (xr[L + l] * rad,)
            out_pos = out_pos + (xr[2 * L + l] * rad,)
    return out_m0 + out_neg + out_pos


@triton.jit
def _mix_low_rank(
    xr, kc_edge, edge_live, basis, L: tl.constexpr, RANK: tl.constexpr,
    BLOCK_E: tl.constexpr, WP: tl.constexpr, TRANSPOSE: tl.constexpr,
):  # fmt: skip
    """Rank R ≥ 1: ``y[o] = Σ_r cb[r] ⊙ Σ_i kc[slot(i, o), r] · xr[i]`` (per m-block).

    ``TRANSPOSE`` applies the adjoint, ``Σ_i kc[slot(o, i), r]``: the backward's local gradient.
    """
    n_m0: tl.constexpr = L + 1
    out_m0 = ()
    for o in tl.static_range(n_m0):
        acc = tl.zeros((BLOCK_E, WP), dtype=tl.float32)
        for r in tl.static_range(RANK):
            part = tl.zeros((BLOCK_E, WP), dtype=tl.float32)
            for i in tl.static_range(n_m0):
                slot = o * n_m0 + i if TRANSPOSE else i * n_m0 + o
                part += _kernel_entry(kc_edge, edge_live, slot, r, RANK) * xr[i]
            acc += part * basis[r]
        out_m0 = out_m0 + (acc,)
    out_neg = ()
    out_pos = ()
    for o in tl.static_range(L):
        acc_neg = tl.zeros((BLOCK_E, WP), dtype=tl.float32)
        acc_pos = tl.zeros((BLOCK_E, WP), dtype=tl.float32)
        for r in tl.static_range(RANK):
            part_neg = tl.zeros((BLOCK_E, WP), dtype=tl.float32)
            part_pos = tl.zeros((BLOCK_E, WP), dtype=tl.float32)
            for i in tl.static_range(L):
                slot = n_m0 * n_m0 + (o * L + i if TRANSPOSE else i * L + o)
                k = _kernel_entry(kc_edge, edge_live, slot, r, RANK)
                part_neg += k * xr[n_m0 + i]
                part_pos += k * xr[n_m0 + L + i]
            acc_neg += part_neg * basis[r]
            acc_pos += part_pos * basis[r]
        out_neg = out_neg + (acc_neg,)
        out_pos = out_pos + (acc_pos,)
    return out_m0 + out_neg + out_pos


@triton.jit
def _kernel_edge_stride(L: tl.constexpr, WD: tl.constexpr, RANK: tl.constexpr):
    """Per-edge length of contiguous ``kc``: (L+1)·WD for rank 0, K·R otherwise."""
    if RANK == 0:
        return (L + 1) * WD
    else:
        return ((L + 1) * (L + 1) + L * L) * RANK


@triton.jit
def _gather_edge_tile(
    x_ptr, src_ptr, first, n_edge, x_sn,
    BLOCK_E: tl.constexpr, WP: tl.constexpr, WD: tl.constexpr,
):  # fmt: skip
    """Edges ``first .. first+BLOCK_E`` with their liveness, the channel vector and mask, the
    (edge, channel) mask and the pointer tile of each edge's source row of ``x``."""
    edges = first + tl.arange(0, BLOCK_E)
    edge_live = edges < n_edge
    cvec = tl.arange(0, WP)
    c_mask = cvec < WD
    tile_mask = edge_live[:, None] & c_mask[None, :]
    src = tl.load(src_ptr + edges, mask=edge_live, other=0).to(tl.int64)
    x_tile = x_ptr + (src * x_sn)[:, None] + cvec[None, :]
    return edges, edge_live, cvec, c_mask, tile_mask, x_tile


# Forward kernel: one program per BLOCK_E consecutive edges, all channels.


@triton.jit
def _rotate_mix_fwd_kernel(
    x_ptr, src_ptr, w_ptr, kc_ptr, cb_ptr, u_ptr,
    n_edge, x_sn, w_se,
    L: tl.constexpr, FD: tl.constexpr, WD: tl.constexpr, WP: tl.constexpr,
    RANK: tl.constexpr, BLOCK_E: tl.constexpr, W_SR: tl.constexpr,
):  # fmt: skip
    ROW: tl.constexpr = (3 * L + 1) * FD
    edges, edge_live, cvec, c_mask, tile_mask, x_tile = _gather_edge_tile(
        x_ptr, src_ptr, tl.program_id(0).to(tl.int64) * BLOCK_E, n_edge, x_sn, BLOCK_E, WP, WD
    )
    xr = _rotate_to_local(x_tile, tile_mask, w_ptr + edges * w_se, edge_live,
                          L, BLOCK_E, WP, WD, W_SR)  # fmt: skip

    kc_edge = kc_ptr + edges * _kernel_edge_stride(L, WD, RANK)
    if RANK == 0:
        y = _mix_by_degree(xr, kc_edge, cvec, tile_mask, L, WD)
    else:
        basis = _load_basis(cb_ptr, cvec, c_mask, RANK, WD)
        y = _mix_low_rank(xr, kc_edge, edge_live, basis, L, RANK, BLOCK_E, WP, False)

    # Focus-major store: wide channel c = f·FD + cf lands in u[f, e, r·FD + cf].
    focus_offset = (cvec // FD).to(tl.int64) * n_edge * ROW + cvec % FD
    u_tile = u_ptr + focus_offset[None, :] + (edges * ROW)[:, None]
    for r in tl.static_range(3 * L + 1):
        tl.store(u_tile + r * FD, y[r], mask=tile_mask)


# Launcher


def kernel_operands(
    x: Tensor, wigner: Tensor, kc: Tensor, cb: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Layouts the kernels address with compile-time inner strides.

    ``x``: each node's (D, C_wide) block contiguous (a row slice of wider node features is
    fine); ``wigner``: unit column stride (any row/edge stride, e.g. the leading block of a
    wider cache); ``kc``, ``cb``: contiguous. Anything else is copied once here.
    """
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        x = x.contiguous()
    if wigner.stride(2) != 1:
        wigner = wigner.contiguous()
    return x, wigner, kc.contiguous(), cb.contiguous()


def launch_rotate_mix_fwd(
    x: Tensor,
    src: Tensor,
    wigner: Tensor,
    kc: Tensor,
    cb: Tensor,
    lmax: int,
    n_focus: int,
    rank: int,
    tiles: LaunchTiles,
) -> Tensor:
    """Run the forward kernel with explicit tiles (the op picks them from the table)."""
    n_edge, c_wide = src.shape[0], x.shape[2]
    focus_dim = c_wide // n_focus
    u = torch.empty((n_focus, n_edge, n_reduced(lmax) * focus_dim), device=x.device, dtype=x.dtype)
    if n_edge == 0:
        return u
    x, wigner, kc, cb = kernel_operands(x, wigner, kc, cb)
    grid = (triton.cdiv(n_edge, tiles.block_e),)
    wrap_triton(_rotate_mix_fwd_kernel)[grid](
        x, src, wigner, kc, cb, u,
        n_edge, x.stride(0), wigner.stride(0),
        L=lmax, FD=focus_dim, WD=c_wide, WP=triton.next_power_of_2(c_wide),
        RANK=rank, BLOCK_E=tiles.block_e, W_SR=wigner.stride(1), num_warps=tiles.num_warps,
    )  # fmt: skip
    return u


# Op registration (the autograd formula is registered by rotate_mix_backward, imported below)


@triton_op("so2kernels::so2_rotate_mix", mutates_args=())
def _rotate_mix_op(
    x: Tensor,
    src: Tensor,
    src_order: Tensor,
    src_rowptr: Tensor,
    wigner: Tensor,
    kc: Tensor,
    cb: Tensor,
    lmax: int,
    n_focus: int,
    rank: int,
) -> Tensor:
    check_rotate_mix_inputs(x, src, src_order, src_rowptr, wigner, kc, cb, lmax, n_focus, rank)
    if not use_triton(x, src, wigner, kc, cb):
        return rotate_mix_reference(
            x, src, src_order, src_rowptr, wigner, kc, cb, lmax, n_focus, rank
        )
    check_fused_regime(x, wigner, kc, cb, lmax, n_focus, rank)
    tiles = rotate_mix_tiles("fwd", x.shape[2], lmax, rank, x.device)
    return launch_rotate_mix_fwd(x, src, wigner, kc, cb, lmax, n_focus, rank, tiles)


@_rotate_mix_op.register_fake
def _rotate_mix_fake(
    x: Tensor,
    src: Tensor,
    src_order: Tensor,
    src_rowptr: Tensor,
    wigner: Tensor,
    kc: Tensor,
    cb: Tensor,
    lmax: int,
    n_focus: int,
    rank: int,
) -> Tensor:
    check_rotate_mix_inputs(x, src, src_order, src_rowptr, wigner, kc, cb, lmax, n_focus, rank)
    focus_dim = x.shape[2] // n_focus
    return x.new_empty((n_focus, src.shape[0], n_reduced(lmax) * focus_dim))


def rotate_mix(
    x: Tensor,
    src: Tensor,
    src_order: Tensor,
    src_rowptr: Tensor,
    wigner: Tensor,
    kc: Tensor,
    cb: Tensor,
    lmax: int,
    n_focus: int,
    rank: int,
) -> Tensor:
    """``torch.ops.so2kernels.so2_rotate_mix``: (F, E, ROW); see the module docstring.

    Raises:
        ValueError: operand shapes disagree, or (fused path) lmax/focus_dim outside the regime.
        UnsupportedInputError: the fused path got a non-float32 operand.
    """
    out: Tensor = torch.ops.so2kernels.so2_rotate_mix(
        x, src, src_order, src_rowptr, wigner, kc, cb, lmax, n_focus, rank
    )
    return out


__all__ = [
    "UnsupportedInputError",
    "check_rotate_mix_inputs",
    "launch_rotate_mix_fwd",
    "rotate_mix",
    "rotate_mix_reference",
]

# Registers so2_rotate_mix_bwd and the autograd formulas of both ops.
from so2kernels import rotate_mix_backward as _rotate_mix_backward  # noqa: E402, F401
