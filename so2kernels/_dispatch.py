"""Where an op runs: Triton (CUDA, or CPU under ``TRITON_INTERPRET=1``) or its eager reference.

One place decides, so every op answers the same way. ``TRITON_INTERPRET`` is read when
``@triton.jit`` runs, so it must be set before ``so2kernels`` is imported (tests/conftest.py does).
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext

import torch

INTERPRET: bool = os.environ.get("TRITON_INTERPRET") == "1"

if INTERPRET:
    # Under the interpreter wrap_triton() returns the raw interpreted kernel, so AOT tracing
    # must treat our triton_ops as opaque (see the triton-on-cpu notes in the README).
    import torch._functorch.config as _functorch_config

    _functorch_config.decompose_custom_triton_ops = False


def triton_available() -> bool:
    """True when Triton kernels can run at all (a CUDA driver, or the CPU interpreter)."""
    if INTERPRET:
        return True
    from torch.utils._triton import has_triton

    return bool(has_triton())


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether an op on these tensors takes the Triton path.

    CUDA tensors go to Triton; CPU tensors only under the interpreter. Everything else runs the
    eager reference of identical semantics.
    """
    if not tensors:
        return False
    if all(t.is_cuda for t in tensors):
        devices = {t.device for t in tensors}
        if len(devices) > 1:
            raise UnsupportedInputError(
                f"so2kernels: operands on different devices ({', '.join(map(str, devices))}); "
                "move them to one device"
            )
        return triton_available()
    return INTERPRET and all(t.device.type == "cpu" for t in tensors)


def launch_device(t: torch.Tensor) -> AbstractContextManager[object]:
    """Make ``t``'s CUDA device current for a Triton launch.

    Triton launches on the *current* device and stream, not on its operands' device (torch's
    own ops switch devices for themselves): without this, operands on ``cuda:1`` while
    ``cuda:0`` is current would be handed to a kernel running on ``cuda:0``.
    """
    if not t.is_cuda or t.device.index == torch.cuda.current_device():
        return nullcontext()
    return torch.cuda.device(t.device)


class UnsupportedInputError(ValueError):
    """The fused path cannot take these inputs (dtype, shape regime); the message says why."""


def require_fp32(op: str, **tensors: torch.Tensor) -> None:
    """The fused kernels accumulate in fp32 with IEEE dots and refuse anything else."""
    for name, t in tensors.items():
        if t.dtype != torch.float32:
            raise UnsupportedInputError(
                f"so2kernels.{op}: the fused path needs float32 for '{name}', got {t.dtype}; "
                f"call its eager reference (so2kernels.<op>_reference, e.g. "
                f"so2kernels.rotate_mix_reference) for other dtypes"
            )
