"""CUDA-graph replay of the energy+force step for small batches.

A 192-atom step launches ~1,400 kernels that each run for microseconds: eager execution is bound
by the host (Python, dispatcher, launches), not by the GPU. Below :data:`CAPTURE_MAX_ATOMS` atoms
:class:`CapturedSteps` therefore records the whole device part of one step once per *shape
bucket* — neighbour search → padding → edge vectors → edge cache → model → energies →
``autograd.grad`` → force/virial assembly — and replays it, so a step costs one graph launch and
two copies, with no host read before the launch.

Shape buckets. A graph has fixed shapes, so each batch is padded up to ``(N_pad, E_pad, B_pad)``
(eight sizes per octave: at most 12.5 % padding). Padding is physically inert by construction,
not by masking: the padded atoms belong to an extra *dummy structure* whose energy is discarded,
and every padded edge joins a dummy atom to its own periodic image at distance ``rcut/2`` along
the dummy cell's x axis. No real atom is the source or destination of a padded edge, so real
energies, forces and virials equal an unpadded evaluation exactly in float64, and in fp32 up to
the rounding of shape-dependent GEMM blocking (~1e-7 relative).
Padded edges are spread over the dummy atoms (about ``E/N`` each) so no segment is pathologically
long.

Host work before a replay. The device idles until the replay starts, so everything the host does
first is wall time. The search table comes from the cells, and the potential reuses it while a
batch's cells, periodicity and atom offsets repeat (MD, relaxations at a fixed cell:
:class:`~service.graph.pair_search.ImageWindowMemo`). A host batch (:class:`ReplayBatch`) is keyed
by what the host knows before the search (:class:`BatchKey`: N_pad, B_pad and the search variant);
the key remembers the edge bucket of its last batch. A batch whose key has a recorded graph for
that bucket is *speculatively* replayed (:meth:`CapturedSteps.speculate`): the host pads positions,
cells, the search table, offsets and types to the bucket (:func:`stage`, NumPy into page-locked
memory), one copy puts them into the graph's static input buffer (:class:`StaticBatch`, with the
real N and B: recorded launches cannot take sizes that change within a bucket), and the graph runs
the direct search (:func:`~service.graph.pair_search.bounded_direct_pairs`, rows beyond N skipped,
no edge stored beyond E_pad), the padding of the edges and CSR tails (one Triton launch whose
values equal :func:`pad_inputs`, the eager reference), a stable argsort for the source order, and
the step. One copy brings back the packed outputs together with the true edge count and the
coincidence flag. If the edges overflowed the bucket, or a pair is too close, the outputs are
discarded and the batch takes the search with a host read (:meth:`CapturedSteps.run`: the right
bucket, which replays the same graph, or the usual ``coincident_atoms`` error); that is also how
the first batch of a key goes. A replay's outputs are on the host. Parameter changes are detected
from a cached tensor list (walking the module tree costs hundreds of µs a call); replacing a
parameter or buffer object anywhere bumps a registration epoch that rebuilds that list.

The recorded graph reads the model's parameters by address: any change to a parameter (in-place
update, ``load_state_dict``) bumps its version and drops every captured graph. Each graph owns a
private memory pool (sharing one pool across captures tripped an allocator assert in torch 2.11);
together they are bounded by :data:`MEMORY_FRACTION` of the device, except that the graph just
recorded is always kept (alone it may exceed that share).
"""

# Triton kernels take untyped pointer/constexpr arguments and @triton.jit is an untyped decorator.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
from __future__ import annotations

import functools
import math
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor, nn
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.profiler import record_function

from service.graph.neighbors import Graph
from service.graph.pair_search import TABLE_WIDTH, ImageWindows, bounded_direct_pairs
from service.graph.structures import Structures

CAPTURE_MAX_ATOMS = 4096
"""Largest batch replayed from a CUDA graph. Beyond a few thousand atoms kernel time dominates
launch overhead and the eager step is as fast; graphs would only pin memory."""
CAPTURE_MAX_EDGES = 600_000
MAX_GRAPHS = 8
"""Captured buckets kept (least recently used dropped first)."""
MEMORY_FRACTION = 0.25
"""Device memory the recorded graphs may pin together (each graph owns a private pool holding
its step's activations); beyond it the least recently used graphs are dropped."""
RECORD_AFTER = 3
"""A bucket is recorded on its third hit: MD and repeated screening shapes replay from the third
step on, while the ever-changing batch shapes of a busy server (each recording costs about three
eager steps and pins memory) run eagerly instead of thrashing the graph cache."""
MAX_TRACKED_SHAPES = 4096
WARMUP_STEPS = 2
"""Eager steps on a side stream before capture (compiles/caches Triton kernels, packs weights)."""

_CAPTURE_LOCK = threading.Lock()
"""Held while a CUDA graph is recorded (see ``CapturedSteps._record``)."""


def bucket_size(n: int, minimum: int = 64) -> int:
    """``n`` rounded up to one of eight sizes per octave (≤ 12.5 % above ``n``)."""
    if n <= minimum:
        return minimum
    grain = 1 << max(n.bit_length() - 4, 0)
    return -(-n // grain) * grain


@dataclass(frozen=True)
class StepShape:
    n_atoms: int
    n_edges: int
    n_structures: int

    @classmethod
    def padded(cls, n_atoms: int, n_edges: int, n_structures: int) -> StepShape:
        """The bucket of a batch: room for at least one dummy atom and one dummy structure."""
        return cls(
            n_atoms=bucket_size(n_atoms + 1),
            n_edges=bucket_size(max(n_edges, 1)),
            n_structures=1 << n_structures.bit_length(),  # next power of two > B
        )


@dataclass
class StepInputs:
    """Device tensors a step reads: the (padded) graph, positions (N, 3), cells (B, 3, 3) and
    atom type indices (N,)."""

    graph: Graph
    positions: Tensor
    cells: Tensor
    types: Tensor

    def to(self, device: torch.device) -> StepInputs:
        return StepInputs(
            graph=self.graph.to(device),
            positions=self.positions.to(device),
            cells=self.cells.to(device),
            types=self.types.to(device),
        )


@dataclass
class StepOutputs:
    """energy (B,), atom_energy (N,), forces (N, 3), virial (B, 3, 3); float64."""

    energy: Tensor
    atom_energy: Tensor
    forces: Tensor
    virial: Tensor


StepFunction = Callable[[StepInputs], StepOutputs]


def pad_inputs(inputs: StepInputs, shape: StepShape, rcut: float) -> StepInputs:
    """``inputs`` padded to ``shape`` with inert dummy atoms, edges and a dummy structure: the
    eager reference of the padding that :func:`stage` and :func:`search_and_pad` build for a
    recorded graph (the tests hold them to it bit for bit)."""
    g = inputs.graph
    n, e, b = g.n_atoms, g.n_edges, g.n_structures
    n_dummy, n_fill, dummy = shape.n_atoms - n, shape.n_edges - e, shape.n_structures - 1
    dev = inputs.positions.device
    k = torch.arange(n_fill, device=dev, dtype=torch.int64)
    pad_dst = n + k * n_dummy // max(n_fill, 1)
    # First padded edge of dummy atom j is ceil(j·P/M): the rows of the dst- and src-CSR tails.
    j = torch.arange(1, n_dummy + 1, device=dev, dtype=torch.int64)
    tail_ptr = e + (j * n_fill + n_dummy - 1) // n_dummy
    pad_shift = torch.zeros(n_fill, 3, dtype=torch.int64, device=dev)
    pad_shift[:, 0] = 1
    dummy_cell = torch.eye(3, dtype=inputs.cells.dtype, device=dev) * (0.5 * rcut)
    edge_tail = torch.full((shape.n_structures - b,), e + n_fill, dtype=torch.int64, device=dev)
    edge_tail[:-1] = e
    graph = Graph(
        src=torch.cat([g.src, pad_dst]),
        dst=torch.cat([g.dst, pad_dst]),
        shifts=torch.cat([g.shifts, pad_shift]),
        edge_batch=torch.cat([g.edge_batch, torch.full_like(pad_dst, dummy)]),
        atom_batch=torch.cat(
            [g.atom_batch, torch.full((n_dummy,), dummy, dtype=torch.int64, device=dev)]
        ),
        dst_rowptr=torch.cat([g.dst_rowptr, tail_ptr]),
        src_order=torch.cat([g.src_order, e + k]),
        src_rowptr=torch.cat([g.src_rowptr, tail_ptr]),
        edge_ptr=torch.cat([g.edge_ptr, edge_tail]),
        n_atoms=shape.n_atoms,
        n_structures=shape.n_structures,
    )
    return StepInputs(
        graph=graph,
        positions=torch.cat([inputs.positions, inputs.positions.new_zeros(n_dummy, 3)]),
        cells=torch.cat([inputs.cells, dummy_cell.expand(shape.n_structures - b, 3, 3)]),
        types=torch.cat([inputs.types, inputs.types.new_zeros(n_dummy)]),
    )


# The recorded step's inputs. What the host knows before the search (positions, cells, the
# search table, offsets, types and the true N and B) is padded to the bucket on the host and
# copied into the graph's static input buffer in one transfer; everything else is built on the
# device inside the graph.


@dataclass(frozen=True)
class ReplayBatch:
    """A host batch bound for a recorded step, all on the host: validated structures (float64),
    atom type indices (N,) int64 and the direct search's per-structure windows."""

    structures: Structures
    types: Tensor
    windows: ImageWindows


@dataclass(frozen=True)
class Bucket:
    """A recorded graph's key: the padded shape, and whether every structure sees one image
    per pair (the search kernel variant the graph runs)."""

    shape: StepShape
    single_image: bool


@dataclass(frozen=True)
class BatchKey:
    """What the host knows of a batch's bucket before its search: the padded atom and
    structure counts and the search variant (the edge count comes from the search)."""

    n_atoms: int
    n_structures: int
    single_image: bool

    @classmethod
    def of(cls, batch: ReplayBatch) -> BatchKey:
        s = batch.structures
        shape = StepShape.padded(s.n_atoms, 0, s.n_structures)
        return cls(shape.n_atoms, shape.n_structures, batch.windows.single_image)

    def bucket(self, n_edges: int) -> Bucket:
        """The bucket of a batch of this key with ``n_edges`` edges."""
        shape = StepShape(self.n_atoms, bucket_size(max(n_edges, 1)), self.n_structures)
        return Bucket(shape, self.single_image)


_STATIC_ALIGNMENT = 16  # bytes: every view starts where Triton's pointer alignment assumes


@dataclass(frozen=True)
class StaticBatch:
    """A padded batch's search and step inputs as views of one byte buffer (one copy fills it).

    Attributes:
        buffer: (bytes,) uint8 holding all the views below.
        positions: (N_pad, 3) float64, dummy atoms at the origin.
        cells: (B_pad, 3, 3) float64, padding structures ``rcut/2`` times the identity.
        table: (B_pad, TABLE_WIDTH) float64 search table, zero rows for padding structures.
        ptr: (B_pad+1,) int64 atom offsets: the real ones, then N up to ``ptr[B_pad] = N_pad``.
        atom_batch: (N_pad,) int64, dummy atoms in the last structure.
        types: (N_pad,) int64, dummy atoms of type 0.
        sizes: (2,) int64 the real N and B.
    """

    buffer: Tensor
    positions: Tensor
    cells: Tensor
    table: Tensor
    ptr: Tensor
    atom_batch: Tensor
    types: Tensor
    sizes: Tensor

    @classmethod
    def empty(cls, shape: StepShape, device: torch.device) -> StaticBatch:
        return cls.view(torch.empty(_layout(shape)[1], dtype=torch.uint8, device=device), shape)

    @classmethod
    def view(cls, buffer: Tensor, shape: StepShape) -> StaticBatch:
        """The fields of ``shape``'s layout as views of the byte buffer ``buffer``."""
        fields = [
            buffer[start : start + 8 * math.prod(dims)]
            .view(torch.int64 if whole else torch.float64)
            .view(dims)
            for start, dims, whole in _layout(shape)[0]
        ]
        return cls(buffer, *fields)


@functools.lru_cache(maxsize=MAX_GRAPHS * 4)
def _layout(shape: StepShape) -> tuple[tuple[tuple[int, tuple[int, ...], bool], ...], int]:
    """Each :class:`StaticBatch` field's byte offset, shape and whether it is int64 (else
    float64), in field order; and the buffer's size."""
    n, b = shape.n_atoms, shape.n_structures
    fields = (
        ((n, 3), False), ((b, 3, 3), False), ((b, TABLE_WIDTH), False), ((b + 1,), True),
        ((n,), True), ((n,), True), ((2,), True),
    )  # fmt: skip
    spans, offset = [], 0
    for dims, whole in fields:
        spans.append((offset, dims, whole))
        size = 8 * math.prod(dims)  # every field is 8 bytes wide
        offset += size + -size % _STATIC_ALIGNMENT
    return tuple(spans), offset


def stage(batch: ReplayBatch, shape: StepShape, rcut: float, pin_memory: bool) -> Tensor:
    """``batch`` padded to ``shape`` in a new host byte buffer laid out as a
    :class:`StaticBatch`, with :func:`pad_inputs`'s values (page-locked with ``pin_memory``, so
    that its copy to the device is an asynchronous DMA). NumPy fills it: this runs before every
    replay, and a few dozen small torch ops would cost several times more."""
    s = batch.structures
    n, b = s.n_atoms, s.n_structures
    spans, size = _layout(shape)
    buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pin_memory)
    raw = buffer.numpy()
    positions, cells, table, ptr, atom_batch, types, sizes = (
        raw[start : start + 8 * math.prod(dims)].view(np.int64 if whole else np.float64)
        for start, dims, whole in spans
    )
    positions[: 3 * n] = s.positions.numpy().reshape(-1)
    positions[3 * n :] = 0.0
    cells[: 9 * b] = s.cells.numpy().reshape(-1)
    cells[9 * b :] = np.tile(np.eye(3).reshape(-1) * (0.5 * rcut), shape.n_structures - b)
    table[: TABLE_WIDTH * b] = batch.windows.table.reshape(-1)
    table[TABLE_WIDTH * b :] = 0.0
    ptr[: b + 1] = s.ptr.numpy()
    ptr[b + 1 :] = n
    ptr[-1] = shape.n_atoms
    atom_batch[:n] = np.repeat(np.arange(b), np.diff(ptr[: b + 1]))
    atom_batch[n:] = shape.n_structures - 1
    types[:n] = batch.types.numpy()
    types[n:] = 0
    sizes[:] = (n, b)
    return buffer


# Triton kernel: the padding of a searched batch, in one launch. Program k covers flat indices
# k·BLOCK ..; each index is at once an edge, a CSR row and a structure offset, and writes
# whichever of those arrays it falls in (the edge range is by far the longest, so the others
# cost only masked lanes). The real sizes N, B and E are read from device memory: they change
# within a bucket, and a recorded launch keeps its scalar arguments.
#
# A batch with more edges than the bucket holds (E > E_pad) keeps its first E_pad edges and gets
# a consistent CSR over them: its outputs are discarded, but the replay must stay in bounds.

_PAD_SIZES = ("padded_atoms", "padded_edges", "padded_structures")


@triton.jit(do_not_specialize=_PAD_SIZES)
def _pad_graph_kernel(
    src, dst, shifts, edge_batch,  # (E_pad,), shifts (E_pad, 3): the tail is written in place
    dst_counts, src_counts,  # (N_pad+1,) the search's cumulative counts (E from row N on)
    ptr,  # (B_pad+1,) atom offsets
    sizes,  # (2,) N, B
    totals,  # (2,) E, close flag
    out_dst_rowptr, out_src_rowptr,  # (N_pad+1,)
    out_edge_ptr,  # (B_pad+1,)
    padded_atoms, padded_edges, padded_structures,
    BLOCK: tl.constexpr,
):  # fmt: skip
    k = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    n_atoms = tl.load(sizes)
    n_structures = tl.load(sizes + 1)
    n_edges = tl.minimum(tl.load(totals), padded_edges)
    n_dummy = padded_atoms - n_atoms  # >= 1 by StepShape.padded
    n_fill = padded_edges - n_edges
    dummy = padded_structures - 1

    # Edges [E, E_pad): padded edge E + f joins dummy atom N + f·n_dummy // n_fill to its image.
    fill = (k >= n_edges) & (k < padded_edges)
    fill_atom = n_atoms + (k - n_edges) * n_dummy // tl.maximum(n_fill, 1)
    tl.store(src + k, fill_atom, mask=fill)
    tl.store(dst + k, fill_atom, mask=fill)
    tl.store(edge_batch + k, tl.zeros_like(k) + dummy, mask=fill)
    tl.store(shifts + 3 * k, tl.full((BLOCK,), 1, tl.int64), mask=fill)
    tl.store(shifts + 3 * k + 1, tl.zeros_like(k), mask=fill)
    tl.store(shifts + 3 * k + 2, tl.zeros_like(k), mask=fill)

    # CSR rows (N_pad+1): dummy atom j >= 1 starts at edge E + ceil(j·n_fill / n_dummy), for
    # destinations and sources alike (a padded edge's source is its destination).
    on_row = k <= padded_atoms
    real = k <= n_atoms
    tail = n_edges + ((k - n_atoms) * n_fill + n_dummy - 1) // n_dummy
    value = tl.load(dst_counts + k, mask=real, other=0)
    tl.store(out_dst_rowptr + k, tl.where(real, tl.minimum(value, padded_edges), tail), mask=on_row)
    value = tl.load(src_counts + k, mask=real, other=0)
    tl.store(out_src_rowptr + k, tl.where(real, tl.minimum(value, padded_edges), tail), mask=on_row)

    # Structure offsets (B_pad+1): the empty padding structures, then the dummy one at the end.
    on_offset = k <= padded_structures
    real = k <= n_structures
    first_atom = tl.load(ptr + k, mask=real, other=0)
    value = tl.minimum(tl.load(dst_counts + first_atom, mask=real, other=0), padded_edges)
    padded = tl.where(k < padded_structures, n_edges, padded_edges)
    tl.store(out_edge_ptr + k, tl.where(real, value, padded), mask=on_offset)


# Launcher

_PAD_BLOCK = 1024


def search_and_pad(
    static: StaticBatch, shape: StepShape, single_image: bool
) -> tuple[StepInputs, Tensor]:
    """The padded step inputs of the batch in ``static``, built where ``static`` lives with
    fixed-shape launches only (what a recorded graph replays): the direct search into arrays of
    E_pad edges, :func:`pad_inputs`'s inert padding, the source order.

    Returns the inputs and the (2,) int64 ``[E, close]`` of the search. When ``E <= E_pad`` and
    ``close`` is 0 the inputs equal :func:`pad_inputs` of the batch's graph bit for bit;
    otherwise they are in bounds but meaningless.

    The source order is a stable argsort of the padded ``src``: padded edges' sources (dummy
    atoms, all above the real ones) do not decrease along the edges, so it equals the real
    edges' order followed by the padded edges in place, as :func:`pad_inputs` builds it.
    """
    pairs = bounded_direct_pairs(
        static.positions, static.cells, static.ptr, static.atom_batch, static.table,
        static.sizes[:1], shape.n_edges, single_image=single_image,
    )  # fmt: skip
    device = static.positions.device
    dst_rowptr = torch.empty(shape.n_atoms + 1, dtype=torch.int64, device=device)
    src_rowptr = torch.empty_like(dst_rowptr)
    edge_ptr = torch.empty(shape.n_structures + 1, dtype=torch.int64, device=device)
    longest = max(shape.n_edges, shape.n_atoms + 1, shape.n_structures + 1)
    _pad_graph_kernel[(triton.cdiv(longest, _PAD_BLOCK),)](
        pairs.src, pairs.dst, pairs.shifts, pairs.edge_batch, pairs.dst_rowptr,
        pairs.src_rowptr, static.ptr, static.sizes, pairs.totals, dst_rowptr, src_rowptr,
        edge_ptr, shape.n_atoms, shape.n_edges, shape.n_structures, BLOCK=_PAD_BLOCK,
    )  # fmt: skip
    graph = Graph(
        src=pairs.src,
        dst=pairs.dst,
        shifts=pairs.shifts,
        edge_batch=pairs.edge_batch,
        atom_batch=static.atom_batch,
        dst_rowptr=dst_rowptr,
        src_order=torch.argsort(pairs.src, stable=True),
        src_rowptr=src_rowptr,
        edge_ptr=edge_ptr,
        n_atoms=shape.n_atoms,
        n_structures=shape.n_structures,
    )
    return StepInputs(graph, static.positions, static.cells, static.types), pairs.totals


# Outputs: the recorded step packs its outputs and the search's totals into one buffer, so a
# replay returns them with one copy, which is also what tells whether the bucket held the batch.


@dataclass(frozen=True)
class _PackedOutputs:
    """The step's outputs flattened into one float64 buffer (energy, atom_energy, forces,
    virial, then the search's ``[E, close]``), with each output's padded shape and dtype to
    view it back."""

    buffer: Tensor
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]

    @classmethod
    def pack(cls, outputs: StepOutputs, totals: Tensor) -> _PackedOutputs:
        parts = (outputs.energy, outputs.atom_energy, outputs.forces, outputs.virial)
        flat = [t.detach().reshape(-1).double() for t in parts]
        return cls(
            buffer=torch.cat([*flat, totals.double()]),  # E < 2^53: exact in float64
            shapes=tuple(tuple(t.shape) for t in parts),
            dtypes=tuple(t.dtype for t in parts),
        )

    def fetch(self, n_atoms: int, n_structures: int) -> tuple[StepOutputs, int, bool]:
        """The real rows (on the host, in their own dtypes), E and the close flag, from one
        copy of the buffer: a replayed step's one host round trip."""
        host = torch.empty(self.buffer.shape, dtype=torch.float64, pin_memory=self.buffer.is_cuda)
        host.copy_(self.buffer)
        parts, start = [], 0
        for shape, dtype, rows in zip(
            self.shapes, self.dtypes, (n_structures, n_atoms, n_atoms, n_structures), strict=True
        ):
            row_size = math.prod(shape[1:])
            part = host[start : start + rows * row_size].view(rows, *shape[1:])
            parts.append(part if dtype == torch.float64 else part.to(dtype))
            start += shape[0] * row_size
        n_edges, close = host[-2:].tolist()
        return StepOutputs(*parts), int(n_edges), bool(close)


@dataclass
class _Recorded:
    graph: torch.cuda.CUDAGraph
    static: StaticBatch
    outputs: _PackedOutputs
    pool_bytes: int


# Weight versions. A recorded graph reads parameters by address; an in-place update bumps a
# tensor's version, a new tensor object (assignment, ``load_state_dict(assign=True)``) is seen
# through the registration hooks, which count every registration in the process.

_registrations = 0


def _count_registration(*_: Any) -> None:
    global _registrations
    _registrations += 1


register_module_parameter_registration_hook(_count_registration)
register_module_buffer_registration_hook(_count_registration)
register_module_module_registration_hook(_count_registration)


class _WeightVersions:
    """``key()`` changes whenever a parameter or buffer of ``model`` may have changed."""

    def __init__(self, model: nn.Module):
        self._model = model
        self._epoch = -1
        self._tensors: list[Tensor] = []

    def key(self) -> tuple[tuple[int, int], ...]:
        if self._epoch != _registrations:
            self._epoch = _registrations
            self._tensors = [*self._model.parameters(), *self._model.buffers()]
        return tuple((t.data_ptr(), t._version) for t in self._tensors)


class CapturedSteps:
    """Per-bucket CUDA graphs of the searched step (see the module docstring)."""

    def __init__(self, model: nn.Module, step: StepFunction, rcut: float, device: torch.device):
        self._model = model
        self._step = step
        self._rcut = rcut
        self._device = device
        self._graphs: OrderedDict[Bucket, _Recorded] = OrderedDict()
        self._hits: Counter[Bucket] = Counter()
        self._predicted: dict[BatchKey, int] = {}
        """E_pad of the last batch seen of each key."""
        self._versions = _WeightVersions(model)
        self._weights = self._versions.key()
        self._memory_budget = int(
            MEMORY_FRACTION * torch.cuda.get_device_properties(device).total_memory
        )

    def accepts(self, n_atoms: int, n_edges: int) -> bool:
        return n_atoms < CAPTURE_MAX_ATOMS and n_edges < CAPTURE_MAX_EDGES

    @property
    def n_graphs(self) -> int:
        return len(self._graphs)

    def speculate(self, batch: ReplayBatch) -> StepOutputs | None:
        """The step's outputs (on the host), replayed before any search in the bucket of the
        last batch of the same :class:`BatchKey`. ``None`` when there is no such bucket or no
        graph for it, when the batch's edges overflow it, or when some pair is too close: the
        caller then searches with a host read (:meth:`run`), which also raises the error. An
        edge count in a smaller bucket is accepted (padding is inert) and predicted next."""
        self._drop_stale_graphs()
        key = BatchKey.of(batch)
        predicted = self._predicted.get(key)
        if predicted is None:
            return None
        bucket = key.bucket(predicted)
        recorded = self._graphs.get(bucket)
        if recorded is None:
            return None
        self._graphs.move_to_end(bucket)
        outputs, n_edges, close = self._replay(recorded, bucket, batch)
        if close or n_edges > predicted:
            return None
        # A smaller bucket is predicted next only once it has a graph: edge counts that hover
        # at a bucket boundary (MD) keep replaying the larger graph instead of searching.
        if key.bucket(n_edges) in self._graphs:
            self._predict(key, n_edges)
        return outputs

    def run(self, batch: ReplayBatch, n_edges: int) -> StepOutputs | None:
        """The step's outputs (on the host) for a batch whose search found ``n_edges`` edges,
        replayed from its bucket's graph; ``None`` while the bucket is not yet worth recording
        or when the batch is too large to record (the caller then evaluates eagerly)."""
        self._drop_stale_graphs()
        key = BatchKey.of(batch)
        self._predict(key, n_edges)
        if not self.accepts(batch.structures.n_atoms, n_edges):
            return None
        bucket = key.bucket(n_edges)
        recorded = self._graphs.get(bucket)
        if recorded is None:
            if len(self._hits) > MAX_TRACKED_SHAPES:  # a server sees endless batch shapes
                self._hits.clear()
            self._hits[bucket] += 1
            if self._hits[bucket] < RECORD_AFTER:
                return None
            recorded = self._record(bucket, batch)
            self._graphs[bucket] = recorded
            while len(self._graphs) > 1 and (
                len(self._graphs) > MAX_GRAPHS
                or sum(r.pool_bytes for r in self._graphs.values()) > self._memory_budget
            ):
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(bucket)
        outputs, found, close = self._replay(recorded, bucket, batch)
        if close or found != n_edges:
            raise RuntimeError(
                f"the recorded search found {found} edges (close pair: {close}) where the "
                f"search before it found {n_edges}"
            )
        return outputs

    def observe(self, batch: ReplayBatch, n_edges: int) -> None:
        """Predict ``n_edges``' bucket for the next batch of ``batch``'s key, for a batch the
        caller searched and evaluated without :meth:`run` (which predicts by itself)."""
        self._predict(BatchKey.of(batch), n_edges)

    def clear(self) -> None:
        """Drop every recorded graph and its memory (e.g. before retrying after an OOM)."""
        self._graphs.clear()

    def _drop_stale_graphs(self) -> None:
        key = self._versions.key()
        if key != self._weights:
            self._graphs.clear()
            self._weights = key

    def _predict(self, key: BatchKey, n_edges: int) -> None:
        if len(self._predicted) > MAX_TRACKED_SHAPES:
            self._predicted.clear()
        self._predicted[key] = key.bucket(n_edges).shape.n_edges

    def _load(self, static: StaticBatch, bucket: Bucket, batch: ReplayBatch) -> None:
        """``batch`` padded into ``static`` with one copy (asynchronous from pinned memory)."""
        pinned = self._device.type == "cuda"
        staged = stage(batch, bucket.shape, self._rcut, pin_memory=pinned)
        static.buffer.copy_(staged, non_blocking=pinned)

    def _searched_step(self, static: StaticBatch, bucket: Bucket) -> _PackedOutputs:
        """What a graph records: search, padding and step from the static inputs."""
        inputs, totals = search_and_pad(static, bucket.shape, bucket.single_image)
        return _PackedOutputs.pack(self._step(inputs), totals)

    def _replay(
        self, recorded: _Recorded, bucket: Bucket, batch: ReplayBatch
    ) -> tuple[StepOutputs, int, bool]:
        # The host's share of the step, under the profiler range of the search it replaces.
        with record_function("so2serve::graph"):
            self._load(recorded.static, bucket, batch)
        recorded.graph.replay()
        s = batch.structures
        return recorded.outputs.fetch(s.n_atoms, s.n_structures)

    def _record(self, bucket: Bucket, batch: ReplayBatch) -> _Recorded:
        static = StaticBatch.empty(bucket.shape, self._device)
        self._load(static, bucket, batch)
        side = torch.cuda.Stream(self._device)
        side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self._searched_step(static, bucket)
        torch.cuda.current_stream(self._device).wait_stream(side)
        before = torch.cuda.memory_reserved(self._device)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the service's other threads (HTTP, metrics) may touch CUDA meanwhile.
        # On our own stream: torch's default capture stream is made once per process, on
        # whichever device was current then, and capturing on it would make that device
        # current for this model's launches (a second GPU's). One capture at a time in the
        # process: two GPUs' workers recording at once invalidated each other's captures
        # (cudaErrorStreamCaptureInvalidated, 80 of 80 tries on two H200s).
        with _CAPTURE_LOCK, torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
            outputs = self._searched_step(static, bucket)
        pool_bytes = torch.cuda.memory_reserved(self._device) - before
        return _Recorded(graph, static, outputs, pool_bytes=max(pool_bytes, 0))
