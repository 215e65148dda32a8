"""Envelopes and radial bases: golden values, C³ at the cutoff, finite gradients at small r."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from service.graph.radial import (
    bessel_basis,
    c3_envelope,
    gaussian_basis,
    initial_bessel_frequencies,
    initial_gaussian_centers,
)
from tests.conftest import shared_path

RCUT = 6.0


@pytest.fixture(scope="module")
def golden() -> np.lib.npyio.NpzFile:
    return np.load(shared_path("reference", "golden", "wigner_d.npz"))


@pytest.mark.parametrize(
    ("dtype", "suffix", "tol"), [(torch.float64, "f64", 1e-14), (torch.float32, "f32", 1e-6)]
)
def test_golden(golden: np.lib.npyio.NpzFile, dtype: torch.dtype, suffix: str, tol: float) -> None:
    vec = torch.from_numpy(golden["edge_vec"]).to(dtype)
    length = torch.sqrt((vec * vec).sum(-1) + 1e-14)
    np.testing.assert_allclose(length.numpy(), golden[f"edge_len_{suffix}"], rtol=tol)
    for p in (5, 7):
        env = c3_envelope(length, RCUT, p)
        np.testing.assert_allclose(env.numpy(), golden[f"env_p{p}_{suffix}"], atol=tol, rtol=tol)
    freqs = initial_bessel_frequencies(8, RCUT, dtype=dtype)
    np.testing.assert_allclose(freqs.numpy(), golden[f"rbf_freqs_{suffix}"], rtol=tol)
    raw = bessel_basis(length, freqs)
    np.testing.assert_allclose(raw.numpy(), golden[f"rbf_raw_{suffix}"], atol=tol, rtol=tol)
    rbf = raw * c3_envelope(length, RCUT, 7).unsqueeze(-1)
    np.testing.assert_allclose(rbf.numpy(), golden[f"rbf_{suffix}"], atol=4 * tol, rtol=tol)


def _derivatives(fn, r: torch.Tensor, order: int) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    r = r.clone().requires_grad_(True)
    out = [fn(r)]
    for _ in range(order):
        (g,) = torch.autograd.grad(out[-1].sum(), r, create_graph=True)
        out.append(g)
    return out


@pytest.mark.parametrize("p", [5, 7])
def test_envelope_is_c3_at_cutoff(p: int) -> None:
    r = torch.tensor([RCUT, RCUT - 1e-6, RCUT + 0.5, 10.0], dtype=torch.float64)
    values = _derivatives(lambda x: c3_envelope(x, RCUT, p), r, 3)
    for k, v in enumerate(values):
        assert abs(float(v[0].detach())) == 0.0, (k, v)
        assert abs(float(v[1].detach())) < 1e-3 ** (4 - k) * 1e3, (
            k,
            v,
        )  # u⁴ vanishes as (1e-6)^(4-k)
        assert float(v[2].detach().abs()) == 0.0 and float(v[3].detach().abs()) == 0.0
    assert float(c3_envelope(torch.tensor(0.0, dtype=torch.float64), RCUT, p)) == 1.0


def test_envelope_flat_near_zero() -> None:
    r = torch.tensor([1e-3], dtype=torch.float64)
    for p in (5, 7):
        value, slope = _derivatives(lambda x, p=p: c3_envelope(x, RCUT, p), r, 1)
        assert abs(1.0 - float(value.detach())) < 1e-12 and abs(float(slope.detach())) < 1e-9


def test_bessel_finite_at_small_r() -> None:
    freqs = initial_bessel_frequencies(8, RCUT, dtype=torch.float64)
    r = torch.tensor([0.0, 1e-7, 1e-4, 0.5], dtype=torch.float64)
    value, slope, curvature = _derivatives(lambda x: bessel_basis(x, freqs), r, 2)
    assert torch.allclose(value[0], freqs)  # sin(w r)/r → w
    for t in (value, slope, curvature):
        assert bool(torch.isfinite(t).all())
    expected = ((freqs * 0.5) * torch.cos(freqs * 0.5) - torch.sin(freqs * 0.5)) / 0.25
    assert torch.allclose(
        _derivatives(lambda x: bessel_basis(x, freqs), r[3:], 1)[1], expected.sum()
    )
    r32 = torch.tensor([1e-7, 1e-3], requires_grad=True)
    (g,) = torch.autograd.grad(bessel_basis(r32, freqs.float()).sum(), r32)
    assert bool(torch.isfinite(g).all())


def test_gaussian_basis() -> None:
    centers, width = initial_gaussian_centers(5, RCUT, dtype=torch.float64)
    assert width == pytest.approx(1.5)
    out = gaussian_basis(torch.tensor([0.0, 3.0], dtype=torch.float64), centers, width)
    assert out.shape == (2, 5)
    assert float(out[0, 0]) == 1.0 and float(out[1, 2]) == 1.0
    assert float(out[1, 3]) == pytest.approx(np.exp(-0.5))
