"""Layout contract shared by every op.

Packed SO(3) coefficients: degree l occupies rows l²..l²+2l, ordered m = -l..+l, so
``packed(l, m) = l² + l + m`` and ``D = (L+1)²``.

Reduced m-major rows (mmax = 1), ``3L+1`` of them:
  rows 0..L       m = 0,  l = 0..L
  rows L+1..2L    m = -1, l = 1..L
  rows 2L+1..3L   m = +1, l = 1..L
A focus stream's row of width ``ROW = (3L+1)·Cf`` is these rows, each ``Cf`` channels wide
(coefficient-major: ``flat = row·Cf + cf``). The wide channel is ``c = f·Cf + cf``.

m=0 block of the SO(2) linear: ``M0 = (L+1)·Cf`` columns (rows 0..L of the reduced order);
|m|=1 block: ``M1 = 2L·Cf`` (rows L+1..3L, ``[m=-1 | m=+1]``); gate width ``LG = L·Cf``.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

# Shape-named aliases of the ops' operands (all plain tensors; the shapes are the contract above).
Tensor = torch.Tensor
FocusRows = Tensor  # (F, E, ROW) focus-major activation
EdgeRows = Tensor  # (E, F, ROW) edge-major activation or its cotangent
LayerStack = Tensor  # (NG, F, E, ROW) one focus-major activation per gated layer
EdgeFocus = Tensor  # (E, F) competition weight
LayerBlocks = Tensor  # (n, F, M, M) per-layer block weights, (in, out) storage
GateBlocks = Tensor  # (n-1, F, Cf, LG) per-layer gate projections
GateWeights = Tensor  # (F, Cf, LG) one layer's gate projection
NodeFeatures = Tensor  # (N, D, C_wide) packed SO(3) node features
EdgeNodes = Tensor  # (E,) int64 node per edge, or a CSR order of the edges
NodeOffsets = Tensor  # (N+1,) int64 CSR row pointers
EdgeWigner = Tensor  # (E, >=D, >=D) Wigner-D per edge (the leading D x D block is read)
RadialKernel = Tensor  # (E, L+1, C_wide) at rank 0, else (E, K·R)
ChannelBasis = Tensor  # (R, C_wide)
# and of their integer attributes
MaxDegree = int  # lmax: the highest degree l of the features
FocusCount = int  # F: focus streams (the competition's channel groups)
FocusWidth = int  # Cf: channels of one focus stream
KernelRank = int  # R: rank of the radial kernel's channel factorisation (0: one per degree)

SUPPORTED_LMAX = range(1, 7)
SUPPORTED_FOCUS_DIMS = (32, 64, 96, 128)
MAX_RANK = 4


def n_coeff(lmax: int) -> int:
    """Packed coefficient count ``(L+1)²``."""
    return (lmax + 1) ** 2


def n_reduced(lmax: int) -> int:
    """Reduced (mmax=1) row count ``3L+1``."""
    return 3 * lmax + 1


def row_width(lmax: int, focus_dim: int) -> int:
    """``ROW = (3L+1)·Cf``."""
    return n_reduced(lmax) * focus_dim


def block_widths(lmax: int, focus_dim: int) -> tuple[int, int, int]:
    """``(M0, M1, LG) = ((L+1)·Cf, 2L·Cf, L·Cf)``."""
    return (lmax + 1) * focus_dim, 2 * lmax * focus_dim, lmax * focus_dim


def n_kernel_slots(lmax: int) -> int:
    """Compact degree-kernel slots ``K = (L+1)² + L²`` (m=0 block, then the shared |m|=1 block)."""
    return (lmax + 1) ** 2 + lmax**2


@cache
def reduced_to_packed(lmax: int) -> tuple[int, ...]:
    """Packed index of every reduced row: ``[l²+l | l²+l-1 (l≥1) | l²+l+1 (l≥1)]``."""
    m0 = [l * l + l for l in range(lmax + 1)]
    neg = [l * l + l - 1 for l in range(1, lmax + 1)]
    pos = [l * l + l + 1 for l in range(1, lmax + 1)]
    return tuple(m0 + neg + pos)


@cache
def reduced_row_degree(lmax: int) -> tuple[int, ...]:
    """Degree l of every reduced row: ``[0..L, 1..L, 1..L]``."""
    return tuple(list(range(lmax + 1)) + list(range(1, lmax + 1)) * 2)


ConstantValues = Sequence[float] | Sequence[Sequence[float]]


def device_constant(
    values: ConstantValues, device: torch.device | str, dtype: torch.dtype
) -> torch.Tensor:
    """A read-only tensor of the (nested tuple) ``values``, uploaded once per (values, device,
    dtype) and reused: building it per call would be a host→device copy, i.e. a stream sync
    that also breaks CUDA-graph capture. Callers must never write into it.

    While a fake/tracing mode is active the tensor is built afresh (a traced constant must not be
    cached); ``values`` must then be hashable tuples as well."""
    if torch.compiler.is_compiling() or any(
        isinstance(mode, FakeTensorMode) for mode in _get_current_dispatch_mode_stack()
    ):
        return torch.tensor(values, device=device, dtype=dtype)
    return _cached_constant(values, torch.device(device), dtype)


@cache
def _cached_constant(
    values: ConstantValues, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    # A normal (non-inference, grad-free) tensor even when first requested inside
    # torch.inference_mode, so a later autograd step may save it for backward.
    with torch.inference_mode(False), torch.no_grad():
        return torch.tensor(values, device=device, dtype=dtype)


def reduced_to_packed_tensor(lmax: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """:func:`reduced_to_packed` as a cached int64 device constant."""
    return device_constant(reduced_to_packed(lmax), device, torch.int64)


def check_regime(op: str, lmax: int, focus_dim: int) -> None:
    """The fused kernels cover lmax 1..6 and Cf in {32, 64, 96, 128}."""
    if lmax not in SUPPORTED_LMAX:
        raise ValueError(f"so2kernels.{op}: lmax must be in 1..6, got {lmax}")
    if focus_dim not in SUPPORTED_FOCUS_DIMS:
        raise ValueError(
            f"so2kernels.{op}: focus_dim must be one of {SUPPORTED_FOCUS_DIMS}, got {focus_dim}"
        )


def edge_major_to_channel_rows(x_local: torch.Tensor, lmax: int) -> torch.Tensor:
    """``(E, F, ROW)`` → ``(E, 3L+1, C_wide)`` with the wide channel ``c = f·Cf + cf``."""
    n_edge, n_focus, row = x_local.shape
    red = n_reduced(lmax)
    return (
        x_local.reshape(n_edge, n_focus, red, row // red)
        .permute(0, 2, 1, 3)
        .reshape(n_edge, red, n_focus * (row // red))
    )


def channel_rows_to_edge_major(rows: torch.Tensor, n_focus: int) -> torch.Tensor:
    """``(E, 3L+1, C_wide)`` → ``(E, F, ROW)``; inverse of :func:`edge_major_to_channel_rows`."""
    n_edge, red, c_wide = rows.shape
    focus_dim = c_wide // n_focus
    return (
        rows.reshape(n_edge, red, n_focus, focus_dim)
        .permute(0, 2, 1, 3)
        .reshape(n_edge, n_focus, red * focus_dim)
    )


@cache
def _rotate_back_rescale_values(lmax: int) -> tuple[float, ...]:
    # mmax = 1: rows of degree l > 1 are scaled by √((2l+1)/3) after rotating back.
    return tuple(
        max(1.0, ((2 * l + 1) / 3.0) ** 0.5) for l in range(lmax + 1) for _ in range(2 * l + 1)
    )


def rotate_back_rescale(
    lmax: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``(D,)`` inverse-rotation rescale of every packed row (1 for l ≤ 1), cached constant."""
    return device_constant(_rotate_back_rescale_values(lmax), device, dtype)


INT32_SPAN = 2**31
"""Offsets a kernel may form in int32: index × stride products of an operand's inner axes."""


def inner_offset_span(t: torch.Tensor) -> int:
    """Largest element offset inside one leading-axis slice of ``t``: Σ (size-1)·stride over
    every axis but the first (0 for an empty tensor)."""
    if t.numel() == 0:
        return 0
    inner = zip(t.shape[1:], t.stride()[1:], strict=True)
    return sum((size - 1) * stride for size, stride in inner)


def int32_inner_offsets(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy of it where its inner-axis offsets would overflow int32.

    Kernels that read an operand through its own strides form the edge (leading-axis) offset in
    int64 but the offsets inside an edge as int32 index × stride products, which is exact for
    any layout whose inner span is below 2³¹ elements. An exotic layout beyond that (e.g. a
    (E, J, C) view of a J-major buffer of more than 2³¹ elements) is copied once to the
    contiguous layout, whose inner span is the slice's size, rather than read wrong.
    """
    return t.contiguous() if inner_offset_span(t) >= INT32_SPAN else t
