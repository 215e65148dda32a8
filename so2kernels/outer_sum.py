"""``segment_outer_sum``: per-edge outer products reduced into their destination nodes.

Layout contract.
Operands (one device; the fused path needs float32 for ``a``, ``b`` and the incoming gradient):

* ``a`` (E, K) per-edge coefficients, any strides;
* ``b`` (E, J, C) per-edge channel rows, any strides (``filt[:, None, :]`` is read in place);
* ``row_map`` (K,) int64: coefficient ``k`` multiplies row ``row_map[k]`` of ``b``; every entry
  must lie in ``0..J-1`` (not checked: that needs a device sync; it is typically a cached device
  constant, :func:`so2kernels._layout.device_constant`). The kernels mask out-of-range entries
  so a bad map never reads outside ``b``;
* ``dst_rowptr`` (N+1,) int64: edges are sorted by destination, node ``n`` owns edges
  ``dst_rowptr[n] .. dst_rowptr[n+1]-1``, ``dst_rowptr[0] = 0``, ``dst_rowptr[N] = E`` (the graph
  builder guarantees it; checking would sync).

Math::

    out[n, k, c] = Σ_{e in seg(n)} a[e, k] · b[e, row_map[k], c]              (N, K, C)

Nodes without edges get 0. With ``g = grad_out`` and ``dst(e)`` the node owning edge e::

    grad_a[e, k]    = Σ_c g[dst(e), k, c] · b[e, row_map[k], c]               (E, K)
    grad_b[e, j, c] = Σ_{k: row_map[k] = j} g[dst(e), k, c] · a[e, k]         (E, J, C)

(rows j that no k maps to get 0).

Fused forward: one program per (node, channel block) walks the node's edge segment BLOCK_E
edges at a time, gathering ``b``'s rows through ``row_map`` and accumulating a (K, channels)
register tile: the (E, K, C) message is never written, the sum runs in edge order (no atomics,
bitwise reproducible). Fused backward: nothing reduces over edges, but every edge of a segment
reads the same node gradient ``g[n]`` (K, C): one program per (node, segment part) keeps it in
L1 and streams its edges BLOCK_E at a time, as (BLOCK_E, channels) tiles per row j of ``b``:
``grad_b[e, j] = Σ_{k→j} a[e, k]·g[n, k]`` and ``grad_a[e, k] = Σ_c g[n, k, c]·b[e, j, c]`` for
each k mapped to j. So ``b`` is read once per row (not once per coefficient), ``grad_a`` and
``grad_b`` are written once, and no per-edge gather of node rows exists. Small systems cut
segments into parts like the aggregate forward (:func:`so2kernels.aggregate.segment_parts`);
each edge is still written by exactly one program. Nothing is read back to the host (CUDA-graph
safe). Offsets that scale with E or N are int64; those inside an edge are int32, so an operand
whose inner span reaches 2³¹ elements is copied to the contiguous layout first.

Second order (training): under ``create_graph`` the backward is composed from differentiable
torch ops (:func:`segment_outer_sum_backward_reference`); the Triton backward serves forces.
"""

# Triton kernels take untyped pointer/constexpr arguments and @triton.jit is an untyped decorator.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from so2kernels._dispatch import launch_device, require_fp32, use_triton
from so2kernels._layout import int32_inner_offsets
from so2kernels.aggregate import default_segment_parts, segment_part_range
from so2kernels.segment import segment_of_position

__all__ = [
    "OuterSumTiles",
    "check_outer_sum_inputs",
    "default_bwd_tiles",
    "default_tiles",
    "launch_outer_sum_bwd",
    "launch_outer_sum_fwd",
    "segment_outer_sum",
    "segment_outer_sum_backward_reference",
    "segment_outer_sum_reference",
]

_OP = "segment_outer_sum"

# Input checks (shapes and dtypes only: no device synchronisation)


def check_outer_sum_inputs(a: Tensor, b: Tensor, row_map: Tensor, dst_rowptr: Tensor) -> None:
    """Raise ``ValueError`` naming the operand whose shape or dtype disagrees with the contract."""
    if a.dim() != 2:
        raise ValueError(f"so2kernels.{_OP}: a must be (E, K), got shape {tuple(a.shape)}")
    if b.dim() != 3 or b.shape[0] != a.shape[0]:
        raise ValueError(
            f"so2kernels.{_OP}: b must be (E={a.shape[0]}, J, C), got shape {tuple(b.shape)}"
        )
    if row_map.dim() != 1 or row_map.dtype != torch.int64 or row_map.shape[0] != a.shape[1]:
        raise ValueError(
            f"so2kernels.{_OP}: row_map must be a 1-D int64 tensor of K={a.shape[1]} entries, "
            f"got shape {tuple(row_map.shape)} and {row_map.dtype}"
        )
    if dst_rowptr.dim() != 1 or dst_rowptr.dtype != torch.int64 or dst_rowptr.shape[0] < 1:
        raise ValueError(f"so2kernels.{_OP}: dst_rowptr must be a 1-D int64 (N+1,) tensor")
    if a.dtype != b.dtype or not a.is_floating_point():
        raise ValueError(
            f"so2kernels.{_OP}: a and b must share one floating dtype, got {a.dtype}, {b.dtype}"
        )


def _output_shape(a: Tensor, b: Tensor, dst_rowptr: Tensor) -> tuple[int, int, int]:
    """``(N, K, C)``."""
    return dst_rowptr.shape[0] - 1, a.shape[1], b.shape[2]


def _check_grad_out(grad_out: Tensor, a: Tensor, b: Tensor, dst_rowptr: Tensor) -> None:
    expected = _output_shape(a, b, dst_rowptr)
    if tuple(grad_out.shape) != expected or grad_out.dtype != a.dtype:
        raise ValueError(
            f"so2kernels.{_OP}_bwd: grad_out must be (N, K, C) = {expected} of {a.dtype}, got "
            f"{tuple(grad_out.shape)} of {grad_out.dtype}"
        )


# Eager references (any dtype; differentiable by autograd to any order)


def segment_outer_sum_reference(
    a: Tensor, b: Tensor, row_map: Tensor, dst_rowptr: Tensor
) -> Tensor:
    """Ground truth of ``segment_outer_sum``: (N, K, C). Materialises the (E, K, C) messages."""
    check_outer_sum_inputs(a, b, row_map, dst_rowptr)
    message = a[:, :, None] * b.index_select(1, row_map)
    out = message.new_zeros(_output_shape(a, b, dst_rowptr))
    return out.index_add(0, segment_of_position(dst_rowptr, a.shape[0]), message)


def segment_outer_sum_backward_reference(
    grad_out: Tensor, a: Tensor, b: Tensor, row_map: Tensor, dst_rowptr: Tensor
) -> tuple[Tensor, Tensor]:
    """Closed-form ``(grad_a (E, K), grad_b (E, J, C))``, differentiable (training)."""
    check_outer_sum_inputs(a, b, row_map, dst_rowptr)
    _check_grad_out(grad_out, a, b, dst_rowptr)
    g_edge = grad_out.index_select(0, segment_of_position(dst_rowptr, a.shape[0]))  # (E, K, C)
    grad_a = (g_edge * b.index_select(1, row_map)).sum(2)
    grad_b = torch.zeros_like(b).index_add(1, row_map, g_edge * a[:, :, None])
    return grad_a, grad_b


# Triton kernels. Forward tiles are (KP, BLOCK_E, BLOCK_C): coefficients × edges × channels, K
# padded to a power of two and masked. The coefficient axis leads so that Triton's default
# layout puts lanes on channels and the remaining lanes and warps on edges (see default_tiles):
# every coefficient of an (edge, channel) then sits in one thread. Backward tiles are
# (BLOCK_E, BLOCK_C). b's row of coefficient k is row_map[k]; rows outside 0..J-1 are never
# read, so a bad map cannot read out of bounds.


@triton.jit
def _coefficient_rows(map_ptr, J, K: tl.constexpr, KP: tl.constexpr):
    """``(ks, rows, row_live)``: coefficient ids, their b rows and which of them exist (KP,)."""
    ks = tl.arange(0, KP)
    rows = tl.load(map_ptr + ks, mask=ks < K, other=0)
    return ks, rows, (ks < K) & (rows >= 0) & (rows < J)


@triton.jit
def _outer_sum_fwd_kernel(
    a_ptr, b_ptr, map_ptr, rowptr_ptr, out_ptr,
    a_se, a_sk, b_se, b_sj, b_sc, J, C,
    K: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Grid (N, cdiv(C, BLOCK_C)). Edge ``first + i`` accumulates into edge slot
    ``i % BLOCK_E``; the slots are summed once at the end, so the loop has no reductions and
    the summation order is fixed by the launch shape (bitwise reproducible)."""
    node = tl.program_id(0).to(tl.int64)
    cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_live = cs < C
    ks, rows, row_live = _coefficient_rows(map_ptr, J, K, KP)
    # The gathered (KP, BLOCK_C) offsets inside one edge's b block are the same for every edge.
    b_in_edge = ((rows * b_sj)[:, None] + (cs * b_sc)[None, :])[:, None, :]
    b_live = (row_live[:, None] & c_live[None, :])[:, None, :]
    first = tl.load(rowptr_ptr + node)
    stop = tl.load(rowptr_ptr + node + 1)
    acc = tl.zeros((KP, BLOCK_E, BLOCK_C), dtype=tl.float32)
    for e0 in range(first, stop, BLOCK_E):
        edges = e0 + tl.arange(0, BLOCK_E)
        edge_live = edges < stop
        coeff = tl.load(
            a_ptr + (ks * a_sk)[:, None] + (edges * a_se)[None, :],
            mask=(ks < K)[:, None] & edge_live[None, :],
            other=0.0,
        )
        rows_b = tl.load(
            b_ptr + (edges * b_se)[None, :, None] + b_in_edge,
            mask=edge_live[None, :, None] & b_live,
            other=0.0,
        )
        acc += coeff[:, :, None] * rows_b
    out = out_ptr + node * (K * C) + (ks * C)[:, None] + cs[None, :]
    tl.store(out, tl.sum(acc, axis=1), mask=(ks < K)[:, None] & c_live[None, :])


@triton.jit
def _outer_sum_bwd_kernel(
    g_ptr, a_ptr, b_ptr, map_ptr, rowptr_ptr, ga_ptr, gb_ptr,
    a_se, a_sk, b_se, b_sj, b_sc, J, C,
    K: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Grid (N, P): program (n, p) takes edges ``⌊len·p/P⌋ .. ⌊len·(p+1)/P⌋`` of node n's
    segment. Per edge block and channel block, each row j of ``b`` is loaded once and meets the
    node-gradient rows ``g[n, k]`` of the coefficients mapped to it (an L1-resident (BLOCK_C,)
    vector each); ``grad_a`` collects in a (BLOCK_E, KP) tile stored once per edge block."""
    node = tl.program_id(0).to(tl.int64)
    first, stop = segment_part_range(rowptr_ptr, node, tl.program_id(1), tl.num_programs(1))
    slots = tl.arange(0, KP)
    g_node = g_ptr + node * (K * C)
    for e0 in range(first, stop, BLOCK_E):
        edges = e0 + tl.arange(0, BLOCK_E)
        edge_live = edges < stop
        grad_a = tl.zeros((BLOCK_E, KP), dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            cs = c0 + tl.arange(0, BLOCK_C)
            c_live = cs < C
            tile_mask = edge_live[:, None] & c_live[None, :]
            for j in range(J):
                b_row = tl.load(
                    b_ptr + (edges * b_se + j * b_sj)[:, None] + (cs * b_sc)[None, :],
                    mask=tile_mask,
                    other=0.0,
                )
                grad_row = tl.zeros((BLOCK_E, BLOCK_C), dtype=tl.float32)
                for k in tl.static_range(K):
                    if tl.load(map_ptr + k) == j:
                        g_k = tl.load(g_node + k * C + cs, mask=c_live, other=0.0)
                        a_k = tl.load(a_ptr + edges * a_se + k * a_sk, mask=edge_live, other=0.0)
                        grad_row += a_k[:, None] * g_k[None, :]
                        dot = tl.sum(b_row * g_k[None, :], axis=1)
                        grad_a += tl.where(slots[None, :] == k, dot[:, None], 0.0)
                # Every row j is written, so rows no coefficient maps to come out 0.
                tl.store(
                    gb_ptr + (edges * J * C + j * C)[:, None] + cs[None, :], grad_row,
                    mask=tile_mask,
                )  # fmt: skip
        tl.store(
            ga_ptr + (edges * K)[:, None] + slots[None, :],
            grad_a,
            mask=edge_live[:, None] & (slots < K)[None, :],
        )


# Launchers


class OuterSumTiles(NamedTuple):
    """Launch shape of one kernel."""

    block_e: int
    """Edges per tile (BLOCK_E)."""
    block_c: int
    """Channels per tile (BLOCK_C)."""
    num_warps: int


_GPU_WARPS = 4
_GPU_TILE_ELEMENTS = 4096
"""Forward KP·BLOCK_E·BLOCK_C on the GPU: a 3-D fp32 tile is 32 registers per thread at 4
warps."""

_GPU_BWD_TILE_ELEMENTS = 1024
"""Backward BLOCK_E·BLOCK_C on the GPU (8 edges at C 128): 8 values per thread and tile at 4
warps. ptxas (sm_90, K 8, C 128, strides as specialised at run time) needs 80 registers there
and 154 at 2048 (the scheduler hoists the next coefficients' loads): ~6 programs, ~48 edges, in
flight per SM without spills."""

_INTERPRETER_TILE_ELEMENTS = 1 << 16
"""Under TRITON_INTERPRET the cost is programs × ops (numpy on whole tiles): few, wide tiles."""


def _coefficient_lanes(n_coeff: int) -> int:
    return int(triton.next_power_of_2(max(n_coeff, 1)))


def _channel_block(n_chan: int) -> int:
    return int(min(128, max(16, triton.next_power_of_2(max(n_chan, 1)))))


def default_tiles(device: torch.device, n_coeff: int, n_chan: int) -> OuterSumTiles:
    """Forward tile shape for K = ``n_coeff`` coefficients and C = ``n_chan`` channels.

    GPU: the widest channel block (≤ 128) that fits the budget with one edge per warp, then as
    many edges as the budget allows: with 4-wide channel vectors, lanes and warps beyond the
    channel block land on edges, not on coefficients (checked in the sm_90 TTGIR for K 8,
    C 128 and K 4, C 64). Interpreter: one channel block up to 128, as many edges as fit.
    """
    kp = _coefficient_lanes(n_coeff)
    block_c = _channel_block(n_chan)
    if device.type != "cuda":
        block_e = max(1, min(128, _INTERPRETER_TILE_ELEMENTS // (kp * block_c)))
        return OuterSumTiles(int(triton.next_power_of_2(block_e)), block_c, 4)
    while kp * _GPU_WARPS * block_c > _GPU_TILE_ELEMENTS and block_c > 16:
        block_c //= 2
    block_e = max(_GPU_WARPS, _GPU_TILE_ELEMENTS // (kp * block_c))
    return OuterSumTiles(int(triton.next_power_of_2(block_e)), block_c, _GPU_WARPS)


def default_bwd_tiles(device: torch.device, n_chan: int) -> OuterSumTiles:
    """Backward tile shape for C = ``n_chan`` channels: one channel block up to 128 and the
    edges the register budget allows (GPU), or up to 128 edges (interpreter)."""
    block_c = _channel_block(n_chan)
    if device.type != "cuda":
        return OuterSumTiles(int(min(128, _INTERPRETER_TILE_ELEMENTS // block_c)), block_c, 4)
    return OuterSumTiles(max(1, _GPU_BWD_TILE_ELEMENTS // block_c), block_c, _GPU_WARPS)


def launch_outer_sum_fwd(
    a: Tensor, b: Tensor, row_map: Tensor, dst_rowptr: Tensor, tiles: OuterSumTiles | None = None
) -> Tensor:
    """Forward kernel: (N, K, C) contiguous. ``tiles`` overrides the default launch shape."""
    n_node, n_coeff, n_chan = _output_shape(a, b, dst_rowptr)
    out = a.new_empty((n_node, n_coeff, n_chan))
    if out.numel() == 0:
        return out
    a, b = int32_inner_offsets(a), int32_inner_offsets(b)
    block_e, block_c, num_warps = tiles or default_tiles(a.device, n_coeff, n_chan)
    grid = (n_node, triton.cdiv(n_chan, block_c))
    # The index tensors are read with unit stride (an edge-table column is a strided view).
    wrap_triton(_outer_sum_fwd_kernel)[grid](
        a, b, row_map.contiguous(), dst_rowptr.contiguous(), out,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), b.shape[1], n_chan,
        K=n_coeff, KP=_coefficient_lanes(n_coeff), BLOCK_E=block_e, BLOCK_C=block_c,
        num_warps=num_warps,
    )  # fmt: skip
    return out


def launch_outer_sum_bwd(
    grad_out: Tensor,
    a: Tensor,
    b: Tensor,
    row_map: Tensor,
    dst_rowptr: Tensor,
    tiles: OuterSumTiles | None = None,
    n_part: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Backward kernel: ``(grad_a (E, K), grad_b (E, J, C))`` contiguous; ``grad_out``
    contiguous. ``tiles`` and ``n_part`` (segment parts) override the default launch shape."""
    n_edge, n_coeff = a.shape
    n_node = dst_rowptr.shape[0] - 1
    n_rows, n_chan = b.shape[1], b.shape[2]
    grad_a = a.new_empty((n_edge, n_coeff))
    grad_b = b.new_empty((n_edge, n_rows, n_chan))
    if n_edge == 0 or n_rows * n_chan == 0:
        return grad_a.zero_(), grad_b
    block_e, block_c, num_warps = tiles or default_bwd_tiles(a.device, n_chan)
    if n_part is None:
        n_part = default_segment_parts(a.device, n_node, n_edge, 1)
    if n_part < 1:
        raise ValueError(f"so2kernels.{_OP}_bwd: n_part must be >= 1, got {n_part}")
    a, b = int32_inner_offsets(a), int32_inner_offsets(b)
    wrap_triton(_outer_sum_bwd_kernel)[(n_node, n_part)](
        grad_out, a, b, row_map.contiguous(), dst_rowptr.contiguous(), grad_a, grad_b,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), n_rows, n_chan,
        K=n_coeff, KP=_coefficient_lanes(n_coeff), BLOCK_E=block_e, BLOCK_C=block_c,
        num_warps=num_warps,
    )  # fmt: skip
    return grad_a, grad_b


# Op registration


@triton_op(f"so2kernels::{_OP}", mutates_args=())
def _outer_sum_op(a: Tensor, b: Tensor, row_map: Tensor, dst_rowptr: Tensor) -> Tensor:
    check_outer_sum_inputs(a, b, row_map, dst_rowptr)
    if not use_triton(a, b, row_map, dst_rowptr):
        return segment_outer_sum_reference(a, b, row_map, dst_rowptr)
    require_fp32(_OP, a=a, b=b)
    with launch_device(a):
        return launch_outer_sum_fwd(a, b, row_map, dst_rowptr)


@_outer_sum_op.register_fake
def _outer_sum_fake(a: Tensor, b: Tensor, row_map: Tensor, dst_rowptr: Tensor) -> Tensor:
    check_outer_sum_inputs(a, b, row_map, dst_rowptr)
    return a.new_empty(_output_shape(a, b, dst_rowptr))


@triton_op(f"so2kernels::{_OP}_bwd", mutates_args=())
def _outer_sum_bwd_op(
    grad_out: Tensor, a: Tensor, b: Tensor, row_map: Tensor, dst_rowptr: Tensor
) -> tuple[Tensor, Tensor]:
    check_outer_sum_inputs(a, b, row_map, dst_rowptr)
    _check_grad_out(grad_out, a, b, dst_rowptr)
    if not use_triton(grad_out, a, b, row_map, dst_rowptr):
        return segment_outer_sum_backward_reference(grad_out, a, b, row_map, dst_rowptr)
    require_fp32(f"{_OP}_bwd", grad_out=grad_out, a=a, b=b)
    with launch_device(grad_out):
        return launch_outer_sum_bwd(grad_out.contiguous(), a, b, row_map, dst_rowptr)


@_outer_sum_bwd_op.register_fake
def _outer_sum_bwd_fake(
    grad_out: Tensor, a: Tensor, b: Tensor, row_map: Tensor, dst_rowptr: Tensor
) -> tuple[Tensor, Tensor]:
    check_outer_sum_inputs(a, b, row_map, dst_rowptr)
    _check_grad_out(grad_out, a, b, dst_rowptr)
    return a.new_empty(a.shape), b.new_empty(b.shape)


def _outer_sum_setup_context(
    ctx: Any, inputs: tuple[Tensor, Tensor, Tensor, Tensor], output: Tensor
) -> None:
    ctx.save_for_backward(*inputs)


def _outer_sum_backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
    """Triton first order; the differentiable closed form under ``create_graph``."""
    a, b, row_map, dst_rowptr = ctx.saved_tensors
    if torch.is_grad_enabled():
        grad_a, grad_b = segment_outer_sum_backward_reference(grad_out, a, b, row_map, dst_rowptr)
    else:
        grad_a, grad_b = torch.ops.so2kernels.segment_outer_sum_bwd(
            grad_out, a, b, row_map, dst_rowptr
        )
    needs = ctx.needs_input_grad
    return grad_a if needs[0] else None, grad_b if needs[1] else None, None, None


_outer_sum_op.register_autograd(_outer_sum_backward, setup_context=_outer_sum_setup_context)


# Typed Python entry point


def segment_outer_sum(a: Tensor, b: Tensor, row_map: Tensor, dst_rowptr: Tensor) -> Tensor:
    """``torch.ops.so2kernels.segment_outer_sum``: (N, K, C); see the module docstring.

    Raises:
        ValueError: operand shapes or dtypes disagree with the layout contract.
        UnsupportedInputError: the fused path got a non-float32 operand.
    """
    out: Tensor = torch.ops.so2kernels.segment_outer_sum(a, b, row_map, dst_rowptr)
    return out
