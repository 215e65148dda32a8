"""The fused value path (so2kernels ops; Triton interpreter on CPU) against the reference.

Geometry comes from DeePMD's golden triclinic cache; gradients are taken with respect to every
geometric input the ops see (Wigner, envelopes, vectors), so the ops' backward is checked too.
"""

from __future__ import annotations

import pytest
import torch

from service.model.deepmd_import import load_deepmd_checkpoint
from tests.model.golden import golden_file, triclinic_cache


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["plain"])
def test_fused_matches_reference_with_gradients(variant: str) -> None:
    model, _ = load_deepmd_checkpoint(golden_file(f"tiny_fused_{variant}.pt"))
    types = torch.tensor([0, 1, 1])
    results = []
    for fused in (False, True):
        cache, _ = triclinic_cache()
        leaves = [cache.wigner, cache.env, cache.vec, cache.length]
        for leaf in leaves:
            leaf.requires_grad_(True)
        energy = model(types, cache, fused=fused, live_weights=False).sum()
        grads = torch.autograd.grad(energy, leaves)
        results.append((energy.detach(), grads))
    (e_ref, g_ref), (e_fused, g_fused) = results
    assert abs(float(e_ref - e_fused)) < 1e-6
    for a, b in zip(g_ref, g_fused, strict=True):
        torch.testing.assert_close(b, a, atol=2e-6, rtol=1e-5)
