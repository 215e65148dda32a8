"""CSR segment reductions: ``segment_sum`` (edges → nodes) and its adjoint ``segment_broadcast``.

Layout contract
---------------
``order`` (E,) int64 lists the row ids grouped by segment (e.g. a stable argsort of ``src``) and
``row_ptr`` (N+1,) int64 holds the segment offsets into ``order``: segment ``n`` owns
``order[row_ptr[n]:row_ptr[n+1]]``. ``order`` must be a permutation of ``0..E-1`` and
``row_ptr[0] = 0``, ``row_ptr[N] = E`` (checked by :func:`validate_csr`, which synchronises and is
therefore left to the caller that builds the CSR; the ops only check shapes).

* ``segment_sum(rows (E, *S)) -> (N, *S)``: ``out[n] = Σ_{k in seg(n)} rows[order[k]]``.
* ``segment_broadcast(values (N, *S)) -> (E, *S)``: ``out[order[k]] = values[n]`` for k in seg(n).

Each is the other's adjoint, so each is the other's backward (and hence its own second order).
The fused path reduces every segment in one program, in ``order``'s order: no atomics, the result
is bitwise reproducible run to run.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from so2kernels._dispatch import require_fp32, use_triton

# Input checks


def _check_csr(op: str, order: Tensor, row_ptr: Tensor, n_rows: int) -> None:
    """Shape/dtype checks that need no device synchronisation."""
    if order.dim() != 1 or row_ptr.dim() != 1:
        raise ValueError(
            f"so2kernels.{op}: order and row_ptr must be 1-D, got shapes "
            f"{tuple(order.shape)} and {tuple(row_ptr.shape)}"
        )
    if order.dtype != torch.int64 or row_ptr.dtype != torch.int64:
        raise ValueError(
            f"so2kernels.{op}: order and row_ptr must be int64, "
            f"got {order.dtype} and {row_ptr.dtype}"
        )
    if row_ptr.shape[0] < 1:
        raise ValueError(f"so2kernels.{op}: row_ptr needs N+1 >= 1 entries")
    if order.shape[0] != n_rows:
        raise ValueError(
            f"so2kernels.{op}: order has {order.shape[0]} entries but there are {n_rows} rows"
        )


def validate_csr(order: Tensor, row_ptr: Tensor) -> None:
    """Full CSR contract check (synchronises; call once where the CSR is built, or in tests).

    Raises:
        ValueError: ``row_ptr`` is not a non-decreasing 0..E offset array, or ``order`` is not a
            permutation of ``0..E-1``.
    """
    _check_csr("validate_csr", order, row_ptr, order.shape[0])
    n_rows = order.shape[0]
    if int(row_ptr[0]) != 0 or int(row_ptr[-1]) != n_rows:
        raise ValueError(f"row_ptr must start at 0 and end at E={n_rows}")
    if bool((row_ptr[1:] < row_ptr[:-1]).any()):
        raise ValueError("row_ptr must be non-decreasing")
    seen = torch.zeros(n_rows, dtype=torch.int64, device=order.device)
    if n_rows and (bool((order < 0).any()) or bool((order >= n_rows).any())):
        raise ValueError("order holds ids outside 0..E-1")
    seen.index_add_(0, order, torch.ones_like(order))
    if bool((seen != 1).any()):
        raise ValueError("order must be a permutation of 0..E-1")


def csr_from_index(index: Tensor, n_segments: int) -> tuple[Tensor, Tensor]:
    """``(order, row_ptr)`` grouping the rows of ``index`` (E,) by value: a stable argsort and
    the cumulative segment counts, both int64."""
    order = torch.argsort(index, stable=True)
    counts = torch.bincount(index, minlength=n_segments)
    row_ptr = torch.zeros(n_segments + 1, dtype=torch.int64, device=index.device)
    torch.cumsum(counts, 0, out=row_ptr[1:])
    return order, row_ptr


# Eager references (any dtype, differentiable by autograd)


def _segment_of_sorted(order: Tensor, row_ptr: Tensor) -> Tensor:
    """(E,) segment id of every position of ``order`` (no host sync: output_size is known)."""
    n_segments = row_ptr.shape[0] - 1
    counts = row_ptr[1:] - row_ptr[:-1]
    ids = torch.arange(n_segments, device=row_ptr.device, dtype=torch.int64)
    return torch.repeat_interleave(ids, counts, output_size=order.shape[0])


def segment_sum_reference(rows: Tensor, order: Tensor, row_ptr: Tensor) -> Tensor:
    """``out[n] = Σ_{k in row_ptr[n]..row_ptr[n+1]} rows[order[k]]``: (E, *S) -> (N, *S)."""
    _check_csr("segment_sum", order, row_ptr, rows.shape[0])
    out = rows.new_zeros((row_ptr.shape[0] - 1, *rows.shape[1:]))
    return out.index_add(0, _segment_of_sorted(order, row_ptr), rows.index_select(0, order))


def segment_broadcast_reference(values: Tensor, order: Tensor, row_ptr: Tensor) -> Tensor:
    """``out[order[k]] = values[n]`` for k in segment n: (N, *S) -> (E, *S)."""
    _check_csr("segment_broadcast", order, row_ptr, order.shape[0])
    _check_segment_count("segment_broadcast", values, row_ptr)
    out = values.new_zeros((order.shape[0], *values.shape[1:]))
    return out.index_copy(0, order, values.index_select(0, _segment_of_sorted(order, row_ptr)))


def _check_segment_count(op: str, values: Tensor, row_ptr: Tensor) -> None:
    if values.dim() < 1 or values.shape[0] != row_ptr.shape[0] - 1:
        raise ValueError(
            f"so2kernels.{op}: values has {values.shape[0] if values.dim() else 0} rows but "
            f"row_ptr describes {row_ptr.shape[0] - 1} segments"
        )


# Triton kernels. Grid (N, cdiv(P, BLOCK_P)); each program owns one segment's column chunk and
# walks the segment BLOCK_K positions at a time. Offsets are int64 (E·P may exceed 2^31).


@triton.jit
def _segment_sum_kernel(
    rows_ptr,  # (E, P), row stride rows_se, unit column stride
    order_ptr,  # (E,) int64
    row_ptr_ptr,  # (N+1,) int64
    out_ptr,  # (N, P) contiguous
    rows_se,
    P,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    seg = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    col_mask = cols < P
    first = tl.load(row_ptr_ptr + seg)
    stop = tl.load(row_ptr_ptr + seg + 1)
    acc = tl.zeros((BLOCK_P,), dtype=tl.float32)
    for k0 in range(first, stop, BLOCK_K):
        pos = k0 + tl.arange(0, BLOCK_K)
        pos_mask = pos < stop
        row = tl.load(order_ptr + pos, mask=pos_mask, other=0)
        tile = tl.load(
            rows_ptr + row[:, None] * rows_se + cols[None, :],
            mask=pos_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        acc += tl.sum(tile, axis=0)
    tl.store(out_ptr + seg * P + cols, acc, mask=col_mask)


@triton.jit
def _segment_broadcast_kernel(
    values_ptr,  # (N, P), row stride values_sn, unit column stride
    order_ptr,  # (E,) int64
    row_ptr_ptr,  # (N+1,) int64
    out_ptr,  # (E, P) contiguous
    values_sn,
    P,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    seg = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    col_mask = cols < P
    first = tl.load(row_ptr_ptr + seg)
    stop = tl.load(row_ptr_ptr + seg + 1)
    value = tl.load(values_ptr + seg * values_sn + cols, mask=col_mask, other=0.0)
    tile = tl.broadcast_to(value[None, :], (BLOCK_K, BLOCK_P))
    for k0 in range(first, stop, BLOCK_K):
        pos = k0 + tl.arange(0, BLOCK_K)
        pos_mask = pos < stop
        row = tl.load(order_ptr + pos, mask=pos_mask, other=0)
        tl.store(
            out_ptr + row[:, None] * P + cols[None, :],
            tile,
            mask=pos_mask[:, None] & col_mask[None, :],
        )


# Launchers

_BLOCK_K = 4
"""Segment positions per loop step: short enough for the ~10¹–10² edges per atom of a
neighbour list, long enough to keep several row loads in flight."""


def _column_block(n_cols: int) -> int:
    return int(min(1024, max(16, triton.next_power_of_2(max(n_cols, 1)))))


def _as_matrix(t: Tensor) -> Tensor:
    """(R, *S) -> (R, P) with unit column stride (copies only if the trailing dims do not
    flatten to a unit-stride row)."""
    flat = t.reshape(t.shape[0], math.prod(t.shape[1:]))
    return flat if flat.stride(1) == 1 or flat.shape[1] <= 1 else flat.contiguous()


def _launch_segment_sum(rows: Tensor, order: Tensor, row_ptr: Tensor) -> Tensor:
    n_segments = row_ptr.shape[0] - 1
    out = torch.empty((n_segments, *rows.shape[1:]), device=rows.device, dtype=rows.dtype)
    matrix = _as_matrix(rows)
    n_cols = matrix.shape[1]
    if n_segments == 0 or n_cols == 0:
        return out
    block_p = _column_block(n_cols)
    grid = (n_segments, triton.cdiv(n_cols, block_p))
    wrap_triton(_segment_sum_kernel)[grid](
        matrix, order, row_ptr, out, matrix.stride(0), n_cols,
        BLOCK_K=_BLOCK_K, BLOCK_P=block_p, num_warps=4,
    )  # fmt: skip
    return out


def _launch_segment_broadcast(values: Tensor, order: Tensor, row_ptr: Tensor) -> Tensor:
    n_segments = row_ptr.shape[0] - 1
    out = torch.empty((order.shape[0], *values.shape[1:]), device=values.device, dtype=values.dtype)
    matrix = _as_matrix(values)
    n_cols = matrix.shape[1]
    if n_segments == 0 or n_cols == 0:
        return out
    block_p = _column_block(n_cols)
    grid = (n_segments, triton.cdiv(n_cols, block_p))
    wrap_triton(_segment_broadcast_kernel)[grid](
        matrix, order, row_ptr, out, matrix.stride(0), n_cols,
        BLOCK_K=_BLOCK_K, BLOCK_P=block_p, num_warps=4,
    )  # fmt: skip
    return out


# Op registration


@triton_op("so2kernels::segment_sum", mutates_args=())
def _segment_sum_op(rows: Tensor, order: Tensor, row_ptr: Tensor) -> Tensor:
    _check_csr("segment_sum", order, row_ptr, rows.shape[0])
    if not use_triton(rows, order, row_ptr):
        return segment_sum_reference(rows, order, row_ptr)
    require_fp32("segment_sum", rows=rows)
    return _launch_segment_sum(rows, order, row_ptr)


@triton_op("so2kernels::segment_broadcast", mutates_args=())
def _segment_broadcast_op(values: Tensor, order: Tensor, row_ptr: Tensor) -> Tensor:
    _check_csr("segment_broadcast", order, row_ptr, order.shape[0])
    _check_segment_count("segment_broadcast", values, row_ptr)
    if not use_triton(values, order, row_ptr):
        return segment_broadcast_reference(values, order, row_ptr)
    require_fp32("segment_broadcast", values=values)
    return _launch_segment_broadcast(values, order, row_ptr)


@_segment_sum_op.register_fake
def _segment_sum_fake(rows: Tensor, order: Tensor, row_ptr: Tensor) -> Tensor:
    return rows.new_empty((row_ptr.shape[0] - 1, *rows.shape[1:]))


@_segment_broadcast_op.register_fake
def _segment_broadcast_fake(values: Tensor, order: Tensor, row_ptr: Tensor) -> Tensor:
    return values.new_empty((order.shape[0], *values.shape[1:]))


def _save_csr(
    ctx: torch.autograd.function.FunctionCtx, inputs: tuple[Tensor, ...], output: Tensor
) -> None:
    _, order, row_ptr = inputs
    ctx.save_for_backward(order, row_ptr)


def _segment_sum_backward(
    ctx: torch.autograd.function.FunctionCtx, grad: Tensor
) -> tuple[Tensor, None, None]:
    order, row_ptr = ctx.saved_tensors  # type: ignore[attr-defined]
    return torch.ops.so2kernels.segment_broadcast(grad, order, row_ptr), None, None


def _segment_broadcast_backward(
    ctx: torch.autograd.function.FunctionCtx, grad: Tensor
) -> tuple[Tensor, None, None]:
    order, row_ptr = ctx.saved_tensors  # type: ignore[attr-defined]
    return torch.ops.so2kernels.segment_sum(grad, order, row_ptr), None, None


_segment_sum_op.register_autograd(_segment_sum_backward, setup_context=_save_csr)
_segment_broadcast_op.register_autograd(_segment_broadcast_backward, setup_context=_save_csr)


# Typed Python entry points


def segment_sum(rows: Tensor, order: Tensor, row_ptr: Tensor) -> Tensor:
    """(E, *S) -> (N, *S) CSR segment sum; see the module docstring for the contract."""
    out: Tensor = torch.ops.so2kernels.segment_sum(rows, order, row_ptr)
    return out


def segment_broadcast(values: Tensor, order: Tensor, row_ptr: Tensor) -> Tensor:
    """(N, *S) -> (E, *S) adjoint of :func:`segment_sum`."""
    out: Tensor = torch.ops.so2kernels.segment_broadcast(values, order, row_ptr)
    return out
