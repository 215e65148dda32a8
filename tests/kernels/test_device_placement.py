"""Ops on a CUDA device that is not the current one, and operands split across devices.

Triton launches on the current device; the ops make their operands' device current for the
launch. These tests need two GPUs.
"""

from __future__ import annotations

import pytest
import torch
from test_mixing_stack import make_operands as stack_operands
from test_rotate_mix import Case
from test_rotate_mix import make_operands as rotate_operands

from so2kernels._dispatch import UnsupportedInputError
from so2kernels.mixing_stack import so2_mixing_stack
from so2kernels.rotate_mix import rotate_mix
from so2kernels.segment import csr_from_index, segment_sum

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


@pytest.mark.gpu
@two_gpus
def test_operands_on_two_gpus_are_refused() -> None:
    rows = torch.randn(6, 4, device="cuda:0")
    order, row_ptr = csr_from_index(torch.tensor([0, 1, 1, 2, 0, 2]), 3)
    with pytest.raises(UnsupportedInputError, match="different devices"):
        segment_sum(rows, order.to("cuda:1"), row_ptr.to("cuda:1"))


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("precision", ["ieee", "fp16x3"])
def test_ops_on_the_second_gpu_match_the_first(precision: str) -> None:
    torch.cuda.set_device(0)
    results = []
    for device in ("cuda:0", "cuda:1"):
        ops = [t.requires_grad_(True) for t in stack_operands(2, 64, 2, 1000, 3, device=device)]
        x_local, z_all, u_final = so2_mixing_stack(*ops, 2, 64, True, precision=precision)
        (grad_u0,) = torch.autograd.grad(x_local.square().sum(), ops[0])
        rot = rotate_operands(Case(lmax=2, focus_dim=64, n_focus=2, rank=1), device=device)
        x = rot.x.requires_grad_(True)
        u0 = rotate_mix(x, *rot.args()[1:])
        (grad_x,) = torch.autograd.grad(u0.square().sum(), x)
        summed = segment_sum(u0[0], rot.src_order, rot.src_rowptr)  # (E, ROW) per source
        outputs = [x_local, z_all, u_final, grad_u0, u0, grad_x, summed]
        assert all(t.device == torch.device(device) for t in outputs)
        results.append([t.detach().cpu() for t in outputs])
        assert torch.cuda.current_device() == 0
    for first, second in zip(*results, strict=True):
        torch.testing.assert_close(second, first, rtol=0, atol=0)
