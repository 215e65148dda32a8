"""The per-evaluation graph: full neighbour list over periodic images, CSR indices, edge vectors.

Backends (same output, bit for bit: all are put in canonical order ``dst, src, shift``):

* ``"direct"`` — :mod:`service.graph.pair_search`, an all-pairs search in two Triton passes on
  the structures' device (CUDA, or the CPU under ``TRITON_INTERPRET=1``): a handful of launches
  and one host read, O(Σ n_b²·K_b) work (K_b periodic images per pair, 1 unless the cell is
  thinner than twice the cutoff). The default on CUDA up to :data:`DIRECT_MAX_CANDIDATES`.
* ``"torch"`` — :mod:`service.graph.cell_list`, a batched O(N) cell list in plain torch. It runs
  on the structures' device, handles triclinic, tiny (many images), mixed-pbc and cell-less
  structures in one call, and chunks its candidate arrays so 1M-atom boxes fit; it costs a few
  dozen launches and several host reads. The default for large batches on CUDA.
* ``"vesin"`` — vesin's C++ cell list, one structure at a time, on the host. The whole graph
  (pairs, coincidence check, canonical order, CSRs) is built on the host and copied to the
  structures' device once. vesin searches a hair beyond the cutoff and its pairs are re-checked
  with our own edge-vector arithmetic, so the cutoff (``≤``) and coincidence rules are the same.
  The default for CPU batches.

``"auto"`` picks vesin (when importable) for CPU batches; on CUDA, direct while its candidate
count Σ n_b²·K_b stays within :data:`DIRECT_MAX_CANDIDATES`, torch beyond. Nothing ever caps
the number of neighbours.

:func:`place_and_build_graph` is the request path: a batch validated on the host goes to the
device in one packed copy (with the direct search's per-structure table, and with whatever else
the caller needs there: :func:`place_and_build_graph_carrying`), and its graph is built there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch import Tensor

from service.graph.cell_list import (
    COINCIDENT_DISTANCE,
    WINDOW_MARGIN,
    PairList,
    checked_pairs,
    find_pairs,
    row_times_matrix,
    stable_argsort,
)
from service.graph.structures import Structures

if TYPE_CHECKING:
    from service.graph.pair_search import ImageWindows

Backend = Literal["auto", "direct", "torch", "vesin"]
Search = Literal["direct", "torch", "vesin"]
SEARCHES: tuple[Search, ...] = ("direct", "torch", "vesin")

DIRECT_MAX_CANDIDATES = 2**28
"""``auto`` on CUDA: batches whose direct search visits at most this many candidates
(Σ_b n_b²·K_b) use it, larger ones the torch cell list. A conservative guess, not yet measured:
the cell list costs a near-constant ~7 ms up to 12k atoms on an H200, and the direct search's
two passes are expected to cost ~1 ms per 1.5·10^8 candidates (12,288² at one image per pair),
so the crossover should lie above 2^28 (about 16k atoms of water at 6 Å). Set it from the
``neighbor_direct_ms`` and ``neighbor_ms`` columns of ``benchmarks/graph.py``."""


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

    def tensors(self) -> list[Tensor]:
        """The index tensors, in field order (what :meth:`with_tensors` takes back)."""
        return [getattr(self, name) for name in _GRAPH_TENSORS]

    def with_tensors(self, tensors: Sequence[Tensor]) -> Graph:
        """This graph with its index tensors replaced, in :meth:`tensors` order."""
        named: dict[str, Any] = dict(zip(_GRAPH_TENSORS, tensors, strict=True))
        return replace(self, **named)

    def to(self, device: torch.device | str) -> Graph:
        return self.with_tensors([t.to(device) for t in self.tensors()])


_GRAPH_TENSORS = tuple(f.name for f in fields(Graph) if f.name not in ("n_atoms", "n_structures"))


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
    ``min_distance``. The direct search of a batch already on the device reads its cells back
    first (one extra host read); :func:`place_and_build_graph` avoids that for host batches.
    """
    _check_cutoff(rcut)
    device = structures.device
    windows = None
    if _may_search_directly(device, backend):
        windows = _image_windows(
            structures.cells.cpu(), structures.pbc.cpu(), structures.ptr.cpu(), rcut, min_distance
        )
    search = resolve_backend(device, backend, windows)
    if search == "direct":
        assert windows is not None
        table = torch.from_numpy(windows.table).to(device, non_blocking=True)
        return _direct_graph(structures, table, windows, rcut, min_distance, candidate_budget)
    if search == "vesin":
        host = structures.to("cpu")
        pairs = _vesin_pairs(host, rcut, min_distance)
        if pairs is not None:
            return graph_from_pairs(host, pairs).to(device)
    return _cell_list_graph(structures, rcut, min_distance, candidate_budget)


def place_and_build_graph(
    structures: Structures,
    rcut: float,
    device: torch.device | str,
    *,
    backend: Backend = "auto",
    min_distance: float = COINCIDENT_DISTANCE,
    candidate_budget: int = 2**25,
) -> tuple[Structures, Graph]:
    """The batch on ``device`` and its graph there (see :func:`build_graph`), with as few
    transfers as possible: a host batch bound for an accelerator travels in one packed,
    non-blocking copy together with the direct search's table (or, for vesin, with its graph),
    so the direct search's edge count is the only host read."""
    placed, graph, _ = place_and_build_graph_carrying(
        structures, rcut, device, (), backend=backend, min_distance=min_distance,
        candidate_budget=candidate_budget,
    )  # fmt: skip
    return placed, graph


def place_and_build_graph_carrying(
    structures: Structures,
    rcut: float,
    device: torch.device | str,
    carry: Sequence[Tensor],
    *,
    backend: Backend = "auto",
    min_distance: float = COINCIDENT_DISTANCE,
    candidate_budget: int = 2**25,
    windows: ImageWindows | None = None,
) -> tuple[Structures, Graph, list[Tensor]]:
    """:func:`place_and_build_graph`, with ``carry`` (tensors on the structures' device, e.g.
    the atom types the host already looked up) placed on ``device`` in the same packed copy:
    after the search's host read the caller then launches nothing to prepare them.
    ``windows``: the host batch's search table for ``rcut`` and ``min_distance``, if the caller
    already made it."""
    _check_cutoff(rcut)
    device = torch.device(device)
    if structures.device.type != "cpu" or device.type == "cpu":
        placed = structures.to(device)
        carried = [t.to(device) for t in carry]
        graph = build_graph(
            placed, rcut, backend=backend, min_distance=min_distance,
            candidate_budget=candidate_budget,
        )  # fmt: skip
        return placed, graph, carried
    host = [*_structure_tensors(structures), *carry]
    if windows is None and _may_search_directly(device, backend):
        windows = _image_windows(
            structures.cells, structures.pbc, structures.ptr, rcut, min_distance
        )
    search = resolve_backend(device, backend, windows)
    if search == "direct":
        assert windows is not None
        *moved, table = transfer_packed([*host, torch.from_numpy(windows.table)], device)
        placed, carried = _split_placed(moved)
        graph = _direct_graph(placed, table, windows, rcut, min_distance, candidate_budget)
        return placed, graph, carried
    if search == "vesin":
        pairs = _vesin_pairs(structures, rcut, min_distance)
        if pairs is not None:
            graph = graph_from_pairs(structures, pairs)
            moved = transfer_packed([*host, *graph.tensors()], device)
            placed, carried = _split_placed(moved[: len(host)])
            return placed, graph.with_tensors(moved[len(host) :]), carried
    placed, carried = _split_placed(transfer_packed(host, device))
    return placed, _cell_list_graph(placed, rcut, min_distance, candidate_budget), carried


def _split_placed(moved: Sequence[Tensor]) -> tuple[Structures, list[Tensor]]:
    """Moved ``[*structure tensors, *carried]`` back into a batch and the carried list."""
    return Structures(*moved[:_N_STRUCTURE_TENSORS]), list(moved[_N_STRUCTURE_TENSORS:])


def resolve_backend(
    device: torch.device, backend: Backend, windows: ImageWindows | None = None
) -> Search:
    """The search a batch on ``device`` gets. ``auto``: vesin (when importable) on the CPU; on
    CUDA the direct search when its ``windows`` (:func:`~service.graph.pair_search.image_windows`)
    count at most :data:`DIRECT_MAX_CANDIDATES` candidates and Triton is available, else torch."""
    if backend == "auto":
        if device.type == "cpu":
            return "vesin" if _has_vesin() else "torch"
        small = windows is not None and windows.n_candidates <= DIRECT_MAX_CANDIDATES
        return "direct" if small and _triton_runs_on(device) else "torch"
    for search in SEARCHES:
        if backend == search:
            return search
    raise ValueError(f"unknown neighbour-list backend {backend!r}")


def _check_cutoff(rcut: float) -> None:
    if not rcut > 0.0:
        raise ValueError(f"rcut must be positive, got {rcut}")


def _may_search_directly(device: torch.device, backend: Backend) -> bool:
    """Whether the direct search's table is needed (to run it, or to decide on it)."""
    return backend == "direct" or (backend == "auto" and device.type == "cuda")


def _triton_runs_on(device: torch.device) -> bool:
    # Imported here: so2kernels' package import registers every kernel of the project.
    from so2kernels._dispatch import INTERPRET, triton_available

    if device.type == "cuda":
        return triton_available()
    return device.type == "cpu" and INTERPRET


def _image_windows(
    cells: Tensor, pbc: Tensor, ptr: Tensor, rcut: float, min_distance: float
) -> ImageWindows:
    # Imported here: defining the Triton kernel must wait until TRITON_INTERPRET is settled.
    from service.graph.pair_search import image_windows

    return image_windows(cells, pbc, ptr, rcut, min_distance)


def _direct_graph(
    structures: Structures,
    table: Tensor,
    windows: ImageWindows,
    rcut: float,
    min_distance: float,
    candidate_budget: int,
) -> Graph:
    """The direct search's graph. On a close pair the torch cell list takes over: it raises the
    error (the same code and message as that backend), or, for a distance within rounding of
    ``min_distance`` that only the kernel's arithmetic puts below it, returns the graph (the
    host validation accepted the pair too; a request must not fail on a rounding tie)."""
    from service.graph.pair_search import direct_pairs

    if not _triton_runs_on(structures.device):
        raise ValueError(
            "the direct neighbour search runs Triton: CUDA tensors, or CPU tensors under "
            f"TRITON_INTERPRET=1 (got {structures.device})"
        )
    found = direct_pairs(
        structures.positions, structures.cells, structures.ptr, structures.atom_batch, table,
        single_image=windows.single_image,
    )  # fmt: skip
    if found is None:
        return _cell_list_graph(structures, rcut, min_distance, candidate_budget)
    return Graph(
        src=found.src,
        dst=found.dst,
        shifts=found.shifts,
        edge_batch=found.edge_batch,
        atom_batch=structures.atom_batch,
        dst_rowptr=found.dst_rowptr,
        src_order=stable_argsort(found.src),
        src_rowptr=found.src_rowptr,
        edge_ptr=found.edge_ptr,
        n_atoms=structures.n_atoms,
        n_structures=structures.n_structures,
    )


def _cell_list_graph(
    structures: Structures, rcut: float, min_distance: float, candidate_budget: int
) -> Graph:
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


def _has_vesin() -> bool:
    try:
        import vesin  # noqa: F401
    except ImportError:
        return False
    return True


# One-copy transfers


_TRANSFER_ALIGNMENT = 16


def transfer_packed(tensors: Sequence[Tensor], device: torch.device) -> list[Tensor]:
    """Host tensors (detached) on ``device`` after one non-blocking copy: their bytes are packed
    into one buffer and the device buffer is sliced and re-viewed. Pieces start 16-byte aligned,
    so every dtype views back in place and Triton still sees aligned pointers. Each small copy
    costs ~10 µs of driver time whatever its size, and a blocking one waits for the device.
    For CUDA the bytes are packed straight into page-locked memory from torch's caching host
    allocator, so the copy is a true asynchronous DMA (no driver staging) and the allocator
    keeps the block until the copy recorded on the stream has finished."""
    pieces: list[Tensor] = []
    spans: list[tuple[int, int]] = []
    offset = 0
    for t in tensors:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        pieces.append(raw)
        pad = -raw.numel() % _TRANSFER_ALIGNMENT
        if pad:
            pieces.append(raw.new_zeros(pad))
        spans.append((offset, raw.numel()))
        offset += raw.numel() + pad
    if device.type == "cuda":
        staging = torch.empty(offset, dtype=torch.uint8, pin_memory=True)
        torch.cat(pieces, out=staging)
    else:
        staging = torch.cat(pieces)
    buffer = staging.to(device, non_blocking=True)
    return [
        buffer[start : start + size].view(t.dtype).view(t.shape)
        for t, (start, size) in zip(tensors, spans, strict=True)
    ]


_N_STRUCTURE_TENSORS = len(fields(Structures))


def _structure_tensors(structures: Structures) -> list[Tensor]:
    """The tensors of :class:`Structures` in constructor order."""
    return [getattr(structures, f.name) for f in fields(Structures)]


_VESIN_MAX_SPAN = 1000.0
"""vesin 0.6 dies with SIGFPE when a structure spans ~1e5 cutoffs (its cell grid overflows); a
server must never crash on input, so structures wider than this many cutoffs go to torch."""


def _vesin_pairs(structures: Structures, rcut: float, min_distance: float) -> PairList | None:
    """vesin per structure, then our own distance check and canonical order, all on the host
    (``structures`` must be on the CPU). None when some structure is too wide for vesin to
    handle safely.

    vesin keeps pairs with ``|r| < cutoff`` by its own arithmetic; the contract is ``|r| ≤ rcut``
    by ours (a lattice constant of rcut/2 puts whole shells exactly on the cutoff). So vesin
    searches a cutoff :data:`WINDOW_MARGIN` wider and our test decides, as in the other
    backends."""
    from vesin import NeighborList

    finder = NeighborList(cutoff=rcut * WINDOW_MARGIN, full_list=True)
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
    return checked_pairs(
        structures.positions,
        structures.cells,
        structures.atom_batch,
        torch.from_numpy(np.concatenate(dst)),
        torch.from_numpy(np.concatenate(src)),
        torch.from_numpy(np.concatenate(shifts)),
        rcut,
        min_distance,
    )


def graph_from_pairs(structures: Structures, pairs: PairList) -> Graph:
    """Attach batch indices and both CSRs to canonically ordered pairs."""
    from so2kernels.segment import row_ptr_from_index  # see the package docstring

    n_atoms = structures.n_atoms
    atom_batch = structures.atom_batch
    dst_rowptr = row_ptr_from_index(pairs.dst, n_atoms)
    src_order = stable_argsort(pairs.src)
    return Graph(
        src=pairs.src,
        dst=pairs.dst,
        shifts=pairs.shifts,
        edge_batch=atom_batch.index_select(0, pairs.dst),
        atom_batch=atom_batch,
        dst_rowptr=dst_rowptr,
        src_order=src_order,
        src_rowptr=row_ptr_from_index(pairs.src, n_atoms),
        edge_ptr=dst_rowptr.index_select(0, structures.ptr),
        n_atoms=n_atoms,
        n_structures=structures.n_structures,
    )


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
