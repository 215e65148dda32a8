"""Edge cache of the triclinic water cell against DeePMD-kit's EdgeFeatureCache (golden §3.3)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from service.graph.edge_cache import EdgeCache, build_edge_cache
from service.graph.neighbors import build_graph, edge_vectors
from service.graph.structures import StructureArrays, Structures
from tests.conftest import shared_path
from tests.graph.test_radial import radial_basis

RCUT = 6.0


@pytest.fixture(scope="module")
def golden() -> dict[str, np.ndarray]:
    common = np.load(shared_path("reference", "golden", "tiny_fused_common_intermediates.npz"))
    outputs = np.load(shared_path("reference", "golden", "tiny_fused_plain_golden.npz"))
    return {
        **dict(common),
        "tricl_coord": outputs["tricl_coord"],
        "tricl_box": outputs["tricl_box"],
    }


@pytest.fixture(scope="module")
def cache(golden: dict[str, np.ndarray]) -> EdgeCache:
    item = StructureArrays(
        numbers=[8, 1, 1], positions=golden["tricl_coord"], cell=golden["tricl_box"]
    )
    structures = Structures.from_arrays([item])
    graph = build_graph(structures, RCUT)
    vec = edge_vectors(graph, structures.positions, structures.cells)
    return build_edge_cache(graph, vec, rcut=RCUT, lmax=2)


def _match(golden: dict[str, np.ndarray], cache: EdgeCache) -> tuple[np.ndarray, np.ndarray]:
    """Indices (ours, theirs) pairing every real reference edge with ours by (src, dst, vector)."""
    mask = golden["tricl_edge_mask"]
    src, dst = golden["tricl_edge_index"]
    vec = golden["tricl_edge_vec"]
    ours_vec = cache.vec.double().numpy()
    ours_src, ours_dst = cache.graph.src.numpy(), cache.graph.dst.numpy()
    mine, theirs = [], []
    for k in np.flatnonzero(mask):
        same = (ours_src == src[k]) & (ours_dst == dst[k])
        close = same & (np.abs(ours_vec - vec[k]).max(axis=1) < 1e-5)
        assert close.sum() == 1, f"reference edge {k} has {close.sum()} matches"
        mine.append(int(np.flatnonzero(close)[0]))
        theirs.append(int(k))
    return np.array(mine), np.array(theirs)


def test_same_edge_set(golden: dict[str, np.ndarray], cache: EdgeCache) -> None:
    mine, _ = _match(golden, cache)
    assert cache.graph.n_edges == int(golden["tricl_edge_mask"].sum()) == 116
    assert len(set(mine.tolist())) == 116
    assert int((cache.graph.src == cache.graph.dst).sum()) == 36


def test_edge_tensors(golden: dict[str, np.ndarray], cache: EdgeCache) -> None:
    mine, theirs = _match(golden, cache)
    env = cache.env.numpy()[mine]
    np.testing.assert_allclose(env, golden["tricl_edge_env"][theirs], atol=1e-6, rtol=1e-5)
    with torch.no_grad():  # the model's basis on the cache's lengths and envelope
        basis = radial_basis("bessel", 8, torch.float32)
        rbf = basis(cache.length, torch.reciprocal(cache.length), cache.env_rbf)
    rbf = rbf.numpy()[mine]
    np.testing.assert_allclose(rbf, golden["tricl_edge_rbf"][theirs], atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(
        cache.quat.numpy()[mine], golden["tricl_edge_quat"][theirs], atol=1e-6
    )
    np.testing.assert_allclose(
        cache.wigner.numpy()[mine], golden["tricl_D_full"][theirs], atol=2e-6
    )
    np.testing.assert_allclose(
        cache.inv_sqrt_deg.numpy(), golden["tricl_inv_sqrt_deg"], atol=1e-6, rtol=1e-6
    )


def test_cache_layout(cache: EdgeCache) -> None:
    e = cache.graph.n_edges
    assert cache.wigner.shape == (e, 9, 9) and cache.wigner.is_contiguous()
    assert cache.wigner.dtype == torch.float32
    for t in (cache.vec, cache.length, cache.env, cache.env_rbf, cache.quat, cache.deg):
        assert t.dtype == torch.float32
    deg = torch.zeros(3).index_add_(0, cache.graph.dst, cache.env.double().pow(2).float())
    assert torch.allclose(cache.deg, deg, atol=1e-6)


def test_forces_flow_through_cache(cache: EdgeCache) -> None:
    """Every cached quantity is differentiable w.r.t. the edge-vector leaf, with finite grads."""
    leaf = cache.vec.detach().double().requires_grad_(True)
    c = build_edge_cache(cache.graph, leaf, rcut=RCUT, lmax=2)
    energy = (c.wigner.sum(dim=(1, 2)) * c.env).sum() + c.inv_sqrt_deg.sum() + c.env_rbf.sum()
    (grad,) = torch.autograd.grad(energy, leaf)
    assert grad.shape == leaf.shape and bool(torch.isfinite(grad).all())
    assert float(grad.abs().max()) > 0.0
