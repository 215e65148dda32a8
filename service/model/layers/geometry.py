"""What the model reads from the per-evaluation edge cache, and the edge→node reductions.

The model never builds graphs; it consumes ``service.graph.EdgeCache`` (or anything with the same
fields, e.g. a test fixture built from golden tensors), typed here as protocols.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor


class GraphLike(Protocol):
    """Topology fields the model reads (``service.graph.Graph``, a frozen dataclass: read-only
    members)."""

    @property
    def src(self) -> Tensor:
        """(E,) int64 message source j."""

    @property
    def dst(self) -> Tensor:
        """(E,) int64 centre i, edges sorted by dst."""

    @property
    def src_order(self) -> Tensor:
        """(E,) int64 stable argsort of src."""

    @property
    def src_rowptr(self) -> Tensor:
        """(N+1,) int64."""

    @property
    def dst_rowptr(self) -> Tensor:
        """(N+1,) int64."""


class EdgeCacheLike(Protocol):
    """Geometry fields the model reads (``service.graph.EdgeCache``)."""

    vec: Tensor  # (E, 3) r_src - r_dst (+ shift), compute dtype
    length: Tensor  # (E,) sqrt(|r|² + eps²)
    env: Tensor  # (E,) p=5 envelope: message weight
    env_rbf: Tensor  # (E,) p=7 envelope: multiplies the radial basis
    wigner: Tensor  # (E, D, D) block-diagonal real Wigner-D, global → local
    inv_sqrt_deg: Tensor  # (N,) rsqrt(Σ env² + floor)

    @property
    def graph(self) -> GraphLike: ...


def sum_into_dst(rows: Tensor, dst: Tensor, n_nodes: int) -> Tensor:
    """``out[i] = Σ_{dst(e)=i} rows[e]``: ``rows (E, *S) → (N, *S)``.

    ``index_add`` is differentiable to any order, which training's force loss needs.
    """
    out = rows.new_zeros((n_nodes, *rows.shape[1:]))
    return out.index_add(0, dst, rows)
