"""Our e3nn-convention harmonics and the Lebedev projectors of the S2 FFN."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from service.model.layers.ffn import S2GridGLUFFN
from service.model.layers.sphere import e3nn_harmonics_norm, s2_grid_projectors

e3nn_o3 = pytest.importorskip("e3nn.o3")


def test_harmonics_match_e3nn() -> None:
    rng = np.random.default_rng(0)
    points = rng.normal(size=(40, 3))
    points = np.concatenate([points, np.eye(3), -np.eye(3)])
    ours = e3nn_harmonics_norm(points, 6)
    ref = e3nn_o3.spherical_harmonics(
        list(range(7)), torch.from_numpy(points), normalize=True, normalization="norm"
    ).numpy()
    np.testing.assert_allclose(ours, ref, atol=1e-12)


@pytest.mark.parametrize("lmax", [1, 2, 3, 4, 6])
def test_grid_round_trip_is_identity(lmax: int) -> None:
    to_grid, from_grid = s2_grid_projectors(lmax)
    np.testing.assert_allclose(from_grid @ to_grid, np.eye((lmax + 1) ** 2), atol=1e-12)


def test_grid_ffn_projectors_stay_exact_through_casts() -> None:
    """float32 → float64 → float32 → float64 casts end with the exact float64 projectors (a
    buffer cast from float32 would keep float32's rounding)."""
    ffn = S2GridGLUFFN(lmax=2, channels=8, hidden=8)
    exact = torch.from_numpy(s2_grid_projectors(2)[1])
    assert ffn.from_grid.dtype == torch.float32
    assert torch.equal(ffn.from_grid, exact.float())
    ffn.double().float().double()
    assert ffn.from_grid.dtype == torch.float64
    assert torch.equal(ffn.from_grid, exact)
    assert torch.equal(ffn.to(torch.float32).from_grid, exact.float())
