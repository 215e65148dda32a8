"""Edge frames and real Wigner-D matrices in the exact basis of model-dpa4.md §2.3.

Conventions (load-bearing for checkpoints):

* :func:`edge_quaternion` gives the global→local rotation that maps ``r̂`` to **+z**: two exact
  charts ``q₊ ∝ (1+ẑ, ŷ, −x̂, 0)`` (singular only at −z) and ``q₋ ∝ (−x̂, 0, 1−ẑ, ŷ)`` (singular
  only at +z), blended with the C^∞ step ``b = s((ẑ+1)/2)`` after aligning the sign of ``q₊`` to
  ``q₋``, then renormalised. Near either pole only the regular chart contributes (``b`` is flat
  0 or 1 there), so the quaternion and every ``D`` are smooth through the poles. Across the
  plane ``x̂ = 0`` inside the blend band the sign alignment switches, which changes the *roll*
  about the local z axis discontinuously; the model is invariant to that roll (§2.3 "roll
  invariance"), and the same convention is what the reference checkpoints were trained with.
* ``D^1 = Q R Qᵀ`` with ``Q·(x, y, z) = (−y, −z, x)``: the l=1 coefficients of a vector ``u``
  are ``(−u_y, −u_z, u_x)``. Generally ``D^l(R) Y^l(u) = Y^l(R u)`` with ``Y^l`` the real
  harmonics of the §2.3 basis (e3nn's at ``Q u``), packed ``[l², l²+2l]``, ``m = −l..l``.
* ``D^l`` for l ≥ 2 is a homogeneous polynomial of degree 2l in the quaternion (the spin-l
  representation of SU(2), made real). We evaluate it as ``monomials(q) @ table_l``; each table
  is the exact expansion of the Cayley–Klein formula, built once per process in float64
  (milliseconds, cached), never per call. Being a polynomial of a smooth quaternion, ``D`` is
  C^∞ with finite derivatives of every order, including at r̂ = ±z. Evaluation is one small
  GEMM per degree in the quaternion's dtype up to l = 4 (fp32: ≤ 7e-7 from the exact D on the
  golden edges, the fp32 quaternion's own rounding) and in float64 from l = 5, whose tables'
  coefficients (up to ~2e4) would amplify fp32 rounding to ~1.5e-6.
* Under autograd :func:`wigner_d` keeps only the quaternion (16 B/edge in fp32) and recomputes
  the polynomial in the backward, instead of keeping the powers and monomial products of every
  degree; the recomputation is itself differentiable, so force training's double backward works.
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor

MAX_LMAX = 8

_CHUNK_FLOAT64_ENTRIES = 2**26
"""Without autograd, edges are processed in chunks whose monomial matrix holds at most this many
entries (512 MiB in float64)."""

FLOAT64_FROM_DEGREE = 5
"""Degrees from this one up are evaluated in float64 whatever the quaternion's dtype."""

_L1_SIGNS = (-1.0, -1.0, 1.0)
"""Signs of the l=1 coefficients (m = −1, 0, +1), fed by the axes (y, z, x): the coefficient
vector of u is (−u_y, −u_z, u_x)."""


# edge frame
def _normalize_or_zero(v: Tensor) -> Tensor:
    """Rows of ``v`` scaled to unit length; rows of (near-)zero length become 0 with zero
    gradient instead of NaN (such rows are always multiplied by a blend weight of exactly 0)."""
    norm2 = (v * v).sum(dim=-1, keepdim=True)
    degenerate = norm2 <= torch.finfo(v.dtype).tiny ** 0.5
    safe = torch.where(degenerate, torch.ones_like(v), v)
    unit = safe / torch.sqrt((safe * safe).sum(dim=-1, keepdim=True))
    return torch.where(degenerate, torch.zeros_like(v), unit)


def smooth_step(t: Tensor) -> Tensor:
    """C^∞ step ``s(t) = e^{−1/t} / (e^{−1/t} + e^{−1/(1−t)})``: 0 for t ≤ 0, 1 for t ≥ 1, all
    derivatives 0 at both ends. Evaluated as ``sigmoid(1/(1−t) − 1/t)`` on a clamped argument."""
    inside = (t > 0.0) & (t < 1.0)
    tc = torch.where(inside, t, torch.full_like(t, 0.5))
    value = torch.sigmoid(1.0 / (1.0 - tc) - 1.0 / tc)
    return torch.where(inside, value, (t >= 1.0).to(t.dtype))


def edge_quaternion(edge_vec: Tensor, edge_len: Tensor, eps: float = 1e-7) -> Tensor:
    """(E, 4) unit quaternions (w, x, y, z) of the global→local rotation taking r̂ to +z.

    Args:
        edge_vec: (E, 3) edge vectors.
        edge_len: (E,) ``sqrt(|r|² + eps²)``; r̂ is ``r / sqrt(edge_len² + eps²)`` as in the
            reference (eps enters twice; negligible, kept for bitwise studies).
    """
    unit = edge_vec / torch.sqrt(edge_len * edge_len + eps * eps).unsqueeze(-1)
    x, y, z = unit.unbind(-1)
    zero = torch.zeros_like(x)
    q_pos = _normalize_or_zero(torch.stack((1.0 + z, y, -x, zero), dim=-1))
    q_neg = _normalize_or_zero(torch.stack((-x, zero, 1.0 - z, y), dim=-1))
    align = torch.where((q_pos * q_neg).sum(dim=-1) < 0.0, -1.0, 1.0).to(x.dtype)
    blend = smooth_step(0.5 * (z + 1.0))
    mixed = (blend * align).unsqueeze(-1) * q_pos + (1.0 - blend).unsqueeze(-1) * q_neg
    norm: Tensor = torch.linalg.vector_norm(mixed, dim=-1, keepdim=True)
    return mixed / norm


def quaternion_to_rotation(q: Tensor) -> Tensor:
    """(E, 3, 3) active rotation matrix of unit quaternions (w, x, y, z)."""
    w, x, y, z = q.unbind(-1)
    rows = (
        (1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)),
        (2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)),
        (2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)),
    )
    return torch.stack([torch.stack(r, dim=-1) for r in rows], dim=-2)


def _to_l1_order(t: Tensor, dim: int) -> Tensor:
    """Axis ``dim`` of size 3 reordered (x, y, z) → (y, z, x), the axes feeding the l=1
    coefficients, by slices (an index list would be uploaded to the device on every call)."""
    return torch.cat((t.narrow(dim, 1, 2), t.narrow(dim, 0, 1)), dim=dim)


@cache
def _l1_sign_products() -> tuple[tuple[float, ...], ...]:
    return tuple(tuple(a * b for b in _L1_SIGNS) for a in _L1_SIGNS)


def l1_block(rotation: Tensor) -> Tensor:
    """(E, 3, 3) ``D^1 = Q R Qᵀ``: rows/columns of R permuted to (y, z, x) and signed."""
    # Imported here for the reason given in edge_cache.EdgeCache.reduced_wigner.
    from so2kernels._layout import device_constant

    signs = device_constant(_l1_sign_products(), rotation.device, rotation.dtype)
    return _to_l1_order(_to_l1_order(rotation, 1), 2) * signs


# exact polynomial tables
def _binomial_series(power: int, unit: complex) -> NDArray[np.complex128]:
    """Coefficients over k of ``(s + unit·t)^power = Σ_k C(power, k) unit^k s^{power−k} t^k``."""
    return np.array([math.comb(power, k) * unit**k for k in range(power + 1)])


def _complex_to_real(l: int) -> NDArray[np.complex128]:
    """Rows m = −l..l of the complex→real map of §2.3: m = 0: ``e_0``;
    m > 0: ``(e_m + (−1)^m e_{−m})/√2``; m < 0: ``(−i e_{|m|} + (−1)^m i e_{−|m|})/√2``."""
    t = np.zeros((2 * l + 1, 2 * l + 1), dtype=np.complex128)
    h = 1.0 / math.sqrt(2.0)
    t[l, l] = 1.0
    for m in range(1, l + 1):
        t[l + m, l + m] = h
        t[l + m, l - m] = (-1) ** m * h
        t[l - m, l + m] = -1j * h
        t[l - m, l - m] = (-1) ** m * 1j * h
    return t


def _monomial_exponents(degree: int) -> NDArray[np.int64]:
    """(n, 4) exponents of (w, x, y, z) of all monomials of ``degree``, lexicographic."""
    rows = [
        (a, b, c, degree - a - b - c)
        for a in range(degree, -1, -1)
        for b in range(degree - a, -1, -1)
        for c in range(degree - a - b, -1, -1)
    ]
    return np.array(rows, dtype=np.int64)


@cache
def _table(l: int) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
    """Exponents (n, 4) and coefficients (n, (2l+1)²) with ``D^l(q) = monomials(q) @ table``.

    Exact expansion of the Cayley–Klein form of the spin-l representation: it acts on
    ``e_m = ξ^{l+m} η^{l−m} / √((l+m)!(l−m)!)`` through ``ξ → Ra ξ + Rb η``,
    ``η → −R̄b ξ + R̄a η`` with ``Ra = w − iz``, ``Rb = y − ix``, so

        D_{m'm} = N Σ_{i+j=l+m'} C(l+m, i) C(l−m, j) Ra^i R̄a^{l−m−j} · Rb^{l+m−i} (−R̄b)^j,

    ``N = √((l+m')!(l−m')!/((l+m)!(l−m)!))``. The (w, z) and (x, y) factors separate, so each
    term is an outer product of two binomial convolutions. Then ``D_real = T D Tᴴ``.
    """
    degree = 2 * l
    exponents = _monomial_exponents(degree)
    column = np.full((degree + 1,) * 4, -1, dtype=np.int64)
    column[tuple(exponents.T)] = np.arange(len(exponents))
    size = 2 * l + 1
    fact = [math.factorial(k) for k in range(degree + 1)]
    complex_d = np.zeros((size, size, len(exponents)), dtype=np.complex128)
    for m in range(-l, l + 1):
        for i in range(l + m + 1):
            for j in range(l - m + 1):
                mp = i + j - l
                scale = (
                    math.comb(l + m, i)
                    * math.comb(l - m, j)
                    * math.sqrt(fact[l + mp] * fact[l - mp] / (fact[l + m] * fact[l - m]))
                )
                # Ra^i R̄a^n in powers of z (w takes the rest); Rb^p (−R̄b)^j in powers of x.
                n_a, p_b = l - m - j, l + m - i
                wz = np.convolve(_binomial_series(i, -1j), _binomial_series(n_a, 1j))
                xy = (-1) ** j * np.convolve(_binomial_series(p_b, -1j), _binomial_series(j, 1j))
                kz, kx = np.meshgrid(np.arange(len(wz)), np.arange(len(xy)), indexing="ij")
                cols = column[i + n_a - kz, kx, p_b + j - kx, kz]
                np.add.at(complex_d[mp + l, m + l], cols.ravel(), scale * np.outer(wz, xy).ravel())
    basis = _complex_to_real(l)
    real_d = np.einsum("pa,abk,qb->pqk", basis, complex_d, basis.conj())
    if np.abs(real_d.imag).max() > 1e-9:
        raise AssertionError(f"Wigner-D table for l={l} is not real")
    return exponents, np.ascontiguousarray(real_d.real.reshape(size * size, -1).T)


@cache
def _device_table(l: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Exponents (n, 4) int64 and coefficients (n, (2l+1)²) in ``dtype`` on ``device``: uploaded
    once (read-only), as normal tensors even when first asked for under inference mode."""
    exponents, coeffs = _table(l)
    with torch.inference_mode(False), torch.no_grad():
        return (
            torch.from_numpy(exponents).to(device),
            torch.from_numpy(coeffs).to(device=device, dtype=dtype),
        )


@cache
def _block_positions(lmax: int, device: torch.device) -> Tensor:
    """Flat positions in a (D, D) matrix of the entries of blocks l = 0..lmax, block-major
    (uploaded once, read-only)."""
    dim = (lmax + 1) ** 2
    index = []
    for l in range(lmax + 1):
        start, size = l * l, 2 * l + 1
        rows = np.arange(start, start + size)
        index.append((rows[:, None] * dim + rows[None, :]).ravel())
    with torch.inference_mode(False), torch.no_grad():
        return torch.from_numpy(np.concatenate(index)).to(device)


# evaluation
def _monomials(powers: Tensor, exponents: Tensor) -> Tensor:
    """(E, n) products ``Π_c q_c^{k_c}`` from per-component powers (4, E, degree+1)."""
    out = powers[0].index_select(1, exponents[:, 0])
    for c in range(1, 4):
        out = out * powers[c].index_select(1, exponents[:, c])
    return out


def _powers(components: Tensor, degree: int) -> Tensor:
    """(4, E, degree+1) ``q_c^k`` by repeated multiplication: unlike ``pow``, every derivative
    order stays finite at q_c = 0 (the poles have exact zeros)."""
    out = [torch.ones_like(components), components]
    for _ in range(2, degree + 1):
        out.append(out[-1] * components)
    return torch.stack(out, dim=-1)


def wigner_blocks(q: Tensor, lmax: int) -> list[Tensor]:
    """Per-degree real Wigner-D blocks ``[(E, 2l+1, 2l+1) for l in 0..lmax]`` in q's dtype."""
    if not 0 <= lmax <= MAX_LMAX:
        raise ValueError(f"wigner_d supports lmax in 0..{MAX_LMAX}, got {lmax}")
    n_edges = q.shape[0]
    blocks = [torch.ones(n_edges, 1, 1, dtype=q.dtype, device=q.device)]
    if lmax >= 1:
        blocks.append(l1_block(quaternion_to_rotation(q)))
    powers: dict[torch.dtype, Tensor] = {}
    for l in range(2, lmax + 1):
        dtype = torch.float64 if l >= FLOAT64_FROM_DEGREE else q.dtype
        if dtype not in powers:
            powers[dtype] = _powers(q.to(dtype).T, 2 * lmax)  # (4, E, 2L+1)
        exponents, coeffs = _device_table(l, q.device, dtype)
        block = _monomials(powers[dtype], exponents) @ coeffs
        blocks.append(block.view(n_edges, 2 * l + 1, 2 * l + 1).to(q.dtype))
    return blocks


def _dense_with_autograd(q: Tensor, lmax: int) -> Tensor:
    """(E, D, D) block-diagonal assembly of :func:`wigner_blocks`, differentiable."""
    n_edges, dim = q.shape[0], (lmax + 1) ** 2
    values = torch.cat([b.flatten(1) for b in wigner_blocks(q, lmax)], dim=1)
    flat = torch.zeros(n_edges, dim * dim, dtype=q.dtype, device=q.device)
    flat = flat.index_copy(1, _block_positions(lmax, q.device), values)
    return flat.view(n_edges, dim, dim)


def _dense_in_chunks(q: Tensor, lmax: int) -> Tensor:
    """(E, D, D) without autograd, edge chunks bounding the monomial intermediates."""
    n_edges, dim = q.shape[0], (lmax + 1) ** 2
    out = torch.zeros(n_edges, dim, dim, dtype=q.dtype, device=q.device)
    chunk = max(1, _CHUNK_FLOAT64_ENTRIES // len(_monomial_exponents(2 * max(lmax, 1))))
    for start in range(0, n_edges, chunk):
        rows = slice(start, min(start + chunk, n_edges))
        for l, block in enumerate(wigner_blocks(q[rows], lmax)):
            out[rows, l * l : (l + 1) ** 2, l * l : (l + 1) ** 2] = block
    return out


class _RecomputedWigner(torch.autograd.Function):
    """``wigner_d`` that saves only ``q`` and re-evaluates the polynomial in the backward."""

    @staticmethod
    def forward(q: Tensor, lmax: int) -> Tensor:
        return _dense_in_chunks(q, lmax)

    @staticmethod
    def setup_context(
        ctx: torch.autograd.function.FunctionCtx, inputs: tuple[Tensor, int], output: Tensor
    ) -> None:
        q, lmax = inputs
        ctx.save_for_backward(q)
        ctx.lmax = lmax  # type: ignore[attr-defined]

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        (q,) = ctx.saved_tensors  # type: ignore[attr-defined]
        # Grad mode is on here exactly when the caller asked for create_graph: then the
        # recomputation stays attached to q so the gradient is differentiable again.
        create_graph = torch.is_grad_enabled()
        with torch.enable_grad():
            point = q if create_graph else q.detach().requires_grad_(True)
            dense = _dense_with_autograd(point, ctx.lmax)  # type: ignore[attr-defined]
            (grad_q,) = torch.autograd.grad(dense, point, grad, create_graph=create_graph)
        return grad_q, None


def wigner_d(q: Tensor, lmax: int) -> Tensor:
    """(E, D, D) block-diagonal real Wigner-D, ``D = (lmax+1)²``, contiguous, q's dtype.

    ``D[e, l²+l+m', l²+l+m] = D^l_{m'm}(q_e)``; off-block entries are exactly 0. Rotation to the
    edge frame is ``x_loc = D @ x_glob`` (maps r̂ to the local +z axis); back is ``Dᵀ``.
    Evaluated in edge chunks (bounded intermediates); under autograd only ``q`` is kept and the
    backward recomputes.
    """
    if not 0 <= lmax <= MAX_LMAX:
        raise ValueError(f"wigner_d supports lmax in 0..{MAX_LMAX}, got {lmax}")
    if q.requires_grad and torch.is_grad_enabled():
        out: Tensor = _RecomputedWigner.apply(q, lmax)  # type: ignore[no-untyped-call]
        return out
    return _dense_in_chunks(q, lmax)
