"""The device side of the engine: one batch at a time, out-of-memory recovery, host copies.

``Worker.run`` executes in its device's worker thread, or, for a lone client's small request
while every device is idle, inline on the event loop's thread; the engine never overlaps the
two, so exactly one stream of work is in flight on each device. On a device out-of-memory
error the worker drops the evaluator's recorded CUDA graphs (their memory pools), bisects the
batch by structure and retries each half; a structure that fails alone is reported per
structure (``StructureTooLargeError`` for memory), so the rest of the batch still gets its
results and nobody receives partial or stale numbers.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
from torch import Tensor

from service.engine.errors import DeviceFaultError, StructureTooLargeError
from service.engine.evaluator import Evaluator, PredictionLike
from service.engine.kernel_sets import preload_recorded_kernels
from service.engine.metrics import ServiceMetrics
from service.graph.errors import InvalidStructureError
from service.graph.structures import StructureArrays, Structures
from service.model.errors import HostMemoryError, NonFiniteResultError, non_finite_fields

log = logging.getLogger("so2serve.worker")

T = TypeVar("T")

_ATOM_FIELDS = ("forces", "energies")
_STRUCTURE_FIELDS = ("virial", "stress")


@dataclass(frozen=True)
class BatchOutput:
    """Host (numpy, float64) results of one batch of B structures and N atoms.

    Rows of a structure listed in ``failures`` hold NaN and must not be delivered.
    """

    energy: np.ndarray  # (B,)
    forces: np.ndarray | None  # (N, 3)
    energies: np.ndarray | None  # (N,)
    virial: np.ndarray | None  # (B, 3, 3)
    stress: np.ndarray | None  # (B, 6)
    failures: Mapping[int, BaseException]  # structure index in the batch → why it has no result
    seconds: float  # wall time of the whole pass, retries included
    started_at: float  # perf_counter() at its start ...
    finished_at: float  # ... and at its end


def select_structures(structures: Structures, start: int, stop: int) -> Structures:
    """Structures ``start:stop`` of a validated batch, as views (no re-validation)."""
    ptr = structures.ptr
    a, b = int(ptr[start]), int(ptr[stop])
    return Structures(
        numbers=structures.numbers[a:b],
        positions=structures.positions[a:b],
        cells=structures.cells[start:stop],
        pbc=structures.pbc[start:stop],
        ptr=ptr[start : stop + 1] - ptr[start],
    )


_ALLOCATION_FAILURES = ("out of memory", "can't allocate memory", "not enough memory")
"""How allocators word a failure: CUDA's and libraries' "out of memory"; PyTorch's CPU allocator
"can't allocate memory" (torch 2.13) or "not enough memory"."""


def is_out_of_memory(exc: BaseException) -> bool:
    """Allocation failures: torch's typed error, Python's ``MemoryError`` (the potential's host
    memory check among them) or an allocator's message saying so."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    message = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(text in message for text in _ALLOCATION_FAILURES)


def to_host(tensors: Mapping[str, Tensor | None]) -> dict[str, np.ndarray | None]:
    """float64, C-contiguous host copies of ``tensors`` (None stays None), in one transfer.

    The outputs are packed into one float64 buffer on their device and copied once: each
    separate device-to-host copy is a synchronisation of its own (tens of µs on a GPU).
    """
    present = {k: t.detach() for k, t in tensors.items() if t is not None}
    out: dict[str, np.ndarray | None] = dict.fromkeys(tensors)
    if not present:
        return out
    packed = torch.cat([t.reshape(-1).to(torch.float64) for t in present.values()])
    flat = packed.cpu().numpy()
    start = 0
    for name, t in present.items():
        stop = start + t.numel()
        out[name] = flat[start:stop].reshape(t.shape)
        start = stop
    return out


class _AskedProperties:
    """What the request of each structure of a batch asked for, looked up on a failure only
    (no per-structure work on the passes that succeed)."""

    def __init__(self, parts: Sequence[Structures], part_properties: Sequence[frozenset[str]]):
        if len(parts) != len(part_properties):
            raise ValueError(f"{len(parts)} parts but {len(part_properties)} property sets")
        self._ends = np.cumsum([part.n_structures for part in parts])
        self._asked = [own | {"energy"} for own in part_properties]

    def of(self, index: int) -> frozenset[str]:
        """Properties of batch structure ``index`` (energy always included)."""
        return self._asked[int(np.searchsorted(self._ends, index, side="right"))]


def _single_structure_shapes(n_atoms: int) -> dict[str, tuple[int, ...]]:
    return {"forces": (n_atoms, 3), "energies": (n_atoms,), "virial": (1, 3, 3), "stress": (1, 6)}


@dataclass
class _Partial:
    """Results of a contiguous run of structures; failures keyed by batch index."""

    energy: np.ndarray
    fields: dict[str, np.ndarray | None]
    failures: dict[int, BaseException]

    @classmethod
    def from_prediction(cls, prediction: PredictionLike) -> _Partial:
        names = ("energy", *_ATOM_FIELDS, *_STRUCTURE_FIELDS)
        fields = to_host({name: getattr(prediction, name) for name in names})
        bad = non_finite_fields(fields)
        if bad:  # a model failure like any other: bisected down to the structures it hits
            raise NonFiniteResultError(f"the model returned non-finite {', '.join(bad)}")
        energy = fields.pop("energy")
        assert energy is not None
        return cls(energy=energy, fields=fields, failures={})

    @classmethod
    def failed(cls, n_atoms: int, index: int, reason: BaseException) -> _Partial:
        fields: dict[str, np.ndarray | None] = {
            k: np.full(shape, np.nan) for k, shape in _single_structure_shapes(n_atoms).items()
        }
        return cls(energy=np.full(1, np.nan), fields=fields, failures={index: reason})

    def filled(self, n_atoms: int) -> _Partial:
        """This one structure's results with NaN rows for the fields it did not compute, so
        that it joins a batch that computed them (nobody reads those rows: its request did
        not ask for them)."""
        shapes = _single_structure_shapes(n_atoms)
        fields: dict[str, np.ndarray | None] = {
            k: np.full(shapes[k], np.nan) if v is None else v for k, v in self.fields.items()
        }
        return _Partial(energy=self.energy, fields=fields, failures=self.failures)

    @classmethod
    def join(cls, left: _Partial, right: _Partial) -> _Partial:
        fields: dict[str, np.ndarray | None] = {}
        for name, a in left.fields.items():
            b = right.fields[name]
            fields[name] = None if a is None or b is None else np.concatenate([a, b])
        energy = np.concatenate([left.energy, right.energy])
        return cls(energy=energy, fields=fields, failures={**left.failures, **right.failures})


def _resolve_unless_done(future: asyncio.Future[T], result: T) -> None:
    if not future.done():  # the awaiting task may have been cancelled meanwhile
        future.set_result(result)


def _fail_unless_done(future: asyncio.Future[T], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


class DeviceThread:
    """The one thread that runs device work, in submission order.

    Fed through a ``queue.SimpleQueue`` (a C queue): a hop from the event loop to this thread
    and back (``call_soon_threadsafe``) takes a median 17 µs on a loaded 2-core VM, against
    29 µs through a one-thread ``ThreadPoolExecutor`` with its futures and work items.
    """

    def __init__(self, name: str = "so2serve-device") -> None:
        self._calls: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, call: Callable[[], object]) -> None:
        """Run ``call()`` in the thread after what was submitted before (its result is
        dropped: ``call`` reports back itself)."""
        self._calls.put(call)

    async def run(self, call: Callable[[], T]) -> T:
        """``call()`` in the thread, awaited on the running event loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def call_and_report() -> None:
            try:
                result = call()
            except BaseException as exc:
                loop.call_soon_threadsafe(_fail_unless_done, future, exc)
            else:
                loop.call_soon_threadsafe(_resolve_unless_done, future, result)

        self.submit(call_and_report)
        return await future

    def close(self) -> None:
        """Let the thread finish what was submitted, then end it (blocks until it has)."""
        self._calls.put(None)
        self._thread.join()

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            try:
                call()
            except Exception:  # callers report their own failures; never lose the thread
                log.exception("device thread call failed")


class Worker:
    """Runs batches on the evaluator's device; calls of ``run`` must not overlap (the engine
    makes them from the device thread, or inline from the event loop while the device idles)."""

    def __init__(self, evaluator: Evaluator, metrics: ServiceMetrics) -> None:
        self._evaluator = evaluator
        self._metrics = metrics
        self.device = torch.device(evaluator.execution.device)
        self.fault: DeviceFaultError | None = None  # set once the device stops working
        # One series per GPU: with several devices one unlabelled gauge flipped between them.
        self._memory_peak = (
            metrics.gpu_memory_peak.labels(str(self.device)) if self.device.type == "cuda" else None
        )

    def run(
        self,
        parts: Sequence[Structures],
        properties: frozenset[str],
        part_properties: Sequence[frozenset[str]] | None = None,
    ) -> BatchOutput:
        """Evaluate the concatenation of ``parts`` (structures in order) for ``properties``.

        ``part_properties``: what each part's own request asked for (a subset of
        ``properties``). A structure that fails in a pass computing more than that (e.g. out of
        memory in the backward pass of forces a batch mate asked for) is tried once more for
        its own properties alone: its outcome does not depend on its batch mates.
        """
        start = time.perf_counter()
        batch = parts[0] if len(parts) == 1 else Structures.concat(parts)
        asked = None if part_properties is None else _AskedProperties(parts, part_properties)
        # Host structures as validated: the evaluator places them itself (a Potential keeps a
        # small replayed batch on the host for its neighbour list; copying it to the device
        # here would cost ten synchronous copies there and back).
        partial = self._evaluate(batch, properties, 0, asked)
        if self._memory_peak is not None:
            self._memory_peak.set(torch.cuda.max_memory_allocated(self.device))
        f = partial.fields
        finished = time.perf_counter()
        return BatchOutput(
            energy=partial.energy,
            forces=f["forces"],
            energies=f["energies"],
            virial=f["virial"],
            stress=f["stress"],
            failures=partial.failures,
            seconds=finished - start,
            started_at=start,
            finished_at=finished,
        )

    def warm_up(self, numbers: Sequence[int], *, preload: bool = True) -> None:
        """Small passes through every property, so that the first requests pay no one-time
        costs (kernel compilation, allocator growth, lazy initialisation): the same eight atoms
        in a periodic cell smaller than the cutoff (several images of each atom) and without a
        cell (one image: the neighbour search compiles that case separately). Every other
        kernel variant depends only on the model, not on the size of what is sent.

        With ``preload``, the kernels recorded for this model on this GPU model
        (:mod:`service.engine.kernel_sets`) are compiled first, all at once on a thread pool,
        instead of one after the other at their first launch in the passes."""
        if preload:
            preload_recorded_kernels(self._evaluator)
        grid = np.stack(np.meshgrid(*(np.arange(2.0),) * 3, indexing="ij"), -1).reshape(-1, 3)
        positions = 2.1 * grid + 0.05 * np.arange(grid.shape[0])[:, None]
        species = [numbers[k % len(numbers)] for k in range(grid.shape[0])]
        for cell in (4.2 * np.eye(3), None):
            item = StructureArrays(numbers=species, positions=positions, cell=cell, pbc=None)
            structures = Structures.from_arrays([item])
            output = self.run([structures], frozenset(("energy", "forces", "stress", "energies")))
            if output.failures:
                raise next(iter(output.failures.values()))

    def _evaluate(
        self,
        s: Structures,
        properties: frozenset[str],
        first_index: int,
        asked: _AskedProperties | None,
    ) -> _Partial:
        """``s`` (structures ``first_index..`` of the batch) for ``properties``; ``asked``: the
        properties each structure of the batch was asked for (None: ``properties``)."""
        refused = False  # by the model, for the input itself: no other properties would help
        estimate: str | None = None  # a CPU step's memory account, when that refused it
        try:
            return _Partial.from_prediction(self._evaluator.predict(s, properties))
        except InvalidStructureError as exc:
            if s.n_structures > 1 and exc.index is not None and 0 <= exc.index < s.n_structures:
                return self._without(s, properties, first_index, exc, asked)
            refused = True
            oom = False
            reason: Exception | None = exc.with_traceback(None)  # a client's input: no log
        except Exception as exc:  # any failure is isolated per structure below
            oom = is_out_of_memory(exc)
            if isinstance(exc, HostMemoryError):
                estimate = str(exc)
            what = "out of memory" if oom else f"{type(exc).__name__}: {exc}"
            # The traceback once, where the failure is pinned to one structure; the bisection
            # levels above it log a line each.
            log.warning(
                "pass over structures %d..%d failed (%s)",
                first_index,
                first_index + s.n_structures - 1,
                what,
                exc_info=exc if not oom and s.n_structures == 1 else None,
            )
            # Drop the traceback: its frames pin the failed pass's device tensors.
            reason = None if oom else exc.with_traceback(None)
            if not oom and not self._device_responds():
                # Bisecting would run a pass per structure, each failing the same way, and
                # blame every structure in turn (a client resends the rest after each).
                cause = f"{type(exc).__name__}: {exc}"
                self.fault = DeviceFaultError(device=str(self.device), cause=cause)
                self._metrics.device_faults.labels(str(self.device)).inc()
                log.error("device %s stopped working", self.device, exc_info=exc)
                raise self.fault.again() from None
        if oom:
            self._release_cached_memory()
        own = properties if asked is None or refused else asked.of(first_index)
        if s.n_structures == 1 and own < properties:
            return self._evaluate(s, own, first_index, None).filled(s.n_atoms)
        if s.n_structures == 1:
            if reason is None:
                self._metrics.oom_failures.inc()
                reason = StructureTooLargeError(
                    index=first_index, n_atoms=s.n_atoms, device=str(self.device),
                    estimate=estimate,
                )  # fmt: skip
            return _Partial.failed(s.n_atoms, first_index, reason)
        if oom:
            self._metrics.oom_splits.inc()
        half = s.n_structures // 2
        left = self._evaluate(select_structures(s, 0, half), properties, first_index, asked)
        right = self._evaluate(
            select_structures(s, half, s.n_structures), properties, first_index + half, asked
        )
        return _Partial.join(left, right)

    def _without(
        self,
        s: Structures,
        properties: frozenset[str],
        first_index: int,
        exc: InvalidStructureError,
        asked: _AskedProperties | None,
    ) -> _Partial:
        """The batch again without the structure the model refused (an input error the model
        finds itself, e.g. coincident atoms from its neighbour list): that structure fails,
        the others are evaluated in at most two passes (no bisection)."""
        bad = int(exc.index or 0)
        log.info("structure %d refused by the model (%s)", first_index + bad, exc.code)
        n_atoms = int(s.ptr[bad + 1] - s.ptr[bad])
        parts = [_Partial.failed(n_atoms, first_index + bad, exc.with_traceback(None))]
        if bad > 0:
            head = select_structures(s, 0, bad)
            parts.insert(0, self._evaluate(head, properties, first_index, asked))
        if bad + 1 < s.n_structures:
            rest = select_structures(s, bad + 1, s.n_structures)
            parts.append(self._evaluate(rest, properties, first_index + bad + 1, asked))
        joined = parts[0]
        for part in parts[1:]:
            joined = _Partial.join(joined, part)
        return joined

    def _device_responds(self) -> bool:
        """Whether the device still runs work after a failed pass: a sticky CUDA error (an
        illegal address, a device-side assert, a lost GPU) fails every later call as well,
        while a structure's own failure leaves the context usable."""
        if self.device.type != "cuda":
            return True
        try:
            probe = torch.ones(1, device=self.device)
            return bool((probe + probe).item() == 2.0)
        except Exception:  # any failure of the probe itself is the answer
            return False

    def _release_cached_memory(self) -> None:
        # A Potential also holds recorded CUDA graphs (private pools); evaluators without any
        # (test fakes) simply lack the method. No torch.cuda.empty_cache(): the caching
        # allocator already frees this device's unused blocks (dropped graph pools included)
        # before it reports out of memory, and empty_cache acts on every device of the
        # process: it would wait for the other devices' passes and free their caches too.
        release = getattr(self._evaluator, "release_cached_memory", None)
        if callable(release):
            release()
