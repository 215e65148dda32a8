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
* ``D^l`` is a homogeneous polynomial of degree 2l in the quaternion (the spin-l representation
  of SU(2), made real; l = 0, 1 included). We evaluate it as ``monomials(q) @ table``; each
  degree's table is the exact expansion of the Cayley–Klein formula, built once per process in
  float64 (milliseconds, cached), never per call, and the degrees are stacked block-diagonally
  so all of them cost one gather, three products and one GEMM (the step is launch-bound). Being
  a polynomial of a smooth quaternion, ``D`` is C^∞ with finite derivatives of every order,
  including at r̂ = ±z. Degrees up to l = 4 are evaluated in the quaternion's dtype (fp32:
  ≤ 7e-7 from the exact D on the golden edges, the fp32 quaternion's own rounding), from l = 5
  in float64, whose tables' coefficients (up to ~2e4) would amplify fp32 rounding to ~1.5e-6.
* Under autograd :func:`wigner_d` keeps only the quaternion (16 B/edge in fp32). Its backward is
  the closed form ``∂D/∂q_c = monomials_{2l−1}(q) @ table'_c`` (exact derivative tables, also
  stacked over degrees): two contractions with the incoming gradient, written in differentiable
  torch ops so force training's double backward works.
* :func:`edge_quaternion`'s backward is closed form as well (:func:`_frame_vjp`: the chain
  through both normalisations, the blend and the chart gather, ~30 ops instead of autograd's
  ~65 through the expression). A first-order backward reads the forward's saved terms; under
  create_graph it recomputes them from the inputs in differentiable ops, so the gradient is
  differentiable again.
"""

from __future__ import annotations

import math
from functools import cache
from typing import NamedTuple

import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor

MAX_LMAX = 8

_CHUNK_FLOAT64_ENTRIES = 2**26
"""Without autograd, edges are processed in chunks whose monomial matrix (all degrees) holds at
most this many entries (512 MiB in float64)."""

FLOAT64_FROM_DEGREE = 5
"""Degrees from this one up are evaluated in float64 whatever the quaternion's dtype."""

# edge frame
_CHART_AXES = (2, 1, 0, 0, 0, 0, 2, 1)
_CHART_SIGNS = (1.0, 1.0, -1.0, 0.0, -1.0, 0.0, -1.0, 1.0)
_CHART_OFFSETS = (1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0)
"""Both charts of :func:`edge_quaternion`, ``q₊ = (1+z, y, −x, 0)`` then ``q₋ = (−x, 0, 1−z, y)``,
as ``offset + sign · unit[axis]``: one gather and one fused multiply-add build them (exactly,
the signs being ±1 or 0)."""
_CHART_GATHER_T = tuple(
    tuple(sign if axis == column else 0.0 for column in range(3))
    for axis, sign in zip((*_CHART_AXES, 2), (*_CHART_SIGNS, 1.0), strict=True)
)
"""(9, 3) transpose of the chart gather, plus a last row for the blend's r̂_z: maps cotangents
of the eight chart entries and of the blend argument back onto r̂."""


_BLEND_SATURATION = 0.998
"""``|r̂_z|`` beyond which the pole blend is exactly 0 or 1 in fp32 and float64 alike (its
sigmoid argument exceeds 999 in magnitude): r̂_z is clamped there, which changes no value and
makes the band's edges need no masks."""


def _pole_blend_terms(unit_z: Tensor, *, slope: bool) -> tuple[Tensor, Tensor | None]:
    """The weight ``b = s((r̂_z + 1)/2)`` of the chart q₊, with the C^∞ step
    ``s(t) = e^{−1/t} / (e^{−1/t} + e^{−1/(1−t)})`` (0 for t ≤ 0, 1 for t ≥ 1, all derivatives 0
    at both ends), and (``slope``) its derivative ``∂b/∂r̂_z``.

    With ``t = (1+z)/2``: ``s(t) = sigmoid(1/(1−t) − 1/t) = sigmoid(z/d)``, ``d = (1 − z²)/4``,
    and ``∂b/∂z = b(1−b)·((1 + z²)/4)/d²``, on ``z`` clamped to ±:data:`_BLEND_SATURATION`
    (where ``b`` is already exactly 0 or 1, so the slope is exactly 0 there)."""
    # Imported here: see the package docstring (service/graph/__init__.py).
    from so2kernels._layout import device_constant

    quarter = device_constant((0.25,), unit_z.device, unit_z.dtype)
    z = torch.clamp(unit_z, -_BLEND_SATURATION, _BLEND_SATURATION)
    spread = torch.addcmul(quarter, z, z, value=-0.25)  # (1 − z²)/4 > 0: multiples of 1/4 exact
    blend = torch.sigmoid(z / spread)
    if not slope:
        return blend, None
    steepness = torch.addcmul(quarter, z, z, value=0.25) / (spread * spread)
    return blend, torch.addcmul(blend, blend, blend, value=-1.0) * steepness


class _Frame(NamedTuple):
    """Forward terms of :func:`edge_quaternion` that its closed-form VJP reads (E edges)."""

    quat: Tensor  # (E, 4) the result
    unit: Tensor  # (E, 3) r̂
    radius: Tensor  # (E, 1) sqrt(len² + eps²), r̂ = r / radius
    charts: Tensor  # (E, 2, 4) unit q₊, q₋ (≈ 0 where degenerate)
    chart_norm: Tensor  # (E, 2, 1) chart norms before normalising (floored where degenerate)
    align: Tensor  # (E, 1) ±1: the sign that aligns q₊ to q₋
    blend: Tensor  # (E, 1) b: weight of q₊
    blend_slope: Tensor | None  # (E, 1) ∂b/∂r̂_z (with slopes only)
    mixed_norm: Tensor  # (E, 1) |lerp(q₋, q₊, b)|


def _frame_terms(edge_vec: Tensor, edge_len: Tensor, eps: float, *, slopes: bool) -> _Frame:
    """The edge frame in differentiable torch ops (the VJP's create_graph path reuses it)."""
    # Imported here: see the package docstring (service/graph/__init__.py).
    from so2kernels._layout import device_constant

    device, dtype = edge_vec.device, edge_vec.dtype
    radius = torch.hypot(edge_len, device_constant((eps,), device, dtype)).unsqueeze(-1)
    unit = edge_vec / radius
    raw = torch.addcmul(
        device_constant(_CHART_OFFSETS, device, dtype),
        unit.index_select(1, device_constant(_CHART_AXES, device, torch.int64)),
        device_constant(_CHART_SIGNS, device, dtype),
    ).view(-1, 2, 4)
    # A chart of (near-)zero length (r̂ at its singular pole) is divided by a floor instead of
    # its norm: finite, with finite derivatives of every order, and it never matters, its blend
    # weight being exactly 0 there (see _BLEND_SATURATION).
    chart_norm = torch.linalg.vector_norm(raw, dim=-1, keepdim=True).clamp(
        min=torch.finfo(dtype).tiny ** 0.25
    )
    charts = raw / chart_norm
    q_pos, q_neg = charts.unbind(1)
    # q₊·q₋ = −2 r̂_x/(|q₊||q₋|) (the other products vanish exactly), so aligning q₊ to q₋
    # flips it exactly where r̂_x > 0; no dot product needed.
    align = torch.where(
        unit[:, :1] > 0.0,
        device_constant((-1.0,), device, dtype),
        device_constant((1.0,), device, dtype),
    )
    blend, blend_slope = _pole_blend_terms(unit[:, 2:], slope=slopes)
    # lerp is exactly q₋ at weight 0 and exactly the aligned q₊ at weight 1 (the poles).
    mixed = torch.lerp(q_neg, align * q_pos, blend)
    mixed_norm: Tensor = torch.linalg.vector_norm(mixed, dim=-1, keepdim=True)
    return _Frame(
        mixed / mixed_norm, unit, radius, charts, chart_norm, align, blend, blend_slope,
        mixed_norm,
    )  # fmt: skip


def _frame_vjp(frame: _Frame, edge_len: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    """``(∂/∂edge_vec (E, 3), ∂/∂edge_len (E,))`` of ``Σ grad·quat``: the chain through the
    final normalisation, the blend, both charts' normalisation, the signed chart gather and
    ``r̂ = r / sqrt(len² + eps²)``, each in closed form (the sign alignment is locally
    constant)."""
    # Imported here: see the package docstring (service/graph/__init__.py).
    from so2kernels._layout import device_constant

    quat, charts = frame.quat, frame.charts
    grad_mixed = (grad - quat * (quat * grad).sum(dim=-1, keepdim=True)) / frame.mixed_norm
    q_pos, q_neg = charts.unbind(1)
    grad_blend = (grad_mixed * (frame.align * q_pos - q_neg)).sum(dim=-1, keepdim=True)
    # Weights of q₊ (its alignment sign folded in) and q₋ in the lerp.
    weights = torch.cat([frame.blend * frame.align, 1.0 - frame.blend], dim=1).unsqueeze(-1)
    grad_charts = grad_mixed.unsqueeze(1) * weights  # (E, 2, 4)
    radial = (charts * grad_charts).sum(dim=-1, keepdim=True)
    grad_raw = (grad_charts - charts * radial) / frame.chart_norm
    assert frame.blend_slope is not None
    # One product folds the signed gather of both charts and the blend's r̂_z dependence back
    # onto r̂: rows 0..7 the chart entries, row 8 the blend.
    lever = torch.cat([grad_raw.flatten(1), grad_blend * frame.blend_slope], dim=1)
    grad_unit = lever @ device_constant(_CHART_GATHER_T, quat.device, quat.dtype)
    grad_vec = grad_unit / frame.radius
    along = (grad_unit * frame.unit).sum(dim=-1)
    grad_len = -along * edge_len / (frame.radius.squeeze(-1) ** 2)
    return grad_vec, grad_len


class _EdgeFrame(torch.autograd.Function):
    """:func:`edge_quaternion` with the closed-form VJP of :func:`_frame_vjp`: its forward terms
    are saved for a first-order backward; under create_graph they are recomputed from the inputs
    in differentiable ops, so the gradient is differentiable again."""

    @staticmethod
    def forward(edge_vec: Tensor, edge_len: Tensor, eps: float) -> tuple[Tensor, ...]:
        return tuple(_frame_terms(edge_vec, edge_len, eps, slopes=True))  # type: ignore[arg-type]

    @staticmethod
    def setup_context(
        ctx: torch.autograd.function.FunctionCtx,
        inputs: tuple[Tensor, Tensor, float],
        output: tuple[Tensor, ...],
    ) -> None:
        edge_vec, edge_len, eps = inputs
        ctx.mark_non_differentiable(*output[1:])
        ctx.save_for_backward(edge_vec, edge_len, *output)
        ctx.eps = eps  # type: ignore[attr-defined]
        # Only the quaternion has a cotangent: no zero-filled ones for the saved terms.
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: Tensor | None, *_terms: Tensor | None
    ) -> tuple[Tensor | None, Tensor | None, None]:
        if grad is None:
            return None, None, None
        edge_vec, edge_len, *terms = ctx.saved_tensors  # type: ignore[attr-defined]
        if torch.is_grad_enabled():
            frame = _frame_terms(edge_vec, edge_len, ctx.eps, slopes=True)  # type: ignore[attr-defined]
        else:
            frame = _Frame(*terms)
        return (*_frame_vjp(frame, edge_len, grad), None)


def edge_quaternion(edge_vec: Tensor, edge_len: Tensor, eps: float = 1e-7) -> Tensor:
    """(E, 4) unit quaternions (w, x, y, z) of the global→local rotation taking r̂ to +z.

    Args:
        edge_vec: (E, 3) edge vectors.
        edge_len: (E,) ``sqrt(|r|² + eps²)``; r̂ is ``r / sqrt(edge_len² + eps²)`` as in the
            reference (eps enters twice; negligible, kept for bitwise studies).

    Under autograd the backward is closed form (:func:`_frame_vjp`), twice differentiable.
    """
    needs_grad = edge_vec.requires_grad or edge_len.requires_grad
    if needs_grad and torch.is_grad_enabled():
        quat: Tensor = _EdgeFrame.apply(edge_vec, edge_len, eps)[0]  # type: ignore[no-untyped-call]
        return quat
    return _frame_terms(edge_vec, edge_len, eps, slopes=False).quat


def quaternion_to_rotation(q: Tensor) -> Tensor:
    """(E, 3, 3) active rotation matrix of unit quaternions (w, x, y, z)."""
    w, x, y, z = q.unbind(-1)
    rows = (
        (1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)),
        (2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)),
        (2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)),
    )
    return torch.stack([torch.stack(r, dim=-1) for r in rows], dim=-2)


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


def _degree_groups(lmax: int, dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Degrees 0..lmax grouped by evaluation dtype: below :data:`FLOAT64_FROM_DEGREE` in
    ``dtype``, from it on in float64 (one group when ``dtype`` is float64 already)."""
    if dtype == torch.float64 or lmax < FLOAT64_FROM_DEGREE:
        return [(tuple(range(lmax + 1)), dtype)]
    return [
        (tuple(range(FLOAT64_FROM_DEGREE)), dtype),
        (tuple(range(FLOAT64_FROM_DEGREE, lmax + 1)), torch.float64),
    ]


def _block_size(degrees: tuple[int, ...]) -> int:
    """Number of block entries ``Σ (2l+1)²`` of ``degrees``."""
    return sum((2 * l + 1) ** 2 for l in degrees)


@cache
def _value_table(degrees: tuple[int, ...]) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
    """Exponents (n, 4) of the monomials of every degree ``2l`` (l in ``degrees``, concatenated)
    and the block-diagonal coefficients (n, Σ(2l+1)²): one GEMM gives every block's entries,
    block-major as in :func:`_block_positions`."""
    parts = [_table(l) for l in degrees]
    exponents = np.concatenate([e for e, _ in parts])
    coeffs = np.zeros((len(exponents), _block_size(degrees)))
    row = col = 0
    for e, c in parts:
        coeffs[row : row + len(e), col : col + c.shape[1]] = c
        row, col = row + len(e), col + c.shape[1]
    return exponents, coeffs


@cache
def _derivative_table(degrees: tuple[int, ...]) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
    """Exponents (n', 4) of the monomials of every degree ``2l − 1`` (l ≥ 1 in ``degrees``) and
    coefficients (Σ(2l+1)², 4·n') with ``∂D_s/∂q_c = Σ_k table[s, c·n' + k] · monomial_k(q)``:
    the exact derivative of :func:`_value_table`'s polynomials, so a VJP is two contractions."""
    orders = [l for l in degrees if l >= 1]
    lowered = [_monomial_exponents(2 * l - 1) for l in orders]
    n_lowered = sum(len(e) for e in lowered)
    table = np.zeros((_block_size(degrees), 4, n_lowered))
    row, col = 0, 0
    for l in degrees:
        size = (2 * l + 1) ** 2
        if l >= 1:
            exponents, coeffs = _table(l)
            low = _monomial_exponents(2 * l - 1)
            position = {tuple(e): col + i for i, e in enumerate(low.tolist())}
            for k, exponent in enumerate(exponents.tolist()):
                for c in range(4):
                    if exponent[c] == 0:
                        continue
                    reduced = list(exponent)
                    reduced[c] -= 1
                    target = position[tuple(reduced)]
                    table[row : row + size, c, target] += exponent[c] * coeffs[k]
            col += len(low)
        row += size
    all_lowered = np.concatenate(lowered) if lowered else np.zeros((0, 4), dtype=np.int64)
    return all_lowered, table.reshape(row, 4 * n_lowered)


def _gather_index(exponents: NDArray[np.int64], max_power: int) -> NDArray[np.int64]:
    """(4·n,) positions in flattened powers (E, 4·(max_power+1)) of ``q_c^{k_c}``, c-major."""
    return (np.arange(4)[:, None] * (max_power + 1) + exponents.T).ravel()


@cache
def _device_value_table(
    degrees: tuple[int, ...], lmax: int, device: torch.device, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """Gather index (4·n,) int64 and the coefficients of :func:`_value_table` scattered to the
    flat positions of a ``(D, D)`` matrix, ``D = (lmax+1)²``: (n, D·D), zero off ``degrees``'
    blocks, so one GEMM writes the dense block-diagonal matrix (no zero fill and scatter).
    Uploaded once (read-only), as normal tensors even when first asked for in inference mode."""
    exponents, coeffs = _value_table(degrees)
    index = _gather_index(exponents, 2 * max(degrees))
    dim = (lmax + 1) ** 2
    dense = np.zeros((len(exponents), dim * dim))
    dense[:, _flat_block_positions(degrees, dim)] = coeffs
    with torch.inference_mode(False), torch.no_grad():
        return (
            torch.from_numpy(index).to(device),
            torch.from_numpy(dense).to(device=device, dtype=dtype),
        )


@cache
def _device_derivative_table(
    degrees: tuple[int, ...], device: torch.device, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """Gather index (4·n',) and coefficients (S, 4·n') of :func:`_derivative_table` on
    ``device`` (uploaded once, read-only)."""
    exponents, coeffs = _derivative_table(degrees)
    index = _gather_index(exponents, 2 * max(degrees) - 1)
    with torch.inference_mode(False), torch.no_grad():
        return (
            torch.from_numpy(index).to(device),
            torch.from_numpy(coeffs).to(device=device, dtype=dtype),
        )


def _flat_block_positions(degrees: tuple[int, ...], dim: int) -> NDArray[np.int64]:
    """Flat positions in a (dim, dim) matrix of the entries of the blocks of ``degrees``,
    block-major, row-major within a block."""
    index = []
    for l in degrees:
        rows = np.arange(l * l, (l + 1) ** 2)
        index.append((rows[:, None] * dim + rows[None, :]).ravel())
    return np.concatenate(index)


@cache
def _block_positions(lmax: int, device: torch.device) -> Tensor:
    """Flat positions in a (D, D) matrix of the entries of blocks l = 0..lmax, block-major
    (uploaded once, read-only)."""
    positions = _flat_block_positions(tuple(range(lmax + 1)), (lmax + 1) ** 2)
    with torch.inference_mode(False), torch.no_grad():
        return torch.from_numpy(positions).to(device)


@cache
def _block_coordinates(lmax: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Row and column indices of :func:`_block_positions`' entries: they gather the blocks of a
    (E, D, D) tensor of any strides in one indexing op (a flattening reshape of a
    non-contiguous cotangent would copy it first)."""
    dim = (lmax + 1) ** 2
    positions = _block_positions(lmax, device)
    with torch.inference_mode(False), torch.no_grad():
        return positions // dim, positions % dim


# evaluation
def _monomials(q: Tensor, gather_index: Tensor, max_power: int) -> Tensor:
    """(E, n) products ``Π_c q_c^{k_c}`` of the monomials addressed by ``gather_index``.

    All powers ``q_c^0..q_c^max_power`` are one ``pow`` against a constant exponent row: its
    derivative masks the zero exponents (``0·q^-1`` is never formed), so every derivative order
    stays finite at q_c = 0 (the poles have exact zeros). One gather serves all four components."""
    # Imported here: see the package docstring (service/graph/__init__.py).
    from so2kernels._layout import device_constant

    exponents = device_constant(tuple(float(k) for k in range(max_power + 1)), q.device, q.dtype)
    n_monomials = gather_index.shape[0] // 4  # explicit: with no edges -1 would be ambiguous
    powers = q[:, :, None].pow(exponents).flatten(1)  # (E, 4·(max_power+1))
    w, x, y, z = powers.index_select(1, gather_index).view(q.shape[0], 4, n_monomials).unbind(1)
    return w * x * y * z


def _dense_values(q: Tensor, lmax: int) -> Tensor:
    """(E, D·D) the flattened block-diagonal matrix, in q's dtype: one GEMM per dtype group,
    whose off-group entries are exact zeros (so the groups' sum is exact)."""
    total: Tensor | None = None
    for degrees, dtype in _degree_groups(lmax, q.dtype):
        index, coeffs = _device_value_table(degrees, lmax, q.device, dtype)
        part = (_monomials(q.to(dtype), index, 2 * max(degrees)) @ coeffs).to(q.dtype)
        total = part if total is None else total + part
    assert total is not None
    return total


def _dense_with_autograd(q: Tensor, lmax: int) -> Tensor:
    """(E, D, D) block-diagonal Wigner-D, differentiable."""
    dim = (lmax + 1) ** 2
    return _dense_values(q, lmax).view(q.shape[0], dim, dim)


def _dense_in_chunks(q: Tensor, lmax: int) -> Tensor:
    """(E, D, D) without autograd, edge chunks bounding the monomial intermediates."""
    n_edges, dim = q.shape[0], (lmax + 1) ** 2
    n_monomials = sum(len(_monomial_exponents(2 * l)) for l in range(lmax + 1))
    chunk = max(1, _CHUNK_FLOAT64_ENTRIES // n_monomials)
    if n_edges <= chunk:
        return _dense_with_autograd(q, lmax)
    out = torch.empty(n_edges, dim * dim, dtype=q.dtype, device=q.device)
    for start in range(0, n_edges, chunk):
        rows = slice(start, min(start + chunk, n_edges))
        out[rows] = _dense_values(q[rows], lmax)
    return out.view(n_edges, dim, dim)


def _wigner_vjp(q: Tensor, grad: Tensor, lmax: int) -> Tensor:
    """(E, 4) ``Σ_{ij} grad[e,i,j] ∂D[e,i,j]/∂q[e,c]`` in closed form from the derivative
    tables, in differentiable torch ops (so force training can differentiate it again)."""
    n_edges = q.shape[0]
    rows, cols = _block_coordinates(lmax, q.device)
    block_grad = grad[:, rows, cols]  # (E, S) whatever grad's strides
    total: Tensor | None = None
    offset = 0
    for degrees, dtype in _degree_groups(lmax, q.dtype):
        size = _block_size(degrees)
        part = block_grad.narrow(1, offset, size).to(dtype)
        offset += size
        if max(degrees) == 0:
            continue  # D^0 = 1 is constant
        index, coeffs = _device_derivative_table(degrees, q.device, dtype)
        monomials = _monomials(q.to(dtype), index, 2 * max(degrees) - 1)  # (E, n')
        weights = (part @ coeffs).view(n_edges, 4, coeffs.shape[1] // 4)  # (E, 4, n')
        contribution = (weights @ monomials.unsqueeze(-1)).squeeze(-1).to(q.dtype)
        total = contribution if total is None else total + contribution
    return torch.zeros_like(q) if total is None else total


class _RecomputedWigner(torch.autograd.Function):
    """``wigner_d`` that saves only ``q``; the backward evaluates the derivative polynomials."""

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
        # Grad mode is on here exactly when the caller asked for create_graph; the VJP is then
        # recorded against q and grad, so the gradient is differentiable again.
        (q,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return _wigner_vjp(q, grad, ctx.lmax), None  # type: ignore[attr-defined]


def wigner_d(q: Tensor, lmax: int) -> Tensor:
    """(E, D, D) block-diagonal real Wigner-D, ``D = (lmax+1)²``, contiguous, q's dtype.

    ``D[e, l²+l+m', l²+l+m] = D^l_{m'm}(q_e)``; off-block entries are exactly 0. Rotation to the
    edge frame is ``x_loc = D @ x_glob`` (maps r̂ to the local +z axis); back is ``Dᵀ``.
    Evaluated in edge chunks (bounded intermediates); under autograd only ``q`` is kept and the
    backward evaluates the closed-form derivative.
    """
    if not 0 <= lmax <= MAX_LMAX:
        raise ValueError(f"wigner_d supports lmax in 0..{MAX_LMAX}, got {lmax}")
    if q.requires_grad and torch.is_grad_enabled():
        out: Tensor = _RecomputedWigner.apply(q, lmax)  # type: ignore[no-untyped-call]
        return out
    return _dense_in_chunks(q, lmax)
