"""Initial node state: radial features, environment seed (FiLM on l=0) and GIE (l ≥ 1).

model-dpa4.md §3: the radial MLP maps the enveloped radial basis to per-degree features
``R (E, L+1, C)`` (times the p=5 envelope when version ≥ 1.1); the env seed aggregates
``[s, s·r̂] ⊗ g_e`` per centre into an invariant Gram matrix whose projection gives FiLM logits;
GIE lifts ``R`` to l ≥ 1 through the zonal Wigner rows. ``R`` itself is never formed per edge:
GIE reads its l ≥ 1 rows before the envelope (which scales the zonal entries instead), and the
blocks read it through folded linear maps (service.model.dpa4.DPA4Model.edge_maps).
"""

from __future__ import annotations

import math
from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx

from service.model.config import ModelConfig
from service.model.layers.derived import derived_weights
from service.model.layers.geometry import EdgeCacheLike, sum_into_dst
from service.model.layers.linear import MLP, Dense
from service.model.layers.pointwise import multiply_add
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

    def forward(self, length: Tensor, inv_length: Tensor, env_rbf: Tensor) -> Tensor:
        """``length``, its reciprocal ``inv_length`` and the envelope ``env_rbf``, all ``(E,)``."""
        r = length[:, None]
        if self.kind == "bessel":
            # The cache's lengths are regularised (≥ eps), so 1/r is finite; the envelope and 1/r
            # share one per-edge factor, leaving two (E, n) passes.
            return torch.sin(r * self.freqs) * (env_rbf * inv_length)[:, None]
        basis = torch.exp(-((r - self.freqs) ** 2) / (2.0 * self.width**2))
        return basis * env_rbf[:, None]


class EnvSeed(nn.Module):
    """Environment-seed FiLM logits ``(N, 2C)`` (DeePMD ``EnvironmentInitialEmbedding``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        s = cfg.env_seed_sizes
        self.axis = s.axis
        self.rbf_out = s.rbf_out
        self.rbf_proj = MLP([cfg.n_radial, s.rbf_out, s.rbf_out])
        self.type_table = nn.Parameter(torch.randn(cfg.n_types + 1, s.type_dim) * 0.1)
        self.filter = MLP([s.g_in, s.hidden, s.embed])
        self.output = Dense(s.embed * s.axis, 2 * cfg.channels)

    def filter_pair_terms(self, *, live: bool = True) -> Tensor:
        """``((T+1)², hidden)``: the filter's first layer applied to ``[T_env[a] | T_env[b]]``,
        at row ``a·(T+1) + b`` (source type a, destination type b); cached unless ``live``.

        The type part of the filter input depends on the edge's type pair only, so it is one
        row gather per edge instead of two gathers and a concatenation."""

        def build() -> Tensor:
            matrix = self.filter.dense(0).matrix
            type_dim = self.type_table.shape[1]
            src_rows = self.type_table @ matrix[self.rbf_out : self.rbf_out + type_dim]
            dst_rows = self.type_table @ matrix[self.rbf_out + type_dim :]
            return (src_rows[:, None, :] + dst_rows[None, :, :]).flatten(0, 1)

        sources = (self.type_table, self.filter.dense(0).matrix)
        return derived_weights(self, "filter_pair_terms", sources, build, live=live)

    def forward(
        self,
        cache: EdgeCacheLike,
        inv_length: Tensor,
        rbf_features: Tensor,
        pair: Tensor,
        *,
        fused: bool,
        live: bool = True,
    ) -> Tensor:
        """FiLM logits ``(N, 2C)`` from ``1/length (E,)``, the projected radial basis
        ``rbf_features = rbf_proj(rbf) (E, rbf_out)`` (the caller runs ``rbf_proj``, whose first
        layer it shares with the radial MLP's) and the edges' type pair index ``pair (E,)``
        (``src_type·(T+1) + dst_type``); ``fused`` sums over each centre's edges with the CSR
        op."""
        g = cache.graph
        # r̃ = [s, s·r̂] with s = env/r; the cache's length is sqrt(|r|² + eps²) (§3).
        r_tilde = seed_vectors(cache.vec, cache.env, inv_length)  # (E, 4)
        first = self.filter.dense(0).matrix[: self.rbf_out]
        # In place on the fresh gather: an out-of-place addmm with a full-size addend copies it
        # into its result before the GEMM (one more launch on CUDA).
        pre = self.filter_pair_terms(live=live)[pair].addmm_(rbf_features, first)
        filt = self.filter.last(F.silu(pre))  # (E, embed)
        if fused:
            # Every r̃ component multiplies the one filter row: no (E, 4, embed) message.
            same_row = device_constant((0,) * r_tilde.shape[1], r_tilde.device, torch.int64)
            agg = segment_outer_sum(r_tilde, filt[:, None, :], same_row, g.dst_rowptr)
        else:
            outer = r_tilde[:, :, None] * filt[:, None, :]  # (E, 4, embed)
            agg = sum_into_dst(outer, g.dst, cache.inv_sqrt_deg.shape[0])
        agg = agg * cache.inv_sqrt_deg[:, None, None]
        gram = torch.bmm(agg.transpose(1, 2), agg[:, :, : self.axis])  # (N, embed, axis)
        logits: Tensor = self.output(gram.flatten(1))
        return logits


def seed_vectors(vec: Tensor, env: Tensor, inv_length: Tensor) -> Tensor:
    """(E, 4) ``r̃ = [s, s·r/len]`` with ``s = env/len``, from ``vec (E, 3)``, ``env (E,)`` and
    ``1/len (E,)`` (§3). Backward in closed form (eight launches; autograd takes ten): with
    ``t = env/len²``, ``g_r = g_v·t``, ``d = Σ g_v·r``, ``g_env = (g_s + d/len)/len`` and
    ``g_{1/len} = env·(g_s + 2d/len)``; differentiable ops, so double backward works."""
    out: Tensor = _SeedVectors.apply(vec, env, inv_length)  # type: ignore[no-untyped-call]
    return out


class _SeedVectors(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, vec: Tensor, env: Tensor, inv_length: Tensor) -> Tensor:
        s = env * inv_length
        t = s * inv_length
        # t is saved for a first-order backward; under create_graph it is recomputed from the
        # inputs so that its own derivative is recorded.
        ctx.save_for_backward(vec, env, inv_length, t)
        return torch.cat([s[:, None], vec * t[:, None]], dim=1)

    @staticmethod
    def backward(
        ctx: FunctionCtx, grad: Tensor
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        vec, env, inv_length, t = ctx.saved_tensors  # type: ignore[attr-defined]
        want_vec, want_env, want_inv = ctx.needs_input_grad  # type: ignore[attr-defined]
        if torch.is_grad_enabled():
            t = env * inv_length * inv_length
        grad_s, grad_v = grad[:, 0], grad[:, 1:]
        grad_vec = grad_v * t[:, None] if want_vec else None
        grad_env = grad_inv = None
        if want_env or want_inv:
            along = (grad_v * vec).sum(dim=1)
            if want_env:
                grad_env = torch.addcmul(grad_s, along, inv_length) * inv_length
            if want_inv:
                grad_inv = torch.addcmul(grad_s, along, inv_length, value=2.0) * env
        return grad_vec, grad_env, grad_inv


def film_coefficients(scale_log: Tensor, shift_log: Tensor, channels: int) -> Tensor:
    """``(2C,)``: ``e^a`` on the scale half and ``e^b`` on the shift half of the FiLM logits."""
    return torch.cat([scale_log.exp().expand(channels), shift_log.exp().expand(channels)])


def film(type_feat: Tensor, logits: Tensor, coefficients: Tensor) -> Tensor:
    """``T ⊙ (1 + e^a·tanh(scale)) + e^b·tanh(shift)`` with ``logits = [scale | shift]`` and
    ``coefficients`` from :func:`film_coefficients`."""
    scaled = torch.tanh(logits) * coefficients
    channels = type_feat.shape[-1]
    scale, shift = scaled.split_with_sizes([channels, channels], dim=1)
    return multiply_add(shift, type_feat, scale + 1.0)


def geometric_initial_embedding(
    cache: EdgeCacheLike, degree_rows: Tensor, edge_weight: Tensor | None, *, fused: bool
) -> Tensor:
    """GIE: ``x[i,(l,m)] = inv_sqrt_deg_i Σ_{dst=i} D[e,(l,0),(l,m)]·w_e·R[e,l]`` for l ≥ 1.

    ``degree_rows (E, L, C)`` are the radial features of degrees 1..L before the envelope and the
    type-feature fuse (any strides); ``edge_weight (E,)`` is that envelope (``None``: none). It
    multiplies the (E, D-1) zonal entries instead of the (E, L, C) rows. Returns the l ≥ 1 rows
    ``(N, D-1, C)``. ``fused`` takes all degrees in one CSR ``segment_outer_sum`` (zonal entries
    × the rows of their degree): deterministic, no atomics, and no (E, D-1, C) message in either
    direction; the reference path builds the messages and sums them into the centres.
    """
    lmax = degree_rows.shape[1]
    zonal_entry, row_of_degree = _zonal_entries(lmax, cache.wigner.shape[2], degree_rows.device)
    zonal = cache.wigner.flatten(1).index_select(1, zonal_entry)  # (E, D-1)
    if edge_weight is not None:
        zonal = zonal * edge_weight[:, None]
    if fused:
        summed = segment_outer_sum(zonal, degree_rows, row_of_degree, cache.graph.dst_rowptr)
    else:
        message = zonal[:, :, None] * degree_rows.index_select(1, row_of_degree)
        summed = sum_into_dst(message, cache.graph.dst, cache.inv_sqrt_deg.shape[0])
    return summed * cache.inv_sqrt_deg[:, None, None]


@cache
def _zonal_entry_values(lmax: int, wigner_dim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Flat index of ``D[(l,0), (l,m)]`` in a (Dw·Dw) Wigner row and the row ``l-1`` of the
    degree-l radial features, for every packed row (l, m) with l ≥ 1."""
    degrees = [l for l in range(1, lmax + 1) for _ in range(2 * l + 1)]
    columns = range(1, (lmax + 1) ** 2)
    flat = tuple((l * l + l) * wigner_dim + col for l, col in zip(degrees, columns, strict=True))
    return flat, tuple(l - 1 for l in degrees)


def _zonal_entries(lmax: int, wigner_dim: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``(zonal_entry, row_of_degree)``: :func:`_zonal_entry_values` as (D-1,) int64 device
    constants."""
    flat, rows = _zonal_entry_values(lmax, wigner_dim)
    return (
        device_constant(flat, device, torch.int64),
        device_constant(rows, device, torch.int64),
    )
