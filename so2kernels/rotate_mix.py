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

# Triton kernels grow register tuples by concatenation (``rows += (tile,)``): its frontend has
# no starred unpacking.

# Triton kernels take untyped pointer/constexpr arguments and @triton.jit is an untyped decorator.
# Row tuples grow inside tl.static_range loops (tuple[()] → tuple[Any, ...]).
# mypy: disable-error-code="no-untyped-def,untyped-decorator,assignment"
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


class RotateMixOperands(NamedTuple):
    """The operands of ``so2_rotate_mix`` bundled in schema order (see the module docstring)."""

    x: NodeFeatures
    src: EdgeNodes
    src_order: EdgeNodes
    src_rowptr: NodeOffsets
    wigner: EdgeWigner
    kc: RadialKernel
    cb: ChannelBasis
    lmax: MaxDegree
    n_focus: FocusCount
    rank: KernelRank


# Input checks (shapes only: no device synchronisation)


def check_rotate_mix_inputs(*operands: Any) -> None:
    """Raise ``ValueError`` with the offending operand named when the shapes disagree.

    Takes the ten operands of the op positionally, in :class:`RotateMixOperands` order."""
    _validate_operands(RotateMixOperands(*operands))


def _validate_operands(ops: RotateMixOperands) -> None:
    x, src, wigner, kc, cb = ops.x, ops.src, ops.wigner, ops.kc, ops.cb
    src_order, src_rowptr = ops.src_order, ops.src_rowptr
    lmax, n_focus, rank = ops.lmax, ops.n_focus, ops.rank
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


def placed_basis(cb: Tensor, x: Tensor, rank: int) -> Tensor:
    """``cb`` as the op uses it: rank 0 ignores its values, so a placeholder kept on another
    device is swapped for an empty one beside ``x`` instead of deciding where the op runs."""
    return cb if rank or cb.device == x.device else x.new_empty(cb.shape)


def check_fused_regime(
    x: Tensor, wigner: Tensor, kernel: Tensor, basis: Tensor, shape: tuple[int, int, int]
) -> None:
    """What the Triton path covers: fp32, lmax 1..6, Cf in {32, 64, 96, 128}. ``shape`` is
    (lmax, n_focus, rank); ``kernel``/``basis`` are the op's ``kc``/``cb`` (so in the errors)."""
    lmax, n_focus, rank = shape
    name = "so2_rotate_mix"
    check_regime(name, lmax, x.shape[2] // n_focus)
    require_fp32(name, x=x, wigner=wigner, kc=kernel)
    if rank != 0:
        require_fp32(name, cb=basis)


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
    packed_rows = reduced_to_packed_tensor(lmax, wigner.device)
    leading = wigner.narrow(2, 0, n_coeff(lmax))
    return torch.index_select(leading, 1, packed_rows) * structure_mask(
        lmax, wigner.device, wigner.dtype
    )


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
    # (E, RED, F, Cf) with the focus axis moved to the front, then each edge row flattened.
    return y.reshape(*y.shape[:2], n_focus, y.shape[2] // n_focus).movedim(2, 0).flatten(2)


def from_focus_major(u: Tensor, red: int) -> Tensor:
    """(F, E, ROW) -> (E, 3L+1, C_wide), the inverse of :func:`to_focus_major`."""
    # (F, E, RED, Cf) with the focus axis moved next to the channels, then merged into them.
    return u.reshape(*u.shape[:2], red, u.shape[2] // red).movedim(0, 2).flatten(2)


def rotate_to_local_reference(x: Tensor, src: Tensor, wigner: Tensor, lmax: int) -> Tensor:
    """(E, 3L+1, C_wide) rotated reduced rows ``xr``."""
    gathered = x.index_select(0, src)
    return torch.bmm(wigner_reduced_rows(wigner, lmax), gathered)


def mix_degrees_reference(
    xr: Tensor, kernel: Tensor, basis: Tensor, lmax: int, rank: int
) -> Tensor:
    """(E, 3L+1, C_wide) radial degree mixing of the rotated rows (``kernel``/``basis`` are the
    op's ``kc``/``cb``)."""
    if rank > 0:
        # [edge, in-row, out-row, basis] kernel, rotated rows, basis rows -> mixed out-rows.
        return torch.einsum("abkq,abc,qc->akc", mixing_blocks(kernel, lmax, rank), xr, basis)
    per_row = kernel.index_select(1, degree_index(lmax, xr.device))
    return xr * per_row


def rotate_mix_reference(*operands: Any) -> Tensor:
    """Ground truth of ``so2_rotate_mix``: (F, E, ROW). Any dtype; plain autograd to any order.

    Same positional operands as the op (:class:`RotateMixOperands`); the CSR pair
    ``src_order``/``src_rowptr`` is only shape-checked, never read.
    """
    ops = RotateMixOperands(*operands)
    _validate_operands(ops)
    rotated = rotate_to_local_reference(ops.x, ops.src, ops.wigner, ops.lmax)
    mixed = mix_degrees_reference(rotated, ops.kc, ops.cb, ops.lmax, ops.rank)
    return to_focus_major(mixed, ops.n_focus)


# Triton building blocks shared by the forward and backward kernels.
# A "tile" is (BLOCK_E, WP): BLOCK_E edges × WP = next_pow2(C_wide) channel lanes (masked).
# Strides inside one edge's or one node's block are compile-time constants (the launcher
# normalises layouts), so the many scalar Wigner/kernel loads address as base + immediate
# instead of holding a 64-bit address each. Offsets that scale with E or N are int64.


@triton.jit
def _zero_tile(BLOCK_E: tl.constexpr, WP: tl.constexpr):
    """A fresh fp32 accumulator tile."""
    return tl.full((BLOCK_E, WP), 0.0, tl.float32)


@triton.jit
def _rotate_to_local(
    feat,  # pointers to x[s, 0, c]: (BLOCK_E, WP), or (1, WP) when all edges share one node
    feat_mask,  # mask of the same shape as feat
    rot_base,  # (BLOCK_E,) pointers to wigner[e, 0, 0]
    live,  # (BLOCK_E,)
    L: tl.constexpr,
    BLOCK_E: tl.constexpr,
    WP: tl.constexpr,
    FEAT_ROW: tl.constexpr,  # stride between packed rows of x (channels are unit-stride)
    ROT_ROW: tl.constexpr,  # row stride of the Wigner block (columns are unit-stride)
):
    """The 3L+1 reduced rows of the rotated features, m-major, each a (BLOCK_E, WP) tile.

    Reads only the three rows m' = -1, 0, +1 of each degree block and only that block's columns.
    """
    zero_m = ()
    minus_m = ()
    plus_m = ()
    for deg in tl.static_range(0, L + 1):
        mid = (deg * deg + deg) * ROT_ROW  # the m' = 0 row of this degree block
        sum_zero = _zero_tile(BLOCK_E, WP)
        sum_minus = _zero_tile(BLOCK_E, WP)
        sum_plus = _zero_tile(BLOCK_E, WP)
        for col in tl.static_range(deg * deg, (deg + 1) * (deg + 1)):
            f = tl.load(feat + col * FEAT_ROW, mask=feat_mask, other=0.0)
            rot_col = rot_base + col
            sum_zero += tl.load(rot_col + mid, mask=live, other=0.0)[:, None] * f
            if deg >= 1:
                d_minus = tl.load(rot_col + (mid - ROT_ROW), mask=live, other=0.0)
                d_plus = tl.load(rot_col + (mid + ROT_ROW), mask=live, other=0.0)
                sum_minus += d_minus[:, None] * f
                sum_plus += d_plus[:, None] * f
        zero_m += (sum_zero,)
        if deg >= 1:
            minus_m += (sum_minus,)
            plus_m += (sum_plus,)
    return zero_m + minus_m + plus_m


@triton.jit
def _radial_row(kc_base, lanes, mask2d, degree: tl.constexpr, WD: tl.constexpr):
    """Rank-0 multiplier row ``kc[e, degree, :]`` as a tile (kc contiguous (E, L+1, WD))."""
    offs = lanes[None, :] + degree * WD
    return tl.load(kc_base[:, None] + offs, mask=mask2d, other=0.0)


@triton.jit
def _kernel_entry(kc_base, live, slot: tl.constexpr, r: tl.constexpr, RANK: tl.constexpr):
    """Compact kernel scalar ``kc[e, slot·R + r]`` per edge, as a (BLOCK_E, 1) column."""
    col = tl.load(kc_base + (r + RANK * slot), mask=live, other=0.0)
    return col[:, None]


@triton.jit
def _load_basis(basis_ptr, lanes, lane_mask, RANK: tl.constexpr, WD: tl.constexpr):
    """The R channel-basis rows (cb contiguous (R, WD)), each (1, WP)."""
    rows = ()
    for q in tl.static_range(0, RANK):
        vals = tl.load(basis_ptr + (lanes + q * WD), mask=lane_mask, other=0.0)
        rows += (vals[None, :],)
    return rows


@triton.jit
def _mix_by_degree(xr, kc_base, lanes, mask2d, L: tl.constexpr, WD: tl.constexpr):
    """Rank 0: each reduced row times the radial row of its degree."""
    # Degree 0 has only its m = 0 row; the |m| = 1 rows of degree d sit at L + d and 2L + d.
    first = xr[0] * _radial_row(kc_base, lanes, mask2d, 0, WD)
    zero_m = (first,)
    minus_m = ()
    plus_m = ()
    for deg in tl.static_range(1, L + 1):
        mult = _radial_row(kc_base, lanes, mask2d, deg, WD)
        zero_m += (xr[deg] * mult,)
        minus_m += (xr[deg + L] * mult,)
        plus_m += (xr[deg + 2 * L] * mult,)
    return zero_m + minus_m + plus_m


@triton.jit
def _mix_low_rank(
    xr, kc_base, live, basis, L: tl.constexpr, RANK: tl.constexpr,
    BLOCK_E: tl.constexpr, WP: tl.constexpr, TRANSPOSE: tl.constexpr,
):  # fmt: skip
    """Rank R ≥ 1: ``y[o] = Σ_r cb[r] ⊙ Σ_i kc[slot(i, o), r] · xr[i]`` (per m-block).

    ``TRANSPOSE`` applies the adjoint, ``Σ_i kc[slot(o, i), r]``: the backward's local gradient.
    """
    NZ: tl.constexpr = L + 1  # rows (and kernel side) of the m = 0 block
    SHARED: tl.constexpr = NZ * NZ  # first slot of the shared |m| = 1 kernel
    # m = 0 block: out-row `dst` of degree dst, in-rows 0..L.
    zero_m = ()
    for dst in tl.static_range(0, NZ):
        total = _zero_tile(BLOCK_E, WP)
        for q in tl.static_range(0, RANK):
            inner = _zero_tile(BLOCK_E, WP)
            for srow in tl.static_range(0, NZ):
                idx = dst * NZ + srow if TRANSPOSE else srow * NZ + dst
                inner += _kernel_entry(kc_base, live, idx, q, RANK) * xr[srow]
            total += inner * basis[q]
        zero_m += (total,)
    # |m| = 1 blocks: one L × L kernel shared by the m = -1 rows (NZ..) and m = +1 rows (NZ+L..).
    minus_m = ()
    plus_m = ()
    for dst in tl.static_range(0, L):
        total_minus = _zero_tile(BLOCK_E, WP)
        total_plus = _zero_tile(BLOCK_E, WP)
        for q in tl.static_range(0, RANK):
            inner_minus = _zero_tile(BLOCK_E, WP)
            inner_plus = _zero_tile(BLOCK_E, WP)
            for srow in tl.static_range(0, L):
                idx = SHARED + dst * L + srow if TRANSPOSE else SHARED + srow * L + dst
                coef = _kernel_entry(kc_base, live, idx, q, RANK)
                inner_minus += coef * xr[NZ + srow]
                inner_plus += coef * xr[NZ + L + srow]
            total_minus += inner_minus * basis[q]
            total_plus += inner_plus * basis[q]
        minus_m += (total_minus,)
        plus_m += (total_plus,)
    return zero_m + minus_m + plus_m


@triton.jit
def _kernel_edge_stride(L: tl.constexpr, WD: tl.constexpr, RANK: tl.constexpr):
    """Per-edge length of contiguous ``kc``: (L+1)·WD for rank 0, K·R otherwise."""
    if RANK > 0:
        return (2 * L * L + 2 * L + 1) * RANK
    else:
        return WD * (L + 1)


@triton.jit
def _gather_edge_tile(
    feat_ptr, index_ptr, start, n_items, node_stride,
    BLOCK_E: tl.constexpr, WP: tl.constexpr, WD: tl.constexpr,
):  # fmt: skip
    """Edges ``start .. start+BLOCK_E`` with their liveness, the channel vector and mask, the
    (edge, channel) mask and the pointer tile of each edge's source row of ``x``."""
    ids = tl.arange(0, BLOCK_E) + start
    live = ids < n_items
    lanes = tl.arange(0, WP)
    lane_mask = lanes < WD
    mask2d = live[:, None] & lane_mask[None, :]
    node = tl.load(index_ptr + ids, mask=live, other=0).to(tl.int64)
    feat = feat_ptr + lanes[None, :] + (node * node_stride)[:, None]
    return ids, live, lanes, lane_mask, mask2d, feat


# Forward kernel: one program per BLOCK_E consecutive edges, all channels.


# n_items only bounds the last tile: one compilation serves every edge count.
@triton.jit(do_not_specialize=("n_items",))
def _rotate_mix_fwd_kernel(
    feat_ptr, index_ptr, rot_ptr, coef_ptr, basis_ptr, out_ptr,
    n_items, node_stride, rot_edge_stride,
    L: tl.constexpr, FD: tl.constexpr, WD: tl.constexpr, WP: tl.constexpr,
    RANK: tl.constexpr, BLOCK_E: tl.constexpr, ROT_ROW: tl.constexpr,
):  # fmt: skip
    N_ROWS: tl.constexpr = 3 * L + 1
    EDGE_LEN: tl.constexpr = N_ROWS * FD  # one edge's slice of one focus group in the output
    block_start = tl.cast(tl.program_id(0), tl.int64) * BLOCK_E
    ids, live, lanes, lane_mask, mask2d, feat = _gather_edge_tile(
        feat_ptr, index_ptr, block_start, n_items, node_stride, BLOCK_E, WP, WD
    )
    rot_base = rot_ptr + ids * rot_edge_stride
    xr = _rotate_to_local(feat, mask2d, rot_base, live, L, BLOCK_E, WP, WD, ROT_ROW)

    kc_base = coef_ptr + ids * _kernel_edge_stride(L, WD, RANK)
    if RANK > 0:
        basis = _load_basis(basis_ptr, lanes, lane_mask, RANK, WD)
        mixed = _mix_low_rank(xr, kc_base, live, basis, L, RANK, BLOCK_E, WP, False)
    else:
        mixed = _mix_by_degree(xr, kc_base, lanes, mask2d, L, WD)

    # Wide lane c belongs to focus group g = c // FD at position c % FD of every reduced row;
    # the output is (F, E, EDGE_LEN), so row k of edge e and lane c goes to
    # out[g, e, k·FD + c % FD].
    # int64 before the edge count enters: a focus plane alone can pass 2^31 elements.
    group = (lanes // FD).to(tl.int64)
    lane_off = group * n_items * EDGE_LEN + lanes % FD
    dest = out_ptr + (ids * EDGE_LEN)[:, None] + lane_off[None, :]
    for k in tl.static_range(0, N_ROWS):
        tl.store(dest + k * FD, mixed[k], mask=mask2d)


# The layout contract's shape-named operand aliases, imported below the kernels: Triton keys a
# compiled kernel on its source line, and the shipped kernel sets name those keys.
from so2kernels._layout import (  # noqa: E402
    ChannelBasis,
    EdgeNodes,
    EdgeWigner,
    FocusCount,
    FocusRows,
    KernelRank,
    MaxDegree,
    NodeFeatures,
    NodeOffsets,
    RadialKernel,
)

# Launcher


def kernel_operands(
    feats: Tensor, rot: Tensor, kernel: Tensor, basis: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Layouts the kernels address with compile-time inner strides.

    ``x``: each node's (D, C_wide) block contiguous (a row slice of wider node features is
    fine); ``wigner``: unit column stride (any row/edge stride, e.g. the leading block of a
    wider cache); ``kc``, ``cb``: contiguous. Anything else is copied once here.
    """
    if not (feats.stride(2) == 1 and feats.stride(1) == feats.shape[2]):
        feats = feats.contiguous()
    if rot.stride(2) != 1:
        rot = rot.contiguous()
    return feats, rot, kernel.contiguous(), basis.contiguous()


def launch_rotate_mix_fwd(
    x: NodeFeatures, src: EdgeNodes, wigner: EdgeWigner, kernel: RadialKernel,
    basis: ChannelBasis, lmax: int, n_focus: int, rank: int, tiles: LaunchTiles,
) -> FocusRows:  # fmt: skip
    """Run the forward kernel with explicit tiles (the op picks them from the table).

    ``kernel``/``basis`` are the op's ``kc``/``cb`` operands.
    """
    n_edge = src.shape[0]
    focus_dim = x.shape[2] // n_focus
    c_wide = focus_dim * n_focus
    out_shape = (n_focus, n_edge, focus_dim * n_reduced(lmax))
    u = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    if n_edge > 0:
        feats, rot, coef, chan = kernel_operands(x, wigner, kernel, basis)
        n_programs = triton.cdiv(n_edge, tiles.block_e)
        # src is indexed with unit stride (a column of an edge table is a strided view).
        wrap_triton(_rotate_mix_fwd_kernel)[(n_programs,)](
            feats, src.contiguous(), rot, coef, chan, u,
            n_edge, feats.stride(0), rot.stride(0),
            L=lmax, FD=focus_dim, WD=c_wide, WP=triton.next_power_of_2(c_wide), RANK=rank,
            BLOCK_E=tiles.block_e, ROT_ROW=rot.stride(1), num_warps=tiles.num_warps,
        )  # fmt: skip
    return u


# Op registration (the autograd formula is registered by rotate_mix_backward, imported below)


@triton_op("so2kernels::so2_rotate_mix", mutates_args=())
def _rotate_mix_op(
    x: NodeFeatures,
    src: EdgeNodes,
    src_order: EdgeNodes,
    src_rowptr: NodeOffsets,
    wigner: EdgeWigner,
    kc: RadialKernel,
    cb: ChannelBasis,
    lmax: MaxDegree,
    n_focus: FocusCount,
    rank: KernelRank,
) -> FocusRows:
    ops = RotateMixOperands(
        x=x, src=src, src_order=src_order, src_rowptr=src_rowptr, wigner=wigner,
        kc=kc, cb=placed_basis(cb, x, rank), lmax=lmax, n_focus=n_focus, rank=rank,
    )  # fmt: skip
    _validate_operands(ops)
    if use_triton(x, src, wigner, kc, ops.cb):
        check_fused_regime(x, wigner, kc, ops.cb, (lmax, n_focus, rank))
        tiles = rotate_mix_tiles("fwd", x.shape[2], lmax, rank, x.device)
        with launch_device(x):
            return launch_rotate_mix_fwd(
                ops.x, ops.src, ops.wigner, ops.kc, ops.cb, lmax, n_focus, rank, tiles
            )
    return rotate_mix_reference(*ops)


@_rotate_mix_op.register_fake
def _rotate_mix_fake(*operands: Any) -> Tensor:
    ops = RotateMixOperands(*operands)
    _validate_operands(ops)
    row = n_reduced(ops.lmax) * (ops.x.shape[2] // ops.n_focus)
    return ops.x.new_empty((ops.n_focus, ops.src.shape[0], row))


def rotate_mix(
    x: NodeFeatures,
    src: EdgeNodes,
    src_order: EdgeNodes,
    src_rowptr: NodeOffsets,
    wigner: EdgeWigner,
    kc: RadialKernel,
    cb: ChannelBasis,
    lmax: MaxDegree,
    n_focus: FocusCount,
    rank: KernelRank,
) -> FocusRows:
    """``torch.ops.so2kernels.so2_rotate_mix``: (F, E, ROW); see the module docstring.

    Raises:
        ValueError: operand shapes disagree, or (fused path) lmax/focus_dim outside the regime.
        UnsupportedInputError: the fused path got a non-float32 operand.
    """
    out: FocusRows = torch.ops.so2kernels.so2_rotate_mix(
        x, src, src_order, src_rowptr, wigner=wigner, kc=kc, cb=cb,
        lmax=lmax, n_focus=n_focus, rank=rank,
    )  # fmt: skip
    return out


__all__ = [
    "UnsupportedInputError",
    "check_rotate_mix_inputs",
    "launch_rotate_mix_fwd",
    "placed_basis",
    "rotate_mix",
    "rotate_mix_reference",
]

# Registers so2_rotate_mix_bwd and the autograd formulas of both ops.
from so2kernels import rotate_mix_backward as _rotate_mix_backward  # noqa: E402, F401
