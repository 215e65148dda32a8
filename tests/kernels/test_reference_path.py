"""Every op on CPU tensors without the interpreter: it runs its eager reference (bitwise the
reference's result, no kernel launch) and returns what its fake promises (``opcheck``), also
for permuted operands, whose reference results may come out non-contiguous."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import test_aggregate as agg
import test_gated_act as act
import test_mixing_stack as stack
import test_outer_sum as outer
import test_rotate_mix as rot
import torch

from so2kernels import _dispatch
from so2kernels.aggregate import (
    attention_aggregate_backward_reference,
    attention_aggregate_reference,
)
from so2kernels.gated_act import gated_act_backward_reference, gated_act_reference
from so2kernels.mixing_stack import mixing_stack_reference
from so2kernels.mixing_stack_backward import StackBwdArgs, mixing_stack_backward_reference
from so2kernels.outer_sum import (
    segment_outer_sum_backward_reference,
    segment_outer_sum_reference,
)
from so2kernels.rotate_mix import rotate_mix_reference
from so2kernels.rotate_mix_backward import rotate_mix_backward_reference
from so2kernels.segment import (
    csr_from_index,
    segment_broadcast_reference,
    segment_sum_reference,
)

ops = torch.ops.so2kernels


@pytest.fixture(autouse=True)
def _reference_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_dispatch, "INTERPRET", False)
    assert not _dispatch.use_triton(torch.empty(1))


def permuted(t: torch.Tensor) -> torch.Tensor:
    """Same values and shape, last two axes stored transposed (dense, not contiguous)."""
    return t.mT.contiguous().mT if t.dim() >= 2 else t


def _check(
    op: Any, args: tuple[Any, ...], reference: Callable[..., Any], ref_args: tuple[Any, ...]
) -> None:
    got = op(*args)
    want = reference(*ref_args)
    for g, w in zip(
        *(o if isinstance(o, tuple | list) else (o,) for o in (got, want)), strict=True
    ):
        assert g.is_contiguous() and torch.equal(g, w)
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("layout", [lambda t: t, permuted], ids=["contiguous", "permuted"])
@pytest.mark.parametrize("rank", [0, 1, 3])
def test_rotate_mix(rank: int, layout: Callable[[torch.Tensor], torch.Tensor]) -> None:
    o = rot.make_operands(rot.Case(2, 2, 32, rank, n_node=3, n_edge=5))
    args = (layout(o.x), o.src, o.src_order, o.src_rowptr, layout(o.wigner), layout(o.kc),
            layout(o.cb), 2, 2, rank)  # fmt: skip
    _check(ops.so2_rotate_mix.default, args, rotate_mix_reference, args)
    grad_u = layout(torch.randn(2, 5, 7 * 32))
    _check(
        ops.so2_rotate_mix_bwd.default, (grad_u, *args, True),
        lambda *a: rotate_mix_backward_reference(*a[:11], want_cb=True), (grad_u, *args),
    )  # fmt: skip


@pytest.mark.parametrize("layout", [lambda t: t, permuted], ids=["contiguous", "permuted"])
def test_segment_sum_and_broadcast(layout: Callable[[torch.Tensor], torch.Tensor]) -> None:
    index = torch.tensor([2, 0, 2, 3, 0, 2, 3])
    order, row_ptr = csr_from_index(index, 5)
    rows = layout(torch.randn(7, 3, 4))
    _check(ops.segment_sum.default, (rows, order, row_ptr), segment_sum_reference,
           (rows, order, row_ptr))  # fmt: skip
    values = layout(torch.randn(5, 3, 4))
    _check(ops.segment_broadcast.default, (values, order, row_ptr, 7),
           segment_broadcast_reference, (values, order, row_ptr, 7))  # fmt: skip


@pytest.mark.parametrize("layout", [lambda t: t, permuted], ids=["contiguous", "permuted"])
def test_segment_outer_sum(layout: Callable[[torch.Tensor], torch.Tensor]) -> None:
    a, b, row_map, rowptr = outer.make_operands([2, 0, 2], 3, 16, [3, 0, 4])
    args = (layout(a), layout(b), row_map, rowptr)
    _check(ops.segment_outer_sum.default, args, segment_outer_sum_reference, args)
    grad_out = layout(torch.randn(3, 3, 16))
    _check(ops.segment_outer_sum_bwd.default, (grad_out, *args),
           segment_outer_sum_backward_reference, (grad_out, *args))  # fmt: skip


@pytest.mark.parametrize("layout", [lambda t: t, permuted], ids=["contiguous", "permuted"])
def test_attention_aggregate(layout: Callable[[torch.Tensor], torch.Tensor]) -> None:
    x_local, wigner, weights, rowptr = agg.make_operands(2, 32, 2, 2, [3, 0, 4], 16)
    args = (layout(x_local), layout(wigner), layout(weights), rowptr, 2)
    _check(ops.so2_attention_aggregate.default, args, attention_aggregate_reference, args)
    grad_out = layout(torch.randn(3, 9, 64))
    _check(ops.so2_attention_aggregate_bwd.default, (grad_out, *args),
           attention_aggregate_backward_reference, (grad_out, *args))  # fmt: skip


@pytest.mark.parametrize("layout", [lambda t: t, permuted], ids=["contiguous", "permuted"])
def test_gated_act(layout: Callable[[torch.Tensor], torch.Tensor]) -> None:
    z, gw, gwt = act._operands(2, 32, 2, 5)
    args = (layout(z), layout(gw), gwt, 2, 32)
    _check(ops.gated_act.default, args, gated_act_reference, args)
    grad = layout(torch.randn_like(z))
    _check(ops.gated_act_bwd.default, (grad, *args),
           lambda g, z_, w, _t, lm, fd: gated_act_backward_reference(g, z_, w, lm, fd),
           (grad, *args))  # fmt: skip


@pytest.mark.parametrize("layout", [lambda t: t, permuted], ids=["contiguous", "permuted"])
@pytest.mark.parametrize("n_layers", [1, 2])
def test_mixing_stack(n_layers: int, layout: Callable[[torch.Tensor], torch.Tensor]) -> None:
    tensors = tuple(layout(t) for t in stack.make_operands(2, 32, 2, 5, n_layers))
    args = (*tensors, 2, 32, True, "ieee")
    _check(ops.so2_mixing_stack.default, args, mixing_stack_reference, args[:-1])
    x_local, z_all, u_final = mixing_stack_reference(*tensors, 2, 32, True)
    u0, alpha, *weights = tensors
    bwd_args = (layout(torch.randn_like(x_local)), z_all, u_final, alpha, u0, *weights,
                None, None, 2, 32, True, True)  # fmt: skip
    _check(ops.so2_mixing_stack_bwd.default, (*bwd_args, "ieee"),
           lambda *a: mixing_stack_backward_reference(StackBwdArgs(*a)), bwd_args)  # fmt: skip
