"""Cross-op operand handling of the fused ``so2kernels`` ops: index tensors in strided views (a
column of an edge table), mis-shaped cotangents of the standalone backward ops, clear errors.

Every fused-path case compares against the op's own eager reference fed the same values.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

import so2kernels
from so2kernels import (
    segment_broadcast,
    segment_broadcast_reference,
    segment_outer_sum,
    segment_outer_sum_reference,
    segment_sum,
    segment_sum_reference,
    so2_mixing_stack,
)
from so2kernels._dispatch import UnsupportedInputError, use_triton
from so2kernels.aggregate import attention_aggregate, attention_aggregate_reference
from so2kernels.gated_act import gated_act_backward
from so2kernels.mixing_stack_backward import mixing_stack_backward
from so2kernels.rotate_mix import rotate_mix, rotate_mix_reference
from so2kernels.segment import csr_from_index

fused_only = pytest.mark.skipif(
    not use_triton(torch.empty(1)), reason="CPU operands take the fused path under the interpreter"
)


def column_of_pairs(index: torch.Tensor) -> torch.Tensor:
    """The same int64 values as a stride-2 view: column 0 of an (n, 2) pair table, the way
    ``edge_index[:, 0]`` of an edge-major edge list arrives. The other column is 0, a valid id
    and offset, so a kernel that ignores the stride reads wrong but in-range entries (a large
    filler crashes the interpreter with a segfault: out-of-bounds gathers)."""
    pairs = torch.stack([index, torch.zeros_like(index)], dim=1)
    view = pairs[:, 0]
    assert view.stride() == (2,) and torch.equal(view, index)
    return view


def assert_close_to(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    assert bool(torch.isfinite(got).all()), "non-finite values"
    scale = max(want.abs().max().item(), 1e-30) if want.numel() else 1.0
    err = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
    assert err <= rtol * scale, f"max abs err {err:.3e} > {rtol:.0e} x {scale:.3e}"


# 1. Non-contiguous int64 index tensors pass the checks (1-D, int64) and are then read by the
#    kernels as if unit-stride: wrong values and gradients, and reads past the index storage.


@fused_only
@pytest.mark.parametrize("strided", ["order", "row_ptr"])
def test_segment_ops_read_strided_index_tensors(strided: str) -> None:
    order, row_ptr = csr_from_index(torch.tensor([2, 0, 1, 2, 0, 0, 1, 2, 2]), 3)
    args = {"order": order, "row_ptr": row_ptr}
    args[strided] = column_of_pairs(args[strided])
    rows, values = torch.randn(9, 5), torch.randn(3, 5)
    assert_close_to(
        segment_sum(rows, args["order"], args["row_ptr"]),
        segment_sum_reference(rows, order, row_ptr),
    )
    assert_close_to(
        segment_broadcast(values, args["order"], args["row_ptr"]),
        segment_broadcast_reference(values, order, row_ptr),
    )


@fused_only
@pytest.mark.parametrize("strided", ["src", "src_order", "src_rowptr"])
def test_rotate_mix_reads_strided_index_tensors(strided: str) -> None:
    lmax, n_focus, focus_dim, rank = 1, 1, 32, 1
    dim, n_node, n_edge = 4, 4, 9
    src = torch.tensor([1, 0, 3, 1, 1, 0, 2, 3, 1])
    order, row_ptr = csr_from_index(src, n_node)
    graph = {"src": src, "src_order": order, "src_rowptr": row_ptr}
    graph[strided] = column_of_pairs(graph[strided])
    x = torch.randn(n_node, dim, focus_dim, dtype=torch.float64)
    wigner = torch.randn(n_edge, dim, dim, dtype=torch.float64)
    kc = torch.randn(n_edge, 5 * rank, dtype=torch.float64)
    cb = torch.randn(rank, focus_dim, dtype=torch.float64)
    x32 = x.float().requires_grad_()
    got = rotate_mix(
        x32, graph["src"], graph["src_order"], graph["src_rowptr"], wigner.float(), kc.float(),
        cb.float(), lmax, n_focus, rank,
    )  # fmt: skip
    x64 = x.clone().requires_grad_()
    want = rotate_mix_reference(x64, src, order, row_ptr, wigner, kc, cb, lmax, n_focus, rank)
    assert_close_to(got, want)
    cotangent = torch.randn(want.shape, dtype=torch.float64)
    (grad_got,) = torch.autograd.grad(got, x32, cotangent.float())
    (grad_want,) = torch.autograd.grad(want, x64, cotangent)
    assert_close_to(grad_got, grad_want)


@fused_only
def test_attention_aggregate_reads_strided_dst_rowptr() -> None:
    lmax, focus_dim = 1, 32
    row_ptr = torch.tensor([0, 3, 3, 7, 9])
    x_local = torch.randn(9, 1, 4 * focus_dim)
    wigner = torch.randn(9, 4, 4)
    weights = torch.rand(9, 1)
    got = attention_aggregate(x_local, wigner, weights, column_of_pairs(row_ptr), lmax)
    want = attention_aggregate_reference(x_local, wigner, weights, row_ptr, lmax)
    assert_close_to(got, want)


@fused_only
@pytest.mark.parametrize("strided", ["row_map", "dst_rowptr"])
def test_segment_outer_sum_reads_strided_index_tensors(strided: str) -> None:
    row_map, row_ptr = torch.tensor([2, 0, 1, 2]), torch.tensor([0, 3, 3, 7, 9])
    index = {"row_map": row_map, "dst_rowptr": row_ptr}
    index[strided] = column_of_pairs(index[strided])
    a, b = torch.randn(9, 4), torch.randn(9, 3, 16)
    a_got = a.clone().requires_grad_()
    got = segment_outer_sum(a_got, b, index["row_map"], index["dst_rowptr"])
    a_want = a.clone().requires_grad_()
    want = segment_outer_sum_reference(a_want, b, row_map, row_ptr)
    assert_close_to(got, want)
    cotangent = torch.randn(want.shape)
    (grad_got,) = torch.autograd.grad(got, a_got, cotangent)
    (grad_want,) = torch.autograd.grad(want, a_want, cotangent)
    assert_close_to(grad_got, grad_want)


# 2. The standalone backward ops accept mis-shaped cotangents / operands without a ValueError.


def _stack_outputs() -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(0)
    lmax, focus_dim, n_focus, n_edge, n_layers = 1, 32, 1, 3, 2
    m0, m1, gate = (lmax + 1) * focus_dim, 2 * lmax * focus_dim, lmax * focus_dim
    u0 = torch.randn(n_focus, n_edge, m0 + m1, generator=gen)
    alpha = torch.full((n_edge, n_focus), 0.5)
    w0 = torch.randn(n_layers, n_focus, m0, m0, generator=gen) / math.sqrt(m0)
    w1 = torch.randn(n_layers, n_focus, m1, m1, generator=gen) / math.sqrt(m1)
    gw = torch.randn(n_layers - 1, n_focus, focus_dim, gate, generator=gen) / math.sqrt(focus_dim)
    operands = (u0, alpha, w0, w1, gw)
    return operands, tuple(so2_mixing_stack(*operands, lmax, focus_dim, True))


@pytest.mark.parametrize("bad", ["grad_u", "grad_z"])
def test_mixing_stack_bwd_rejects_mis_shaped_cotangents(bad: str) -> None:
    """A (ROW,) cotangent is refused by a check naming it (it used to be broadcast over every
    edge and focus; for grad_z, every layer added the same row)."""
    (u0, alpha, w0, w1, gw), (x_local, z_all, u_final) = _stack_outputs()
    extra: dict[str, torch.Tensor | None] = {"grad_z": None, "grad_u": None}
    extra[bad] = torch.randn(u0.shape[-1])
    with pytest.raises(ValueError, match=bad):
        mixing_stack_backward(
            torch.randn_like(x_local), z_all, u_final, alpha, u0, w0, w1, gw,
            extra["grad_z"], extra["grad_u"], 1, 32, True, True,
        )  # fmt: skip


def test_mixing_stack_bwd_rejects_focus_major_grad_out() -> None:
    """grad_out must be edge-major (E, F, ROW): a focus-major (F, E, ROW) one is refused by a
    check naming it (it used to broadcast against x_local, or die in an unrelated
    RuntimeError)."""
    (u0, alpha, w0, w1, gw), (_, z_all, u_final) = _stack_outputs()
    with pytest.raises(ValueError, match="grad_out"):
        mixing_stack_backward(
            torch.randn(u0.shape), z_all, u_final, alpha, u0, w0, w1, gw, None, None,
            1, 32, True, True,
        )  # fmt: skip


def _gate_operands() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lmax, focus_dim = 2, 32
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(1, 3, 7 * focus_dim, generator=gen)
    gw = torch.randn(1, focus_dim, lmax * focus_dim, generator=gen) / math.sqrt(focus_dim)
    return z, gw, torch.randn(z.shape, generator=gen)


def test_gated_act_bwd_rejects_mis_shaped_gwt() -> None:
    """The backward op checks ``gwt`` like the forward (given ``gw`` itself, (F, Cf, LG) instead
    of (F, LG, Cf), it used to return wrong gradients)."""
    z, gw, grad = _gate_operands()
    with pytest.raises(ValueError, match="gwt"):
        gated_act_backward(grad, z, gw, gw, 2, 32)


def test_gated_act_bwd_rejects_mis_shaped_grad() -> None:
    """A cotangent with fewer edges than ``z`` is refused (the fused path used to read past
    it)."""
    z, gw, _ = _gate_operands()
    with pytest.raises(ValueError, match="grad"):
        gated_act_backward(torch.randn(1, 2, z.shape[2]), z, gw, gw.mT.contiguous(), 2, 32)


# 3. Clear errors.


def test_segment_sum_zero_dim_rows_raise_value_error() -> None:
    order, row_ptr = csr_from_index(torch.tensor([0, 1]), 2)
    with pytest.raises(ValueError, match="rows"):
        segment_sum(torch.tensor(1.0), order, row_ptr)


@fused_only
def test_dtype_refusal_names_an_existing_reference_module() -> None:
    """The fp32 refusal points the caller at a reference that exists."""
    row_ptr = torch.tensor([0, 1, 2])
    a, b = torch.randn(2, 1, dtype=torch.float64), torch.randn(2, 1, 4, dtype=torch.float64)
    with pytest.raises(UnsupportedInputError) as info:
        segment_outer_sum(a, b, torch.tensor([0]), row_ptr)
    named = re.findall(r"so2kernels\.([A-Za-z_]\w*)", str(info.value))
    assert "rotate_mix_reference" in named
    assert all(hasattr(so2kernels, name) for name in named), named
