"""Radial functions of the edge length: C³ cutoff envelopes and radial bases (model-dpa4.md §2.2).

All are elementwise torch expressions, differentiable to any order, in the dtype of ``length``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

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
    """:func:`c3_envelope` for each of ``exponents``, in that order, sharing ``x``, ``u⁴`` and
    the series: summed in increasing powers, each truncation is a partial sum on the way, so
    every envelope costs one multiply beyond the longest series (few ops per edge cache)."""
    if not exponents or min(exponents) < 1:
        raise ValueError(f"envelope exponents must be >= 1, got {tuple(exponents)}")
    coefficients = envelope_coefficients(max(exponents))
    x = length / rcut
    u = torch.clamp(1.0 - x, min=0.0, max=1.0)
    u2 = u * u
    u4 = u2 * u2
    wanted = set(exponents)
    envelopes: dict[int, Tensor] = {1: u4} if 1 in wanted else {}
    series: Tensor | None = None
    power = x
    for k in range(1, len(coefficients)):
        if series is None:
            series = x * coefficients[k] + 1.0
        else:
            power = power * x
            series = torch.add(series, power, alpha=coefficients[k])
        if k + 1 in wanted:
            envelopes[k + 1] = u4 * series
    return [envelopes[p] for p in exponents]


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
