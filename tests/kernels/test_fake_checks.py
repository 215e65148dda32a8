"""Every op's fake (meta) registration refuses what the op refuses, with the op's message.

``torch.compile`` traces through the fakes: a shape the op would refuse must fail there, at
trace time and with the same sentence, not later inside a compiled graph.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import so2kernels  # noqa: F401  (registers the ops)

ops = torch.ops.so2kernels


def _segment_sum() -> object:
    return ops.segment_sum(torch.zeros(5, 3), torch.arange(4), torch.tensor([0, 2, 5]))


def _segment_broadcast() -> object:
    return ops.segment_broadcast(torch.zeros(3, 4), None, torch.tensor([0, 2, 5]), 5)


def _gated_act() -> object:
    z, gw = torch.zeros(1, 3, 7 * 32), torch.zeros(1, 32, 64)
    return ops.gated_act(z, gw, gw, 2, 32)  # gwt must be gw transposed


def _gated_act_bwd() -> object:
    z, gw = torch.zeros(1, 3, 7 * 32), torch.zeros(1, 32, 64)
    return ops.gated_act_bwd(torch.zeros(1, 2, 7 * 32), z, gw, gw.mT, 2, 32)


def _mixing_stack() -> object:
    u0 = torch.zeros(1, 3, 7 * 32)
    w0, w1, gw = torch.zeros(2, 1, 96, 96), torch.zeros(2, 1, 128, 128), torch.zeros(1, 1, 32, 64)
    return ops.so2_mixing_stack(u0, torch.zeros(1, 3), w0, w1, gw, 2, 32, True, "ieee")


def _mixing_stack_precision() -> object:
    u0 = torch.zeros(1, 3, 7 * 32)
    w0, w1, gw = torch.zeros(2, 1, 96, 96), torch.zeros(2, 1, 128, 128), torch.zeros(1, 1, 32, 64)
    return ops.so2_mixing_stack(u0, torch.zeros(3, 1), w0, w1, gw, 2, 32, True, "tf32")


CASES: dict[str, tuple[Callable[[], object], str]] = {
    "segment_sum": (_segment_sum, "order has 4 entries but there are 5 rows"),
    "segment_broadcast": (_segment_broadcast, "values has 3 rows but row_ptr describes 2"),
    "gated_act": (_gated_act, "gwt must be gw.transpose"),
    "gated_act_bwd": (_gated_act_bwd, "grad must have z's shape"),
    "so2_mixing_stack": (_mixing_stack, "alpha must have shape"),
    "so2_mixing_stack precision": (_mixing_stack_precision, "unknown stack precision"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fake_refuses_what_the_op_refuses(name: str) -> None:
    call, message = CASES[name]
    with pytest.raises(ValueError, match=message):
        call()
    with FakeTensorMode(), pytest.raises(ValueError, match=message):
        call()
