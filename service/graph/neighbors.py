"""The per-evaluation graph: full neighbour list over periodic images, CSR indices, edge vectors.

Backends (same output, bit for bit: both are put in canonical order ``dst, src, shift``):

* ``"torch"`` — :mod:`service.graph.cell_list`, a batched O(N) cell list in plain torch. It runs
  on the structures' device, so a CUDA request never round-trips atoms or edges through the host,
  handles triclinic, tiny (many images), mixed-pbc and cell-less structures in one call, and
  chunks its candidate arrays so 1M-atom boxes fit. The default for large batches on CUDA.
* ``"vesin"`` — vesin's C++ cell list, one structure at a time, on the host. The whole graph
  (pairs, coincidence check, canonical order, CSRs) is built on the host and copied to the
  structures' device once. Its pairs are re-checked with our own edge-vector arithmetic so the
  coincidence rule is the same.

``"auto"`` picks vesin (when importable) for CPU tensors and for CUDA batches of at most
:data:`VESIN_MAX_ATOMS` atoms, torch otherwise. Nothing ever caps the number of neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from service.graph.cell_list import (
    COINCIDENT_DISTANCE,
    PairList,
    canonical_order,
    find_pairs,
    raise_if_coincident,
    row_times_matrix,
    stable_argsort,
)
from service.graph.structures import Structures

Backend = Literal["auto", "torch", "vesin"]

VESIN_MAX_ATOMS = 384
"""``auto`` on CUDA: batches up to this many atoms go to vesin on the host. Measured on an H200
host (water, rcut 6 Å, `benchmarks/results/graph_h200_2026-11-29.json`): the device cell list
costs a near-constant ~7 ms (a few dozen small launches and host syncs for data-dependent sizes)
from 192 to 12k atoms, the host path (vesin, canonical order, CSRs, one copy) 5.2 ms at 192 atoms
and ~21 ms at 1,536; they cross near 400 atoms."""


@dataclass(frozen=True)
class Graph:
    """Directed edges ``src → dst`` (message flows from neighbour j to centre i).

    Attributes:
        src: (E,) int64 neighbour j (message source).
        dst: (E,) int64 centre i; edges sorted by dst, then src, then shift.
        shifts: (E, 3) int64 integer cell shifts S: ``r_e = x[src] + S·cell − x[dst]``.
        edge_batch: (E,) int64 structure of every edge.
        atom_batch: (N,) int64 structure of every atom.
        dst_rowptr: (N+1,) int64: edges of centre i are ``dst_rowptr[i]:dst_rowptr[i+1]``.
        src_order: (E,) int64 stable argsort of src.
        src_rowptr: (N+1,) int64: edges with source j are ``src_order[src_rowptr[j]:...[j+1]]``.
        edge_ptr: (B+1,) int64: edges of structure b are ``edge_ptr[b]:edge_ptr[b+1]``
            (contiguous because atoms are structure-major and edges dst-sorted).
        n_atoms, n_structures: N and B.
    """

    src: Tensor
    dst: Tensor
    shifts: Tensor
    edge_batch: Tensor
    atom_batch: Tensor
    dst_rowptr: Tensor
    src_order: Tensor
    src_rowptr: Tensor
    edge_ptr: Tensor
    n_atoms: int
    n_structures: int

    @property
    def n_edges(self) -> int:
        return int(self.src.shape[0])

    @property
    def device(self) -> torch.device:
        return self.src.device

    def to(self, device: torch.device | str) -> Graph:
        return replace(
            self,
            src=self.src.to(device),
            dst=self.dst.to(device),
            shifts=self.shifts.to(device),
            edge_batch=self.edge_batch.to(device),
            atom_batch=self.atom_batch.to(device),
            dst_rowptr=self.dst_rowptr.to(device),
            src_order=self.src_order.to(device),
            src_rowptr=self.src_rowptr.to(device),
            edge_ptr=self.edge_ptr.to(device),
        )


def build_graph(
    structures: Structures,
    rcut: float,
    *,
    backend: Backend = "auto",
    min_distance: float = COINCIDENT_DISTANCE,
    candidate_budget: int = 2**25,
) -> Graph:
    """Full neighbour graph of a batch within ``rcut`` Å, on the structures' device.

    Every ordered pair with ``0 < |r| ≤ rcut`` over all periodic images (self-images included).
    Raises :class:`InvalidStructureError` (``'coincident_atoms'``) for pairs closer than
    ``min_distance``.
    """
    if not rcut > 0.0:
        raise ValueError(f"rcut must be positive, got {rcut}")
    if resolve_backend(structures, backend) == "vesin":
        host = structures.to("cpu")
        pairs = _vesin_pairs(host, rcut, min_distance)
        if pairs is not None:
            return graph_from_pairs(host, pairs).to(structures.device)
    pairs = find_pairs(
        structures.positions,
        structures.cells,
        structures.pbc,
        structures.ptr,
        rcut,
        min_distance=min_distance,
        candidate_budget=candidate_budget,
    )
    return graph_from_pairs(structures, pairs)


def resolve_backend(structures: Structures, backend: Backend) -> Literal["torch", "vesin"]:
    """The search a batch gets: ``auto`` → vesin on the host for CPU batches and for CUDA
    batches of at most :data:`VESIN_MAX_ATOMS` atoms (when vesin is importable), else torch."""
    if backend == "auto":
        small = structures.device.type == "cpu" or structures.n_atoms <= VESIN_MAX_ATOMS
        return "vesin" if small and _has_vesin() else "torch"
    if backend not in ("torch", "vesin"):
        raise ValueError(f"unknown neighbour-list backend {backend!r}")
    return backend


def _has_vesin() -> bool:
    try:
        import vesin  # noqa: F401
    except ImportError:
        return False
    return True


_VESIN_MAX_SPAN = 1000.0
"""vesin 0.6 dies with SIGFPE when a structure spans ~1e5 cutoffs (its cell grid overflows); a
server must never crash on input, so structures wider than this many cutoffs go to torch."""


def _vesin_pairs(structures: Structures, rcut: float, min_distance: float) -> PairList | None:
    """vesin per structure, then our own distance check and canonical order, all on the host
    (``structures`` must be on the CPU). None when some structure is too wide for vesin to
    handle safely."""
    from vesin import NeighborList

    finder = NeighborList(cutoff=rcut, full_list=True)
    positions = structures.positions.detach().numpy()
    cells = structures.cells.detach().numpy()
    pbc = structures.pbc.numpy()
    offsets = structures.ptr.tolist()
    dst, src, shifts = [], [], []
    for b in range(structures.n_structures):
        lo, hi = offsets[b], offsets[b + 1]
        box = np.where(pbc[b][:, None], cells[b], 0.0)
        points = positions[lo:hi]
        span = max(float(np.ptp(points, axis=0).max()), float(np.abs(box).sum(axis=0).max()))
        if span > _VESIN_MAX_SPAN * rcut:
            return None
        i, j, s = finder.compute(points, box, pbc[b].tolist(), quantities="ijS")
        dst.append(i.astype(np.int64) + lo)
        src.append(j.astype(np.int64) + lo)
        shifts.append(s.astype(np.int64).reshape(-1, 3))
    d = torch.from_numpy(np.concatenate(dst))
    s_ = torch.from_numpy(np.concatenate(src))
    sh = torch.from_numpy(np.concatenate(shifts))
    vec = (
        structures.positions.index_select(0, s_)
        + row_times_matrix(
            sh.to(structures.positions.dtype), structures.cells, structures.atom_batch[d]
        )
        - structures.positions.index_select(0, d)
    )
    identity = torch.zeros_like(d, dtype=torch.bool)
    raise_if_coincident(
        (vec * vec).sum(dim=1), identity, d, s_, sh, structures.atom_batch, min_distance
    )
    return canonical_order(d, s_, sh, n_atoms=structures.n_atoms)


def graph_from_pairs(structures: Structures, pairs: PairList) -> Graph:
    """Attach batch indices and both CSRs to canonically ordered pairs."""
    n_atoms = structures.n_atoms
    atom_batch = structures.atom_batch
    dst_rowptr = _rowptr(pairs.dst, n_atoms)
    src_order = stable_argsort(pairs.src)
    return Graph(
        src=pairs.src,
        dst=pairs.dst,
        shifts=pairs.shifts,
        edge_batch=atom_batch.index_select(0, pairs.dst),
        atom_batch=atom_batch,
        dst_rowptr=dst_rowptr,
        src_order=src_order,
        src_rowptr=_rowptr(pairs.src, n_atoms),
        edge_ptr=dst_rowptr.index_select(0, structures.ptr),
        n_atoms=n_atoms,
        n_structures=structures.n_structures,
    )


def _rowptr(index: Tensor, n: int) -> Tensor:
    """(n+1,) int64 ``[0, cumsum(bincount(index))]``."""
    counts = torch.bincount(index, minlength=n)
    return torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])


def edge_vectors(
    graph: Graph, positions: Tensor, cells: Tensor, strain: Tensor | None = None
) -> Tensor:
    """(E, 3) ``r_e = x[src] + S·cell − x[dst]`` in the dtype of ``positions``.

    Differentiable with respect to ``positions`` (N, 3), ``cells`` (B, 3, 3) and an optional
    ``strain`` ε (B, 3, 3) applied as ``x' = x (I + ε[batch])``, ``cell' = cell (I + ε)``, so that
    ``virial = −∂E/∂ε`` at ε = 0.
    """
    if strain is not None:
        deform = torch.eye(3, dtype=strain.dtype, device=strain.device) + strain
        positions = row_times_matrix(positions, deform, graph.atom_batch)
        cells = cells @ deform
    shift_vec = row_times_matrix(graph.shifts.to(positions.dtype), cells, graph.edge_batch)
    return positions.index_select(0, graph.src) + shift_vec - positions.index_select(0, graph.dst)
