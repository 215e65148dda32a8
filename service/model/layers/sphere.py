"""Real spherical harmonics in e3nn's convention and the Lebedev grid projectors of the S2 FFN.

The S2-grid GLU (model-dpa4.md §4.3) evaluates packed coefficients on a Lebedev grid with e3nn's
real spherical harmonics ("norm" normalisation: ``Σ_m Y_lm(r̂)² = 1``) at the raw grid points. e3nn
is only a test dependency, so the harmonics are built here: e3nn's basis is the textbook real
tesseral basis (no Condon–Shortley phase) with the polar axis along y, i.e.
``Y_e3nn(x, y, z) = Y_tesseral(z, x, y)`` (checked against e3nn in tests/model/test_sphere.py).
Everything here runs once per model in float64 NumPy; the results are constant buffers.
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np
from numpy.polynomial import legendre as npleg
from scipy.integrate import lebedev_rule

_LEBEDEV_ORDERS = (3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31, 35, 41, 47, 53)


def _tesseral_norm(points: np.ndarray, lmax: int) -> np.ndarray:
    """Real tesseral harmonics, z polar, no Condon–Shortley phase, ``Σ_m Y² = 1`` per degree.

    ``points (G, 3)`` unit vectors → ``(G, (L+1)²)`` packed ``m = -l..l``.
    """
    x, y, z = points[:, 0], points[:, 1], points[:, 2]
    xy = x + 1j * y
    out = np.zeros((points.shape[0], (lmax + 1) ** 2))
    for l in range(lmax + 1):
        legendre_l = np.zeros(l + 1)
        legendre_l[l] = 1.0
        for m in range(l + 1):
            # P_l^m(z) = (1-z²)^{m/2} d^m P_l/dz^m, and (1-z²)^{m/2} e^{imφ} = (x+iy)^m on the
            # unit sphere, so the harmonics are polynomials (exact at the poles).
            deriv = npleg.legval(z, npleg.legder(legendre_l, m)) if m <= l else 0.0
            norm = math.sqrt(math.factorial(l - m) / math.factorial(l + m))
            azimuth = xy**m
            if m == 0:
                out[:, l * l + l] = norm * deriv
            else:
                out[:, l * l + l + m] = math.sqrt(2.0) * norm * deriv * azimuth.real
                out[:, l * l + l - m] = math.sqrt(2.0) * norm * deriv * azimuth.imag
    return out


def e3nn_harmonics_norm(points: np.ndarray, lmax: int) -> np.ndarray:
    """e3nn ``spherical_harmonics(range(L+1), p, normalize=True, normalization="norm")``."""
    unit = points / np.linalg.norm(points, axis=1, keepdims=True)
    return _tesseral_norm(unit[:, [2, 0, 1]], lmax)


def lebedev_order_for(lmax: int) -> int:
    """Smallest Lebedev rule exact for degree ``3L`` (the GLU integrand Y_a·Y_b·Y_out)."""
    for order in _LEBEDEV_ORDERS:
        if order >= 3 * lmax:
            return order
    raise ValueError(f"no Lebedev rule for lmax={lmax}")


@cache
def s2_grid_projectors(lmax: int) -> tuple[np.ndarray, np.ndarray]:
    """``(to_grid (G, D), from_grid (D, G))`` in float64.

    ``to_grid = Y/√(L+1)`` and ``from_grid = (Y·w·√(L+1)·(2l+1))ᵀ`` with weights summing to 1, so
    ``from_grid @ to_grid = I`` on degrees ≤ L (DeePMD's scaling, model-dpa4.md §4.3).
    """
    points, weights = lebedev_rule(lebedev_order_for(lmax))
    points = np.asarray(points).T
    weights = np.asarray(weights) / np.sum(weights)
    harmonics = e3nn_harmonics_norm(points, lmax)
    degree = np.repeat(np.arange(lmax + 1), 2 * np.arange(lmax + 1) + 1)
    scale = math.sqrt(lmax + 1)
    to_grid = harmonics / scale
    from_grid = (harmonics * weights[:, None] * scale * (2 * degree + 1)[None, :]).T
    return to_grid, from_grid
