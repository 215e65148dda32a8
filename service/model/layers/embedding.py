"""Initial node state: radial features, environment seed (FiLM on l=0) and GIE (l ≥ 1).

model-dpa4.md §3: the radial MLP maps the enveloped radial basis to per-degree features
``R (E, L+1, C)`` (times the p=5 envelope when version ≥ 1.1); the env seed aggregates
``[s, s·r̂] ⊗ g_e`` per centre into an invariant Gram matrix whose projection gives FiLM logits;
GIE lifts ``R`` to l ≥ 1 through the zonal Wigner rows.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from service.model.config import ModelConfig
from service.model.layers.geometry import EdgeCacheLike, sum_into_dst
from service.model.layers.linear import MLP, Dense, degree_of_packed_rows


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

    def forward(self, types: Tensor, cache: EdgeCacheLike, rbf: Tensor) -> Tensor:
        g = cache.graph
        vec = cache.vec
        inv_r = torch.rsqrt((vec * vec).sum(-1, keepdim=True) + self.eps**2)
        s = cache.env[:, None] * inv_r
        r_tilde = torch.cat([s, s * vec * inv_r], dim=-1)  # (E, 4)
        filt_in = torch.cat(
            [self.rbf_proj(rbf), self.type_table[types[g.src]], self.type_table[types[g.dst]]], -1
        )
        filt = self.filter(filt_in)  # (E, embed)
        outer = r_tilde[:, :, None] * filt[:, None, :]  # (E, 4, embed)
        agg = sum_into_dst(outer, g.dst, types.shape[0]) * cache.inv_sqrt_deg[:, None, None]
        gram = torch.bmm(agg.transpose(1, 2), agg[:, :, : self.axis])  # (N, embed, axis)
        logits: Tensor = self.output(gram.flatten(1))
        return logits


def film(type_feat: Tensor, logits: Tensor, scale_log: Tensor, shift_log: Tensor) -> Tensor:
    """``T ⊙ (1 + e^a·tanh(scale)) + e^b·tanh(shift)`` with ``logits = [scale | shift]``."""
    c = type_feat.shape[-1]
    scale = 1.0 + torch.exp(scale_log) * torch.tanh(logits[:, :c])
    return type_feat * scale + torch.exp(shift_log) * torch.tanh(logits[:, c:])


@functools.cache
def _zonal_gather_index(lmax: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """``(zonal_row, column, degree)``, each ``(D-1,)`` int64 over the packed rows l ≥ 1: the
    Wigner entry ``D[(l,0), (l,m)]`` of row ``(l,m)`` and its degree (constant per device)."""
    degree = degree_of_packed_rows(lmax)[1:]
    column = torch.arange(1, (lmax + 1) ** 2)
    zonal_row = degree * degree + degree
    # Normal tensors even when first built under inference mode: autograd saves gather indices.
    with torch.inference_mode(False):
        return zonal_row.to(device), column.to(device), degree.to(device)


def geometric_initial_embedding(cache: EdgeCacheLike, radial: Tensor, n_nodes: int) -> Tensor:
    """GIE: ``x[i,(l,m)] = inv_sqrt_deg_i Σ_{dst=i} D[e,(l,0),(l,m)]·R[e,l]`` for l ≥ 1.

    ``radial (E, L+1, C)`` (before the type-feature fuse) → ``(N, (L+1)², C)`` with row 0 zero.
    """
    zonal_row, column, degree = _zonal_gather_index(radial.shape[1] - 1, radial.device)
    # One gather per operand for all degrees (no per-degree slices + cat).
    zonal = cache.wigner[:, zonal_row, column]  # (E, D-1)
    message = zonal[:, :, None] * radial.index_select(1, degree)  # (E, D-1, C)
    out = sum_into_dst(message, cache.graph.dst, n_nodes) * cache.inv_sqrt_deg[:, None, None]
    return F.pad(out, (0, 0, 1, 0))
