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
from service.model.layers.derived import derived_weights
from service.model.layers.edge_chunks import EdgeChunk, plan_edge_chunks, whole_graph
from service.model.layers.embedding import (
    EnvSeed,
    RadialBasis,
    film,
    film_coefficients,
    geometric_initial_embedding,
)
from service.model.layers.ffn import GatedGLUFFN, make_ffn
from service.model.layers.geometry import EdgeCacheLike
from service.model.layers.linear import MLP, Dense
from service.model.layers.norms import EquivariantRMSNorm
from service.model.layers.pointwise import log_envelope_bias, multiply_add
from service.model.layers.so2conv import ConvEdgeInputs, EdgeOps, SO2Convolution
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
        edge: ConvEdgeInputs,
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
            x, edge, cache, fused=fused, live_weights=live_weights,
            stack_precision=stack_precision, taps=conv_taps, chunks=chunks,
        )  # fmt: skip
        normed = self.post_conv_norm(update, live=live_weights)
        x = x + normed
        if taps is not None and conv_taps is not None:
            taps.update({f"{prefix}so2_{k}": v for k, v in conv_taps.items()})
            taps[f"{prefix}so2conv_out"] = update
            taps[f"{prefix}post_so2_norm_out"] = normed
        for k, (norm, ffn) in enumerate(zip(self.ffn_norms, self.ffns, strict=True)):
            pre = norm(x, live=live_weights)
            delta = ffn(pre, live=live_weights)
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
        treats the weights as frozen (inference): weights derived from them (packed stack,
        folded radial maps, norm rows, …; service.model.layers.derived) are built once per
        weights version, and the norms run closed-form first-order backwards, so there are no
        weight gradients and no ``create_graph`` (that raises); ``taps`` collects
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
        # One mixed-precision add (the float32 raw energies are widened exactly in the kernel).
        return self.energy_bias[types] + raw

    def convolutions(self) -> list[SO2Convolution]:
        """Every block's SO(2) convolution, in block order."""
        return [block.conv for block in self.blocks if isinstance(block, InteractionBlock)]

    def edge_maps(self, *, live: bool = True) -> tuple[Tensor, Tensor]:
        """``(head, pair_terms)``: every block's per-edge inputs as linear maps of the radial
        MLP's last hidden layer ``h (E, Hr)`` and of the edge's type pair (cached unless
        ``live``).

        The fused radial features are ``R = env·(h @ W_last) + (T[src] + T[dst])`` per degree,
        and each block reads them only through linear maps (SO2Convolution.radial_maps). So
        ``head (Hr, [L·C +] ΣP) = [W_last[:, l≥1] |] W_last @ maps`` (the l ≥ 1 rows feed GIE)
        and ``pair_terms ((T+1)², ΣP)`` holds ``(T[a] + T[b]) @ Σ_l maps_l`` at row
        ``a·(T+1) + b``: per step one GEMM on ``h`` and one row gather replace the (E, L+1, C)
        features and every per-block product with them.
        """
        cfg = self.config
        convs = self.convolutions()

        def build() -> tuple[Tensor, Tensor]:
            kernels, logits = zip(*(conv.radial_maps() for conv in convs), strict=True)
            maps = torch.cat([*kernels, *(m for m in logits if m is not None)], dim=1)
            last = self.radial_mlp.last.matrix
            head = last @ maps
            if self.env_seed is not None:
                head = torch.cat([last[:, cfg.channels :], head], dim=1)
            per_type = self.type_embedding @ maps.view(cfg.lmax + 1, cfg.channels, -1).sum(0)
            return head, (per_type[:, None, :] + per_type[None, :, :]).flatten(0, 1)

        sources: list[Tensor] = [self.radial_mlp.last.matrix, self.type_embedding]
        for conv in convs:
            sources += conv.radial_sources()
        return derived_weights(self, "edge_maps", sources, build, live=live)

    def film_coefficients(self, *, live: bool = True) -> Tensor:
        """``(2C,)`` FiLM strengths ``[e^a … | e^b …]`` (cached unless ``live``)."""
        return derived_weights(
            self, "film", (self.film_scale_log, self.film_shift_log),
            lambda: film_coefficients(
                self.film_scale_log, self.film_shift_log, self.config.channels
            ),
            live=live,
        )  # fmt: skip

    def initial_state(
        self,
        types: Tensor,
        cache: EdgeCacheLike,
        taps: dict[str, Tensor] | None = None,
        *,
        fused: bool = False,
        live: bool = True,
    ) -> tuple[Tensor, list[ConvEdgeInputs]]:
        """``(x0 (N, (L+1)², C), every block's per-edge inputs)`` (§1 steps 4–7); ``fused``
        runs the edge → centre sums as CSR segment ops."""
        cfg = self.config
        g = cache.graph
        lmax, c = cfg.lmax, cfg.channels
        type_feat = self.type_embedding[types]
        # One index per edge for everything that depends on its (source, destination) types.
        pair = torch.add(types[g.dst], types[g.src], alpha=cfg.n_types + 1)
        # One reciprocal for the radial basis and the env seed: products instead of divisions,
        # whose backward is several kernels each.
        inv_length = torch.reciprocal(cache.length)
        rbf = self.radial_basis(cache.length, inv_length, cache.env_rbf)
        head, pair_terms = self.edge_maps(live=live)
        radial_hidden, rbf_features = self._open_radial_mlps(rbf, live=live)
        projected = radial_hidden @ head
        envelope = cache.env if cfg.version >= 1.1 else None
        if self.env_seed is None:
            columns = projected
            x = F.pad(type_feat[:, None, :], (0, 0, 0, (lmax + 1) ** 2 - 1))
        else:
            degree_rows, columns = projected.split_with_sizes(
                [lmax * c, projected.shape[1] - lmax * c], dim=1
            )
            assert rbf_features is not None
            logits = self.env_seed(cache, inv_length, rbf_features, pair, fused=fused, live=live)
            x0_scalar = film(type_feat, logits, self.film_coefficients(live=live))
            rows = degree_rows.view(-1, lmax, c)
            gie = geometric_initial_embedding(cache, rows, envelope, fused=fused)
            x = torch.cat([x0_scalar[:, None, :], gie], dim=1)
            if taps is not None:
                taps["env_seed_film"] = logits
                taps["gie_out"] = F.pad(gie, (0, 0, 1, 0))
        if envelope is None:
            columns = columns + pair_terms[pair]
        else:
            columns = multiply_add(pair_terms[pair], columns, envelope[:, None])
        return x, self._conv_inputs(columns, cache, fused=fused)

    def _open_radial_mlps(self, rbf: Tensor, *, live: bool) -> tuple[Tensor, Tensor | None]:
        """``(radial MLP's last hidden layer (E, Hr), env seed's rbf_proj(rbf) (E, rbf_out) or
        None)``. Both MLPs open with ``SiLU(rbf @ W)`` on the same basis: their first layers run
        as one GEMM and one SiLU (concatenated weights, cached unless ``live``), and the
        backward joins both gradients in one GEMM instead of two and a sum."""
        seed = self.env_seed
        if seed is None:
            return self.radial_mlp.hidden(rbf), None
        if len(self.radial_mlp.layers) < 2 or len(seed.rbf_proj.layers) < 2:
            return self.radial_mlp.hidden(rbf), seed.rbf_proj(rbf)
        radial_first, seed_first = self.radial_mlp.dense(0).matrix, seed.rbf_proj.dense(0).matrix
        first = derived_weights(
            self, "first_radial_layers", (radial_first, seed_first),
            lambda: torch.cat([radial_first, seed_first], dim=1), live=live,
        )  # fmt: skip
        opened = F.silu(rbf @ first)
        radial, projected = opened.split_with_sizes(
            [radial_first.shape[1], seed_first.shape[1]], dim=1
        )
        rbf_features = seed.rbf_proj.last(seed.rbf_proj.hidden_after_first(projected))
        return self.radial_mlp.hidden_after_first(radial), rbf_features

    def _conv_inputs(
        self, columns: Tensor, cache: EdgeCacheLike, *, fused: bool
    ) -> list[ConvEdgeInputs]:
        """Every block's :class:`ConvEdgeInputs` from the per-edge columns ``(E, ΣP)`` laid out
        ``[kernel of block 0 | … | logit biases of all blocks]``."""
        convs = self.convolutions()
        env = cache.env
        logit_widths = [conv.logit_width for conv in convs]
        sizes = [conv.kernel_width for conv in convs]
        if any(logit_widths):
            sizes.append(sum(logit_widths))
        # One split: its backward is a single concatenation of every block's gradients.
        pieces = columns.split_with_sizes(sizes, dim=1)
        unit_alpha = env.new_ones(env.shape[0], 1) if self.config.n_focus == 1 else None
        terms: list[Tensor]
        if any(logit_widths):
            # 2·log env joins every block's logit bias once; −inf where env = 0.
            biases = log_envelope_bias(pieces[-1], env)
            terms = list(biases.split_with_sizes(logit_widths, dim=1))
        else:
            ops = EdgeOps(whole_graph(cache.graph), fused)
            terms = [(env * ops.from_dst(cache.inv_sqrt_deg))[:, None]] * len(convs)
        return [
            ConvEdgeInputs(conv.edge_kernel(kernel), term, unit_alpha)
            for conv, kernel, term in zip(convs, pieces[: len(convs)], terms, strict=True)
        ]

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
            state: tuple[Tensor, list[ConvEdgeInputs]] = checkpoint(
                partial(self.initial_state, fused=fused, live=live_weights),
                types, cache, use_reentrant=False,
            )  # fmt: skip
            x, conv_inputs = state
        else:
            x, conv_inputs = self.initial_state(types, cache, taps, fused=fused, live=live_weights)
        if taps is not None:
            taps["x0"] = x
        chunks = plan_edge_chunks(cache.graph, edge_chunk)
        for i, (block, edge) in enumerate(zip(self.blocks, conv_inputs, strict=True)):
            x = block(
                x, edge, cache, fused=fused, live_weights=live_weights, taps=taps,
                prefix=f"b{i}_", chunks=chunks, stack_precision=stack_precision,
            )  # fmt: skip
            if taps is not None:
                taps[f"b{i}_out"] = x
        x0 = x[:, 0]
        readout: Tensor = self.readout(x0, live=live_weights)
        return x0 + readout
