"""The model-side API used by the service, the clients and training: :class:`Potential`.

``Potential.predict(structures)`` runs, for a batch of validated structures::

    build_graph → edge vectors (autograd leaf) → build_edge_cache → DPA4Model → atomic energies
    → E per structure (float64) → one autograd.grad(E, edge_vec) → forces, virial (CSR sums)
    → stress = −sym(W)/V

A host batch goes to the device in one packed copy, its atom types riding along, and its
neighbour list is built there (:func:`~service.graph.neighbors.place_and_build_graph_carrying`:
the direct Triton search for small and medium batches, one host read for the edge count). Small
host batches on CUDA (below ``CAPTURE_MAX_ATOMS``, direct search) replay a CUDA graph of the
whole step, search included (:mod:`service.model.captured`): one launch instead of ~1,400, and
once a batch's bucket can be predicted from earlier batches, no host read before it; the
replay's outputs come back to the host in one copy. ``capture=False`` turns that off (training
always runs eagerly).

Each phase runs under a ``so2serve::<phase>`` profiler range (graph, edge_cache, model, backward,
assembly; free when no profiler is active), so benchmarks/model.py --profile can split a step.

Forces are exactly −∂E/∂r and the virial is the strain derivative (both from the edge gradient,
service.graph.assembly). ``create_graph=True`` keeps the graph so a force loss can be
differentiated (training). The execution path (fused so2kernels ops vs their eager references) and
precision (``fp32``, ``fp64``, or the opt-in ``fp16x3`` mixing-stack tier) are decided here, once,
and reported in :class:`ExecutionInfo` (hence in ``/info`` and every response's provenance).
"""

from __future__ import annotations

import copy
import threading
import warnings
from collections.abc import Callable, Collection
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from ase.data import atomic_numbers
from torch import Tensor
from torch.profiler import record_function

from service.graph.assembly import assemble_forces_virial, atom_rowptr, stress_from_virial
from service.graph.cell_list import COINCIDENT_DISTANCE
from service.graph.edge_cache import build_edge_cache
from service.graph.errors import InvalidStructureError
from service.graph.neighbors import edge_vectors, place_and_build_graph_carrying, resolve_backend
from service.graph.pair_search import ImageWindowMemo
from service.graph.segments import csr_segment_sum
from service.graph.structures import Structures
from service.model.captured import CapturedSteps, ReplayBatch, StepInputs, StepOutputs
from service.model.config import ModelConfig
from service.model.dpa4 import DPA4Model
from service.model.errors import HostMemoryError, ModelFileError
from service.model.host_memory import host_available_bytes
from so2kernels._dispatch import INTERPRET, triton_available
from so2kernels.mixing_stack import StackPrecision

PROPERTIES = frozenset({"energy", "energies", "forces", "virial", "stress"})
PATHS = ("auto", "fused", "reference")
PRECISIONS = ("fp32", "fp64", "fp16x3")
"""``fp64`` runs the model in float64 on the reference path (validation, finite differences).
``fp16x3`` is fp32 except the mixing stacks' GEMMs, which run the opt-in error-compensated fp16
tensor-core tier (three fp16 products per fp32 product, ~2^-22 relative per GEMM): fused path
only, inference only (``create_graph`` is refused: the double backward has no fast tier)."""
STACK_TIERS = {
    "fp32": StackPrecision.EXACT,
    "fp64": StackPrecision.EXACT,
    "fp16x3": StackPrecision.FAST,
}
"""The mixing-stack GEMM tier of each precision."""
MEMORY_MODES = ("auto", "fast", "lean")
"""Per-edge activation policy of the SO(2) convolutions (see :func:`edge_chunk_for`):
``fast`` keeps every activation for the backward; ``lean`` runs the per-edge pipeline in
destination-node chunks (``DEFAULT_EDGE_CHUNK`` edges on CUDA, ``CPU_EDGE_CHUNK`` on the CPU) and
recomputes each chunk in the backward (bounded memory, one extra value-path forward); ``auto`` is
``lean`` on the CPU, and on CUDA ``fast`` while the estimated activations fit in half of the free
device memory, ``lean`` beyond."""
DEFAULT_EDGE_CHUNK = 131_072
"""Edges per chunk in ``lean`` mode on CUDA: big enough that every kernel launch fills an H200,
small enough that one chunk's activations stay around a couple of GB at C_wide = 128."""
CPU_EDGE_CHUNK = 4096
"""Edges per chunk on the CPU, where small chunks are faster as well as lighter: a chunk's
intermediates stay in the caches. Shipped model, forces and stress, water, 2026-12-03
(``benchmarks/cpu_step.py``): on the H200 host's 16 cores 192 / 768 / 1,536 atoms take 0.60 /
2.31 / 4.50 s and 0.60 / 1.20 / 2.20 GiB, against 0.80 / 4.18 / 6.97 s and 1.7 / 6.7 / 13.4 GiB
unchunked (1,024–8,192 edges all within ~30 % of the best); on 2 cores 768 atoms take 9.1 s
against 28.0 s."""
AUTO_MEMORY_FRACTION = 0.5
HOST_RESIDENT_PER_EDGE = 0.6
HOST_CHUNK_PER_EDGE = 5.0
"""A CPU step's memory in units of :func:`step_bytes_per_edge`: what stays for
the whole step per edge (edge cache, embedding outputs, gradients), and what one chunk's (or an
unchunked step's) edges take on top while it runs. Fitted with margin to the peak resident
memory of the reference path, forces and stress (2026-12-03): 0.51–0.53 resident per edge for
the shipped and the ``medium`` model at chunks of 2048 edges; 3.7 per edge unchunked, and the
chunk's share 3.6–4.3. Against ``benchmarks/cpu_step.py``'s peaks (shipped model, 17k–137k
edges, chunks of 1,024–8,192 edges and unchunked) the estimate came out at 1.02–1.52×."""


@dataclass
class Prediction:
    """Results of one batch, float64: on the potential's device, or on the host when a CUDA
    graph replayed the step (its one copy back to the host also carries the edge count that
    tells whether the replay's bucket held the batch).

    ``stress`` is ASE Voigt ``(xx, yy, zz, yz, xz, xy)`` in eV/Å³; rows of structures without a
    full 3-D periodic cell are NaN (a volume is undefined). Fields not requested are ``None``.
    """

    energy: Tensor  # (B,) eV
    energies: Tensor | None = None  # (N,) eV per atom
    forces: Tensor | None = None  # (N, 3) eV/Å
    virial: Tensor | None = None  # (B, 3, 3) eV
    stress: Tensor | None = None  # (B, 6) eV/Å³


@dataclass(frozen=True)
class ExecutionInfo:
    """What produced a prediction: value path, arithmetic tier and device."""

    path: str  # "fused" | "reference"
    precision: str  # PRECISIONS
    device: str
    memory: str = "auto"  # MEMORY_MODES


@dataclass(frozen=True)
class PotentialMetadata:
    """Identity of the served model."""

    name: str
    sha256: str
    elements: tuple[str, ...]
    rcut: float
    config: ModelConfig
    provenance: dict[str, Any] = field(default_factory=dict)


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` → CUDA when available, else CPU; ``"cpu"``, ``"cuda"``, ``"cuda:N"`` as given.
    Anything else, or a CUDA device this machine does not have, is a ``ValueError`` that says
    so (torch's own errors here are a RuntimeError or an assertion deep in the first kernel)."""
    name = str(device)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(name)
    except RuntimeError:
        resolved = None
    if resolved is None or resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}")
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: CUDA is not available on this machine")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    return resolved


def resolve_devices(spec: str) -> list[torch.device]:
    """The devices a service runs on: one as :func:`resolve_device` takes it, ``cuda:all``
    (every visible GPU), or distinct ``cuda:N`` joined by commas (``cuda:0,cuda:1``)."""
    names = spec.split(",")
    if names == ["cuda:all"]:
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda:all': CUDA is not available on this machine")
        return [torch.device("cuda", k) for k in range(torch.cuda.device_count())]
    if len(names) == 1:
        return [resolve_device(names[0])]
    devices = [resolve_device(name) for name in names]
    if any(d.type != "cuda" or d.index is None for d in devices):
        raise ValueError(f"several devices must each be cuda:N, got {spec!r}")
    if len(set(devices)) < len(devices):
        raise ValueError(f"a device is named twice in {spec!r}")
    return devices


def device_scope(device: torch.device) -> AbstractContextManager[object]:
    """``device`` made current while an evaluation runs on it: Triton launches, CUDA-graph
    capture and its side streams act on the *current* CUDA device, not on the tensors' one,
    so a model on ``cuda:1`` (or one of several in a process) must not rely on the default."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def resolve_path(config: ModelConfig, device: torch.device, path: str) -> str:
    """The one place that decides the SO(2) value path.

    ``auto``: fused on CUDA when the architecture is fused-eligible, the reference otherwise.
    ``fused`` elsewhere runs the ops, which execute Triton under ``TRITON_INTERPRET=1`` and their
    own reference otherwise.
    """
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if path == "auto":
        return "fused" if device.type == "cuda" and config.fused_eligible else "reference"
    if path == "fused" and not config.fused_eligible:
        raise ValueError(
            "this architecture is outside the fused kernels' regime (focus_dim in {32,64,96,128}, "
            "lmax 1..6, mixing_layers >= 2, rank <= 4): use path='reference'"
        )
    return path


def value_path_bytes_per_edge(config: ModelConfig, dtype: torch.dtype = torch.float32) -> int:
    """Per-edge activations one SO(2) convolution keeps for its backward in ``fast`` mode:
    ``u0``, ``x_local``, ``u_final`` and the ``n-1`` gated pre-activations, each (3L+1)·C_wide."""
    row = (3 * config.lmax + 1) * config.hidden_channels
    itemsize = torch.empty((), dtype=dtype).element_size()
    return (config.mixing_layers + 2) * row * itemsize


def step_bytes_per_edge(config: ModelConfig, dtype: torch.dtype = torch.float32) -> int:
    """:func:`value_path_bytes_per_edge` over all of the model's SO(2) convolutions."""
    return config.n_blocks * value_path_bytes_per_edge(config, dtype)


def edge_chunk_for(
    mode: str, config: ModelConfig, n_edges: int, device: torch.device, *, create_graph: bool
) -> int | None:
    """Edges per chunk for one evaluation, or ``None`` for the whole graph at once.

    Training (``create_graph``) always runs unchunked: its double backward goes through the
    eager closed forms, not through checkpoint recomputation.
    """
    if mode not in MEMORY_MODES:
        raise ValueError(f"memory must be one of {MEMORY_MODES}, got {mode!r}")
    if create_graph or mode == "fast":
        return None
    chunk = DEFAULT_EDGE_CHUNK if device.type == "cuda" else CPU_EDGE_CHUNK
    if n_edges <= chunk:
        return None
    if mode == "lean" or device.type != "cuda":
        return chunk
    needed = n_edges * step_bytes_per_edge(config)
    return chunk if needed > AUTO_MEMORY_FRACTION * available_memory(device) else None


def host_step_bytes(
    config: ModelConfig, n_edges: int, edge_chunk: int | None, dtype: torch.dtype = torch.float32
) -> int:
    """Estimated peak host memory of one CPU step over ``n_edges`` edges."""
    per_edge = step_bytes_per_edge(config, dtype)
    working = n_edges if edge_chunk is None else min(edge_chunk, n_edges)
    return int(per_edge * (HOST_RESIDENT_PER_EDGE * n_edges + HOST_CHUNK_PER_EDGE * working))


def host_edge_capacity(
    config: ModelConfig, available: int, dtype: torch.dtype = torch.float32
) -> int:
    """Most edges one chunked CPU step holds within ``available`` bytes, by
    :func:`host_step_bytes` (0 when not even one chunk fits)."""
    per_edge = step_bytes_per_edge(config, dtype)
    room = available / per_edge - HOST_CHUNK_PER_EDGE * CPU_EDGE_CHUNK
    return max(int(room / HOST_RESIDENT_PER_EDGE), 0)


def check_host_memory(
    config: ModelConfig, n_edges: int, edge_chunk: int | None, dtype: torch.dtype = torch.float32
) -> None:
    """``HostMemoryError`` when a CPU step's estimate exceeds what the host (or the process's
    container) has available; nothing where that cannot be read."""
    available = host_available_bytes()
    needed = host_step_bytes(config, n_edges, edge_chunk, dtype)
    if available is not None and needed > available:
        raise HostMemoryError(
            f"evaluating {n_edges:,} edges on the CPU needs about {needed / 2**30:.1f} GiB of "
            f"memory, and {available / 2**30:.1f} GiB are available"
        )


def available_memory(device: torch.device) -> int:
    """Bytes a step can still allocate: free on the device plus what PyTorch's caching allocator
    holds but does not use. The driver's free figure alone shrinks for good after one large
    request (the allocator keeps its blocks), which would push every later medium-size step of
    a long-running server into the slower chunked mode."""
    free, _ = torch.cuda.mem_get_info(device)
    cached_unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + max(cached_unused, 0))


def check_fast_tier(precision: str, path: str, device: torch.device) -> None:
    """A fast stack tier exists only in the fused Triton kernels: refuse it anywhere else, at
    construction, rather than fail (or fall back to the exact tier) on the first request."""
    if path != "fused":
        raise ValueError(
            f"precision={precision!r} needs the fused path (the reference path is exact fp32 or "
            f"fp64); the value path resolved to {path!r}: use path='fused' on CUDA with a "
            "fused-eligible model"
        )
    runs_triton = triton_available() and (
        device.type == "cuda" or (device.type == "cpu" and INTERPRET)
    )
    if not runs_triton:
        raise ValueError(
            f"precision={precision!r} needs the Triton kernels (CUDA, or TRITON_INTERPRET=1 on "
            f"CPU); device {device} would run the ops' exact references instead"
        )


def _type_lookup(type_map: tuple[str, ...]) -> Tensor:
    """Atomic number → type index (−1 for elements the model does not know)."""
    table = torch.full((119,), -1, dtype=torch.int64)
    for index, symbol in enumerate(type_map):
        table[atomic_numbers[symbol]] = index
    return table


class Potential:
    """A model placed on a device with a fixed execution path; evaluates batches of structures."""

    def __init__(
        self,
        model: DPA4Model,
        *,
        device: str | torch.device = "auto",
        path: str = "auto",
        precision: str = "fp32",
        metadata: PotentialMetadata | None = None,
        memory: str = "auto",
        capture: bool | None = None,
    ):
        if memory not in MEMORY_MODES:
            raise ValueError(f"memory must be one of {MEMORY_MODES}, got {memory!r}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        self.device = resolve_device(device)
        cfg = model.config
        if precision == "fp64" and path == "auto":
            path = "reference"
        resolved = resolve_path(cfg, self.device, path)
        if precision == "fp64" and resolved == "fused":
            raise ValueError("precision='fp64' runs on the reference path only (kernels are fp32)")
        if STACK_TIERS[precision] is StackPrecision.FAST:
            check_fast_tier(precision, resolved, self.device)
        self.stack_precision = STACK_TIERS[precision]
        self.dtype = torch.float64 if precision == "fp64" else torch.float32
        self.model = model.to(self.device, self.dtype).eval()
        self.execution = ExecutionInfo(resolved, precision, str(self.device), memory)
        self.metadata = metadata or PotentialMetadata(
            name="in-memory", sha256="", elements=cfg.type_map, rcut=cfg.rcut, config=cfg
        )
        self._types_of_number = _type_lookup(cfg.type_map)
        self._device_types_of_number = self._types_of_number.to(self.device)
        if capture is None:
            capture = self.device.type == "cuda"
        if capture and self.device.type != "cuda":
            raise ValueError("capture=True needs a CUDA device (CUDA graphs)")
        self._capture = capture
        self._start_replay()

    def _start_replay(self) -> None:
        """State of replayed steps, which a copy of this potential builds afresh."""
        self._captured = (
            CapturedSteps(self.model, self._step, self.config.rcut, self.device)
            if self._capture
            else None
        )
        # A recorded graph reads one static input buffer and writes one output buffer: two
        # threads evaluating through this potential (two calculators sharing a loaded model)
        # must not interleave one's load, replay and fetch with the other's. The engine already
        # runs one pass per device at a time; without graphs nothing is shared.
        self._one_at_a_time: AbstractContextManager[object] = (
            threading.Lock() if self._capture else nullcontext()
        )
        # Replayed batches only, which run under the lock above.
        self._search_tables = ImageWindowMemo()

    def __getstate__(self) -> dict[str, Any]:
        # Recorded CUDA graphs and a lock neither pickle nor deep-copy (a calculator sent to a
        # worker process, copy.deepcopy(calc)): a copy records its own graphs when it replays.
        state = self.__dict__.copy()
        for name in ("_captured", "_one_at_a_time", "_search_tables"):
            del state[name]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._start_replay()

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    def atom_types(self, structures: Structures) -> Tensor:
        """Type index of every atom, on the structures' device; unknown elements raise
        ``InvalidStructureError``. Runs where the atomic numbers live (the host for requests),
        so the check costs no device sync."""
        on_device = structures.numbers.device == self.device
        table = (
            self._device_types_of_number
            if on_device
            else self._types_of_number.to(structures.numbers.device)
        )
        types = table[structures.numbers.clamp(0, 118)]
        unknown = types < 0
        if bool(unknown.any()):
            atom = int(torch.nonzero(unknown)[0, 0])
            struct = int(structures.atom_batch[atom])
            number = int(structures.numbers[atom])
            raise InvalidStructureError(
                "unknown_element",
                f"element Z={number} is not supported by this model (elements: "
                f"{', '.join(self.config.type_map)})",
                field=f"structures[{struct}].numbers",
                index=struct,
            )
        return types

    def predict(
        self,
        structures: Structures,
        properties: Collection[str] = ("energy", "forces"),
        *,
        create_graph: bool = False,
    ) -> Prediction:
        """Evaluate a batch; see the module docstring for the pipeline. Thread-safe: calls
        through one potential run one at a time."""
        with self._one_at_a_time, device_scope(self.device):
            return self._predict(structures, properties, create_graph)

    def _predict(
        self, structures: Structures, properties: Collection[str], create_graph: bool
    ) -> Prediction:
        unknown = set(properties) - PROPERTIES
        if unknown:
            raise ValueError(
                f"unknown properties {sorted(unknown)}; choose from {sorted(PROPERTIES)}"
            )
        if create_graph and self.stack_precision is not StackPrecision.EXACT:
            raise ValueError(
                f"create_graph (training) needs an exact precision, not "
                f"{self.execution.precision!r}: the stack's double backward has no fast tier"
            )
        cfg = self.config
        types = self.atom_types(structures)  # unknown elements fail here, where the numbers live
        want_grad = bool({"forces", "virial", "stress"} & set(properties))
        replay = self._replay_batch(structures, types) if want_grad and not create_graph else None
        out = None
        if replay is not None:
            # A graph recorded for this batch's predicted bucket costs no memory beyond what it
            # holds, so the memory mode (decided on the edge count) does not gate it.
            out = self._replay(lambda captured: captured.speculate(replay))
        if out is None:
            with record_function("so2serve::graph"):
                # The types ride in the batch's packed copy: nothing is left to launch between
                # the search's host read and the step.
                placed, graph, (placed_types,) = place_and_build_graph_carrying(
                    structures, cfg.rcut, self.device, [types],
                    windows=replay.windows if replay is not None else None,
                )  # fmt: skip
            edge_chunk = edge_chunk_for(
                self.execution.memory, cfg, graph.n_edges, self.device, create_graph=create_graph
            )
            if self.device.type == "cpu":  # a device reports out of memory; Linux may kill
                check_host_memory(cfg, graph.n_edges, edge_chunk, self.dtype)
            if replay is not None and self._captured is not None:
                n_edges = graph.n_edges
                if edge_chunk is None:
                    out = self._replay(lambda captured: captured.run(replay, n_edges))
                else:  # chunked for memory, not replayed; the next speculation must know
                    self._captured.observe(replay, n_edges)
            if out is None:
                inputs = StepInputs(graph, placed.positions, placed.cells, placed_types)
                out = self._step(
                    inputs.to(self.device), want_grad=want_grad, create_graph=create_graph,
                    edge_chunk=edge_chunk,
                )  # fmt: skip
                structures = placed  # its outputs are on the device: so is the stress
        result = Prediction(energy=out.energy)
        if "energies" in properties:
            result.energies = out.atom_energy
        if "forces" in properties:
            result.forces = out.forces
        if "virial" in properties or "stress" in properties:
            result.virial = out.virial
        if "stress" in properties:
            result.stress = stress_from_virial(out.virial, structures.cells, structures.pbc)
        return result

    def pass_edge_capacity(self) -> int | None:
        """Edges a step of this CPU potential holds in ``AUTO_MEMORY_FRACTION`` of the host's
        memory available now (a CPU server's pass budget); None on CUDA, where a pass that
        does not fit fails cleanly, and where the host's memory cannot be read."""
        available = host_available_bytes() if self.device.type == "cpu" else None
        if available is None:
            return None
        return host_edge_capacity(self.config, int(AUTO_MEMORY_FRACTION * available), self.dtype)

    def release_cached_memory(self) -> None:
        """Drop the recorded CUDA graphs and their memory pools (the engine calls this on
        out-of-memory before it bisects a batch); shapes are recorded again when they recur."""
        if self._captured is not None:
            self._captured.clear()

    def _replay_batch(self, structures: Structures, types: Tensor) -> ReplayBatch | None:
        """The batch as a recorded step takes it, or ``None`` where replay does not apply: no
        CUDA graphs, a batch already on the device, too many atoms, or a search other than
        the direct one (the only one a graph can record)."""
        captured = self._captured
        if (
            captured is None
            or structures.device.type != "cpu"
            or not captured.accepts(structures.n_atoms, 0)
        ):
            return None
        windows = self._search_tables(
            structures.cells, structures.pbc, structures.ptr, self.config.rcut,
            COINCIDENT_DISTANCE,
        )  # fmt: skip
        if resolve_backend(self.device, "auto", windows) != "direct":
            return None
        return ReplayBatch(structures, types, windows)

    def _replay(self, run: Callable[[CapturedSteps], StepOutputs | None]) -> StepOutputs | None:
        """``run`` on the recorded steps (``None``: evaluate eagerly). If capturing fails (an
        op that cannot be recorded), warn once and turn replay off for this potential: a
        request never fails for an optimisation. Out of memory is not such a failure: the
        recorded graphs are dropped (their pools freed) and the error goes to the caller's OOM
        handling (the engine bisects the batch)."""
        captured = self._captured
        if captured is None:  # turned off by an earlier failure of this same call
            return None
        try:
            return run(captured)
        except torch.cuda.OutOfMemoryError:
            captured.clear()
            raise
        except RuntimeError as exc:
            warnings.warn(
                f"CUDA-graph capture failed ({exc}); evaluating without graphs from now on",
                RuntimeWarning,
                stacklevel=3,
            )
            self._captured = None
            torch.cuda.synchronize(self.device)
            return None

    def _step(
        self,
        inputs: StepInputs,
        *,
        want_grad: bool = True,
        create_graph: bool = False,
        edge_chunk: int | None = None,
    ) -> StepOutputs:
        """The device part of one evaluation (also what :class:`CapturedSteps` records):
        edge vectors → edge cache → model → energies → ∂E/∂r → forces and virials.
        Without ``want_grad`` (no force-like property asked for) forces and virial are empty."""
        cfg = self.config
        graph = inputs.graph
        with torch.enable_grad() if (want_grad or create_graph) else torch.no_grad():
            vec = edge_vectors(graph, inputs.positions, inputs.cells)
            edge_vec = vec.detach().requires_grad_(want_grad)
            with record_function("so2serve::edge_cache"):
                cache = build_edge_cache(
                    graph, edge_vec, rcut=cfg.rcut, lmax=cfg.lmax,
                    env_exponents=cfg.env_exponents, deg_floor=cfg.degree_norm_floor,
                    eps=cfg.eps, dtype=self.dtype,
                )  # fmt: skip
            with record_function("so2serve::model"):
                atom_energy = self.model(
                    inputs.types, cache, fused=self.execution.path == "fused",
                    live_weights=create_graph, edge_chunk=edge_chunk,
                    stack_precision=self.stack_precision,
                )  # fmt: skip
            # A CSR sum, not index_add: the atomic adds would make energies vary in the last bit.
            energy = csr_segment_sum(atom_energy, atom_rowptr(graph))
            if not want_grad:
                empty = energy.new_zeros(0)
                return StepOutputs(energy.detach(), atom_energy.detach(), empty, empty)
            with record_function("so2serve::backward"):
                (edge_grad,) = torch.autograd.grad(
                    energy.sum(), edge_vec, create_graph=create_graph, allow_unused=True
                )
            if edge_grad is None:  # no edges at all: nothing depends on geometry
                edge_grad = torch.zeros_like(edge_vec)
            with record_function("so2serve::assembly"):
                assembled = assemble_forces_virial(
                    graph, edge_grad.double(), edge_vec.detach().double(), atom_virial=False
                )
        if create_graph:
            return StepOutputs(energy, atom_energy, assembled.forces, assembled.virial)
        return StepOutputs(
            energy.detach(), atom_energy.detach(), assembled.forces, assembled.virial
        )

    def info(self) -> dict[str, Any]:
        """JSON-ready description of the served model and how it runs."""
        meta = self.metadata
        return {
            "name": meta.name,
            "sha256": meta.sha256,
            "elements": list(meta.elements),
            "rcut": meta.rcut,
            "config": meta.config.to_dict(),
            "provenance": meta.provenance,
            "n_parameters": sum(p.numel() for p in self.model.parameters()),
            "execution": {
                "path": self.execution.path,
                "precision": self.execution.precision,
                "device": self.execution.device,
                "memory": self.execution.memory,
                "cuda_graphs": self._captured is not None,
            },
        }


def default_model_path() -> Path:
    """The shipped default model: ``service/models/default.safetensors``."""
    return Path(__file__).resolve().parents[1] / "models" / "default.safetensors"


def load_potential(
    model: str | Path | None = None,
    *,
    device: str | torch.device = "auto",
    path: str = "auto",
    precision: str = "fp32",
    memory: str = "auto",
    capture: bool | None = None,
) -> Potential:
    """Load a model file (``None`` = the shipped default) into a :class:`Potential`."""
    net, meta = _read_model_file(model)
    return Potential(
        net, device=device, path=path, precision=precision, metadata=meta, memory=memory,
        capture=capture,
    )  # fmt: skip


def load_potentials(
    model: str | Path | None = None,
    *,
    devices: str = "auto",
    path: str = "auto",
    precision: str = "fp32",
) -> list[Potential]:
    """The model file read once and placed on every device ``devices`` names (see
    :func:`resolve_devices`), one copy each: a service or screening run over several GPUs."""
    targets = resolve_devices(devices)
    net, meta = _read_model_file(model)
    last = len(targets) - 1
    return [
        # Placing a model moves it: every device but the last gets a copy of the host one.
        Potential(
            net if k == last else copy.deepcopy(net),
            device=device,
            path=path,
            precision=precision,
            metadata=meta,
        )
        for k, device in enumerate(targets)
    ]


def _read_model_file(model: str | Path | None) -> tuple[DPA4Model, PotentialMetadata]:
    from service.model.io import load_model

    file = Path(model) if model is not None else default_model_path()
    if model is None and not file.is_file():
        raise ModelFileError(f"no default model shipped at {file}; pass a model file")
    net = load_model(file)
    doc = net.file_metadata or {}
    meta = PotentialMetadata(
        name=file.stem,
        sha256=str(doc["model_sha256"]),
        elements=net.config.type_map,
        rcut=net.config.rcut,
        config=net.config,
        provenance=dict(doc.get("provenance", {})),
    )
    return net, meta
