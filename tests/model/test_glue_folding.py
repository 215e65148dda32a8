"""Folded per-edge inputs and cached derived weights give the model's defining numbers.

``DPA4Model.initial_state`` never forms the radial features ``R (E, L+1, C)``: every block's
kernel and attention logit bias come from the radial MLP's last hidden layer through folded
maps (DPA4Model.edge_maps). These tests rebuild them the defining way (model-dpa4.md §3–§4.2) in
float64 and compare, over the architecture options the fold has to handle; they also check that
frozen (cached) weights give the same energies and forces as live ones and follow in-place
parameter updates.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import numpy as np
import pytest
import torch
from ase import Atoms

from service.graph.edge_cache import EdgeCache, build_edge_cache
from service.graph.neighbors import build_graph, edge_vectors
from service.graph.structures import Structures
from service.model.config import ModelConfig
from service.model.dpa4 import DPA4Model
from service.model.layers.so2conv import ConvEdgeInputs
from tests.model.randomized import randomized_model

BASE: dict[str, Any] = dict(
    type_map=("O", "H"), channels=16, lmax=2, n_blocks=2, mixing_layers=2, n_radial=6
)
CONFIGS: dict[str, dict[str, Any]] = {
    "bar_like": dict(focus_dim=16, n_focus=1, radial_so2_rank=1, n_atten_head=1, ffn="s2"),
    "wide_hidden": dict(focus_dim=16, n_focus=2, radial_so2_rank=2, n_atten_head=2),
    "rank0_scatter_v10": dict(
        focus_dim=16, n_focus=1, radial_so2_mode="none", n_atten_head=0, version=1.0
    ),
    "no_env_seed": dict(focus_dim=16, n_focus=1, use_env_seed=False, radial_mlp=(12, 10)),
}


def _water(seed: int = 0) -> Structures:
    rng = np.random.default_rng(seed)
    molecule = np.array([[0.0, 0.0, 0.0], [0.96, 0.0, 0.0], [-0.24, 0.93, 0.0]])
    centres = np.array([[0.6, 0.7, 0.5], [2.9, 1.1, 1.4], [1.3, 2.8, 2.6]])
    positions = (centres[:, None, :] + molecule[None]).reshape(-1, 3)
    positions += rng.normal(scale=0.05, size=positions.shape)
    cell = np.array([[4.2, 0.0, 0.0], [0.3, 4.0, 0.0], [0.2, 0.4, 4.1]])
    return Structures.from_atoms([Atoms("OH2" * 3, positions=positions, cell=cell, pbc=True)])


def _model_and_cache(name: str) -> tuple[DPA4Model, EdgeCache, torch.Tensor]:
    cfg = ModelConfig(**{**BASE, "rcut": 3.5, **CONFIGS[name]})
    model = randomized_model(cfg, seed=3).double()
    structures = _water()
    graph = build_graph(structures, cfg.rcut)
    vec = edge_vectors(graph, structures.positions, structures.cells)
    cache = build_edge_cache(
        graph, vec, rcut=cfg.rcut, lmax=cfg.lmax, env_exponents=cfg.env_exponents,
        deg_floor=cfg.degree_norm_floor, eps=cfg.eps, dtype=torch.float64,
    )  # fmt: skip
    types = torch.tensor([0, 1, 1] * 3)
    return model, cache, types


def _defining_inputs(
    model: DPA4Model, cache: EdgeCache, types: torch.Tensor
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """``(GIE rows (N, D-1, C), [(kernel, edge term) per block])`` the defining way."""
    cfg = model.config
    g = cache.graph
    rbf = model.radial_basis(cache.length, 1.0 / cache.length, cache.env_rbf)
    radial = model.radial_mlp(rbf).view(-1, cfg.lmax + 1, cfg.channels)
    if cfg.version >= 1.1:
        radial = radial * cache.env[:, None, None]
    gie = torch.zeros(types.shape[0], (cfg.lmax + 1) ** 2 - 1, cfg.channels, dtype=torch.float64)
    for degree in range(1, cfg.lmax + 1):
        rows = slice(degree * degree, (degree + 1) ** 2)
        zonal = cache.wigner[:, degree * degree + degree, rows]
        message = zonal[:, :, None] * radial[:, degree, None, :]
        gie[:, rows.start - 1 : rows.stop - 1].index_add_(0, g.dst, message)
    gie = gie * cache.inv_sqrt_deg[:, None, None]
    fused = (
        radial
        + (model.type_embedding[types[g.src]] + model.type_embedding[types[g.dst]])[:, None, :]
    )
    active = cache.env > 0
    log_env = torch.where(active, torch.log(torch.where(active, cache.env, 1.0)), -math.inf)
    per_block = []
    for conv in model.convolutions():
        rad = fused if conv.radial_hidden is None else fused @ conv.radial_hidden
        kernel = rad if conv.mixer_weight is None else rad.flatten(1) @ conv.mixer_weight
        if conv.attention is None:
            term = (cache.env * cache.inv_sqrt_deg[g.dst])[:, None]
        else:
            on_l0 = rad[:, 0].view(-1, conv.n_focus, conv.focus_dim)
            logit = torch.einsum("efi,ifh->efh", on_l0, conv.attention.logit_weight).flatten(1)
            term = logit + 2.0 * log_env[:, None]
        per_block.append((kernel, term))
    return gie, per_block


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize(("fused", "tol"), [(False, 1e-12), (True, 2e-5)])
def test_folded_edge_inputs_match_definition(name: str, fused: bool, tol: float) -> None:
    """Float64 on the reference path; the fused path's CSR ops run in float32."""
    model, cache, types = _model_and_cache(name)
    with torch.no_grad():
        gie, per_block = _defining_inputs(model, cache, types)
        if fused:
            model, cache = model.float(), _cache_as(cache, torch.float32)
        x0, inputs = model.initial_state(types, cache, fused=fused, live=False)
    if model.env_seed is not None:
        torch.testing.assert_close(x0[:, 1:].double(), gie, rtol=tol, atol=tol)
    else:
        assert bool((x0[:, 1:] == 0).all())
    for edge, (kernel, term) in zip(inputs, per_block, strict=True):
        assert isinstance(edge, ConvEdgeInputs)
        torch.testing.assert_close(edge.kernel.double(), kernel, rtol=tol, atol=tol)
        finite = torch.isfinite(term)
        assert torch.equal(torch.isfinite(edge.edge_term), finite)
        ours = edge.edge_term.double()[finite]
        torch.testing.assert_close(ours, term[finite], rtol=tol, atol=tol)
        assert (edge.unit_alpha is None) == (model.config.n_focus > 1)


def _cache_as(cache: EdgeCache, dtype: torch.dtype) -> EdgeCache:
    moved = copy.copy(cache)
    for field in ("vec", "length", "env", "env_rbf", "wigner", "inv_sqrt_deg"):
        setattr(moved, field, getattr(cache, field).to(dtype))
    return moved


def _energy_and_edge_grad(
    model: DPA4Model, cache: EdgeCache, types: torch.Tensor, *, live: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = cache.vec.detach().requires_grad_(True)
    graph_cache = build_edge_cache(
        cache.graph, leaf, rcut=cache.rcut, lmax=cache.lmax, eps=cache.eps,
        env_exponents=model.config.env_exponents, deg_floor=model.config.degree_norm_floor,
        dtype=torch.float64,
    )  # fmt: skip
    energy = model(types, graph_cache, live_weights=live).sum()
    (grad,) = torch.autograd.grad(energy, leaf)
    return energy.detach(), grad


@pytest.mark.parametrize("name", ["bar_like", "wide_hidden"])
def test_frozen_weights_match_live_and_follow_updates(name: str) -> None:
    model, cache, types = _model_and_cache(name)
    model = copy.deepcopy(model)
    e_live, g_live = _energy_and_edge_grad(model, cache, types, live=True)
    e_frozen, g_frozen = _energy_and_edge_grad(model, cache, types, live=False)
    torch.testing.assert_close(e_frozen, e_live, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_frozen, g_live, rtol=1e-10, atol=1e-10)
    # An in-place update (an optimiser step) must reach the cached derived weights.
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.01)
    e_live2, _ = _energy_and_edge_grad(model, cache, types, live=True)
    e_frozen2, _ = _energy_and_edge_grad(model, cache, types, live=False)
    assert not torch.isclose(e_live2, e_live, rtol=1e-6)
    torch.testing.assert_close(e_frozen2, e_live2, rtol=1e-12, atol=1e-12)
