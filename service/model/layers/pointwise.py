"""Elementwise helpers whose autograd costs fewer launches than the stock ops.

``torch.addcmul``'s derivative multiplies each factor by the (unit) ``value`` before the incoming
gradient, one extra full-size launch per differentiable factor; in the launch-bound step that is
pure overhead. :func:`multiply_add` keeps addcmul's single forward launch with the plain product
rule as its backward.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx


def multiply_add(base: Tensor, left: Tensor, right: Tensor) -> Tensor:
    """``base + left·right`` (broadcasting) in one launch; backward ``g``, ``g·right``,
    ``g·left`` (summed back to each input's shape), in differentiable ops so force training's
    double backward works."""
    out: Tensor = _MultiplyAdd.apply(base, left, right)  # type: ignore[no-untyped-call]
    return out


class _MultiplyAdd(torch.autograd.Function):
    @staticmethod
    def forward(base: Tensor, left: Tensor, right: Tensor) -> Tensor:
        return torch.addcmul(base, left, right)

    @staticmethod
    def setup_context(
        ctx: FunctionCtx, inputs: tuple[Tensor, Tensor, Tensor], output: Tensor
    ) -> None:
        base, left, right = inputs
        ctx.save_for_backward(left, right)
        ctx.shapes = (base.shape, left.shape, right.shape)  # type: ignore[attr-defined]

    @staticmethod
    def backward(
        ctx: FunctionCtx, grad: Tensor
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        left, right = ctx.saved_tensors  # type: ignore[attr-defined]
        base_shape, left_shape, right_shape = ctx.shapes  # type: ignore[attr-defined]
        wanted = ctx.needs_input_grad  # type: ignore[attr-defined]
        grad_base = grad.sum_to_size(base_shape) if wanted[0] else None
        grad_left = (grad * right).sum_to_size(left_shape) if wanted[1] else None
        grad_right = (grad * left).sum_to_size(right_shape) if wanted[2] else None
        return grad_base, grad_left, grad_right


def log_envelope_bias(logits: Tensor, env: Tensor) -> Tensor:
    """(E, K) ``logits + 2·log env[:, None]`` for ``env (E,) ≥ 0``: ``−inf`` where env = 0 (the
    edge drops out of the softmax), with zero gradient there.

    ``log(0) = −inf`` already, so the forward is two launches; the backward is the closed form
    ``Σ_k g_k · 2/env`` masked where env = 0, in differentiable ops of ``env`` (second order
    works). Autograd through a guarded log would take twice as many launches each way."""
    out: Tensor = _LogEnvelopeBias.apply(logits, env)  # type: ignore[no-untyped-call]
    return out


class _LogEnvelopeBias(torch.autograd.Function):
    @staticmethod
    def forward(logits: Tensor, env: Tensor) -> Tensor:
        return torch.add(logits, torch.log(env)[:, None], alpha=2.0)

    @staticmethod
    def setup_context(ctx: FunctionCtx, inputs: tuple[Tensor, Tensor], output: Tensor) -> None:
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        # Imported here: so2kernels' package import pulls in every Triton kernel.
        from so2kernels._layout import device_constant

        (env,) = ctx.saved_tensors  # type: ignore[attr-defined]
        wanted = ctx.needs_input_grad  # type: ignore[attr-defined]
        grad_env = None
        if wanted[1]:
            one = device_constant((1.0,), env.device, env.dtype)
            zero = device_constant((0.0,), env.device, env.dtype)
            active = env > 0.0
            # env/2 with a unit stand-in where env = 0: the quotient stays finite, then masked.
            half_env = torch.where(active, env * 0.5, one)
            grad_env = torch.where(active, grad.sum(dim=1) / half_env, zero)
        return (grad if wanted[0] else None), grad_env
