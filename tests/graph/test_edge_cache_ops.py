"""The op-lean edge cache: shared envelopes, closed-form Wigner-D backward, fused quaternion charts.

Checks the rewritten pieces against plain float64 evaluations (value and gradients at fp32
rounding), that force training's double backward still works, and an op budget that catches a
regression to the per-degree/per-call evaluation (the step is launch-bound, see issue #4).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import service.graph.wigner as wigner_module
from service.graph.edge_cache import inverse_sqrt_degree, regularised_length
from service.graph.radial import c3_envelope, c3_envelopes, envelope_slope_coefficient
from service.graph.wigner import edge_quaternion, wigner_d

_NO_KERNEL = frozenset(
    {"view", "_unsafe_view", "expand", "unsqueeze", "squeeze", "select", "slice", "t", "detach"}
    | {"transpose", "unbind", "alias", "split", "split_with_sizes", "narrow", "as_strided"}
    | {"permute", "lift_fresh", "_reshape_alias"}
)


class _OpCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts dispatched ops that launch a kernel (views excluded)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.__name__.split(".")[0] not in _NO_KERNEL:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _random_quat(n: int, seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    q = torch.randn(n, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    unit: torch.Tensor = q / torch.linalg.vector_norm(q, dim=1, keepdim=True)
    return unit.to(dtype)


def _envelope_float64(length: torch.Tensor, rcut: float, exponent: int) -> torch.Tensor:
    """The series as written in model-dpa4.md §2.2; at an unphysical negative length the
    polynomial ``(1-x)⁴ S_p(x)`` itself (``u`` clamped at 0 only), as radial.c3_envelope."""
    x = length.double() / rcut
    u = torch.clamp(1.0 - x, min=0.0)
    coeffs = [1.0, 4.0, 10.0, 20.0, 35.0, 56.0, 84.0, 120.0][:exponent]
    return u**4 * sum(c * x**k for k, c in enumerate(coeffs))


def test_shared_envelopes_match_single_and_float64() -> None:
    length = torch.linspace(0.0, 7.0, 2001, dtype=torch.float32)
    env7, env5, env1 = c3_envelopes(length, 6.0, (7, 5, 1))
    for exponent, env in ((7, env7), (5, env5), (1, env1)):
        # The series is one GEMM whose kernel (hence summation order) may depend on its row
        # count, so shared and single evaluations agree to fp32 rounding, not bitwise.
        single = c3_envelope(length, 6.0, exponent)
        torch.testing.assert_close(env, single, rtol=0.0, atol=2.5e-7)
        exact = _envelope_float64(length, 6.0, exponent)
        torch.testing.assert_close(env.double(), exact, rtol=0.0, atol=5e-7)
    assert bool((env7[length >= 6.0] == 0).all())
    with pytest.raises(ValueError):
        c3_envelopes(length, 6.0, (5, 0))
    with pytest.raises(ValueError):
        c3_envelopes(length, 6.0, ())


def test_shared_envelope_gradients_of_every_order() -> None:
    length = torch.tensor([1e-3, 0.4, 2.3, 5.99, 6.5], dtype=torch.float64)
    length.requires_grad_(True)
    assert torch.autograd.gradgradcheck(
        lambda r: torch.stack(c3_envelopes(r, 6.0, (7, 5))), (length,)
    )


def test_closed_form_envelope_derivatives_match_plain_autograd() -> None:
    """First and second derivatives of the closed form equal autograd through the plain series
    in float64, at and beyond the cutoff, for an unphysical negative length and for p = 1."""
    length = torch.tensor([-0.3, 1e-3, 0.4, 2.3, 5.99, 6.0, 6.5], dtype=torch.float64)
    length.requires_grad_(True)
    exponents = (7, 5, 1)
    weights = torch.randn(len(exponents), length.shape[0], dtype=torch.float64)

    def grads(envelopes: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        total = sum((e * w).sum() for e, w in zip(envelopes, weights, strict=True))
        (first,) = torch.autograd.grad(total, length, create_graph=True)
        (second,) = torch.autograd.grad((first * first).sum(), length)
        return first, second

    got = grads(c3_envelopes(length, 6.0, exponents))
    want = grads([_envelope_float64(length, 6.0, p) for p in exponents])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def _plain_smooth_step(t: torch.Tensor) -> torch.Tensor:
    """``s(t) = sigmoid(1/(1−t) − 1/t)`` inside (0, 1), masked to 0 / 1 outside (textbook form)."""
    inside = (t > 0.0) & (t < 1.0)
    tc = torch.where(inside, t, torch.full_like(t, 0.5))
    value = torch.sigmoid(1.0 / (1.0 - tc) - 1.0 / tc)
    return torch.where(inside, value, (t >= 1.0).to(t.dtype))


def _plain_quaternion(vec: torch.Tensor, length: torch.Tensor, eps: float) -> torch.Tensor:
    """The edge frame of wigner.edge_quaternion written out in plain ops (autograd reference)."""
    unit = vec / torch.sqrt(length * length + eps * eps)[:, None]
    x, y, z = unit.unbind(1)
    q_pos = torch.stack([1.0 + z, y, -x, torch.zeros_like(x)], dim=1)
    q_neg = torch.stack([-x, torch.zeros_like(x), 1.0 - z, y], dim=1)

    def normalised(q: torch.Tensor) -> torch.Tensor:
        norm2 = (q * q).sum(1, keepdim=True)
        bad = norm2 <= torch.finfo(q.dtype).tiny ** 0.5
        return q * torch.where(bad, 0.0, torch.rsqrt(torch.where(bad, 1.0, norm2)))

    q_pos, q_neg = normalised(q_pos), normalised(q_neg)
    align = torch.where((q_pos * q_neg).sum(1, keepdim=True) < 0.0, -1.0, 1.0)
    mixed = torch.lerp(q_neg, align * q_pos, _plain_smooth_step(0.5 * (z[:, None] + 1.0)))
    norm: torch.Tensor = torch.linalg.vector_norm(mixed, dim=1, keepdim=True)
    return mixed / norm


def test_closed_form_frame_derivatives_match_plain_autograd() -> None:
    """The frame's closed-form VJP and its create_graph derivative equal autograd through the
    plain expression, for generic edges, edges inside the blend band and at both poles."""
    gen = torch.Generator().manual_seed(5)
    generic = torch.randn(24, 3, dtype=torch.float64, generator=gen)
    band = torch.randn(8, 3, dtype=torch.float64, generator=gen)
    band[:, 2] = torch.linspace(-0.9, 0.9, 8, dtype=torch.float64) * band[:, :2].norm(dim=1)
    poles = torch.tensor([[0.0, 0.0, 1.3], [0.0, 0.0, -0.7], [1e-9, 0.0, 2.0]], dtype=torch.float64)
    vec = torch.cat([generic, band, poles]).requires_grad_(True)
    weights = torch.randn(vec.shape[0], 4, dtype=torch.float64, generator=gen)

    def grads(frame: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        length = torch.sqrt((vec * vec).sum(-1) + 1e-14)
        total = (frame(vec, length, 1e-7) * weights).sum()
        (first,) = torch.autograd.grad(total, vec, create_graph=True)
        (second,) = torch.autograd.grad((first * first).sum(), vec)
        return first, second

    got = grads(edge_quaternion)
    want = grads(_plain_quaternion)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def _plain_vjp(q: torch.Tensor, weights: torch.Tensor, lmax: int) -> torch.Tensor:
    point = q.detach().double().requires_grad_(True)
    if lmax == 0:
        return torch.zeros_like(point)  # D^0 = 1: the plain evaluation has no graph to q
    dense = wigner_module._dense_with_autograd(point, lmax)
    (grad,) = torch.autograd.grad((dense * weights.double()).sum(), point)
    return grad


@pytest.mark.parametrize("lmax", [0, 1, 2, 4, 6])
def test_closed_form_backward_matches_float64_autograd(lmax: int) -> None:
    """fp32 (one dtype group up to l = 4, fp32 + float64 groups beyond) and float64: the
    closed-form VJP equals autograd through the float64 polynomial at the input's rounding."""
    for dtype, relative in ((torch.float32, 2e-6), (torch.float64, 1e-12)):
        q = _random_quat(64, 7, dtype).requires_grad_(True)
        dim = (lmax + 1) ** 2
        weights = torch.randn(64, dim, dim, generator=torch.Generator().manual_seed(8))
        (got,) = torch.autograd.grad((wigner_d(q, lmax) * weights.to(dtype)).sum(), q)
        assert got.dtype == dtype
        expected = _plain_vjp(q, weights, lmax)
        scale = max(float(expected.abs().max()), 1.0)
        assert float((got.double() - expected).abs().max()) <= relative * scale, (dtype, lmax)


def test_no_edges() -> None:
    q = torch.zeros(0, 4, requires_grad=True)
    d = wigner_d(q, 6)
    assert d.shape == (0, 49, 49)
    (grad,) = torch.autograd.grad(d.sum(), q)
    assert grad.shape == (0, 4)


def test_double_backward_through_closed_form() -> None:
    # A fixed projection of D keeps the numerical Jacobians small (the check is O(outputs)).
    q = _random_quat(4, 9).requires_grad_(True)
    projection = torch.randn(
        256, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2)
    )
    assert torch.autograd.gradgradcheck(lambda p: wigner_d(p, 3).flatten(1) @ projection, (q,))


def test_double_backward_fp32_two_dtype_groups() -> None:
    """create_graph through the fp32 + float64 groups (l = 6): second derivatives equal float64
    autograd of the plain polynomial at fp32 rounding."""
    q = _random_quat(16, 10, torch.float32).requires_grad_(True)
    weights = torch.randn(16, 49, 49, generator=torch.Generator().manual_seed(11))
    (grad,) = torch.autograd.grad((wigner_d(q, 6) * weights).sum(), q, create_graph=True)
    (second,) = torch.autograd.grad(grad.square().sum(), q)
    point = q.detach().double().requires_grad_(True)
    dense = wigner_module._dense_with_autograd(point, 6)
    (grad64,) = torch.autograd.grad((dense * weights.double()).sum(), point, create_graph=True)
    (second64,) = torch.autograd.grad(grad64.square().sum(), point)
    scale = float(second64.abs().max())
    assert float((second.double() - second64).abs().max()) <= 1e-5 * scale


def test_chunked_evaluation_with_two_dtype_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    q = _random_quat(23, 12, torch.float32)
    dense = wigner_module._dense_with_autograd(q, 6)
    monkeypatch.setattr(wigner_module, "_CHUNK_FLOAT64_ENTRIES", 1)  # one edge per chunk
    chunked = wigner_d(q, 6)
    torch.testing.assert_close(chunked, dense, rtol=0.0, atol=1e-6)


def test_edge_frame_and_wigner_op_budget() -> None:
    """Quaternion + Wigner-D (lmax 2) forward and backward stay within the op budget of the
    batched evaluation with the closed-form frame VJP (was 63 + 64 forward, 95 + 129 backward
    per-degree/per-chart; then 55 + 88 batched under plain autograd; 61 + 49 with the closed-form
    VJP; now 29 + 46: mask-free pole blend and chart norms, dense-column Wigner GEMM, powers by
    one pow)."""
    vec = torch.randn(100, 3, generator=torch.Generator().manual_seed(13)).requires_grad_(True)
    length = torch.sqrt((vec * vec).sum(-1) + 1e-14)
    with _OpCounter() as forward:
        d = wigner_d(edge_quaternion(vec, length, 1e-7), 2)
    with _OpCounter() as backward:
        torch.autograd.grad(d, vec, torch.ones_like(d))
    assert forward.count <= 31, forward.count
    assert backward.count <= 48, backward.count


def test_envelope_pair_op_budget() -> None:
    """Shared series and the closed-form backward (was 19 + 50 under plain autograd; now 7 + 4:
    powers by pow, series and slope polynomials in one GEMM)."""
    length = torch.linspace(0.1, 7.0, 100).requires_grad_(True)
    with _OpCounter() as forward:
        env7, env5 = c3_envelopes(length, 6.0, (7, 5))
    with _OpCounter() as backward:
        torch.autograd.grad(env7 + env5, length, torch.ones_like(length))
    assert forward.count <= 7, forward.count
    assert backward.count <= 4, backward.count


@pytest.mark.parametrize("exponent", [1, 2, 5, 7, 8])
def test_envelope_slope_is_one_beta_density_term(exponent: int) -> None:
    """``dE_p/dx = c_p·x^(p-1)·(1-x)³`` (what the closed-form slope rows rely on), against
    autograd through the plain series in float64."""
    x = torch.linspace(0.0, 1.0, 41, dtype=torch.float64).requires_grad_(True)
    (slope,) = torch.autograd.grad(_envelope_float64(x, 1.0, exponent).sum(), x)
    beta_term = envelope_slope_coefficient(exponent) * x.detach() ** (exponent - 1)
    torch.testing.assert_close(slope, beta_term * (1.0 - x.detach()) ** 3, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("dtype", "tol", "slope_tol"), [(torch.float32, 3e-7, 2e-5), (torch.float64, 1e-15, 1e-12)]
)
def test_pole_blend_matches_plain_smooth_step(
    dtype: torch.dtype, tol: float, slope_tol: float
) -> None:
    """The mask-free blend equals the textbook step on the whole range, is exactly 0 / 1 (with
    exactly zero slope) beyond the saturation, and its slope equals autograd of the step. In
    fp32 the slope's ``b(1-b)`` is 0 once b rounds to 1 while the true slope is still ~1e-5 of
    its peak (the masked form did the same; the roll it moves leaves the model invariant)."""
    z = torch.cat(
        [torch.linspace(-1.0, 1.0, 4001, dtype=torch.float64), torch.tensor([-0.999, 0.9985])]
    )
    want = _plain_smooth_step(0.5 * (z + 1.0))
    got, slope = wigner_module._pole_blend_terms(z.to(dtype), slope=True)
    assert slope is not None
    torch.testing.assert_close(got.double(), want, rtol=0.0, atol=tol)
    saturated = z.abs() >= wigner_module._BLEND_SATURATION
    assert bool((got[saturated] == (z[saturated] > 0).to(dtype)).all())
    assert bool((slope[saturated] == 0.0).all())
    point = z.clone().requires_grad_(True)
    (want_slope,) = torch.autograd.grad(_plain_smooth_step(0.5 * (point + 1.0)).sum(), point)
    scale = float(want_slope.abs().max())
    torch.testing.assert_close(slope.double(), want_slope, rtol=0.0, atol=slope_tol * scale)


def test_regularised_length_closed_form_backward() -> None:
    """``sqrt(|r|² + eps²)``: value, and first and second derivatives against autograd through
    the plain expression (a zero vector included: the length stays eps, the gradient 0)."""
    vec = torch.randn(16, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    vec[0] = 0.0
    vec.requires_grad_(True)
    eps = 1e-3
    length = regularised_length(vec, eps)
    plain = torch.sqrt((vec * vec).sum(-1) + eps * eps)
    torch.testing.assert_close(length, plain, rtol=1e-15, atol=0.0)
    weights = torch.randn(16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    got = torch.autograd.grad((length * weights).sum(), vec, create_graph=True)[0]
    want = torch.autograd.grad((plain * weights).sum(), vec, create_graph=True)[0]
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-15)
    assert float(got[0].detach().abs().max()) == 0.0
    (second,) = torch.autograd.grad(got.square().sum(), vec)
    (second_want,) = torch.autograd.grad(want.square().sum(), vec)
    torch.testing.assert_close(second, second_want, rtol=1e-12, atol=1e-12)


def test_inverse_sqrt_degree_closed_form_backward() -> None:
    """``(deg, rsqrt(deg + floor))`` over CSR segments (one empty): values, and first and second
    derivatives through both outputs, against autograd through a plain index_add."""
    counts = torch.tensor([3, 0, 2, 4])
    rowptr = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    dst = torch.repeat_interleave(torch.arange(4), counts)
    env = torch.rand(9, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    env[4] = 0.0
    env.requires_grad_(True)
    weights = torch.randn(2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(7))

    def plain(e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        deg = torch.zeros(4, dtype=e.dtype).index_add(0, dst, e * e)
        return deg, torch.rsqrt(deg + 0.25)

    got, want = inverse_sqrt_degree(env, rowptr, 0.25), plain(env)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-15, atol=0.0)

    def first(outputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        total = (outputs[0] * weights[0]).sum() + (outputs[1] * weights[1]).sum()
        (grad,) = torch.autograd.grad(total, env, create_graph=True)
        return grad

    grad, grad_want = first(got), first(want)
    torch.testing.assert_close(grad, grad_want, rtol=1e-14, atol=1e-15)
    (second,) = torch.autograd.grad(grad.square().sum(), env)
    (second_want,) = torch.autograd.grad(grad_want.square().sum(), env)
    torch.testing.assert_close(second, second_want, rtol=1e-12, atol=1e-14)
    (only_inv,) = torch.autograd.grad(inverse_sqrt_degree(env, rowptr, 0.25)[1].sum(), env)
    (only_inv_want,) = torch.autograd.grad(plain(env)[1].sum(), env)
    torch.testing.assert_close(only_inv, only_inv_want, rtol=1e-14, atol=1e-15)
