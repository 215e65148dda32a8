"""Direct (all-pairs) neighbour search on the structures' device: two Triton passes, one sync.

Contract (the same as :mod:`service.graph.cell_list`): for every structure ``b`` of a flat batch
(atoms ``ptr[b]:ptr[b+1]``) every ordered pair ``(dst=i, src=j, shift=S)`` with
``r = x_j + S·cell_b − x_i`` and ``0 < |r| ≤ cutoff``, over all periodic images, in canonical
order (``dst``, then ``src``, then ``S`` lexicographically). Pairs closer than ``min_distance``
raise :class:`InvalidStructureError` (``'coincident_atoms'``).

Image windows. With ``d_a`` the dual vector of periodic axis ``a`` (column ``a`` of the inverse
of :func:`~service.graph.cell_list.binning_frames`; ``1/|d_a|`` is the lattice height ``h_a``) and
``s = x·d`` the fractional coordinates of the positions *as given* (never wrapped), a pair within
the cutoff has ``|s_j − s_i + S_a| = |r·d_a| ≤ cutoff/h_a``. So its shift lies in
``[ceil(−c_a − Δs_a), floor(c_a − Δs_a)]`` with ``c_a = cutoff·WINDOW_MARGIN/h_a``: at most
``K_a = floor(2·c_a) + 1`` integers, one whenever the cutoff is below half the height. Open axes
have ``c_a = 0`` and ``d_a = 0``, hence ``S_a = 0``. A destination atom visits
``n_b·K_0·K_1·K_2`` candidates: source-major, then the ``K`` window slots lexicographically.
Since the window's first shift depends only on ``(i, j)``, that walk *is* canonical order, so
no sort is needed for the destination side.

Passes (one program per destination atom, candidates ``BLOCK`` at a time):

1. count the accepted candidates of each destination and of each source, and flag any closer
   than ``min_distance`` (an atom paired with itself at ``S = 0`` excluded); cumulative sums of
   the counts are both CSRs' offsets, and one host read fetches the edge count and the flag
   together;
2. walk the same candidates in the same order and write ``src``, ``dst``, ``S`` and the edge's
   structure at ``dst_rowptr[i]`` plus a running count.

Everything but the second pass is launched before the host read: after it the device idles
until the host has launched what is left, which is on the wall-clock path of every request.

:func:`bounded_direct_pairs` is the same search without the host read, for a CUDA graph to
record: the batch is padded to a fixed number of rows (rows from the device-resident atom count
N on are skipped) and the second pass writes into arrays of a fixed capacity, storing no edge
beyond it; the edge count and the coincidence flag stay on the device for the caller to read
back with its results.

``r`` is evaluated like :func:`~service.graph.neighbors.edge_vectors`: ``S·cell`` as the
row-times-matrix sum ``(S_0·c_0 + S_1·c_1) + S_2·c_2``, then ``(x_j + S·cell) − x_i``, and
``|r|² = (r_0² + r_1²) + r_2²``, with floating-point contraction off, so a pair on the cutoff is
decided as the torch backend decides it (up to how its BLAS orders a 3-term dot product).

Per-structure parameters are computed on the host (cells are tiny) and travel in one float64
table, ``(B, TABLE_WIDTH)``: ``d`` (9, ``d_a`` at columns ``3a..3a+2``), ``c`` (3), ``K`` (3),
``cutoff²``, ``min_distance²``.
"""

# Triton kernels take untyped pointer/constexpr arguments and @triton.jit is an untyped decorator.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from numpy.typing import NDArray
from torch import Tensor

from service.graph.cell_list import WINDOW_MARGIN, binning_frames
from service.graph.errors import (
    MAX_IMAGE_WINDOW,
    InvalidStructureError,
    thin_cell_error,
)

TABLE_WIDTH = 17
_DUAL, _REACH, _IMAGES, _CUTOFF2, _MIN2 = 0, 9, 12, 15, 16


MAX_CANDIDATES_PER_ATOM = 2**31 - 1
"""The per-destination candidate index is 32-bit; a structure whose atoms each visit more
candidates than this is far past any size the direct search is meant for."""


@dataclass(frozen=True)
class Tiles:
    """Launch shape: ``rows`` destination atoms per program, ``block`` candidates per step."""

    rows: int
    block: int


GPU_TILES = Tiles(rows=1, block=256)
"""One destination per program (192 atoms already give 192 programs; no structure straddles a
program) and 2 candidates per thread at 4 warps, so a candidate's float64 working set stays in
registers."""

INTERPRETER_TILES = Tiles(rows=64, block=1024)
"""The interpreter pays per operation, not per element: wide tiles, few programs."""


@dataclass(frozen=True)
class ImageWindows:
    """Per-structure search parameters of a batch, built on the host.

    Attributes:
        table: (B, TABLE_WIDTH) float64 (layout in the module docstring), on the host.
        n_candidates: Σ_b n_b²·K_b, the work of one pass.
        single_image: every structure has ``K = 1`` (no window decoding in the kernel).
    """

    table: NDArray[np.float64]
    n_candidates: int
    single_image: bool


def image_windows(
    cells: Tensor, pbc: Tensor, ptr: Tensor, cutoff: float, min_distance: float
) -> ImageWindows:
    """The search table of a batch from host tensors ``cells`` (B, 3, 3), ``pbc`` (B, 3) and
    ``ptr`` (B+1,); raises ``'singular_cell'`` when a window would be absurdly large."""
    pbc_np = pbc.numpy()
    inverse = _inverse_frames(cells.detach().to(torch.float64), pbc)
    dual = np.where(pbc_np[:, None, :], inverse, 0.0)  # (B, k, a): column a is d_a
    reach = np.where(pbc_np, cutoff * WINDOW_MARGIN * np.linalg.norm(inverse, axis=1), 0.0)
    with np.errstate(invalid="ignore", over="ignore"):
        images = np.floor(2.0 * reach) + 1.0
    window = images.prod(axis=1)
    bad = ~np.isfinite(window) | (window > MAX_IMAGE_WINDOW)
    if bad.any():
        b = int(np.flatnonzero(bad)[0])
        raise thin_cell_error(b, float(window[b]))
    sizes = np.diff(ptr.numpy())
    per_atom = sizes * window
    if per_atom.max(initial=0) > MAX_CANDIDATES_PER_ATOM:
        raise ValueError(
            f"direct pair search: {int(per_atom.max())} candidates per atom exceed 2^31; "
            "use the cell list (backend='torch')"
        )
    table = np.empty((pbc_np.shape[0], TABLE_WIDTH), dtype=np.float64)
    table[:, _DUAL:_REACH] = dual.transpose(0, 2, 1).reshape(-1, 9)
    table[:, _REACH:_IMAGES] = reach
    table[:, _IMAGES:_CUTOFF2] = images
    table[:, _CUTOFF2] = cutoff * cutoff
    table[:, _MIN2] = min_distance * min_distance
    return ImageWindows(
        table=table,
        n_candidates=int((sizes * per_atom).sum()),
        single_image=bool((window == 1.0).all()),
    )


def _inverse_frames(cells: Tensor, pbc: Tensor) -> NDArray[np.float64]:
    """(B, 3, 3) inverses of the search frames (lattice rows on periodic axes, an orthonormal
    complement on open ones); fully periodic batches, the common case, skip the complement."""
    frames = cells.numpy() if bool(pbc.all()) else binning_frames(cells, pbc).numpy()
    try:
        return np.linalg.inv(frames)
    except np.linalg.LinAlgError:
        b = int(np.flatnonzero(np.linalg.det(frames) == 0.0)[0])
        raise InvalidStructureError(
            "singular_cell",
            f"structure {b}: the lattice vectors of the periodic axes are linearly dependent",
            field=f"structures[{b}].cell",
            index=b,
        ) from None


# Triton kernel. Row i of a program's tile walks destination i's candidates c = 0 .. n_b·K − 1
# (source lo + c // K, window slot c % K split into three axes) BLOCK at a time; rows of other
# structures simply have other lo, K, frames. The 3-vectors are spelled out: the interpreter
# pays per operation (and per helper call), a GPU does not care.


# The capacity changes per batch, and the two (1,) scalars are views at offsets that change with
# N: specialising on their values or alignment would compile a variant per batch shape.
@triton.jit(
    do_not_specialize=("edge_capacity",),
    do_not_specialize_on_alignment=("atom_count", "close_flag"),
)
def _direct_pairs_kernel(
    positions,  # (N, 3) contiguous, float64 or float32
    cells,  # (B, 3, 3) contiguous, positions' dtype
    table,  # (B, TABLE_ROW) float64, see the module docstring
    ptr,  # (B+1,) int64 atom offsets
    atom_batch,  # (N,) int64
    atom_count,  # (1,) int64 N: rows from N on (a padded batch's dummy atoms) are skipped
    rowptr,  # (R+1,) int64, R >= N: pass 1 stores counts at i+1; pass 2 reads rowptr[i] (after
    # the cumulative sum) as the first edge of i
    close_flag,  # (1,) int64, pass 1 raises it on a close pair
    src_out,  # (capacity,) int64, pass 2
    dst_out,  # (capacity,) int64, pass 2
    shift_out,  # (capacity, 3) int64, pass 2
    batch_out,  # (capacity,) int64, pass 2
    src_rowptr,  # (R+1,) int64, pass 1 adds one at j+1 per edge with source j
    edge_capacity,  # pass 2 stores no edge from this index on
    TABLE_ROW: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    WRITE: tl.constexpr,
    SINGLE_IMAGE: tl.constexpr,
):
    atom = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = atom < tl.load(atom_count)
    atom = tl.where(row_ok, atom, 0)
    b = tl.load(atom_batch + atom)
    lo = tl.load(ptr + b)
    hi = tl.load(ptr + b + 1)
    row = table + b * TABLE_ROW
    cell = cells + b * 9
    # Per row (ROWS, 1): dual vectors d_a (float64), lattice rows (positions' dtype), reach.
    d00, d01, d02 = tl.load(row)[:, None], tl.load(row + 1)[:, None], tl.load(row + 2)[:, None]
    d10, d11, d12 = tl.load(row + 3)[:, None], tl.load(row + 4)[:, None], tl.load(row + 5)[:, None]
    d20, d21, d22 = tl.load(row + 6)[:, None], tl.load(row + 7)[:, None], tl.load(row + 8)[:, None]
    c00, c01, c02 = tl.load(cell)[:, None], tl.load(cell + 1)[:, None], tl.load(cell + 2)[:, None]
    c10, c11, c12 = (
        tl.load(cell + 3)[:, None],
        tl.load(cell + 4)[:, None],
        tl.load(cell + 5)[:, None],
    )
    c20, c21, c22 = (
        tl.load(cell + 6)[:, None],
        tl.load(cell + 7)[:, None],
        tl.load(cell + 8)[:, None],
    )
    reach0, reach1, reach2 = (
        tl.load(row + 9)[:, None],
        tl.load(row + 10)[:, None],
        tl.load(row + 11)[:, None],
    )
    k1 = tl.load(row + 13).to(tl.int32)[:, None]
    k2 = tl.load(row + 14).to(tl.int32)[:, None]
    n_images = tl.load(row + 12).to(tl.int32)[:, None] * k1 * k2
    xi0 = tl.load(positions + 3 * atom)[:, None]
    xi1 = tl.load(positions + 3 * atom + 1)[:, None]
    xi2 = tl.load(positions + 3 * atom + 2)[:, None]
    cutoff2 = tl.load(row + 15).to(xi0.dtype)[:, None]
    min2 = tl.load(row + 16).to(xi0.dtype)[:, None]
    wi0, wi1, wi2 = xi0.to(tl.float64), xi1.to(tl.float64), xi2.to(tl.float64)
    si0 = (wi0 * d00 + wi1 * d01) + wi2 * d02
    si1 = (wi0 * d10 + wi1 * d11) + wi2 * d12
    si2 = (wi0 * d20 + wi1 * d21) + wi2 * d22
    n_candidates = tl.where(row_ok, (hi - lo).to(tl.int32), 0)[:, None] * n_images
    i = atom[:, None]
    b = b[:, None]
    lo = lo[:, None]
    accepted = tl.zeros((ROWS,), dtype=tl.int64)
    close = tl.zeros((ROWS,), dtype=tl.int64)
    first_edge = tl.zeros((ROWS,), dtype=tl.int64)
    if WRITE:
        first_edge = tl.load(rowptr + atom)
    for start in range(0, tl.max(n_candidates), BLOCK):
        c = start + tl.arange(0, BLOCK)[None, :]
        live = c < n_candidates
        if SINGLE_IMAGE:
            j = lo + c.to(tl.int64)
            t0 = tl.zeros((ROWS, BLOCK), dtype=tl.int64)
            t1 = t0
            t2 = t0
        else:
            j = lo + (c // n_images).to(tl.int64)
            slot = c % n_images
            t0 = (slot // (k1 * k2)).to(tl.int64)
            t1 = ((slot // k2) % k1).to(tl.int64)
            t2 = (slot % k2).to(tl.int64)
        xj0 = tl.load(positions + 3 * j, mask=live, other=0.0)
        xj1 = tl.load(positions + 3 * j + 1, mask=live, other=0.0)
        xj2 = tl.load(positions + 3 * j + 2, mask=live, other=0.0)
        wj0, wj1, wj2 = xj0.to(tl.float64), xj1.to(tl.float64), xj2.to(tl.float64)
        # Window of each axis: [ceil(-c_a - ds_a), floor(c_a - ds_a)].
        ds0 = ((wj0 * d00 + wj1 * d01) + wj2 * d02) - si0
        ds1 = ((wj0 * d10 + wj1 * d11) + wj2 * d12) - si1
        ds2 = ((wj0 * d20 + wj1 * d21) + wj2 * d22) - si2
        s0 = tl.ceil(-reach0 - ds0).to(tl.int64) + t0
        s1 = tl.ceil(-reach1 - ds1).to(tl.int64) + t1
        s2 = tl.ceil(-reach2 - ds2).to(tl.int64) + t2
        in_window = (
            (s0 <= tl.floor(reach0 - ds0).to(tl.int64))
            & (s1 <= tl.floor(reach1 - ds1).to(tl.int64))
            & (s2 <= tl.floor(reach2 - ds2).to(tl.int64))
        )
        # r = (x_j + S·cell) − x_i with S·cell summed in row order, as edge_vectors does.
        f0, f1, f2 = s0.to(xi0.dtype), s1.to(xi0.dtype), s2.to(xi0.dtype)
        r0 = (xj0 + ((f0 * c00 + f1 * c10) + f2 * c20)) - xi0
        r1 = (xj1 + ((f0 * c01 + f1 * c11) + f2 * c21)) - xi1
        r2 = (xj2 + ((f0 * c02 + f1 * c12) + f2 * c22)) - xi2
        dist2 = (r0 * r0 + r1 * r1) + r2 * r2
        itself = (j == i) & (s0 == 0) & (s1 == 0) & (s2 == 0)
        candidate = live & in_window & ~itself
        keep = candidate & (dist2 <= cutoff2)
        keep_count = keep.to(tl.int32)
        if WRITE:
            rank = (tl.cumsum(keep_count, 1) - 1).to(tl.int64)
            edge = (first_edge + accepted)[:, None] + rank
            keep = keep & (edge < edge_capacity)
            tl.store(src_out + edge, j, mask=keep)
            tl.store(dst_out + edge, tl.broadcast_to(i, (ROWS, BLOCK)), mask=keep)
            tl.store(batch_out + edge, tl.broadcast_to(b, (ROWS, BLOCK)), mask=keep)
            tl.store(shift_out + 3 * edge, s0, mask=keep)
            tl.store(shift_out + 3 * edge + 1, s1, mask=keep)
            tl.store(shift_out + 3 * edge + 2, s2, mask=keep)
        else:
            near = (candidate & (dist2 < min2)).to(tl.int64)
            close = tl.maximum(close, tl.max(near, 1))
            tl.atomic_add(src_rowptr + j + 1, tl.full((ROWS, BLOCK), 1, tl.int64), mask=keep)
        accepted += tl.sum(keep_count, 1).to(tl.int64)
    if not WRITE:
        tl.store(rowptr + atom + 1, accepted, mask=row_ok)
        tl.atomic_max(close_flag, tl.max(close, 0))


# Launchers


@dataclass(frozen=True)
class _CanonicalEdges:
    """Edges in canonical order with both CSR offsets (all int64, on the device): ``dst``,
    ``src``, ``edge_batch`` (E,), ``shifts`` (E, 3), ``dst_rowptr`` and ``src_rowptr`` (N+1,);
    ``src_rowptr`` counts edges per source (their order is left to the caller)."""

    dst: Tensor
    src: Tensor
    shifts: Tensor
    edge_batch: Tensor
    dst_rowptr: Tensor
    src_rowptr: Tensor


@dataclass(frozen=True)
class DirectPairs(_CanonicalEdges):
    """All edges of a batch; ``edge_ptr`` (B+1,) is the first edge of every structure."""

    edge_ptr: Tensor


@dataclass(frozen=True)
class BoundedPairs(_CanonicalEdges):
    """A padded batch's edges in arrays of a fixed capacity: the edge arrays hold the first
    ``min(E, capacity)`` edges (the rest is left unwritten); the offsets ``(R+1,)`` are the full
    cumulative counts (constant ``E`` from row N on, even beyond the capacity); ``totals`` (2,)
    is ``[E, close]``, ``close`` non-zero when some pair is closer than the table's
    ``min_distance``."""

    totals: Tensor


def _default_tiles(device: torch.device) -> Tiles:
    return GPU_TILES if device.type == "cuda" else INTERPRETER_TILES


def _launch_pass(
    batch: tuple[Tensor, ...],
    rowptr: Tensor,
    src_rowptr: Tensor,
    edges: tuple[Tensor, ...],
    *,
    write: bool,
    single_image: bool,
    tiles: Tiles,
) -> None:
    """One pass over rows ``0 .. R-1`` (R = ``len(src_rowptr) - 1``). ``batch``: positions,
    cells, table, ptr, atom_batch and the (1,) atom count N; ``rowptr`` (R+2,) ends with the
    close flag; ``edges``: src, dst, shifts, edge_batch (empty for the counting pass)."""
    n_rows = src_rowptr.shape[0] - 1
    _direct_pairs_kernel[(triton.cdiv(n_rows, tiles.rows),)](
        *batch, rowptr, rowptr[n_rows + 1 :], *edges, src_rowptr, edges[0].shape[0],
        TABLE_ROW=TABLE_WIDTH, ROWS=tiles.rows, BLOCK=tiles.block, WRITE=write,
        SINGLE_IMAGE=single_image, num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip


def _edge_arrays(n_edges: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Uninitialised src, dst, shifts, edge_batch for ``n_edges`` edges."""
    src = torch.empty(n_edges, dtype=torch.int64, device=device)
    dst = torch.empty_like(src)
    shifts = torch.empty(n_edges, 3, dtype=torch.int64, device=device)
    return src, dst, shifts, torch.empty_like(src)


def direct_pairs(
    positions: Tensor, cells: Tensor, ptr: Tensor, atom_batch: Tensor, table: Tensor,
    *, single_image: bool, tiles: Tiles | None = None,
) -> DirectPairs | None:  # fmt: skip
    """All pairs of a batch by the two-pass direct search; ``None`` when some pair is closer
    than the table's ``min_distance`` (the caller produces the error).

    Args:
        positions: (N, 3) float64 or float32, Å, on the device that runs Triton (CUDA, or the
            CPU under ``TRITON_INTERPRET=1``).
        cells: (B, 3, 3) lattice rows, positions' dtype.
        ptr: (B+1,) int64 atom offsets; atom_batch: (N,) int64 structure of every atom.
        table: (B, TABLE_WIDTH) float64 from :func:`image_windows`, on the same device.
        single_image: :attr:`ImageWindows.single_image` (compiles the window decoding out).
        tiles: launch shape; :data:`GPU_TILES` on CUDA, :data:`INTERPRETER_TILES` on the CPU.

    Synchronises once (edge count and coincidence flag in one read), after launching all that
    does not need the edge count (both CSRs, the structures' edge offsets).
    """
    n_atoms = positions.shape[0]
    device = positions.device
    positions = positions.contiguous()
    cells = cells.to(positions.dtype).contiguous()
    rowptr = torch.zeros(n_atoms + 2, dtype=torch.int64, device=device)
    src_rowptr = torch.zeros(n_atoms + 1, dtype=torch.int64, device=device)
    batch = (positions, cells, table, ptr, atom_batch, ptr[-1:])  # ptr[B] is N
    tiles = tiles or _default_tiles(device)
    if n_atoms > 0:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        counting = (empty, empty, empty.view(0, 3), empty)
        _launch_pass(
            batch, rowptr, src_rowptr, counting, write=False, single_image=single_image,
            tiles=tiles,
        )  # fmt: skip
    dst_rowptr = rowptr[: n_atoms + 1]
    dst_rowptr[1:].cumsum_(0)
    src_rowptr[1:].cumsum_(0)
    edge_ptr = dst_rowptr.index_select(0, ptr)
    n_edges, close = rowptr[n_atoms:].tolist()
    if close:
        return None
    edges = _edge_arrays(n_edges, device)
    if n_edges > 0:
        _launch_pass(
            batch, rowptr, src_rowptr, edges, write=True, single_image=single_image, tiles=tiles
        )
    src, dst, shifts, edge_batch = edges
    return DirectPairs(dst, src, shifts, edge_batch, dst_rowptr, src_rowptr, edge_ptr)


def bounded_direct_pairs(
    positions: Tensor, cells: Tensor, ptr: Tensor, atom_batch: Tensor, table: Tensor,
    atom_count: Tensor, capacity: int, *, single_image: bool, tiles: Tiles | None = None,
) -> BoundedPairs:  # fmt: skip
    """The direct search of a batch padded to R >= N rows, into arrays of ``capacity`` edges,
    without a host read: every launch has a fixed shape, so a CUDA graph can record it.

    Args:
        positions: (R, 3), atom_batch: (R,) rows padded beyond the real N atoms (never read).
        cells: (B', 3, 3), table: (B', TABLE_WIDTH), ptr: (B'+1,) structures padded beyond the
            real B (only the real structures' rows and offsets are read).
        atom_count: (1,) int64 N, on the device.
        capacity: edges the arrays hold; edges beyond it are counted but not stored.
        single_image, tiles: as for :func:`direct_pairs`.
    """
    n_rows = positions.shape[0]
    device = positions.device
    rowptr = torch.zeros(n_rows + 2, dtype=torch.int64, device=device)
    src_rowptr = torch.zeros(n_rows + 1, dtype=torch.int64, device=device)
    batch = (positions, cells, table, ptr, atom_batch, atom_count)
    tiles = tiles or _default_tiles(device)
    edges = _edge_arrays(capacity, device)
    launch = functools.partial(
        _launch_pass, batch, rowptr, src_rowptr, edges, single_image=single_image, tiles=tiles
    )
    launch(write=False)
    rowptr[1 : n_rows + 1].cumsum_(0)
    src_rowptr[1:].cumsum_(0)
    launch(write=True)
    src, dst, shifts, edge_batch = edges
    return BoundedPairs(
        dst, src, shifts, edge_batch, rowptr[: n_rows + 1], src_rowptr, rowptr[n_rows:]
    )


# Below the kernel on purpose: Triton's hash of a kernel includes its line number, and the shipped
# kernel sets (so2kernels/tables/*.kernels.json) find kernels by that hash.
class ImageWindowMemo:
    """:func:`image_windows` for the last ``size`` distinct batches, keyed by their bytes.

    An MD run or a relaxation at a fixed cell asks for the same table every step; building it
    costs ~0.1–0.2 ms of host time (NumPy inverse, norms, windows) before a replayed step can
    launch, and hashing the inputs a few µs. Callers must not write into a returned table, and
    serialise their calls (no lock: the replay path already runs one batch at a time).
    """

    def __init__(self, size: int = 8):
        self._size = size
        self._tables: dict[tuple[object, ...], ImageWindows] = {}  # oldest first

    def __call__(
        self, cells: Tensor, pbc: Tensor, ptr: Tensor, cutoff: float, min_distance: float
    ) -> ImageWindows:
        key = (
            str(cells.dtype), cells.detach().numpy().tobytes(), pbc.numpy().tobytes(),
            ptr.numpy().tobytes(), cutoff, min_distance,
        )  # fmt: skip
        windows = self._tables.pop(key, None)
        if windows is None:
            windows = image_windows(cells, pbc, ptr, cutoff, min_distance)
            if len(self._tables) >= self._size:
                del self._tables[next(iter(self._tables))]
        self._tables[key] = windows  # now the newest
        return windows
