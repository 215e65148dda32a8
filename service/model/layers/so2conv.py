"""SO(2) convolution of one interaction block (model-dpa4.md §4.2) on the so2kernels value path.

Pipeline, per block with degree L, focus streams F of width Cf (``C_wide = F·Cf``):

1. ``pre_focus_mix``: per-degree ``C → C_wide`` on the node features.
2. Radial kernel from the block's radial features: ``rad = R[:, 0..L] (@ W_hid)``; rank 0 ("none")
   multiplies each degree by ``rad``, rank R ≥ 1 ("degree_channel") contracts ``rad`` into the
   compact degree kernel ``kc = rad.flatten() @ W_mix`` with channel basis ``cb``. Every use of
   ``R`` is linear (this kernel and the attention logits' ``rad[:, 0] @ w_logit``), so the model
   folds these maps into its radial MLP (:meth:`SO2Convolution.radial_maps`) and hands each
   block only its per-edge kernel and logit bias (:class:`ConvEdgeInputs`).
3. ``rotate_mix`` (gather at src + Wigner rotation to the edge frame + radial mixing) → ``u0``.
4. Focus competition ``α = 0.98·softmax(u0[l=0] @ w) + 0.02/F`` from the pre-stack l=0 row.
5. ``mixing_stack`` (gated SO(2) linears, residual, α applied by the final layer) → ``x_local``.
6. Rotate back with ``Dᵀ`` over the reduced rows, rescale l > 1 by ``√((2l+1)/3)``.
7. Aggregate at dst: envelope-gated attention with null mass and an output gate (the weights
   enter unnormalised; normalisation and gate are one factor per node and head), or the
   env-weighted scatter with degree normalisation; ``post_focus_mix`` ``C_wide → C``.

Steps 3 and 5 are the so2kernels ops (``fused``) or their eager references (``reference``). The
stack's GEMM tier (``stack_precision``) is an explicit argument: the exact fp32 tier everywhere,
or, on the fused path only, the opt-in error-compensated fp16x3 tier; the rest stays exact. The
packed stack weights are cached for inference and rebuilt live when weights need gradients. On
the fused path steps 6–7 are one op, ``so2_attention_aggregate`` (rotate back, rescale, edge
weights, dst CSR sum in registers: the (E, D, C_wide) messages never exist), and every
edge↔node gather/sum is a CSR segment op, so the aggregation is deterministic (no atomics).

Memory budget (forces, fp32; DeePMD bar config C 128, L 2, 2 blocks, 3 mixing layers, F·Cf =
1·128, water at rcut 6 Å ≈ 89 edges/atom). Per-edge activations one convolution keeps for its
backward when unchunked: ``u0``, ``x_local``, ``u_final`` and ``n−1`` gated pre-activations, each
(3L+1)·C_wide fp32 = 3.5 KiB, i.e. (n+2)·3.5 = 17.5 KiB/edge, ≈ 1.5 MiB/atom per block, 3.0 MiB/atom
for the model (potential.value_path_bytes_per_edge). With edge chunks (potential ``memory="lean"``)
each chunk's pipeline is checkpointed: only its inputs are kept (node features, the block's
per-edge inputs (E, K·R + F·H) = 56 B/edge, the Wigner cache 324 B/edge), and the value-path
activations exist for one chunk at a time (131k edges ≈ 2.3 GB transient, independent of system
size) at the price of one extra value-path forward per step; the embedding stage before the
blocks is recomputed in the backward as well (DPA4Model.descriptor). Counted on CPU (saved-tensor
hooks, fused path, 192-atom water box, bar config): everything kept for the backward is
4.2 MiB/atom unchunked and 0.42 MiB/atom in ``lean`` mode (4.6 and 0.62 while the radial rows
(E, L+1, C) were kept); measured peak on the H200 before that: 5.6 MiB/atom ``fast``,
1.71 MiB/atom ``lean`` (12,288 and 73,728 atoms).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from service.model.config import ModelConfig
from service.model.layers.derived import derived_weights
from service.model.layers.edge_chunks import EdgeChunk, split_edges, split_nodes, whole_graph
from service.model.layers.geometry import EdgeCacheLike, sum_into_dst
from service.model.layers.linear import DegreeLinear, FocusLinear
from service.model.layers.norms import ScalarRMSNorm, unit_rms
from so2kernels._layout import (
    n_kernel_slots,
)
from so2kernels.aggregate import attention_aggregate, attention_aggregate_reference
from so2kernels.mixing_stack import StackPrecision, mixing_stack_reference, so2_mixing_stack
from so2kernels.rotate_mix import rotate_mix_reference
from so2kernels.segment import segment_broadcast, segment_sum

FOCUS_LABEL_SMOOTHING = 0.02


@dataclass(frozen=True)
class PackedStack:
    """Mixing-stack weights in the ops' layout (see so2kernels.mixing_stack)."""

    w0_all: Tensor  # (n, F, M0, M0)
    w1_all: Tensor  # (n, F, M1, M1)
    gw_all: Tensor  # (n-1, F, Cf, LG)


class SO2Linear(nn.Module):
    """Weights of one SO(2) linear: ``weight_m0 (M0, F·M0)``, ``weight_m1 (L·Cf, F·2L·Cf)``.

    ``weight_m1`` holds ``[W_u | W_v]`` per focus on its output axis; the (in, out) |m|=1 block is
    ``[[W_u, W_v], [-W_v, W_u]]`` over rows/columns ``[m=-1 | m=+1]`` (model-dpa4.md §10.3).
    """

    def __init__(self, lmax: int, focus_dim: int, n_focus: int):
        super().__init__()
        m0 = (lmax + 1) * focus_dim
        half = lmax * focus_dim
        self.weight_m0 = nn.Parameter(torch.randn(m0, n_focus * m0) / math.sqrt(m0))
        self.weight_m1 = nn.Parameter(torch.randn(half, n_focus * 2 * half) / math.sqrt(2 * half))

    def packed(self, n_focus: int) -> tuple[Tensor, Tensor]:
        """``(W0 (F, M0, M0), W1 (F, M1, M1))`` assembled per focus."""
        m0 = self.weight_m0.shape[0]
        half = self.weight_m1.shape[0]
        w0 = self.weight_m0.view(m0, n_focus, m0).permute(1, 0, 2)
        w = self.weight_m1.view(half, n_focus, 2 * half).permute(1, 0, 2)
        w_u, w_v = w[..., :half], w[..., half:]
        w1 = torch.cat([torch.cat([w_u, w_v], -1), torch.cat([-w_v, w_u], -1)], dim=-2)
        return w0.contiguous(), w1.contiguous()


class EdgeOps:
    """Gathers and reductions between one chunk's edges and its nodes.

    The fused path uses the CSR segment ops (each the other's adjoint: no atomics in either
    direction, reproducible bit for bit); the reference path uses ``index_select``/``index_add``.
    """

    def __init__(self, chunk: EdgeChunk, fused: bool):
        self.chunk = chunk
        self.fused = fused

    def sum_to_dst(self, rows: Tensor) -> Tensor:
        """``(Ec, *S) → (n_chunk, *S)``: sum over each destination's edges."""
        c = self.chunk
        if self.fused:
            return segment_sum(rows, None, c.dst_rowptr)
        return sum_into_dst(rows, c.dst, c.n_nodes)

    def from_dst(self, values: Tensor) -> Tensor:
        """``(n_chunk, *S) → (Ec, *S)``: each edge reads its destination's row."""
        c = self.chunk
        if self.fused:
            return segment_broadcast(values, None, c.dst_rowptr, c.n_edges)
        return values.index_select(0, c.dst)

    def from_src(self, values: Tensor) -> Tensor:
        """``(N, *S) → (Ec, *S)``: each edge reads its source's row."""
        c = self.chunk
        if self.fused:
            return segment_broadcast(values, c.src_order, c.src_rowptr)
        return values.index_select(0, c.src)


@dataclass(frozen=True)
class ConvEdgeInputs:
    """Per-edge inputs of one block's convolution, computed once per step for every block from
    the radial features (service.model.dpa4): the radial features themselves never exist.

    ``kernel``: the compact degree kernel ``(E, K·R)`` in the rotate-mix layout, or with rank 0
    the per-degree multiplier ``(E, L+1, C_wide)``. ``edge_term``: with attention the logit bias
    ``(E, F·H)`` (radial term ``rad[:, 0] @ w_logit`` plus ``2·log env``, −inf where env = 0);
    without, the scatter weights ``(E, 1) = env·inv_sqrt_deg[dst]``. ``unit_alpha``: ``(E, 1)``
    ones when there is no focus competition (one focus), shared by all blocks.
    """

    kernel: Tensor
    edge_term: Tensor
    unit_alpha: Tensor | None


class Attention(nn.Module):
    """Envelope-gated softmax aggregation with a null mass and a node output gate (§4.2 step 9).

    Split in node terms (queries, keys, output gate; once per block) and per-edge softmax weights
    (per chunk), so the weighted sum itself can be one fused rotate-back + aggregate op. The
    weights go into that op unnormalised; the softmax denominator and the output gate are then
    one per-(node, head) factor on the aggregate, so no per-edge division exists.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        f, cf, h = cfg.n_focus, cfg.focus_width, cfg.n_atten_head
        self.n_focus, self.focus_dim, self.n_head = f, cf, h
        self.eps = cfg.eps
        self.qk_norm = ScalarRMSNorm(cf, f)
        self.q_proj = FocusLinear(cf, cf, f)
        self.k_proj = FocusLinear(cf, cf, f)
        self.logit_weight = nn.Parameter(torch.randn(cf, f, h) * 0.01)
        # softplus(0.5413) ≈ 1: the null mass starts as heavy as one full-weight neighbour.
        self.null_raw = nn.Parameter(torch.full((f, h), 0.5413))
        self.gate_norm = ScalarRMSNorm(cf, f)
        self.gate_weight = nn.Parameter(torch.randn(cf, f, h) * 0.01)

    def node_projection(self, *, live: bool = True) -> Tensor:
        """``(F, Cf, 2·Cf + H)``: ``[W_q | W_k | W_gate]`` per focus acting on the unit-RMS l=0
        row, with both norms' scales and the logits' ``1/√hd`` folded in (cached unless
        ``live``): one GEMM gives queries, keys and gate logits."""

        def build() -> Tensor:
            inv_sqrt_hd = 1.0 / math.sqrt(self.focus_dim // self.n_head)
            w_q = self.qk_norm.fold(self.q_proj.per_focus()) * inv_sqrt_hd
            w_k = self.qk_norm.fold(self.k_proj.per_focus())
            w_gate = self.gate_norm.fold(self.gate_weight.permute(1, 0, 2))
            return torch.cat([w_q, w_k, w_gate], dim=2)

        sources = (
            self.qk_norm.scale, self.q_proj.weight, self.k_proj.weight, self.gate_norm.scale,
            self.gate_weight,
        )  # fmt: skip
        return derived_weights(self, "node_projection", sources, build, live=live)

    def null_logit(self, *, live: bool = True) -> Tensor:
        """``log(softplus(z) + eps)`` as ``(1, F·H)``: the null mass in logit units."""
        return derived_weights(
            self, "null_logit", (self.null_raw,),
            lambda: torch.log(F.softplus(self.null_raw).reshape(1, -1) + self.eps), live=live,
        )  # fmt: skip

    def logit_map(self) -> Tensor:
        """``(C_wide, F·H)``: the logits' radial term ``rad[:, 0] @ w_logit`` per focus as one
        block-diagonal matrix on the wide l=0 radial row."""
        weight = self.logit_weight
        eye = torch.eye(self.n_focus, dtype=weight.dtype, device=weight.device)
        block_diagonal = torch.einsum("ifh,fg->figh", weight, eye)
        return block_diagonal.reshape(self.n_focus * self.focus_dim, -1)

    def node_terms(self, x_l0: Tensor, *, live: bool = True) -> tuple[Tensor, Tensor, Tensor]:
        """``x_l0 (N, F, Cf)`` → queries (pre-scaled by ``1/√hd``), keys ``(N, F, Cf)`` and the
        output gate ``(N, F·H)``."""
        # Both norms divide by the same RMS (same input and eps): compute it once.
        normalised = unit_rms(x_l0, self.eps, live=live)
        projected = torch.einsum("nfi,fio->nfo", normalised, self.node_projection(live=live))
        cf = self.focus_dim
        q, k, gate_logit = projected.split_with_sizes([cf, cf, self.n_head], dim=2)
        return q, k, torch.sigmoid(gate_logit).flatten(1)

    def edge_weights(
        self, q: Tensor, k: Tensor, logit_bias: Tensor, null_logit: Tensor, ops: EdgeOps
    ) -> tuple[Tensor, Tensor]:
        """Unnormalised softmax weights ``(Ec, F·H)`` of a chunk's edges and the softmax
        denominators ``(n_chunk, F·H)`` of its nodes; ``q`` holds the chunk's nodes.

        The weights are ``env²·e^ℓ`` shifted per node: ``ℓ + 2 log env`` (in ``logit_bias``) so
        tiny envelopes near rcut do not underflow before the normalisation; edges with env = 0
        drop out exactly. The denominator adds the null mass ``softplus(z) + eps``.
        """
        n_edges = logit_bias.shape[0]
        heads, head_dim = self.n_focus * self.n_head, self.focus_dim // self.n_head
        q_e = ops.from_dst(q).view(n_edges, heads, head_dim)
        k_e = ops.from_src(k).view(n_edges, heads, head_dim)
        logits = torch.add(logit_bias, (q_e * k_e).sum(-1))
        # The shift cancels exactly, so it carries no gradient (a max is order-independent).
        shift = null_logit.detach().expand(ops.chunk.n_nodes, -1).clone()
        idx = ops.chunk.dst[:, None].expand_as(logits)
        shift.scatter_reduce_(0, idx, logits.detach(), reduce="amax", include_self=True)
        edge_exp = torch.exp(logits - ops.from_dst(shift))
        return edge_exp, ops.sum_to_dst(edge_exp) + torch.exp(null_logit - shift)


class SO2Convolution(nn.Module):
    """One block's SO(2) convolution: ``(N, (L+1)², C) → (N, (L+1)², C)``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        lmax, c, cf, nf = cfg.lmax, cfg.channels, cfg.focus_width, cfg.n_focus
        cw = cfg.hidden_channels
        self.lmax, self.focus_dim, self.n_focus, self.hidden = lmax, cf, nf, cw
        self.channels = c
        self.rank = cfg.radial_so2_rank if cfg.radial_so2_mode == "degree_channel" else 0
        self.pre_focus_mix = DegreeLinear(lmax, c, cw)
        self.post_focus_mix = DegreeLinear(lmax, cw, c, zero_init=True)
        self.radial_hidden = nn.Parameter(torch.randn(c, cw) / math.sqrt(c)) if cw != c else None
        if self.rank > 0:
            k = n_kernel_slots(lmax)
            fan_in = (lmax + 1) * cw
            self.mixer_weight: nn.Parameter | None = nn.Parameter(
                torch.randn(fan_in, k * self.rank) / math.sqrt(fan_in)
            )
            self.channel_basis: nn.Parameter | None = nn.Parameter(
                torch.randn(self.rank, cw) / math.sqrt(self.rank)
            )
        else:
            self.mixer_weight = None
            self.channel_basis = None
        self.linears = nn.ModuleList(SO2Linear(lmax, cf, nf) for _ in range(cfg.mixing_layers))
        self.gates = nn.ParameterList(
            nn.Parameter(torch.randn(cf, nf * lmax * cf) * 0.01)
            for _ in range(cfg.mixing_layers - 1)
        )
        self.compete_weight = nn.Parameter(torch.randn(cf, nf) * 0.01) if nf > 1 else None
        self.attention = Attention(cfg) if cfg.n_atten_head > 0 else None

    def _linears(self) -> list[SO2Linear]:
        return [lin for lin in self.linears if isinstance(lin, SO2Linear)]

    def _stack_parameters(self) -> list[nn.Parameter]:
        params: list[nn.Parameter] = []
        for lin in self._linears():
            params += [lin.weight_m0, lin.weight_m1]
        return params + list(self.gates)

    def _pack(self) -> PackedStack:
        w0, w1 = zip(*(lin.packed(self.n_focus) for lin in self._linears()), strict=True)
        cf, lg = self.focus_dim, self.lmax * self.focus_dim
        if len(self.gates) > 0:
            gw = torch.stack([g.view(cf, self.n_focus, lg).permute(1, 0, 2) for g in self.gates])
        else:
            gw = self._linears()[0].weight_m0.new_zeros(0, self.n_focus, cf, lg)
        return PackedStack(torch.stack(w0), torch.stack(w1), gw.contiguous())

    def packed_stack(self, *, live: bool) -> PackedStack:
        """Stack weights in op layout; ``live`` keeps them in autograd (training)."""
        sources = self._stack_parameters()
        return derived_weights(self, "packed_stack", sources, self._pack, live=live)

    @property
    def kernel_width(self) -> int:
        """Columns of the per-edge kernel: ``K·R``, or ``(L+1)·C_wide`` with rank 0."""
        if self.rank == 0:
            return (self.lmax + 1) * self.hidden
        return n_kernel_slots(self.lmax) * self.rank

    @property
    def logit_width(self) -> int:
        """Columns of the attention logit bias, ``F·H`` (0 without attention)."""
        return 0 if self.attention is None else self.n_focus * self.attention.n_head

    def radial_maps(self) -> tuple[Tensor, Tensor | None]:
        """Linear maps from the block's radial features ``R (E, L+1, C)``, flattened degree-major,
        to its per-edge kernel ``((L+1)·C, kernel_width)`` and attention logit bias
        ``((L+1)·C, F·H)`` (``None`` without attention).

        Every per-edge use of ``R`` in a block is linear: ``rad = R @ W_hid`` per degree, then
        ``kc = rad.flatten() @ W_mix`` (rank ≥ 1) or ``rad`` itself (rank 0), and
        ``rad[:, 0] @ w_logit``. Composing the maps here lets the model fold them into the radial
        MLP's last layer (service.model.dpa4) so ``R`` is never materialised per edge.
        """
        lp1, c, cw = self.lmax + 1, self.channels, self.hidden
        hidden = self.radial_hidden
        if self.rank == 0:
            # rad itself: the hidden projection per degree (the identity when C_wide = C).
            weight = self.pre_focus_mix.weight
            per_degree = (
                hidden if hidden is not None
                else torch.eye(c, dtype=weight.dtype, device=weight.device)
            )  # fmt: skip
            degrees = torch.eye(lp1, dtype=weight.dtype, device=weight.device)
            kernel = torch.kron(degrees, per_degree)
        else:
            assert self.mixer_weight is not None
            mixer = self.mixer_weight.view(lp1, cw, -1)
            kernel = (mixer if hidden is None else hidden @ mixer).flatten(0, 1)
        if self.attention is None:
            return kernel, None
        on_l0 = self.attention.logit_map()
        if hidden is not None:
            on_l0 = hidden @ on_l0
        logit = F.pad(on_l0, (0, 0, 0, (lp1 - 1) * c))
        return kernel, logit

    def radial_sources(self) -> list[Tensor]:
        """The parameters :meth:`radial_maps` reads."""
        optional = (
            self.radial_hidden,
            self.mixer_weight,
            None if self.attention is None else self.attention.logit_weight,
        )
        return [t for t in optional if t is not None]

    def edge_kernel(self, columns: Tensor) -> Tensor:
        """The per-edge kernel in the rotate-mix layout from its ``(E, kernel_width)`` columns."""
        if self.rank == 0:
            return columns.view(columns.shape[0], self.lmax + 1, self.hidden)
        return columns

    def focus_alpha(self, u0: Tensor, unit_alpha: Tensor | None) -> Tensor:
        """``α (E, F)`` from the pre-stack l=0 row of ``u0 (F, E, ROW)`` (``unit_alpha`` with one
        focus)."""
        if self.compete_weight is None:
            assert unit_alpha is not None, "one focus stream needs the shared unit alpha"
            return unit_alpha
        logits = torch.einsum("fec,cf->ef", u0[:, :, : self.focus_dim], self.compete_weight)
        soft = torch.softmax(logits, dim=1)
        return soft * (1.0 - FOCUS_LABEL_SMOOTHING) + FOCUS_LABEL_SMOOTHING / self.n_focus

    def forward(
        self,
        x: Tensor,
        edge: ConvEdgeInputs,
        cache: EdgeCacheLike,
        *,
        fused: bool,
        live_weights: bool,
        stack_precision: StackPrecision = StackPrecision.EXACT,
        taps: dict[str, Tensor] | None = None,
        chunks: list[EdgeChunk] | None = None,
    ) -> Tensor:
        """``x (N, (L+1)², C)`` and the block's per-edge inputs → update ``(N, (L+1)², C)``.

        ``stack_precision`` is the mixing stack's GEMM tier; the fast tier needs ``fused``.

        ``chunks`` (default: the whole graph) splits the per-edge pipeline by destination-node
        ranges. With several chunks under autograd each chunk is checkpointed: its per-edge
        activations (u0, z_all, x_local, …) are dropped after the forward and recomputed in
        the backward, so they never exist for more than one chunk at a time.
        """
        value_path = _value_path(fused, stack_precision)
        n_nodes = x.shape[0]
        chunks = chunks if chunks is not None else [whole_graph(cache.graph)]
        if taps is not None and len(chunks) != 1:
            raise ValueError("taps need the whole graph as one edge chunk")
        # Node-major rows: the rotate-mix op gathers each source's (D, C_wide) block whole.
        wide = self.pre_focus_mix(x, live=live_weights).contiguous()
        if self.attention is not None:
            x_l0 = wide[:, 0].view(n_nodes, self.n_focus, self.focus_dim)
            q, k, gate = self.attention.node_terms(x_l0, live=live_weights)
            null_logit = self.attention.null_logit(live=live_weights)
        else:
            q = k = gate = null_logit = wide.new_zeros(0)
        stack = self.packed_stack(live=live_weights)
        recompute = len(chunks) > 1 and torch.is_grad_enabled()
        # One split per operand for all chunks: its backward concatenates the chunks' gradients
        # once (slicing per chunk would zero-fill a full-size gradient buffer per chunk).
        alphas = (
            split_edges(edge.unit_alpha, chunks) if edge.unit_alpha is not None
            else [None] * len(chunks)
        )  # fmt: skip
        per_chunk = zip(
            chunks,
            split_nodes(q, chunks) if self.attention is not None else [q] * len(chunks),
            split_edges(edge.kernel, chunks),
            split_edges(edge.edge_term, chunks),
            split_edges(cache.wigner, chunks),
            alphas,
            strict=True,
        )
        parts: list[tuple[Tensor, Tensor | None]] = []
        for chunk, *rows in per_chunk:
            edge_pass = partial(self._edge_pass, chunk, stack, value_path, taps)
            args = (wide, k, null_logit, *rows)
            if recompute:
                parts.append(checkpoint(edge_pass, *args, use_reentrant=False))
            else:
                parts.append(edge_pass(*args))
        sums, denominators = zip(*parts, strict=True)
        out = sums[0] if len(sums) == 1 else torch.cat(sums)
        if self.attention is not None:
            denom = torch.cat(denominators) if len(denominators) > 1 else denominators[0]
            assert denom is not None
            # Softmax normalisation and output gate: one (node, head) factor on the aggregate.
            factor = (gate / denom)[:, None, :, None]
            head_dim = self.hidden // gate.shape[1]
            heads = out.view(n_nodes, out.shape[1], gate.shape[1], head_dim) * factor
            out = heads.view(n_nodes, out.shape[1], self.hidden)
        if taps is not None:
            taps["post_focus_mix_in"] = out
        # Contiguous for the post-norm's flattened reductions.
        update: Tensor = self.post_focus_mix(out, live=live_weights).contiguous()
        return update

    def _edge_pass(
        self,
        chunk: EdgeChunk,
        stack: PackedStack,
        value_path: ValuePath,
        taps: dict[str, Tensor] | None,
        wide: Tensor,
        k: Tensor,
        null_logit: Tensor,
        q: Tensor,
        kernel: Tensor,
        edge_term: Tensor,
        wigner: Tensor,
        unit_alpha: Tensor | None,
    ) -> tuple[Tensor, Tensor | None]:
        """The per-edge pipeline of one chunk → its nodes' aggregate ``(n_chunk, D, C_wide)``
        and, with attention, their softmax denominators ``(n_chunk, F·H)`` (the aggregate is
        then unnormalised and ungated; ``None`` without attention).

        ``wide (N, D, C_wide)`` and the keys ``k (N, F, Cf)`` cover all nodes (sources may be
        anywhere); the queries ``q`` are the chunk's node rows, ``kernel``, ``edge_term``,
        ``wigner`` and ``unit_alpha`` its edge rows.
        """
        cb: Tensor | None = self.channel_basis
        if cb is None:  # rank 0: the op takes an empty channel basis
            cb = wide.new_zeros(0, self.hidden)
        fused = value_path.fused
        u0 = value_path.rotate_mix(
            wide, chunk.src, chunk.src_order, chunk.src_rowptr, wigner, kernel, cb,
            self.lmax, self.n_focus, self.rank,
        )  # fmt: skip
        alpha = self.focus_alpha(u0, unit_alpha)
        x_local, z_all, _ = value_path.mixing_stack(
            u0, alpha, stack.w0_all, stack.w1_all, stack.gw_all,
            self.lmax, self.focus_dim, self.compete_weight is not None,
        )  # fmt: skip
        if taps is not None:
            taps.update(u0=u0, alpha=alpha, z_all=z_all, x_local=x_local, kc=kernel)
        del u0, z_all  # the stack's autograd node keeps what its backward needs
        # Rotate back, l > 1 rescale, weight, sum into the centres: the op or its reference.
        aggregate = attention_aggregate if fused else attention_aggregate_reference
        if self.attention is None:
            return aggregate(x_local, wigner, edge_term, chunk.dst_rowptr, self.lmax), None
        edge_exp, denom = self.attention.edge_weights(
            q, k, edge_term, null_logit, EdgeOps(chunk, fused)
        )
        return aggregate(x_local, wigner, edge_exp, chunk.dst_rowptr, self.lmax), denom


@dataclass(frozen=True)
class ValuePath:
    """The rotate-mix and mixing-stack callables of one execution path and stack tier."""

    fused: bool
    rotate_mix: Callable[..., Tensor]
    mixing_stack: Callable[..., tuple[Tensor, ...]]


def _value_path(fused: bool, stack_precision: StackPrecision) -> ValuePath:
    """The so2kernels ops (``fused``) or their eager references; the stack tier is bound here so
    that every chunk of every block runs the one the caller chose."""
    if fused:
        return ValuePath(
            True,
            torch.ops.so2kernels.so2_rotate_mix,
            partial(so2_mixing_stack, precision=stack_precision),
        )
    if stack_precision is not StackPrecision.EXACT:
        raise ValueError(
            f"stack precision {stack_precision.value!r} runs in the fused mixing-stack kernels "
            "only; the reference path is exact (use fused=True or StackPrecision.EXACT)"
        )
    return ValuePath(False, rotate_mix_reference, mixing_stack_reference)
