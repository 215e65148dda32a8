"""CUDA-graph replay of the energy+force step for small batches.

A 192-atom step launches ~1,400 kernels that each run for microseconds: eager execution is bound
by the host (Python, dispatcher, launches), not by the GPU. Below :data:`CAPTURE_MAX_ATOMS` atoms
:class:`CapturedSteps` therefore records the whole device part of one step once per *shape
bucket* — edge vectors → edge cache → model → energies → ``autograd.grad`` → force/virial
assembly — and replays it, so a step costs one graph launch plus the neighbour list (built on
the device; padding happens wherever the graph is, with shape-only arithmetic and no host
read).

Shape buckets. A graph has fixed shapes, so each batch is padded up to ``(N_pad, E_pad, B_pad)``
(eight sizes per octave: at most 12.5 % padding). Padding is physically inert by construction,
not by masking: the padded atoms belong to an extra *dummy structure* whose energy is discarded,
and every padded edge joins a dummy atom to its own periodic image at distance ``rcut/2`` along
the dummy cell's x axis. No real atom is the source or destination of a padded edge, so real
energies, forces and virials equal an unpadded evaluation exactly in float64, and in fp32 up to
the rounding of shape-dependent GEMM blocking (~1e-7 relative).
Padded edges are spread over the dummy atoms (about ``E/N`` each) so no segment is pathologically
long.

The recorded graph reads the model's parameters by address: any change to a parameter (in-place
update, ``load_state_dict``) bumps its version and drops every captured graph. Each graph owns a
private memory pool (sharing one pool across captures tripped an allocator assert in torch 2.11);
together they are bounded by :data:`MEMORY_FRACTION` of the device.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
from torch import Tensor, nn

from service.graph.neighbors import Graph

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
    """``inputs`` padded to ``shape`` with inert dummy atoms, edges and a dummy structure.

    Built with device arithmetic on Python ints only: no host synchronisation.
    """
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


@dataclass
class _Recorded:
    graph: torch.cuda.CUDAGraph
    inputs: StepInputs
    outputs: StepOutputs
    pool_bytes: int


def _copy_into(static: StepInputs, fresh: StepInputs) -> None:
    for spec in fields(Graph):
        target = getattr(static.graph, spec.name)
        if isinstance(target, Tensor):
            target.copy_(getattr(fresh.graph, spec.name), non_blocking=True)
    static.positions.copy_(fresh.positions, non_blocking=True)
    static.cells.copy_(fresh.cells, non_blocking=True)
    static.types.copy_(fresh.types, non_blocking=True)


def _weights_key(model: nn.Module) -> tuple[tuple[int, int], ...]:
    tensors = [*model.parameters(), *model.buffers()]
    return tuple((t.data_ptr(), t._version) for t in tensors)


class CapturedSteps:
    """Per-bucket CUDA graphs of ``step`` (see the module docstring)."""

    def __init__(self, model: nn.Module, step: StepFunction, rcut: float, device: torch.device):
        self._model = model
        self._step = step
        self._rcut = rcut
        self._device = device
        self._graphs: OrderedDict[StepShape, _Recorded] = OrderedDict()
        self._hits: Counter[StepShape] = Counter()
        self._weights = _weights_key(model)
        self._memory_budget = int(
            MEMORY_FRACTION * torch.cuda.get_device_properties(device).total_memory
        )

    def accepts(self, n_atoms: int, n_edges: int) -> bool:
        return n_atoms < CAPTURE_MAX_ATOMS and n_edges < CAPTURE_MAX_EDGES

    @property
    def n_graphs(self) -> int:
        return len(self._graphs)

    def run(self, inputs: StepInputs) -> StepOutputs | None:
        """The step's outputs for ``inputs`` (unpadded, on the device or the host), replayed
        from the bucket's graph; ``None`` while the bucket is not yet worth recording (the
        caller then evaluates eagerly)."""
        g = inputs.graph
        key = _weights_key(self._model)
        if key != self._weights:
            self._graphs.clear()
            self._weights = key
        shape = StepShape.padded(g.n_atoms, g.n_edges, g.n_structures)
        recorded = self._graphs.get(shape)
        if recorded is None:
            if len(self._hits) > MAX_TRACKED_SHAPES:  # a server sees endless batch shapes
                self._hits.clear()
            self._hits[shape] += 1
            if self._hits[shape] < RECORD_AFTER:
                return None
        padded = pad_inputs(inputs, shape, self._rcut)
        if recorded is None:
            recorded = self._record(padded.to(self._device))
            self._graphs[shape] = recorded
            while len(self._graphs) > 1 and (
                len(self._graphs) > MAX_GRAPHS
                or sum(r.pool_bytes for r in self._graphs.values()) > self._memory_budget
            ):
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(shape)
            _copy_into(recorded.inputs, padded)
        recorded.graph.replay()
        out = recorded.outputs
        # Clones: the next replay overwrites the static outputs.
        return StepOutputs(
            energy=out.energy[: g.n_structures].clone(),
            atom_energy=out.atom_energy[: g.n_atoms].clone(),
            forces=out.forces[: g.n_atoms].clone(),
            virial=out.virial[: g.n_structures].clone(),
        )

    def clear(self) -> None:
        """Drop every recorded graph and its memory (e.g. before retrying after an OOM)."""
        self._graphs.clear()

    def _record(self, static: StepInputs) -> _Recorded:
        side = torch.cuda.Stream(self._device)
        side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self._step(static)
        torch.cuda.current_stream(self._device).wait_stream(side)
        before = torch.cuda.memory_reserved(self._device)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the service's other threads (HTTP, metrics) may touch CUDA meanwhile.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            outputs = self._step(static)
        pool_bytes = torch.cuda.memory_reserved(self._device) - before
        return _Recorded(graph, static, outputs, pool_bytes=max(pool_bytes, 0))
