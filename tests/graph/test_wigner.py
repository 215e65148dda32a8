"""Edge quaternion and real Wigner-D: golden numbers, group properties, basis, smoothness."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from service.graph.wigner import (
    MAX_LMAX,
    edge_quaternion,
    quaternion_to_rotation,
    wigner_d,
)
from tests.conftest import shared_path

EPS = 1e-7
Q_MAP = torch.tensor([[0.0, -1.0, 0.0], [0.0, 0.0, -1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
"""M·(x, y, z) = (−y, −z, x): the map between the model's real basis and e3nn's."""


def _quat(vec: torch.Tensor) -> torch.Tensor:
    length = torch.sqrt((vec * vec).sum(-1) + EPS * EPS)
    return edge_quaternion(vec, length, EPS)


def _random_unit(n: int, seed: int) -> torch.Tensor:
    v = torch.randn(n, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    unit: torch.Tensor = v / torch.linalg.vector_norm(v, dim=1, keepdim=True)
    return unit


def _random_quat(n: int, seed: int) -> torch.Tensor:
    q = torch.randn(n, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    unit: torch.Tensor = q / torch.linalg.vector_norm(q, dim=1, keepdim=True)
    return unit


def _qmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    w1, x1, y1, z1 = a.unbind(-1)
    w2, x2, y2, z2 = b.unbind(-1)
    return torch.stack(
        (
            w1 * w2 - x1 * x2 - y1 * y2 - z1 * z2,
            w1 * x2 + x1 * w2 + y1 * z2 - z1 * y2,
            w1 * y2 - x1 * z2 + y1 * w2 + z1 * x2,
            w1 * z2 + x1 * y2 - y1 * x2 + z1 * w2,
        ),
        dim=-1,
    )


@pytest.fixture(scope="module")
def golden() -> np.lib.npyio.NpzFile:
    data: np.lib.npyio.NpzFile = np.load(shared_path("reference", "golden", "wigner_d.npz"))
    return data


def test_golden_float64(golden: np.lib.npyio.NpzFile) -> None:
    vec = torch.from_numpy(golden["edge_vec"])
    q = _quat(vec)
    np.testing.assert_allclose(q.numpy(), golden["edge_quat_f64"], atol=1e-13)
    np.testing.assert_allclose(quaternion_to_rotation(q).numpy(), golden["rotmat_f64"], atol=1e-13)
    np.testing.assert_allclose(wigner_d(q, 6).numpy(), golden["D_full_f64"], atol=1e-11)


def test_golden_float32(golden: np.lib.npyio.NpzFile) -> None:
    vec = torch.from_numpy(golden["edge_vec"]).float()
    q = _quat(vec)
    assert q.dtype == torch.float32
    np.testing.assert_allclose(q.numpy(), golden["edge_quat_f32"], atol=2e-7)
    d = wigner_d(q, 6)
    assert d.dtype == torch.float32
    np.testing.assert_allclose(d.double().numpy(), golden["D_full_f64"], atol=2e-6)
    np.testing.assert_allclose(d[:, :9, :9].numpy(), golden["D_full_l2_f32"], atol=2e-6)


def test_block_diagonal_and_orthogonal() -> None:
    q = _random_quat(40, 1)
    d = wigner_d(q, MAX_LMAX)
    dim = (MAX_LMAX + 1) ** 2
    eye = torch.eye(dim, dtype=torch.float64)
    assert torch.allclose(d @ d.transpose(1, 2), eye.expand_as(d), atol=1e-10)
    mask = torch.zeros(dim, dim, dtype=torch.bool)
    for l in range(MAX_LMAX + 1):
        mask[l * l : (l + 1) ** 2, l * l : (l + 1) ** 2] = True
    assert bool((d[:, ~mask] == 0).all())
    assert torch.allclose(torch.linalg.det(d), torch.ones(40, dtype=torch.float64), atol=1e-9)


def test_homomorphism() -> None:
    a, b = _random_quat(20, 2), _random_quat(20, 3)
    lmax = 6
    assert torch.allclose(
        wigner_d(_qmul(a, b), lmax), wigner_d(a, lmax) @ wigner_d(b, lmax), atol=1e-10
    )
    assert torch.allclose(wigner_d(-a, lmax), wigner_d(a, lmax), atol=1e-12)


def test_l1_block_is_signed_permuted_rotation() -> None:
    q = _random_quat(10, 4)
    rot = quaternion_to_rotation(q)
    assert torch.allclose(wigner_d(q, 1)[:, 1:, 1:], Q_MAP @ rot @ Q_MAP.T, atol=1e-14)


def test_rotation_maps_edge_to_plus_z() -> None:
    u = torch.cat([_random_unit(50, 5), torch.eye(3, dtype=torch.float64), -torch.eye(3)])
    rot = quaternion_to_rotation(_quat(3.0 * u))
    z = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)
    assert torch.allclose(rot @ u.unsqueeze(-1), z.expand(u.shape[0], 3).unsqueeze(-1), atol=1e-12)
    # l=1 coefficient vector (−u_y, −u_z, u_x) goes to that of +z: (0, −1, 0).
    d1 = wigner_d(_quat(3.0 * u), 1)[:, 1:, 1:]
    coeff = (Q_MAP @ u.T).T
    target = torch.tensor([0.0, -1.0, 0.0], dtype=torch.float64).expand(u.shape[0], 3)
    assert torch.allclose((d1 @ coeff.unsqueeze(-1)).squeeze(-1), target, atol=1e-12)


def test_relation_to_e3nn_spherical_harmonics() -> None:
    o3 = pytest.importorskip("e3nn.o3")
    u = _random_unit(30, 6)
    d = wigner_d(_quat(2.5 * u), 6)
    mu = (Q_MAP @ u.T).T
    zhat = (Q_MAP @ torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)).expand(30, 3)
    for l in range(7):
        y = o3.spherical_harmonics(l, mu, normalize=True, normalization="component")
        y_z = o3.spherical_harmonics(l, zhat, normalize=True, normalization="component")
        block = d[:, l * l : (l + 1) ** 2, l * l : (l + 1) ** 2]
        zonal = block[:, l, :]
        assert torch.allclose(zonal, (-1) ** l * y / math.sqrt(2 * l + 1), atol=1e-12), l
        # D^l Y^l(r̂) = Y^l(ẑ): the rotation takes the edge to the local +z axis.
        assert torch.allclose((block @ y.unsqueeze(-1)).squeeze(-1), y_z, atol=1e-11), l


def _pole_path(sign: float, n: int = 401, half_angle: float = 0.02) -> torch.Tensor:
    """Unit vectors on a great circle through ±z (φ = 0.7), crossing the pole mid-way."""
    theta = torch.linspace(-half_angle, half_angle, n, dtype=torch.float64)
    phi = 0.7
    return torch.stack(
        (
            torch.sin(theta) * math.cos(phi),
            torch.sin(theta) * math.sin(phi),
            sign * torch.cos(theta),
        ),
        dim=1,
    )


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_smooth_through_the_poles(sign: float) -> None:
    u = _pole_path(sign)
    d = wigner_d(_quat(2.0 * u), 4)
    step = (u[1:] - u[:-1]).norm(dim=1).max()
    jumps = (d[1:] - d[:-1]).abs().amax(dim=(1, 2))
    # Lipschitz along the path with a modest constant: no jump anywhere, incl. at the pole.
    assert float(jumps.max()) < 20.0 * float(step)


def test_roll_invariant_quantities_continuous_everywhere() -> None:
    """Inside the chart blend band the frame's roll about local z may switch (x̂ = 0); anything
    the model can see (roll-invariant: Dᵀ Λ D with Λ equal on ±m) must stay continuous."""
    lmax = 3
    dim = (lmax + 1) ** 2
    weights = torch.tensor([1.0 + abs(m) + l for l in range(lmax + 1) for m in range(-l, l + 1)])
    lam = torch.diag(weights.double())
    for z in (-0.6, 0.0, 0.5):
        t = torch.linspace(-1e-3, 1e-3, 201, dtype=torch.float64)
        rho = math.sqrt(1 - z * z)
        u = torch.stack((rho * torch.sin(t), rho * torch.cos(t), torch.full_like(t, z)), dim=1)
        d = wigner_d(_quat(u), lmax)
        inv = d.transpose(1, 2) @ lam @ d
        assert inv.shape == (201, dim, dim)
        assert float((inv[1:] - inv[:-1]).abs().max()) < 0.1


def test_gradients_finite_everywhere() -> None:
    special = torch.tensor(
        [[0, 0, 1.0], [0, 0, -1.0], [0, 0, 2.5], [0, 0, -0.7], [1e-9, 0, 1], [0, 1e-9, -1]],
        dtype=torch.float64,
    )
    vec = torch.cat([special, 2.0 * _random_unit(20, 7), 1e-6 * _random_unit(3, 8)])
    leaf = vec.clone().requires_grad_(True)
    weights = torch.randn(vec.shape[0], 49, 49, dtype=torch.float64)
    d = wigner_d(_quat(leaf), 6)
    (grad,) = torch.autograd.grad((d * weights).sum(), leaf, create_graph=True)
    assert bool(torch.isfinite(grad).all())
    (second,) = torch.autograd.grad((grad * grad).sum(), leaf)
    assert bool(torch.isfinite(second).all())
    leaf32 = vec.float().requires_grad_(True)
    (grad32,) = torch.autograd.grad((wigner_d(_quat(leaf32), 6) * weights.float()).sum(), leaf32)
    assert bool(torch.isfinite(grad32).all())


def test_gradcheck_generic_and_near_poles() -> None:
    vec = torch.tensor(
        [[0.3, -1.1, 0.8], [1e-4, 2e-4, 1.0], [-3e-4, 1e-4, -1.5], [0.0, 0.0, 1.2]],
        dtype=torch.float64,
        requires_grad=True,
    )
    assert torch.autograd.gradcheck(lambda v: wigner_d(_quat(v), 3), (vec,), atol=1e-6)


def test_lmax_beyond_the_tables_is_refused() -> None:
    with pytest.raises(ValueError):
        wigner_d(_random_quat(5, 9), MAX_LMAX + 1)


def test_chunked_no_grad_path_equals_autograd_path(monkeypatch: pytest.MonkeyPatch) -> None:
    import service.graph.wigner as wigner_module

    q = _random_quat(37, 10)
    # The limit counts the monomials of all degrees together (130 per edge at lmax 3).
    monkeypatch.setattr(wigner_module, "_CHUNK_FLOAT64_ENTRIES", 130 * 5)  # 5 edges per chunk
    chunked = wigner_d(q, 3)
    dense = wigner_module._dense_with_autograd(q.clone().requires_grad_(True), 3)
    # The same polynomials, but not always the same bits: a BLAS may take another kernel for a
    # 5-row GEMM than for a 10-row one (MKL on an AMD EPYC: 3.3e-16 apart, 2026-12-02). Entries
    # are at most 1 in magnitude, so a few float64 ulps of 1 bound the difference.
    torch.testing.assert_close(chunked, dense.detach(), rtol=0.0, atol=4 * torch.finfo(q.dtype).eps)


def test_fp32_evaluation_per_degree_vs_golden(golden: np.lib.npyio.NpzFile) -> None:
    """fp32 polynomial evaluation (l <= 4) stays at the fp32 quaternion's rounding; l >= 5 runs
    in float64. The whole D in fp32 is within 2e-6 of the exact float64 golden D."""
    vec = torch.from_numpy(golden["edge_vec"]).float()
    d = wigner_d(_quat(vec), 6).double().numpy()
    exact = golden["D_full_f64"]
    for l in range(7):
        rows = slice(l * l, (l + 1) ** 2)
        error = np.abs(d[:, rows, rows] - exact[:, rows, rows]).max()
        assert error <= (1e-6 if l <= 4 else 2e-6), (l, error)


def test_backward_keeps_only_the_quaternion() -> None:
    """The recomputing backward saves q alone (no powers or monomials), and its fp32 gradient is
    the float64 gradient of the plain evaluation to fp32 rounding (1e-6 of the largest entry)."""
    import service.graph.wigner as wigner_module

    q = _random_quat(50, 11).float().requires_grad_(True)
    saved: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        d = wigner_d(q, 4)
    assert len(saved) == 1 and saved[0].shape == (50, 4)
    weights = torch.randn(d.shape, generator=torch.Generator().manual_seed(3))
    (got,) = torch.autograd.grad((d * weights).sum(), q)
    q64 = q.detach().double().requires_grad_(True)
    plain = wigner_module._dense_with_autograd(q64, 4)
    (expected,) = torch.autograd.grad((plain * weights.double()).sum(), q64)
    error = (got.double() - expected).abs().max().item()
    assert error <= 1e-6 * expected.abs().max().item(), error


def test_gradgradcheck_through_recomputation() -> None:
    vec = torch.tensor(
        [[0.3, -1.1, 0.8], [1e-4, 2e-4, 1.0], [-0.5, 0.2, -1.5]],
        dtype=torch.float64,
        requires_grad=True,
    )
    assert torch.autograd.gradgradcheck(lambda v: wigner_d(_quat(v), 2), (vec,), atol=1e-6)
