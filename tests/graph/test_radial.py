"""Envelopes and the model's radial bases: golden values, C³ at the cutoff, finite gradients at
the smallest lengths the model sees."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from service.graph.cell_list import COINCIDENT_DISTANCE
from service.graph.radial import c3_envelope
from service.model.config import preset
from service.model.layers.embedding import RadialBasis
from tests.conftest import shared_path

RCUT = 6.0


def radial_basis(kind: str, n: int, dtype: torch.dtype) -> RadialBasis:
    """The model's basis at initialisation, as the golden fixtures' ``RadialBasis``."""
    return RadialBasis(preset("tiny", ["O", "H"], rcut=RCUT, n_radial=n, basis=kind)).to(dtype)


def basis_values(basis: RadialBasis, length: torch.Tensor, envelope: bool) -> torch.Tensor:
    """(E, n) basis (times the p=7 envelope when ``envelope``), from lengths alone."""
    env = c3_envelope(length, RCUT, 7) if envelope else torch.ones_like(length)
    out: torch.Tensor = basis(length, 1.0 / length, env)
    return out


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
    basis = radial_basis("bessel", 8, dtype)
    golden_freqs = torch.from_numpy(golden[f"rbf_freqs_{suffix}"])
    # The model initialises its (trainable) frequencies in float32, whatever it runs in later.
    np.testing.assert_allclose(basis.freqs.detach().numpy(), golden_freqs, rtol=max(tol, 6e-8))
    with torch.no_grad():
        basis.freqs.copy_(golden_freqs)
        raw = basis_values(basis, length, envelope=False)
        rbf = basis_values(basis, length, envelope=True)
    np.testing.assert_allclose(raw.numpy(), golden[f"rbf_raw_{suffix}"], atol=tol, rtol=tol)
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


def test_bessel_finite_at_the_smallest_lengths() -> None:
    """The model sees lengths down to the coincidence limit (closer atoms are refused), and the
    cache regularises them (never 0): values and two derivatives stay finite there, the value
    tends to ``sin(w r)/r → w``, and the slope is the closed form."""
    basis = radial_basis("bessel", 8, torch.float64)
    freqs = basis.freqs.detach()
    r = torch.tensor([COINCIDENT_DISTANCE, 1e-3, 0.5], dtype=torch.float64)
    value, slope, curvature = _derivatives(lambda x: basis_values(basis, x, False), r, 2)
    assert torch.allclose(value[0], freqs, rtol=1e-6)
    for t in (value, slope, curvature):
        assert bool(torch.isfinite(t).all())
    expected = ((freqs * 0.5) * torch.cos(freqs * 0.5) - torch.sin(freqs * 0.5)) / 0.25
    assert torch.allclose(
        _derivatives(lambda x: basis_values(basis, x, False), r[2:], 1)[1], expected.sum()
    )
    basis32 = radial_basis("bessel", 8, torch.float32)
    r32 = torch.tensor([COINCIDENT_DISTANCE, 1e-3], requires_grad=True)
    (g,) = torch.autograd.grad(basis_values(basis32, r32, False).sum(), r32)
    assert bool(torch.isfinite(g).all())


def test_gaussian_basis() -> None:
    basis = radial_basis("gaussian", 5, torch.float64)
    assert basis.width == pytest.approx(1.5)
    with torch.no_grad():
        out = basis_values(basis, torch.tensor([1e-9, 3.0], dtype=torch.float64), False)
    assert out.shape == (2, 5)
    assert float(out[0, 0]) == pytest.approx(1.0) and float(out[1, 2]) == 1.0
    assert float(out[1, 3]) == pytest.approx(np.exp(-0.5))
