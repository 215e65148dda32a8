"""Dynamic batching: concurrent requests are queued and coalesced into one device pass.

Scheduling contract:

* Requests are admitted (or refused at once: too many atoms, unknown element, queue full) and
  queued FIFO. Batches are formed on the event loop, by callbacks rather than a scheduler
  task: a request that finds the device idle starts its pass from ``submit`` itself, and a
  finished pass starts the next one from the callback that delivers its results. The worker
  thread runs one batch at a time and hands each result back with exactly one
  ``call_soon_threadsafe`` (no executor future, no task wake-ups in between).
* A batch takes structures from the head of the queue while the total atoms stay within
  ``max_batch_atoms`` and the *estimated* edges within ``max_batch_edges``. A request with many
  structures may be spread over several consecutive batches; one structure above the budget
  runs alone. Results are split back per request, in request order.
* While the device is busy, arriving requests accumulate, so the next batch forms without any
  waiting (continuous batching). When the device is idle, the scheduler waits at most
  ``window_s`` for more requests, and only while fewer requests are queued than the previous
  batch held: a lone MD client never waits, a crowd of clients returning together is
  gathered into one pass.
* A request whose client goes away is dropped if none of it has started; a batch already on
  the device finishes and that request's share is discarded. Nobody else is affected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from collections import deque
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from ase.data import chemical_symbols

from service.engine.errors import (
    EngineClosedError,
    EvaluationFailedError,
    QueueFullError,
    StructureTooLargeError,
    TooManyAtomsError,
)
from service.engine.metrics import ServiceMetrics
from service.engine.worker import BatchOutput, Worker, select_structures
from service.graph.errors import InvalidStructureError
from service.graph.structures import MAX_ATOMIC_NUMBER, Structures

log = logging.getLogger("so2serve.engine")

REFERENCE_DENSITY = 0.1
"""Atoms per Å³ assumed where a structure has no full periodic cell to measure it (liquid
water is 0.10, close-packed metals ≈ 0.085, diamond 0.18): used only to estimate edges."""


@dataclass(frozen=True)
class BatchLimits:
    """Admission and batching limits of one engine."""

    max_atoms: int = 100_000  # per structure; above it a request is refused (413)
    max_batch_atoms: int = 16_384  # atom budget of one device pass
    max_batch_edges: int = 2_000_000  # estimated-edge budget of one device pass
    window_s: float = 0.005  # longest wait for more requests while the device is idle
    max_queue: int = 1024  # requests waiting; above it new ones get 503 + Retry-After


@dataclass(frozen=True)
class EvaluationTimings:
    """Where a request's time went inside the engine."""

    queue_s: float  # admission → the worker thread began its first device pass
    compute_s: float  # wall time of the device passes that carried it (shared with others)
    passes: int
    finished_at: float = 0.0  # perf_counter() when its last pass ended (in the worker thread)


@dataclass(frozen=True)
class EvaluationResult:
    """One request's results, float64, structures in request order; None where not asked."""

    energy: np.ndarray  # (B,) eV
    forces: np.ndarray | None  # (N, 3) eV/Å
    energies: np.ndarray | None  # (N,) eV
    virial: np.ndarray | None  # (B, 3, 3) eV
    stress: np.ndarray | None  # (B, 6) eV/Å³ (NaN rows where the structure is not periodic)
    atom_ptr: np.ndarray  # (B+1,) atom offsets
    timings: EvaluationTimings


def estimate_edges(structures: Structures, rcut: float) -> np.ndarray:
    """(B,) expected directed neighbour pairs per structure, n·ρ·(4/3)πr³.

    ρ is measured from the cell of fully periodic structures; otherwise ``REFERENCE_DENSITY``,
    and a finite molecule cannot have more than n−1 neighbours per atom. Whole-batch numpy
    without masks or gathers: this runs on the event loop for every request.
    """
    n_atoms = np.diff(structures.ptr.cpu().numpy()).astype(np.float64)
    pbc = structures.pbc.cpu().numpy()
    volume = np.abs(np.linalg.det(structures.cells.detach().cpu().numpy()))
    measured = pbc.all(axis=1) & (volume > 0)
    density = np.where(measured, n_atoms / np.where(measured, volume, 1.0), REFERENCE_DENSITY)
    neighbours = density * ((4.0 / 3.0) * math.pi * rcut**3)
    neighbours = np.where(pbc.any(axis=1), neighbours, np.minimum(neighbours, n_atoms - 1.0))
    estimate: np.ndarray = n_atoms * neighbours
    return estimate


@dataclass(eq=False)
class _Job:
    """One request in the engine."""

    structures: Structures
    properties: frozenset[str]
    atom_ptr: np.ndarray  # (B+1,) int64
    edge_cumsum: np.ndarray  # (B+1,) float64, cumulative estimated edges
    future: asyncio.Future[EvaluationResult]
    admitted_at: float
    cursor: int = 0  # first structure not yet dispatched
    in_flight: int = 0  # dispatched chunks not yet delivered
    parts: list[tuple[int, dict[str, np.ndarray]]] = field(default_factory=list)
    started_at: float | None = None  # perf_counter() when the worker began its first pass
    finished_at: float = 0.0
    compute_s: float = 0.0
    passes: int = 0

    @property
    def n_structures(self) -> int:
        return len(self.atom_ptr) - 1

    def remaining(self) -> tuple[int, float]:
        """Atoms and estimated edges not yet dispatched."""
        c = self.cursor
        return int(self.atom_ptr[-1] - self.atom_ptr[c]), float(
            self.edge_cumsum[-1] - self.edge_cumsum[c]
        )

    def fitting_stop(self, atom_room: int, edge_room: float) -> int:
        """Largest ``stop`` such that structures ``cursor:stop`` fit in the rooms."""
        c = self.cursor
        atoms = self.atom_ptr[c + 1 :] - self.atom_ptr[c]
        edges = self.edge_cumsum[c + 1 :] - self.edge_cumsum[c]
        k = min(
            int(np.searchsorted(atoms, atom_room, side="right")),
            int(np.searchsorted(edges, edge_room, side="right")),
        )
        return c + k


@dataclass(frozen=True)
class _Chunk:
    """Structures ``start:stop`` of ``job``, placed at the given offsets of a batch."""

    job: _Job
    start: int
    stop: int
    structure_offset: int
    atom_offset: int

    @property
    def n_atoms(self) -> int:
        return int(self.job.atom_ptr[self.stop] - self.job.atom_ptr[self.start])

    def results(self, output: BatchOutput) -> dict[str, np.ndarray]:
        """This chunk's rows of the batch output, for the properties its request asked for."""
        s = slice(self.structure_offset, self.structure_offset + self.stop - self.start)
        a = slice(self.atom_offset, self.atom_offset + self.n_atoms)
        rows = {"energy": output.energy[s]}
        for name, table, sl in (
            ("forces", output.forces, a),
            ("energies", output.energies, a),
            ("virial", output.virial, s),
            ("stress", output.stress, s),
        ):
            if name in self.job.properties and table is not None:
                rows[name] = table[sl]
        return rows

    def failure(self, output: BatchOutput) -> tuple[int, BaseException] | None:
        """(structure index in the request, reason) of this chunk's first failed structure."""
        for batch_index in range(
            self.structure_offset, self.structure_offset + self.stop - self.start
        ):
            reason = output.failures.get(batch_index)
            if reason is not None:
                return self.start + batch_index - self.structure_offset, reason
        return None


@dataclass(frozen=True)
class _Batch:
    chunks: list[_Chunk]
    parts: list[Structures]
    properties: frozenset[str]
    n_atoms: int
    n_edges: float

    @property
    def jobs(self) -> set[_Job]:
        return {c.job for c in self.chunks}


def _relocated(reason: BaseException, index: int) -> BaseException:
    """The failure re-addressed to structure ``index`` of its request."""
    if isinstance(reason, StructureTooLargeError):
        return StructureTooLargeError(index=index, n_atoms=reason.n_atoms, device=reason.device)
    if isinstance(reason, InvalidStructureError):
        where = re.sub(r"^structures\[\d+\]", f"structures[{index}]", reason.field or "")
        return InvalidStructureError(
            reason.code, str(reason), field=where or f"structures[{index}]", index=index
        )
    return EvaluationFailedError(index=index, cause=reason)


class Engine:
    """Admission, queue, batching and result routing around one ``Worker``."""

    def __init__(
        self,
        worker: Worker,
        limits: BatchLimits,
        metrics: ServiceMetrics,
        *,
        rcut: float,
        elements: Collection[int] | None = None,
    ) -> None:
        self._worker = worker
        self._limits = limits
        self._metrics = metrics
        self._rcut = rcut
        self._elements = None if elements is None else np.array(sorted(elements), dtype=np.int64)
        # known[z]: whether the model has element z (a table lookup, no per-request set search).
        self._known: np.ndarray | None = None
        if self._elements is not None:
            self._known = np.zeros(MAX_ATOMIC_NUMBER + 1, dtype=np.bool_)
            self._known[self._elements] = True
        self._queue: deque[_Job] = deque()
        self._queued_atoms = 0
        self._queued_edges = 0.0
        self._expected_requests = 0
        self._atoms_per_second: float | None = None
        self._running: _Batch | None = None  # the batch on the device
        self._window: asyncio.TimerHandle | None = None  # pending end of a coalescing wait
        self._loop: asyncio.AbstractEventLoop | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._open = False

    @property
    def limits(self) -> BatchLimits:
        return self._limits

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> bool:
        return self._open

    async def start(self) -> None:
        """Start the worker thread; from now on requests are admitted on this event loop."""
        self._loop = asyncio.get_running_loop()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="so2serve-device")
        self._open = True

    async def warm_up(self, numbers: Sequence[int]) -> None:
        """Run the worker's warm-up pass in the device thread."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._require_executor(), self._worker.warm_up, numbers)

    async def stop(self) -> None:
        """Stop scheduling; requests still queued or on the device get ``EngineClosedError``."""
        self._open = False
        self._cancel_window()
        closed = EngineClosedError("the server is shutting down")
        leftovers = list(self._queue) + ([] if self._running is None else list(self._running.jobs))
        for job in leftovers:
            if not job.future.done():
                job.future.set_exception(closed)
        self._queue.clear()
        self._queued_atoms, self._queued_edges = 0, 0.0
        self._metrics.queue_depth.set(0)
        if self._executor is not None:
            await asyncio.to_thread(self._executor.shutdown, wait=True, cancel_futures=True)
            self._executor = None

    def submit(
        self, structures: Structures, properties: Collection[str]
    ) -> asyncio.Future[EvaluationResult]:
        """Queue a validated request; the future resolves with its result or fails with the
        typed errors of ``service.engine.errors``. Refusals at admission (too many atoms, an
        element the model does not know: ``InvalidStructureError``, full queue) raise here.

        Cancelling the future (or a task awaiting it) withdraws whatever part of the request
        has not started. A bare future rather than a task: no extra scheduling step per request.
        """
        job = self._admit(structures, frozenset(properties))
        job.future.add_done_callback(lambda f: self._withdraw(job) if f.cancelled() else None)
        self._dispatch_when_due()
        return job.future

    async def evaluate(
        self, structures: Structures, properties: Collection[str]
    ) -> EvaluationResult:
        """``submit`` and wait for the result."""
        return await self.submit(structures, properties)

    # admission

    def _admit(self, structures: Structures, properties: frozenset[str]) -> _Job:
        if not self.running:
            raise EngineClosedError("the model is not loaded yet, or the server is stopping")
        atom_ptr = structures.ptr.cpu().numpy()
        self._check_sizes(np.diff(atom_ptr))
        self._check_elements(structures, atom_ptr)
        if len(self._queue) >= self._limits.max_queue:
            self._metrics.rejected.labels("queue_full").inc()
            raise QueueFullError(
                f"the queue holds {len(self._queue)} requests, its limit (--max-queue); "
                "retry later",
                retry_after_s=self._retry_after_s(),
            )
        edges = estimate_edges(structures, self._rcut)
        job = _Job(
            structures=structures,
            properties=properties,
            atom_ptr=atom_ptr,
            edge_cumsum=np.concatenate([[0.0], np.cumsum(edges)]),
            future=asyncio.get_running_loop().create_future(),
            admitted_at=time.perf_counter(),
        )
        self._queue.append(job)
        self._queued_atoms += int(atom_ptr[-1])
        self._queued_edges += float(job.edge_cumsum[-1])
        self._metrics.queue_depth.set(len(self._queue))
        return job

    def _check_sizes(self, atom_counts: np.ndarray) -> None:
        over = np.flatnonzero(atom_counts > self._limits.max_atoms)
        if over.size:
            self._metrics.rejected.labels("too_many_atoms").inc()
            i = int(over[0])
            raise TooManyAtomsError(
                index=i, n_atoms=int(atom_counts[i]), limit=self._limits.max_atoms
            )

    def _check_elements(self, structures: Structures, atom_ptr: np.ndarray) -> None:
        if self._known is None or self._elements is None:
            return
        numbers = structures.numbers.cpu().numpy()  # validated: 1..MAX_ATOMIC_NUMBER
        known = self._known[numbers]
        if not known.all():
            unknown = np.flatnonzero(~known)
            self._metrics.rejected.labels("unknown_element").inc()
            atom = int(unknown[0])
            i = int(np.searchsorted(atom_ptr, atom, side="right")) - 1
            names = ", ".join(chemical_symbols[z] for z in self._elements)
            z = int(numbers[atom])
            raise InvalidStructureError(
                "unknown_element",
                f"structures[{i}] contains {chemical_symbols[z]} (Z={z}) at atom "
                f"{atom - int(atom_ptr[i])}; this model knows only {names}",
                field=f"structures[{i}].species",
                index=i,
            )

    def _retry_after_s(self) -> int:
        rate = self._atoms_per_second
        if not rate:
            return 1
        return int(min(60, max(1, math.ceil(self._queued_atoms / rate))))

    def _withdraw(self, job: _Job) -> None:
        self._metrics.cancelled.inc()
        self._dequeue(job)

    def _dequeue(self, job: _Job) -> None:
        """Forget the part of ``job`` that has not been dispatched yet."""
        if job in self._queue:
            self._queue.remove(job)
            atoms, edges = job.remaining()
            self._queued_atoms -= atoms
            self._queued_edges -= edges
            self._metrics.queue_depth.set(len(self._queue))

    # scheduling

    def _require_executor(self) -> ThreadPoolExecutor:
        if self._executor is None:
            raise EngineClosedError("the engine is not started")
        return self._executor

    def _dispatch_when_due(self) -> None:
        """Start the next pass now if the device is idle and waiting would not fill it more.

        While fewer requests are queued than the previous pass carried (and the budget is not
        full), wait up to ``window_s`` for the rest of a crowd; the first call that decides to
        wait arms the timer, later arrivals re-check and may start the pass before it fires.
        """
        if self._running is not None or not self._queue or not self._open:
            return
        waiting_helps = len(self._queue) < self._expected_requests and not self._budget_reached()
        if waiting_helps and self._limits.window_s > 0:
            if self._window is None:
                loop = self._require_loop()
                self._window = loop.call_later(self._limits.window_s, self._window_closed)
            return
        self._start_pass()

    def _window_closed(self) -> None:
        self._window = None
        if self._running is None and self._queue and self._open:
            self._start_pass()

    def _cancel_window(self) -> None:
        if self._window is not None:
            self._window.cancel()
            self._window = None

    def _start_pass(self) -> None:
        self._cancel_window()
        batch = self._take_batch()
        self._running = batch
        self._require_executor().submit(self._run_pass, batch, self._require_loop())

    def _run_pass(self, batch: _Batch, loop: asyncio.AbstractEventLoop) -> None:
        """Worker thread: one device pass, then one hop back to the loop with its outcome."""
        outcome: BatchOutput | BaseException
        try:
            outcome = self._worker.run(batch.parts, batch.properties)
        except Exception as exc:  # a bug outside the model's per-structure isolation
            log.exception("device pass failed")
            outcome = exc.with_traceback(None)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(self._finish_pass, batch, outcome)

    def _finish_pass(self, batch: _Batch, outcome: BatchOutput | BaseException) -> None:
        self._running = None
        if not self._open:
            return  # stop() has already failed every request of this batch
        if isinstance(outcome, BaseException):
            self._fail(batch, outcome)
        else:
            self._deliver(batch, outcome)
        self._dispatch_when_due()

    def _require_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise EngineClosedError("the engine is not started")
        return self._loop

    def _budget_reached(self) -> bool:
        return (
            self._queued_atoms >= self._limits.max_batch_atoms
            or self._queued_edges >= self._limits.max_batch_edges
        )

    def _take_batch(self) -> _Batch:
        limits = self._limits
        chunks: list[_Chunk] = []
        parts: list[Structures] = []
        n_structures = n_atoms = 0
        n_edges = 0.0
        while self._queue:
            job = self._queue[0]
            stop = job.fitting_stop(
                limits.max_batch_atoms - n_atoms, limits.max_batch_edges - n_edges
            )
            if stop == job.cursor:
                if chunks:
                    break
                stop = job.cursor + 1  # alone above the budget: it runs alone
            chunk = _Chunk(job, job.cursor, stop, n_structures, n_atoms)
            whole = job.cursor == 0 and stop == job.n_structures
            parts.append(
                job.structures if whole else select_structures(job.structures, job.cursor, stop)
            )
            chunks.append(chunk)
            chunk_edges = float(job.edge_cumsum[stop] - job.edge_cumsum[job.cursor])
            n_structures += stop - job.cursor
            n_atoms += chunk.n_atoms
            n_edges += chunk_edges
            self._queued_atoms -= chunk.n_atoms
            self._queued_edges -= chunk_edges
            job.cursor = stop
            job.in_flight += 1
            if stop < job.n_structures:
                break  # budget full in the middle of this request
            self._queue.popleft()
        self._metrics.queue_depth.set(len(self._queue))
        properties = frozenset({"energy"}.union(*(c.job.properties for c in chunks)))
        batch = _Batch(chunks, parts, properties, n_atoms, n_edges)
        self._record_batch(batch, n_structures)
        return batch

    def _record_batch(self, batch: _Batch, n_structures: int) -> None:
        m, limits = self._metrics, self._limits
        n_requests = len(batch.jobs)
        self._expected_requests = n_requests
        m.batch_requests.observe(n_requests)
        m.batch_structures.observe(n_structures)
        m.batch_atoms.observe(batch.n_atoms)
        m.batch_edges.observe(batch.n_edges)
        m.batch_fill.observe(
            max(batch.n_atoms / limits.max_batch_atoms, batch.n_edges / limits.max_batch_edges)
        )
        m.structures.inc(n_structures)
        m.atom_steps.inc(batch.n_atoms)

    # results

    def _deliver(self, batch: _Batch, output: BatchOutput) -> None:
        m = self._metrics
        m.pass_seconds.observe(output.seconds)
        if output.seconds > 0:
            rate = batch.n_atoms / output.seconds
            m.atom_steps_per_second.set(rate)
            prev = self._atoms_per_second
            self._atoms_per_second = rate if prev is None else 0.8 * prev + 0.2 * rate
        for chunk in batch.chunks:
            job = chunk.job
            job.in_flight -= 1
            if job.started_at is None:  # its first pass: queued until the worker began it
                job.started_at = output.started_at
                m.queue_wait.observe(job.started_at - job.admitted_at)
            job.compute_s += output.seconds
            job.finished_at = output.finished_at
            job.passes += 1
            if job.future.done():
                continue
            failed = chunk.failure(output)
            if failed is not None:
                self._abandon(job, _relocated(failed[1], failed[0]))
                continue
            job.parts.append((chunk.start, chunk.results(output)))
            if job.cursor == job.n_structures and job.in_flight == 0:
                job.future.set_result(self._assemble(job))

    def _fail(self, batch: _Batch, exc: BaseException) -> None:
        for chunk in batch.chunks:
            chunk.job.in_flight -= 1
            if not chunk.job.future.done():
                self._abandon(chunk.job, EvaluationFailedError(index=chunk.start, cause=exc))

    def _abandon(self, job: _Job, reason: BaseException) -> None:
        """Fail a request as a whole (no partial results) and drop what is still queued."""
        job.future.set_exception(reason)
        self._dequeue(job)

    @staticmethod
    def _assemble(job: _Job) -> EvaluationResult:
        job.parts.sort(key=lambda part: part[0])
        tables = [rows for _, rows in job.parts]

        def gather(name: str) -> np.ndarray | None:
            if name not in tables[0]:
                return None
            return (
                tables[0][name] if len(tables) == 1 else np.concatenate([t[name] for t in tables])
            )

        energy = gather("energy")
        assert energy is not None
        started = job.started_at if job.started_at is not None else job.admitted_at
        return EvaluationResult(
            energy=energy,
            forces=gather("forces"),
            energies=gather("energies"),
            virial=gather("virial"),
            stress=gather("stress"),
            atom_ptr=job.atom_ptr,
            timings=EvaluationTimings(
                queue_s=started - job.admitted_at,
                compute_s=job.compute_s,
                passes=job.passes,
                finished_at=job.finished_at,
            ),
        )
