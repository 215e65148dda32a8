"""CSR segment reductions: ``segment_sum`` (edges → nodes) and its adjoint ``segment_broadcast``.

Layout contract.
``order`` (E,) int64 lists the row ids grouped by segment (e.g. a stable argsort of ``src``) and
``row_ptr`` (N+1,) int64 holds the segment offsets into ``order``: segment ``n`` owns
``order[row_ptr[n]:row_ptr[n+1]]``. ``order`` must be a permutation of ``0..E-1`` and
``row_ptr[0] = 0``, ``row_ptr[N] = E`` (checked by :func:`validate_csr`, which synchronises and is
therefore left to the caller that builds the CSR; the ops only check shapes). ``order=None``
means the identity: the rows are already grouped by segment (e.g. edges sorted by ``dst``), and
no (E,) index is read at all.

* ``segment_sum(rows (E, *S)) -> (N, *S)``: ``out[n] = Σ_{k in seg(n)} rows[order[k]]``.
* ``segment_broadcast(values (N, *S)) -> (E, *S)``: ``out[order[k]] = values[n]`` for k in seg(n).

Each is the other's adjoint, so each is the other's backward (and hence its own second order).
The fused path reduces every segment in one program, in ``order``'s order, accumulating in the
rows' dtype (float32 or float64): no atomics, the result is bitwise reproducible run to run, and
no launch reads anything back to the host (safe inside a CUDA graph).
"""

# Triton kernels take untyped pointer/constexpr arguments and @triton.jit is an untyped decorator.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from so2kernels._dispatch import UnsupportedInputError, launch_device, use_triton

# Input checks


def _check_csr(op: str, order: Tensor | None, row_ptr: Tensor, n_rows: int) -> None:
    """Shape/dtype checks that need no device synchronisation."""
    for name, index in (("order", order), ("row_ptr", row_ptr)):
        if index is None:
            continue
        if index.dim() != 1 or index.dtype != torch.int64:
            raise ValueError(
                f"so2kernels.{op}: {name} must be a 1-D int64 tensor, got shape "
                f"{tuple(index.shape)} and {index.dtype}"
            )
    if row_ptr.shape[0] < 1:
        raise ValueError(f"so2kernels.{op}: row_ptr needs N+1 >= 1 entries")
    if order is not None and order.shape[0] != n_rows:
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


def row_ptr_from_index(index: Tensor, n_segments: int) -> Tensor:
    """(n_segments+1,) int64 ``[0, cumsum(bincount(index))]``: where each value's rows start
    once the rows of ``index`` (E,) are grouped by value."""
    counts = torch.bincount(index, minlength=n_segments)
    row_ptr = torch.zeros(n_segments + 1, dtype=torch.int64, device=index.device)
    torch.cumsum(counts, 0, out=row_ptr[1:])
    return row_ptr


def csr_from_index(index: Tensor, n_segments: int) -> tuple[Tensor, Tensor]:
    """``(order, row_ptr)`` grouping the rows of ``index`` (E,) by value: a stable argsort and
    :func:`row_ptr_from_index`, both int64."""
    return torch.argsort(index, stable=True), row_ptr_from_index(index, n_segments)


# Eager references (any dtype, differentiable by autograd)


def segment_of_position(row_ptr: Tensor, n_rows: int) -> Tensor:
    """Owning segment of each of the E CSR positions, as int64 (E,): e.g. every edge's
    destination node from ``dst_rowptr``. ``output_size`` is given, so nothing is read back to
    the host (nor are the counts' signs checked there)."""
    lengths = torch.diff(row_ptr)
    labels = torch.arange(lengths.numel(), dtype=torch.int64, device=row_ptr.device)
    return labels.repeat_interleave(lengths, output_size=n_rows)


def _summed_rows(rows: Tensor) -> int:
    if rows.dim() < 1:
        raise ValueError(
            "so2kernels.segment_sum: rows must have a leading row axis (E, *S); got a 0-d tensor"
        )
    return int(rows.shape[0])


def segment_sum_reference(rows: Tensor, order: Tensor | None, row_ptr: Tensor) -> Tensor:
    """``out[n] = Σ_{k in row_ptr[n]..row_ptr[n+1]} rows[order[k]]``: (E, *S) -> (N, *S)."""
    n_rows = _summed_rows(rows)
    _check_csr("segment_sum", order, row_ptr, n_rows)
    grouped = rows if order is None else rows.index_select(0, order)
    out = rows.new_zeros((row_ptr.shape[0] - 1, *rows.shape[1:]))
    return out.index_add(0, segment_of_position(row_ptr, n_rows), grouped)


def segment_broadcast_reference(
    values: Tensor, order: Tensor | None, row_ptr: Tensor, n_rows: int | None = None
) -> Tensor:
    """``out[order[k]] = values[n]`` for k in segment n: (N, *S) -> (E, *S)."""
    n_rows = _broadcast_rows("segment_broadcast", order, n_rows)
    _check_csr("segment_broadcast", order, row_ptr, n_rows)
    _check_segment_count("segment_broadcast", values, row_ptr)
    grouped = values.index_select(0, segment_of_position(row_ptr, n_rows))
    if order is None:
        return grouped
    return values.new_zeros((n_rows, *values.shape[1:])).index_copy(0, order, grouped)


def _broadcast_rows(op: str, order: Tensor | None, n_rows: int | None) -> int:
    """E of a broadcast: ``order``'s length, or the caller's ``n_rows`` when order is the
    identity (``row_ptr[-1]`` would need a host read)."""
    if order is not None:
        if n_rows is not None and n_rows != order.shape[0]:
            raise ValueError(f"so2kernels.{op}: n_rows={n_rows} but order has {order.shape[0]}")
        return int(order.shape[0])
    if n_rows is None or n_rows < 0:
        raise ValueError(f"so2kernels.{op}: order=None needs the row count n_rows >= 0")
    return n_rows


def _check_segment_count(op: str, values: Tensor, row_ptr: Tensor) -> None:
    if values.dim() < 1 or values.shape[0] != row_ptr.shape[0] - 1:
        raise ValueError(
            f"so2kernels.{op}: values has {values.shape[0] if values.dim() else 0} rows but "
            f"row_ptr describes {row_ptr.shape[0] - 1} segments"
        )


# Triton kernels. The launch grid is (N segments, column chunks of CHUNK); a program reads its
# segment bounds and visits the positions STEP at a time, summing (or storing) in the result's
# dtype. IDENTITY (order is None) maps position k to row k. All offsets are int64 (E·P can pass
# 2^31).


@triton.jit
def _csr_reduce_kernel(
    src,  # (E, P) source rows: stride src_stride between rows, contiguous within one
    perm,  # (E,) int64 position -> row; never read when IDENTITY
    offsets,  # (N+1,) int64 segment bounds
    dst,  # (N, P) contiguous result, same dtype as src
    src_stride,
    width,
    IDENTITY: tl.constexpr,
    STEP: tl.constexpr,
    CHUNK: tl.constexpr,
):
    node = tl.program_id(axis=0).to(tl.int64)
    lane = tl.arange(0, CHUNK) + CHUNK * tl.program_id(axis=1).to(tl.int64)
    lane_ok = lane < width
    lo = tl.load(offsets + node)
    hi = tl.load(offsets + node + 1)
    total = tl.zeros((CHUNK,), dtype=dst.dtype.element_ty)
    for start in range(lo, hi, STEP):
        k = tl.arange(0, STEP) + start
        k_ok = k < hi
        src_row = k if IDENTITY else tl.load(perm + k, mask=k_ok, other=0)
        block = tl.load(
            src + (src_row * src_stride)[:, None] + lane[None, :],
            mask=k_ok[:, None] & lane_ok[None, :],
            other=0.0,
        )
        total += tl.sum(block, axis=0)
    tl.store(dst + node * width + lane, total, mask=lane_ok)


@triton.jit
def _csr_spread_kernel(
    src,  # (N, P) per-segment values: stride src_stride between rows, contiguous within one
    perm,  # (E,) int64 position -> row; never read when IDENTITY
    offsets,  # (N+1,) int64 segment bounds
    dst,  # (E, P) contiguous result
    src_stride,
    width,
    IDENTITY: tl.constexpr,
    STEP: tl.constexpr,
    CHUNK: tl.constexpr,
):
    node = tl.program_id(axis=0).to(tl.int64)
    lane = tl.arange(0, CHUNK) + CHUNK * tl.program_id(axis=1).to(tl.int64)
    lane_ok = lane < width
    lo = tl.load(offsets + node)
    hi = tl.load(offsets + node + 1)
    seg_value = tl.load(src + node * src_stride + lane, mask=lane_ok, other=0.0)
    block = tl.broadcast_to(seg_value[None, :], (STEP, CHUNK))
    for start in range(lo, hi, STEP):
        k = tl.arange(0, STEP) + start
        k_ok = k < hi
        dst_row = k if IDENTITY else tl.load(perm + k, mask=k_ok, other=0)
        tl.store(
            dst + (dst_row * width)[:, None] + lane[None, :],
            block,
            mask=k_ok[:, None] & lane_ok[None, :],
        )


# Launchers

_TILE_ELEMENTS = 4096
"""Cap on STEP·CHUNK, so that the (STEP, CHUNK) tile of one loop step fits in registers."""


def _column_block(n_cols: int) -> int:
    return int(min(1024, max(16, triton.next_power_of_2(max(n_cols, 1)))))


def _position_block(block_p: int) -> int:
    """Segment positions per loop step: the widest tile that fits in registers. Long segments of
    narrow rows (per-atom sums of 3–9 columns over ~10² edges, per-structure sums over 10⁶
    atoms) then take a full tile per step instead of serialising thousands of tiny ones; short
    ones leave most of it masked, which costs issue slots, not memory traffic. It depends on the
    row width only, not on the mean segment length: STEP is a compile-time constant, and a
    server would otherwise compile a variant for every octave of batch shape it meets."""
    return max(4, _TILE_ELEMENTS // block_p)


def _as_matrix(t: Tensor) -> Tensor:
    """(R, *S) -> (R, P) with unit column stride (copies only if the trailing dims do not
    flatten to a unit-stride row)."""
    flat = t.reshape(t.shape[0], math.prod(t.shape[1:]))
    return flat if flat.stride(1) == 1 or flat.shape[1] <= 1 else flat.contiguous()


def _launch_segment_sum(rows: Tensor, order: Tensor | None, row_ptr: Tensor) -> Tensor:
    n_seg = row_ptr.size(0) - 1
    result = rows.new_empty((n_seg, *rows.shape[1:]))
    return _run_csr_kernel(_csr_reduce_kernel, rows, order, row_ptr, result)


def _launch_segment_broadcast(
    values: Tensor, order: Tensor | None, row_ptr: Tensor, n_rows: int
) -> Tensor:
    result = values.new_empty((n_rows, *values.shape[1:]))
    return _run_csr_kernel(_csr_spread_kernel, values, order, row_ptr, result)


def _run_csr_kernel(
    kernel: Any, source: Tensor, order: Tensor | None, row_ptr: Tensor, result: Tensor
) -> Tensor:
    """One program per (segment, column chunk) of ``kernel`` over the CSR positions;
    fills and returns ``result`` (left as is when there is nothing to do)."""
    n_seg = row_ptr.size(0) - 1
    flat = _as_matrix(source)
    width = flat.shape[1]
    if width == 0 or n_seg == 0:
        return result
    chunk = _column_block(width)
    step = _position_block(chunk)
    # The kernels index the CSR with unit stride; a column of an edge table is a strided view.
    perm = (row_ptr if order is None else order).contiguous()
    wrap_triton(kernel)[(n_seg, triton.cdiv(width, chunk))](
        flat, perm, row_ptr.contiguous(), result, flat.stride(0), width,
        IDENTITY=order is None, STEP=step, CHUNK=chunk, num_warps=4,
    )  # fmt: skip
    return result


# Op registration


def _require_float(op: str, t: Tensor, name: str) -> None:
    if t.dtype not in (torch.float32, torch.float64):
        raise UnsupportedInputError(
            f"so2kernels.{op}: the fused path needs float32 or float64 for '{name}', got {t.dtype}"
        )


def _check_sum_operands(rows: Tensor, order: Tensor | None, row_ptr: Tensor) -> None:
    _check_csr("segment_sum", order, row_ptr, _summed_rows(rows))


def _check_broadcast_operands(
    values: Tensor, order: Tensor | None, row_ptr: Tensor, n_rows: int
) -> int:
    """The broadcast's row count E, after the checks its op and fake share."""
    n_rows = _broadcast_rows("segment_broadcast", order, n_rows)
    _check_csr("segment_broadcast", order, row_ptr, n_rows)
    _check_segment_count("segment_broadcast", values, row_ptr)
    return n_rows


@triton_op("so2kernels::segment_sum", mutates_args=())
def _segment_sum_op(rows: Tensor, order: Tensor | None, row_ptr: Tensor) -> Tensor:
    _check_sum_operands(rows, order, row_ptr)
    index = (row_ptr,) if order is None else (order, row_ptr)
    if not use_triton(rows, *index):
        return segment_sum_reference(rows, order, row_ptr)
    _require_float("segment_sum", rows, "rows")
    with launch_device(rows):
        return _launch_segment_sum(rows, order, row_ptr)


@triton_op("so2kernels::segment_broadcast", mutates_args=())
def _segment_broadcast_op(
    values: Tensor, order: Tensor | None, row_ptr: Tensor, n_rows: int
) -> Tensor:
    n_rows = _check_broadcast_operands(values, order, row_ptr, n_rows)
    index = (row_ptr,) if order is None else (order, row_ptr)
    if not use_triton(values, *index):
        return segment_broadcast_reference(values, order, row_ptr, n_rows)
    _require_float("segment_broadcast", values, "values")
    with launch_device(values):
        return _launch_segment_broadcast(values, order, row_ptr, n_rows)


@_segment_sum_op.register_fake
def _segment_sum_fake(rows: Tensor, order: Tensor | None, row_ptr: Tensor) -> Tensor:
    _check_sum_operands(rows, order, row_ptr)
    trailing = rows.shape[1:]
    return rows.new_empty((row_ptr.size(0) - 1, *trailing))


@_segment_broadcast_op.register_fake
def _segment_broadcast_fake(
    values: Tensor, order: Tensor | None, row_ptr: Tensor, n_rows: int
) -> Tensor:
    n_rows = _check_broadcast_operands(values, order, row_ptr, n_rows)
    return values.new_empty((n_rows, *values.shape[1:]))


def _save_sum_csr(
    ctx: torch.autograd.function.FunctionCtx, inputs: tuple[Any, ...], output: Tensor
) -> None:
    # The backward broadcasts over the same CSR and needs E back.
    ctx.n_rows = inputs[0].size(0)  # type: ignore[attr-defined]
    ctx.save_for_backward(*inputs[1:3])


def _save_broadcast_csr(
    ctx: torch.autograd.function.FunctionCtx, inputs: tuple[Any, ...], output: Tensor
) -> None:
    # (values, order, row_ptr, n_rows): the adjoint only needs the CSR pair.
    ctx.save_for_backward(*inputs[1:3])


def _segment_sum_backward(
    ctx: torch.autograd.function.FunctionCtx, grad: Tensor
) -> tuple[Tensor, None, None]:
    order, row_ptr = ctx.saved_tensors  # type: ignore[attr-defined]
    n_rows: int = ctx.n_rows  # type: ignore[attr-defined]
    return segment_broadcast(grad, order, row_ptr, n_rows), None, None


def _segment_broadcast_backward(
    ctx: torch.autograd.function.FunctionCtx, grad: Tensor
) -> tuple[Tensor, None, None, None]:
    order, row_ptr = ctx.saved_tensors  # type: ignore[attr-defined]
    return segment_sum(grad, order, row_ptr), None, None, None


_segment_sum_op.register_autograd(_segment_sum_backward, setup_context=_save_sum_csr)
_segment_broadcast_op.register_autograd(
    _segment_broadcast_backward, setup_context=_save_broadcast_csr
)


# Typed Python entry points


def segment_sum(rows: Tensor, order: Tensor | None, row_ptr: Tensor) -> Tensor:
    """(E, *S) -> (N, *S) CSR segment sum; see the module docstring for the contract."""
    out: Tensor = torch.ops.so2kernels.segment_sum(rows, order, row_ptr)
    return out


def segment_broadcast(
    values: Tensor, order: Tensor | None, row_ptr: Tensor, n_rows: int | None = None
) -> Tensor:
    """(N, *S) -> (E, *S) adjoint of :func:`segment_sum`; ``n_rows`` (E) is required when
    ``order`` is None and must match ``order`` otherwise."""
    rows = _broadcast_rows("segment_broadcast", order, n_rows)
    out: Tensor = torch.ops.so2kernels.segment_broadcast(values, order, row_ptr, rows)
    return out
