"""Edge chunks: contiguous destination-node ranges whose edges are processed together.

Edges are sorted by destination, so a node range ``[n0, n1)`` owns the contiguous edge range
``[dst_rowptr[n0], dst_rowptr[n1])`` and every reduction onto a node (softmax normalisation,
aggregation) stays inside one chunk. That lets the SO(2) convolution run its per-edge pipeline
chunk by chunk and, under autograd, recompute each chunk in the backward instead of storing its
per-edge activations (:mod:`service.model.layers.so2conv`): peak memory then scales with the
chunk, not with the system.

A chunk carries its own CSR views: the destination offsets relative to the chunk (the chunk's
edges are already in destination order, so the destination CSR needs no order array), and a
source CSR over the chunk's edges (the rotate-mix backward reduces node gradients over it).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from torch import Tensor

from service.model.layers.geometry import GraphLike
from so2kernels.segment import csr_from_index


@dataclass(frozen=True)
class EdgeChunk:
    """Edges ``[edge_start, edge_stop)`` = all edges into nodes ``[node_start, node_stop)``."""

    node_start: int
    node_stop: int
    edge_start: int
    edge_stop: int
    src: Tensor  # (Ec,) int64 global source node
    dst: Tensor  # (Ec,) int64 destination relative to node_start
    src_order: Tensor  # (Ec,) int64 stable argsort of src
    src_rowptr: Tensor  # (N+1,) int64 source offsets over the chunk's edges
    dst_rowptr: Tensor  # (n1-n0+1,) int64 destination offsets relative to edge_start

    @property
    def n_nodes(self) -> int:
        return self.node_stop - self.node_start

    @property
    def n_edges(self) -> int:
        return self.edge_stop - self.edge_start

    @property
    def edges(self) -> slice:
        return slice(self.edge_start, self.edge_stop)

    @property
    def nodes(self) -> slice:
        return slice(self.node_start, self.node_stop)


def whole_graph(graph: GraphLike) -> EdgeChunk:
    """One chunk covering the whole graph, sharing the graph's own CSR tensors."""
    n_edge, n_node = graph.src.shape[0], graph.dst_rowptr.shape[0] - 1
    return EdgeChunk(
        node_start=0,
        node_stop=n_node,
        edge_start=0,
        edge_stop=n_edge,
        src=graph.src,
        dst=graph.dst,
        src_order=graph.src_order,
        src_rowptr=graph.src_rowptr,
        dst_rowptr=graph.dst_rowptr,
    )


def split_edges(values: Tensor, chunks: list[EdgeChunk]) -> tuple[Tensor, ...]:
    """Each chunk's rows of a per-edge tensor ``(E, ...)``, as views of one split (the tensor
    itself for a single chunk): autograd then joins the chunks' gradients in one
    concatenation, linear in E whatever the chunk count."""
    if len(chunks) == 1:
        return (values,)
    return tuple(values.split_with_sizes([c.n_edges for c in chunks]))


def split_nodes(values: Tensor, chunks: list[EdgeChunk]) -> tuple[Tensor, ...]:
    """Each chunk's rows of a per-node tensor ``(N, ...)``; chunks tile the nodes in order."""
    if len(chunks) == 1:
        return (values,)
    return tuple(values.split_with_sizes([c.n_nodes for c in chunks]))


def node_ranges(dst_rowptr: list[int], max_edges: int) -> list[tuple[int, int]]:
    """Greedy node ranges with at most ``max_edges`` edges each (a node with more edges than
    that gets a range of its own); empty when there are no nodes."""
    n_node = len(dst_rowptr) - 1
    ranges: list[tuple[int, int]] = []
    start = 0
    while start < n_node:
        # Largest stop with rowptr[stop] - rowptr[start] <= max_edges, at least one node.
        stop = bisect_right(dst_rowptr, dst_rowptr[start] + max_edges, lo=start + 1) - 1
        stop = min(max(stop, start + 1), n_node)
        ranges.append((start, stop))
        start = stop
    return ranges


def plan_edge_chunks(graph: GraphLike, max_edges: int | None) -> list[EdgeChunk]:
    """Chunks of at most ``max_edges`` edges (``None``: the whole graph as one chunk).

    Reads ``dst_rowptr`` on the host once (one device sync per evaluation).
    """
    n_edge = graph.src.shape[0]
    if max_edges is None or n_edge <= max_edges:
        return [whole_graph(graph)]
    if max_edges < 1:
        raise ValueError(f"max_edges must be >= 1, got {max_edges}")
    rowptr = graph.dst_rowptr.tolist()
    n_node = len(rowptr) - 1
    chunks = []
    for n0, n1 in node_ranges(rowptr, max_edges):
        e0, e1 = rowptr[n0], rowptr[n1]
        src = graph.src[e0:e1]
        src_order, src_rowptr = csr_from_index(src, n_node)
        chunks.append(
            EdgeChunk(
                node_start=n0,
                node_stop=n1,
                edge_start=e0,
                edge_stop=e1,
                src=src,
                dst=graph.dst[e0:e1] - n0,
                src_order=src_order,
                src_rowptr=src_rowptr,
                dst_rowptr=graph.dst_rowptr[n0 : n1 + 1] - e0,
            )
        )
    return chunks
