"""C³ cutoff envelopes of the edge length (model-dpa4.md §2.2). The radial bases they multiply
are the model's (trainable): :class:`service.model.layers.embedding.RadialBasis`.

All are elementwise torch expressions, differentiable to any order, in the dtype of ``length``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cache

import torch
from torch import Tensor


def envelope_coefficients(exponent: int) -> list[float]:
    """``C(k+3, 3)`` for k = 0..p-1: the truncated series of ``(1-x)^-4`` (1, 4, 10, 20, 35, …)."""
    if exponent < 1:
        raise ValueError(f"envelope exponent must be >= 1, got {exponent}")
    return [float(math.comb(k + 3, 3)) for k in range(exponent)]


def c3_envelope(length: Tensor, rcut: float, exponent: int) -> Tensor:
    """``E_p(r/rcut) = u⁴ · Σ_{k<p} C(k+3,3) x^k`` with ``x = r/rcut``, ``u = max(1-x, 0)``.

    Equal to ``1 - O(x^p)`` near 0; value and first three derivatives vanish at ``rcut``, and it
    is exactly 0 (with zero gradient) beyond. Shape of ``length`` (r ≥ 0, where ``u`` equals
    the spec's ``clamp(1-x, 0, 1)``).
    """
    return c3_envelopes(length, rcut, (exponent,))[0]


def c3_envelopes(length: Tensor, rcut: float, exponents: Sequence[int]) -> list[Tensor]:
    """:func:`c3_envelope` for each of ``exponents``, in that order, contiguous, sharing ``x``,
    ``u⁴`` and the powers of ``x``; all series are one product and one sum over a coefficient
    table. Under autograd the derivative is closed form (see :class:`_C3Envelopes`): one
    multiply-add per envelope in the backward instead of the series' chain rule."""
    if not exponents or min(exponents) < 1:
        raise ValueError(f"envelope exponents must be >= 1, got {tuple(exponents)}")
    wanted = tuple(exponents)
    if length.requires_grad and torch.is_grad_enabled():
        outputs: tuple[Tensor, ...] = _C3Envelopes.apply(length, rcut, wanted)  # type: ignore[no-untyped-call]
        return list(outputs[: len(wanted)])
    return list(_envelope_terms(length, rcut, wanted, slopes=False)[0])


def envelope_slope_coefficient(exponent: int) -> float:
    """``c_p`` in ``dE_p/dx = c_p · x^(p-1) · (1-x)³`` on ``0 ≤ x ≤ 1``: ``-p·C(p+3, 3)``.

    ``(1-x)⁴ S_p(x) = 1 - O(x^p)`` is ``1 - I_x(p, 4)`` (the regularised incomplete beta
    function), whose derivative is the beta density ``x^(p-1) (1-x)³ / B(p, 4)``."""
    return -float(exponent * math.comb(exponent + 3, 3))


@cache
def _series_table(
    exponents: tuple[int, ...], rcut: float, slopes: bool
) -> tuple[tuple[float, ...], ...]:
    """Coefficients ``(P', n)`` over ``x⁰..x^(n-1)`` (``n = max p``), as nested tuples for
    :func:`so2kernels._layout.device_constant`: the series ``S_p`` of each exponent, then
    (``slopes``) the one-term rows ``(c_p/rcut)·x^(p-1)``, so one GEMM on the powers of x gives
    every series and every slope polynomial."""
    n = max(exponents)
    coefficients = envelope_coefficients(n)
    rows = [tuple(coefficients[j] if j < p else 0.0 for j in range(n)) for p in exponents]
    if slopes:
        rows += [
            tuple(envelope_slope_coefficient(p) / rcut if j == p - 1 else 0.0 for j in range(n))
            for p in exponents
        ]
    return tuple(rows)


_POWERS_OF_U = ((4.0,), (3.0,))
"""Exponents of ``u`` multiplying the series (``u⁴``) and the slope polynomials (``u³``)."""


def _envelope_terms(
    length: Tensor, rcut: float, exponents: tuple[int, ...], *, slopes: bool
) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """The envelopes of ``exponents`` and (``slopes``) their derivatives ``dE_p/dr``, each of
    ``length``'s shape and contiguous; differentiable torch ops throughout (the closed-form
    backward reuses this under ``create_graph``).

    Seven elementwise/GEMM launches whatever the number of envelopes: the powers of ``x`` and of
    ``u`` are one ``pow`` each against a constant exponent column (no scan), the series and slope
    polynomials one GEMM (the constant terms ride on ``x⁰``, so no bias copy; positive terms only
    for x ≥ 0: no cancellation), and one product applies ``u⁴`` and ``u³``. Lengths are never
    negative; for ``x < 0`` the envelope is the polynomial ``(1-x)⁴ S_p(x)`` itself (``u`` is
    clamped at 0 only), so the slope stays its exact derivative everywhere.
    """
    # Imported here: so2kernels' package import pulls in every Triton kernel.
    from so2kernels._layout import device_constant

    device, dtype = length.device, length.dtype
    flat = length.reshape(-1)
    x = flat / rcut
    u = torch.clamp(1.0 - x, min=0.0)
    table = device_constant(_series_table(exponents, rcut, slopes), device, dtype)  # (P', n)
    # Powers by pow, not repeated products (a scan): pow's backward masks zero exponents, so
    # x^k and u^k have finite derivatives of every order at 0.
    x_exponents = device_constant(tuple((float(k),) for k in range(table.shape[1])), device, dtype)
    series = table @ x[None, :].pow(x_exponents)  # (P', n) @ (n, E)
    parts = 2 if slopes else 1
    u_powers = u[None, :].pow(device_constant(_POWERS_OF_U[:parts], device, dtype))  # (parts, E)
    terms = series.view(parts, len(exponents), -1) * u_powers[:, None, :]  # (parts, P, E)
    envelopes = tuple(v.view(length.shape) for v in terms[0].unbind(0))
    if not slopes:
        return envelopes, ()
    return envelopes, tuple(d.view(length.shape) for d in terms[1].unbind(0))


class _C3Envelopes(torch.autograd.Function):
    """Envelopes whose backward is ``g_r = Σ_p g_p · dE_p/dr`` with the slopes saved by the
    forward; under ``create_graph`` the slopes are re-derived from ``length`` in differentiable
    ops, so the gradient is differentiable again (every order stays closed form)."""

    @staticmethod
    def forward(length: Tensor, rcut: float, exponents: tuple[int, ...]) -> tuple[Tensor, ...]:
        envelopes, slopes = _envelope_terms(length, rcut, exponents, slopes=True)
        return (*envelopes, *slopes)

    @staticmethod
    def setup_context(
        ctx: torch.autograd.function.FunctionCtx,
        inputs: tuple[Tensor, float, tuple[int, ...]],
        output: tuple[Tensor, ...],
    ) -> None:
        length, rcut, exponents = inputs
        slopes = output[len(exponents) :]
        ctx.mark_non_differentiable(*slopes)
        ctx.save_for_backward(length, *slopes)
        ctx.rcut, ctx.exponents = rcut, exponents  # type: ignore[attr-defined]
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, *grads: Tensor | None
    ) -> tuple[Tensor | None, None, None]:
        length, *slopes = ctx.saved_tensors  # type: ignore[attr-defined]
        if torch.is_grad_enabled():
            slopes = list(_envelope_terms(length, ctx.rcut, ctx.exponents, slopes=True)[1])  # type: ignore[attr-defined]
        total: Tensor | None = None
        for grad, slope in zip(grads[: len(slopes)], slopes, strict=True):
            if grad is not None:
                total = grad * slope if total is None else torch.addcmul(total, grad, slope)
        return total, None, None
