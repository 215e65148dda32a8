"""The DPA4/SeZM energy model (DeePMD-kit conventions, model-dpa4.md §1–§5).

``DPA4Model(config)(types, cache) → atomic energies (N,) float64``. The model consumes a built edge
cache (service.graph) and never builds graphs; forces/virials come from autograd through
``cache.vec`` (see service.model.potential). Which SO(2) value path runs (fused Triton ops or
their eager references) and the mixing stack's GEMM tier are arguments of ``forward`` decided by
the caller (Potential).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from service.model.config import ModelConfig
from service.model.layers.edge_chunks import EdgeChunk, plan_edge_chunks
from service.model.layers.embedding import (
    EnvSeed,
    RadialBasis,
    film,
    geometric_initial_embedding,
)
from service.model.layers.ffn import GatedGLUFFN, make_ffn
from service.model.layers.geometry import EdgeCacheLike
from service.model.layers.linear import MLP, Dense
from service.model.layers.norms import EquivariantRMSNorm
from service.model.layers.so2conv import SO2Convolution
from so2kernels.mixing_stack import StackPrecision

POST_SO2_NORM_EPS = 1.0
"""Post-SO(2) norm eps with ``edge_norm=False``: a unit floor, ``1/sqrt(1+var)`` (§4.1)."""
PRE_FFN_NORM_EPS = 1e-5


class InteractionBlock(nn.Module):
    """``x ← x + PostNorm(SO2Conv(x))``, then ``x ← x + FFN_k(PreNorm_k(x))`` for each FFN."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.conv = SO2Convolution(cfg)
        self.post_conv_norm = EquivariantRMSNorm(cfg.lmax, cfg.channels, eps=POST_SO2_NORM_EPS)
        self.ffn_norms = nn.ModuleList(
            EquivariantRMSNorm(cfg.lmax, cfg.channels, eps=PRE_FFN_NORM_EPS)
            for _ in range(cfg.ffn_blocks)
        )
        self.ffns = nn.ModuleList(
            make_ffn(cfg.ffn, cfg.lmax, cfg.channels, cfg.ffn_hidden) for _ in range(cfg.ffn_blocks)
        )

    def forward(
        self,
        x: Tensor,
        radial: Tensor,
        cache: EdgeCacheLike,
        *,
        fused: bool,
        live_weights: bool,
        taps: dict[str, Tensor] | None,
        prefix: str,
        chunks: list[EdgeChunk] | None = None,
        stack_precision: StackPrecision = StackPrecision.EXACT,
    ) -> Tensor:
        conv_taps: dict[str, Tensor] | None = {} if taps is not None else None
        update = self.conv(
            x, radial, cache, fused=fused, live_weights=live_weights,
            stack_precision=stack_precision, taps=conv_taps, chunks=chunks,
        )  # fmt: skip
        normed = self.post_conv_norm(update)
        x = x + normed
        if taps is not None and conv_taps is not None:
            taps.update({f"{prefix}so2_{k}": v for k, v in conv_taps.items()})
            taps[f"{prefix}so2conv_out"] = update
            taps[f"{prefix}post_so2_norm_out"] = normed
        for k, (norm, ffn) in enumerate(zip(self.ffn_norms, self.ffns, strict=True)):
            pre = norm(x)
            delta = ffn(pre)
            x = x + delta
            if taps is not None and k == 0:
                taps[f"{prefix}pre_ffn_norm_out"] = pre
                taps[f"{prefix}ffn_out"] = delta
        return x


class FittingNet(nn.Module):
    """GLU fitting: ``h ← val·SiLU(gate)`` with ``[val | gate] = h @ W + b``, then ``h @ w_out``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.hidden = nn.ModuleList()
        dim_in = cfg.channels
        for width in cfg.fitting_widths:
            self.hidden.append(Dense(dim_in, 2 * width, bias=True))
            dim_in = width
        self.output = Dense(dim_in, 1)

    def forward(self, d: Tensor) -> Tensor:
        for layer in self.hidden:
            val, gate = layer(d).chunk(2, dim=-1)
            d = val * F.silu(gate)
        energy: Tensor = self.output(d)
        return energy[:, 0]


class DPA4Model(nn.Module):
    """DPA4 energy model of the supported subset; see the module docstring."""

    energy_bias: Tensor

    def __init__(self, config: ModelConfig):
        super().__init__()
        cfg = config
        self.config = cfg
        c, lmax = cfg.channels, cfg.lmax
        self.type_embedding = nn.Parameter(
            torch.randn(cfg.n_types + 1, c) / (cfg.n_types + c) ** 0.5
        )
        self.radial_basis = RadialBasis(cfg)
        self.radial_mlp = MLP([cfg.n_radial, *cfg.radial_widths, (lmax + 1) * c])
        self.env_seed = EnvSeed(cfg) if cfg.use_env_seed else None
        self.film_scale_log = nn.Parameter(torch.full((1,), float(torch.log(torch.tensor(0.01)))))
        self.film_shift_log = nn.Parameter(torch.full((1,), float(torch.log(torch.tensor(0.01)))))
        self.blocks = nn.ModuleList(InteractionBlock(cfg) for _ in range(cfg.n_blocks))
        self.readout = GatedGLUFFN(0, c, cfg.readout_hidden)
        self.fitting = FittingNet(cfg)
        self.register_buffer("energy_bias", torch.zeros(cfg.n_types, dtype=torch.float64))
        self.file_metadata: dict[str, Any] | None = None
        """The metadata document of the file this model was loaded from (service.model.io)."""

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> DPA4Model:
        """Device/dtype moves keep the per-element energy bias in float64 (eV-level offsets)."""
        bias = self._buffers.pop("energy_bias")
        try:
            super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        finally:
            assert bias is not None
            device = self.type_embedding.device
            self._buffers["energy_bias"] = bias.to(device=device, dtype=torch.float64)
        return self

    def forward(
        self,
        types: Tensor,
        cache: EdgeCacheLike,
        *,
        fused: bool = False,
        live_weights: bool = True,
        taps: dict[str, Tensor] | None = None,
        edge_chunk: int | None = None,
        stack_precision: StackPrecision = StackPrecision.EXACT,
    ) -> Tensor:
        """Atomic energies ``(N,) float64`` of atoms with type indices ``types (N,) int64``.

        ``fused`` selects the so2kernels ops instead of their references; ``live_weights=False``
        lets inference reuse packed stack weights (no weight gradients); ``taps`` collects
        intermediates by name for stage-by-stage validation; ``edge_chunk`` (edges per chunk)
        runs the SO(2) convolutions' per-edge pipeline in chunks that are recomputed in the
        backward (bounded memory; see :mod:`service.model.layers.so2conv`). Not for
        ``create_graph`` (training): leave it ``None`` there. ``stack_precision`` is the GEMM tier
        of every block's mixing stack: ``StackPrecision.FAST`` (fp16x3) needs ``fused``; all other
        arithmetic stays exact fp32 whatever the tier.
        """
        descriptor = self.descriptor(
            types, cache, fused=fused, live_weights=live_weights, taps=taps,
            edge_chunk=edge_chunk, stack_precision=stack_precision,
        )  # fmt: skip
        raw: Tensor = self.fitting(descriptor)
        if taps is not None:
            taps["descriptor"] = descriptor
            taps["fitting_net_raw"] = raw
        return raw.double() + self.energy_bias[types]

    def initial_state(
        self,
        types: Tensor,
        cache: EdgeCacheLike,
        taps: dict[str, Tensor] | None = None,
        *,
        fused: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """``(x0 (N, (L+1)², C), fused radial features (E, L+1, C))`` (§1 steps 4–7); ``fused``
        runs the edge → centre sums as CSR segment ops."""
        cfg = self.config
        g = cache.graph
        n_nodes = types.shape[0]
        type_feat = self.type_embedding[types]
        rbf = self.radial_basis(cache.length, cache.env_rbf)
        radial = self.radial_mlp(rbf).view(-1, cfg.lmax + 1, cfg.channels)
        if cfg.version >= 1.1:
            radial = radial * cache.env[:, None, None]
        x0_scalar = type_feat
        x = type_feat.new_zeros(n_nodes, (cfg.lmax + 1) ** 2, cfg.channels)
        if self.env_seed is not None:
            logits = self.env_seed(types, cache, rbf, fused=fused)
            x0_scalar = film(type_feat, logits, self.film_scale_log, self.film_shift_log)
            x = geometric_initial_embedding(cache, radial, n_nodes, fused=fused)
            if taps is not None:
                taps["env_seed_film"] = logits
                taps["gie_out"] = x
        x = torch.cat([x0_scalar[:, None, :], x[:, 1:]], dim=1)
        edge_type = self.type_embedding[types[g.src]] + self.type_embedding[types[g.dst]]
        return x, radial + edge_type[:, None, :]

    def descriptor(
        self,
        types: Tensor,
        cache: EdgeCacheLike,
        *,
        fused: bool,
        live_weights: bool,
        taps: dict[str, Tensor] | None,
        edge_chunk: int | None = None,
        stack_precision: StackPrecision = StackPrecision.EXACT,
    ) -> Tensor:
        """Invariant per-atom descriptor ``(N, C)``: blocks then the residual l=0 readout."""
        if edge_chunk is not None and taps is None and torch.is_grad_enabled():
            # Bounded-memory mode: the embedding stage's per-edge activations (radial MLP, env-seed
            # filter) are recomputed in the backward like the convolutions' chunks; only its
            # outputs, which every block reads, stay resident.
            state: tuple[Tensor, Tensor] = checkpoint(
                partial(self.initial_state, fused=fused), types, cache, use_reentrant=False
            )
            x, radial = state
        else:
            x, radial = self.initial_state(types, cache, taps, fused=fused)
        if taps is not None:
            taps["x0"] = x
        chunks = plan_edge_chunks(cache.graph, edge_chunk)
        for i, block in enumerate(self.blocks):
            x = block(
                x, radial, cache, fused=fused, live_weights=live_weights, taps=taps,
                prefix=f"b{i}_", chunks=chunks, stack_precision=stack_precision,
            )  # fmt: skip
            if taps is not None:
                taps[f"b{i}_out"] = x
        x0 = x[:, :1]
        readout: Tensor = self.readout(x0)
        return (x0 + readout)[:, 0]
