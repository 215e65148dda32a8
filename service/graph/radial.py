"""Radial functions of the edge length: C³ cutoff envelopes and radial bases (model-dpa4.md §2.2).

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
    """``E_p(r/rcut) = u⁴ · Σ_{k<p} C(k+3,3) x^k`` with ``x = r/rcut``, ``u = clamp(1-x, 0, 1)``.

    Equal to ``1 - O(x^p)`` near 0; value and first three derivatives vanish at ``rcut``, and it
    is exactly 0 (with zero gradient) beyond. Shape of ``length``.
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


@cache
def _series_table(
    exponents: tuple[int, ...], slopes: bool
) -> tuple[tuple[tuple[float, ...], ...], tuple[tuple[float], ...]]:
    """Coefficients ``(P', n)`` over ``x¹..xⁿ`` (``n = max p - 1``) of the series ``S_p``
    (and, with ``slopes``, of their derivatives ``S_p'``: P more rows) and their constant terms
    ``(P', 1)``, as nested tuples for :func:`so2kernels._layout.device_constant`."""
    coefficients = envelope_coefficients(max(exponents))
    n = len(coefficients) - 1
    rows = [tuple(coefficients[j] if j < p else 0.0 for j in range(1, n + 1)) for p in exponents]
    constants = [1.0] * len(exponents)
    if slopes:
        rows += [
            tuple((j + 1) * coefficients[j + 1] if j + 1 < p else 0.0 for j in range(1, n + 1))
            for p in exponents
        ]
        constants += [coefficients[1] if p > 1 else 0.0 for p in exponents]
    return tuple(rows), tuple((c,) for c in constants)


def _envelope_terms(
    length: Tensor, rcut: float, exponents: tuple[int, ...], *, slopes: bool
) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """The envelopes of ``exponents`` and (``slopes``) their derivatives ``dE_p/dr``, each of
    ``length``'s shape and contiguous; differentiable torch ops throughout (the closed-form
    backward reuses this under ``create_graph``)."""
    # Imported here: so2kernels' package import pulls in every Triton kernel.
    from so2kernels._layout import device_constant

    flat = length.reshape(-1)
    x = flat / rcut
    u = torch.clamp(1.0 - x, min=0.0, max=1.0)
    u2 = u * u
    u3 = u2 * u
    u4 = u3 * u
    count, n_terms = len(exponents), max(exponents) - 1
    if n_terms == 0:  # E_1 = u⁴: S = 1, S' = 0
        series = torch.cat([torch.ones_like(x), torch.zeros_like(x)]).view(2, -1)
    else:
        rows, constants = _series_table(exponents, slopes)
        table = device_constant(rows, x.device, x.dtype)  # (P', n)
        powers = x[:, None].expand(-1, n_terms).cumprod(dim=1)  # (E, n): x¹..xⁿ
        series = (table[:, None, :] * powers).sum(dim=-1) + device_constant(
            constants, x.device, x.dtype
        )
    values = u4 * series[:count]  # (P, E)
    envelopes = tuple(v.view(length.shape) for v in values.unbind(0))
    if not slopes:
        return envelopes, ()
    # dE/dx = u³ (u·S' + 4 S·du/dx), du/dx = -1 on 0 < x < 1 (u = 0 beyond, and u is clamped
    # to 1 for an unphysical x < 0, where only the S' term remains).
    falling = torch.where(x > 0.0, u3 * -4.0, 0.0)
    derivative = torch.addcmul(falling * series[:count], u4, series[count:]) / rcut
    return envelopes, tuple(d.view(length.shape) for d in derivative.unbind(0))


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


def initial_bessel_frequencies(
    n: int, rcut: float, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> Tensor:
    """(n,) ``k·π/rcut`` for k = 1..n: the initial (trainable) Bessel frequencies."""
    return torch.arange(1, n + 1, dtype=dtype, device=device) * (math.pi / rcut)


_SINC_SERIES_BELOW = 0.05
"""Below this |w r| the sinc uses its Taylor series (error < 1e-16 relative); above, the direct
quotient has no cancellation in its value."""


def _sinc(x: Tensor) -> Tensor:
    """``sin(x)/x`` with finite derivatives of every order at and near 0 (``torch.sinc``'s second
    derivative is NaN at 0)."""
    small = x.abs() < _SINC_SERIES_BELOW
    xs = torch.where(small, x, torch.zeros_like(x))
    x2 = xs * xs
    series = 1.0 - x2 / 6.0 * (1.0 - x2 / 20.0 * (1.0 - x2 / 42.0))
    xl = torch.where(small, torch.ones_like(x), x)
    return torch.where(small, series, torch.sin(xl) / xl)


def bessel_basis(length: Tensor, freqs: Tensor) -> Tensor:
    """(E, n) ``sin(w r)/r = w·sinc(w r)``: finite (→ w) at r → 0 with finite derivatives of
    every order. No ``√(2/rcut)`` prefactor and no envelope (the caller multiplies one)."""
    return freqs * _sinc(length.unsqueeze(-1) * freqs)


def gaussian_basis(length: Tensor, centers: Tensor, width: float | Tensor) -> Tensor:
    """(E, n) ``exp(-(r - μ)² / (2σ²))`` for centres μ (n,) and width σ."""
    diff = length.unsqueeze(-1) - centers
    return torch.exp(-(diff * diff) / (2.0 * width * width))


def initial_gaussian_centers(
    n: int, rcut: float, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> tuple[Tensor, float]:
    """(n,) centres ``linspace(0, rcut, n)`` and the width ``rcut/(n-1)``."""
    if n < 2:
        raise ValueError(f"a Gaussian basis needs n >= 2, got {n}")
    return torch.linspace(0.0, rcut, n, dtype=dtype, device=device), rcut / (n - 1)
