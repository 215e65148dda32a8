"""The frozen-weight norms (closed-form first-order backward) against their autograd forms."""

from __future__ import annotations

import pytest
import torch

from service.model.layers.norms import EquivariantRMSNorm, unit_rms


def _norm(lmax: int, channels: int, eps: float) -> EquivariantRMSNorm:
    torch.manual_seed(0)
    norm = EquivariantRMSNorm(lmax, channels, eps=eps).double()
    with torch.no_grad():
        norm.scale.copy_(torch.randn_like(norm.scale))
        norm.bias.copy_(torch.randn_like(norm.bias))
    return norm


@pytest.mark.parametrize(("lmax", "eps"), [(1, 1e-5), (2, 1.0), (3, 1e-5)])
def test_frozen_equivariant_norm_matches_autograd(lmax: int, eps: float) -> None:
    norm = _norm(lmax, 6, eps)
    x = torch.randn(5, (lmax + 1) ** 2, 6, dtype=torch.float64, requires_grad=True)
    cotangent = torch.randn(5, (lmax + 1) ** 2, 6, dtype=torch.float64)
    live = norm(x, live=True)
    frozen = norm(x, live=False)
    torch.testing.assert_close(frozen, live, rtol=1e-13, atol=1e-13)
    (grad_live,) = torch.autograd.grad(live, x, cotangent)
    (grad_frozen,) = torch.autograd.grad(frozen, x, cotangent)
    torch.testing.assert_close(grad_frozen, grad_live, rtol=1e-12, atol=1e-12)


def test_frozen_equivariant_norm_gradcheck() -> None:
    norm = _norm(2, 4, 1e-5)
    x = torch.randn(3, 9, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: norm(t, live=False), (x,))


def test_frozen_unit_rms_matches_autograd() -> None:
    torch.manual_seed(1)
    x = torch.randn(7, 2, 8, dtype=torch.float64, requires_grad=True)
    cotangent = torch.randn(7, 2, 8, dtype=torch.float64)
    live = unit_rms(x, 1e-7, live=True)
    frozen = unit_rms(x, 1e-7, live=False)
    torch.testing.assert_close(frozen, live, rtol=1e-13, atol=1e-13)
    (grad_live,) = torch.autograd.grad(live, x, cotangent)
    (grad_frozen,) = torch.autograd.grad(frozen, x, cotangent)
    torch.testing.assert_close(grad_frozen, grad_live, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda t: unit_rms(t, 1e-7, live=False), (x,))


def test_frozen_norms_refuse_second_order() -> None:
    """The closed forms are first order: a double backward must fail loudly, not miss a term
    (the energy has a second path to ``x``, as in a model)."""
    norm = _norm(1, 4, 1e-5)
    x = torch.randn(3, 4, 4, dtype=torch.float64, requires_grad=True)
    for out in (norm(x, live=False), unit_rms(x, 1e-7, live=False)):
        energy = out.pow(3).sum() + x.pow(3).sum()
        with pytest.raises(RuntimeError, match="first-order derivatives only"):
            torch.autograd.grad(energy, x, create_graph=True)
