"""Initial node state: radial features, environment seed (FiLM on l=0) and GIE (l ≥ 1).

model-dpa4.md §3: the radial MLP maps the enveloped radial basis to per-degree features
``R (E, L+1, C)`` (times the p=5 envelope when version ≥ 1.1); the env seed aggregates
``[s, s·r̂] ⊗ g_e`` per centre into an invariant Gram matrix whose projection gives FiLM logits;
GIE lifts ``R`` to l ≥ 1 through the zonal Wigner rows.
"""

from __future__ import annotations

import math
from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from service.model.config import ModelConfig
from service.model.layers.geometry import EdgeCacheLike, sum_into_dst
from service.model.layers.linear import MLP, Dense
from so2kernels._layout import device_constant
from so2kernels.outer_sum import segment_outer_sum


class RadialBasis(nn.Module):
    """Trainable radial basis times the cache's p=7 envelope: ``(E,) → (E, n_radial)``.

    Bessel: ``sin(w_n r)/r`` with trainable ``freqs`` (initial ``nπ/rcut``). Gaussian: trainable
    centres on ``[0, rcut]``, width ``rcut/(n-1)``.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.kind = cfg.basis
        n = cfg.n_radial
        if cfg.basis == "bessel":
            init = torch.arange(1, n + 1, dtype=torch.float64) * math.pi / cfg.rcut
        else:
            init = torch.linspace(0.0, cfg.rcut, n, dtype=torch.float64)
        self.freqs = nn.Parameter(init.float())
        self.width = cfg.rcut / max(n - 1, 1)

    def forward(self, length: Tensor, env_rbf: Tensor) -> Tensor:
        r = length[:, None]
        if self.kind == "bessel":
            # sin(w r)/r = w·sinc(w r/π): finite and smooth as r → 0.
            basis = self.freqs * torch.sinc(r * self.freqs / math.pi)
        else:
            basis = torch.exp(-((r - self.freqs) ** 2) / (2.0 * self.width**2))
        return basis * env_rbf[:, None]


class EnvSeed(nn.Module):
    """Environment-seed FiLM logits ``(N, 2C)`` (DeePMD ``EnvironmentInitialEmbedding``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        s = cfg.env_seed_sizes
        self.axis = s.axis
        self.eps = cfg.eps
        self.rbf_proj = MLP([cfg.n_radial, s.rbf_out, s.rbf_out])
        self.type_table = nn.Parameter(torch.randn(cfg.n_types + 1, s.type_dim) * 0.1)
        self.filter = MLP([s.g_in, s.hidden, s.embed])
        self.output = Dense(s.embed * s.axis, 2 * cfg.channels)

    def forward(self, types: Tensor, cache: EdgeCacheLike, rbf: Tensor, *, fused: bool) -> Tensor:
        """FiLM logits ``(N, 2C)``; ``fused`` sums over each centre's edges with the CSR op."""
        g = cache.graph
        vec = cache.vec
        inv_r = torch.rsqrt((vec * vec).sum(-1, keepdim=True) + self.eps**2)
        s = cache.env[:, None] * inv_r
        r_tilde = torch.cat([s, s * vec * inv_r], dim=-1)  # (E, 4)
        filt_in = torch.cat(
            [self.rbf_proj(rbf), self.type_table[types[g.src]], self.type_table[types[g.dst]]], -1
        )
        filt = self.filter(filt_in)  # (E, embed)
        if fused:
            # Every r̃ component multiplies the one filter row: no (E, 4, embed) message.
            same_row = device_constant((0,) * r_tilde.shape[1], r_tilde.device, torch.int64)
            agg = segment_outer_sum(r_tilde, filt[:, None, :], same_row, g.dst_rowptr)
        else:
            outer = r_tilde[:, :, None] * filt[:, None, :]  # (E, 4, embed)
            agg = sum_into_dst(outer, g.dst, types.shape[0])
        agg = agg * cache.inv_sqrt_deg[:, None, None]
        gram = torch.bmm(agg.transpose(1, 2), agg[:, :, : self.axis])  # (N, embed, axis)
        logits: Tensor = self.output(gram.flatten(1))
        return logits


def film(type_feat: Tensor, logits: Tensor, scale_log: Tensor, shift_log: Tensor) -> Tensor:
    """``T ⊙ (1 + e^a·tanh(scale)) + e^b·tanh(shift)`` with ``logits = [scale | shift]``."""
    c = type_feat.shape[-1]
    scale = 1.0 + torch.exp(scale_log) * torch.tanh(logits[:, :c])
    return type_feat * scale + torch.exp(shift_log) * torch.tanh(logits[:, c:])


def geometric_initial_embedding(
    cache: EdgeCacheLike, radial: Tensor, n_nodes: int, *, fused: bool
) -> Tensor:
    """GIE: ``x[i,(l,m)] = inv_sqrt_deg_i Σ_{dst=i} D[e,(l,0),(l,m)]·R[e,l]`` for l ≥ 1.

    ``radial (E, L+1, C)`` (before the type-feature fuse) → ``(N, (L+1)², C)`` with row 0 zero.
    ``fused`` takes all degrees in one CSR ``segment_outer_sum`` (zonal entries × ``R`` rows
    picked by degree): deterministic, no atomics, and no (E, D-1, C) message in either
    direction. The reference path does one product and one dst sum per degree: the degree's
    ``R[:, l]`` broadcasts over its 2l+1 zonal entries, so no gathered copy of ``R`` is made.
    """
    lmax = radial.shape[1] - 1
    if fused:
        zonal_entry, row_degree = _zonal_entries(lmax, cache.wigner.shape[2], radial.device)
        zonal = cache.wigner.flatten(1).index_select(1, zonal_entry)  # (E, D-1)
        summed = segment_outer_sum(zonal, radial, row_degree, cache.graph.dst_rowptr)
        return F.pad(summed * cache.inv_sqrt_deg[:, None, None], (0, 0, 1, 0))
    per_degree = [radial.new_zeros(n_nodes, 1, radial.shape[2])]
    for degree in range(1, lmax + 1):
        rows = slice(degree * degree, (degree + 1) ** 2)
        zonal = cache.wigner[:, degree * degree + degree, rows]  # (E, 2l+1): D[(l,0), (l,m)]
        message = zonal[:, :, None] * radial[:, degree, None, :]  # (E, 2l+1, C)
        per_degree.append(sum_into_dst(message, cache.graph.dst, n_nodes))
    return torch.cat(per_degree, dim=1) * cache.inv_sqrt_deg[:, None, None]


@cache
def _zonal_entry_values(lmax: int, wigner_dim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Flat index of ``D[(l,0), (l,m)]`` in a (Dw·Dw) Wigner row and the degree l, for every
    packed row (l, m) with l ≥ 1."""
    degrees = [l for l in range(1, lmax + 1) for _ in range(2 * l + 1)]
    columns = range(1, (lmax + 1) ** 2)
    flat = tuple((l * l + l) * wigner_dim + col for l, col in zip(degrees, columns, strict=True))
    return flat, tuple(degrees)


def _zonal_entries(lmax: int, wigner_dim: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``(zonal_entry, row_degree)``: :func:`_zonal_entry_values` as (D-1,) int64 device
    constants."""
    flat, degrees = _zonal_entry_values(lmax, wigner_dim)
    return (
        device_constant(flat, device, torch.int64),
        device_constant(degrees, device, torch.int64),
    )
