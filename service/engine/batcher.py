"""Dynamic batching: concurrent requests are queued and coalesced into one device pass.

Scheduling contract:

* Requests are admitted (or refused at once: too many atoms, unknown element, queue full) and
  queued FIFO. Batches are formed on the event loop, by callbacks rather than a scheduler
  task: a request that finds a device idle starts its pass from ``submit`` itself, and a
  finished pass starts the next one from the callback that delivers its results. Each device
  has its worker thread (a *lane*: one ``Worker`` and its ``worker.DeviceThread``), which
  runs one batch at a time and hands each result back with exactly one
  ``call_soon_threadsafe`` (no executor future, no task wake-ups in between; batches reach
  the thread through a plain queue).
* Several devices share the one queue: whenever a lane is idle and work is queued, the next
  batch goes to it. A request with many structures is spread over several batches, and so
  over several devices at once; its results are joined in structure order whatever lane
  each part ran on. Queued work that would fit in fewer passes than there are idle devices
  is shared evenly among them (each pass takes its share of the queued atoms and edges).
* A batch takes structures from the head of the queue while the total atoms stay within
  ``max_batch_atoms`` and the *estimated* edges within ``max_batch_edges``. A request with many
  structures may be spread over several consecutive batches; one structure above the budget
  runs alone. Results are split back per request, in request order.
* While the device is busy, arriving requests accumulate, so the next batch forms without any
  waiting (continuous batching). The one exception gathers *returning clients*: a request may
  name its client (``submit(..., client=key)``; the API passes the TCP connection, one
  sequential client per keep-alive connection), and the engine learns each client's pace, the
  time from its result being delivered to its next request being admitted. When the device
  becomes free while clients the last pass served are still on their way back (their result
  went out, their next request has not arrived), the next pass waits for them: until all of
  them are back, at most until each is due (``RETURN_MARGIN`` × its pace + slack), at most
  ``GATHER_FRACTION`` of the last pass's duration and at most ``window_s``, and never once the
  queued work fills the budget. Only clients whose pace fits that bound are waited for, so a
  lone MD client never waits (it is the one returning), a client that thinks between steps is
  not waited for, and a crowd of clients that would otherwise split into cohorts taking turns
  on the device (each pass starting with whoever arrived during the previous one) is gathered
  into one pass. ``window_s = 0`` turns gathering off.
* A request whose client goes away is dropped if none of it has started; a batch already on
  the device finishes and that request's share is discarded. Nobody else is affected, and the
  engine stops waiting for that client.
* A request that is *alone* runs on the event loop itself (``inline``), without the hop to the
  worker thread and back: a lone sequential client (MD) would otherwise pay, every step, a
  thread wake-up on each side of its pass (the worker asleep on its queue, the loop asleep in
  its poll for the whole pass), and on a host whose idle cores drop into deep sleep states
  each costs more the longer the pass (0.1–0.4 ms on the H200 host). Alone means: a keyed
  client (``client=``, so the engine knows who else is around) whose whole request fits one
  pass of at most ``inline_max_atoms`` atoms, the device idle, nothing else queued, no
  returning client waited for, and no other client answered within ``INLINE_QUIET_S`` that
  has not come back yet (a crowd's members are out for a few milliseconds between their
  requests; one of them must not block the loop while the others return). The loop is blocked
  for that pass: nobody else is there to serve, and whoever arrives meanwhile waits in the
  socket for at most one small pass, then queues as before. Every other pass, and everything
  under concurrency, goes through the worker thread as described above.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np
from ase.data import chemical_symbols
from prometheus_client import Gauge
from torch import Tensor

from service.engine.errors import (
    DeviceFaultError,
    EngineClosedError,
    EvaluationFailedError,
    QueueFullError,
    StructureTooLargeError,
    TooManyAtomsError,
)
from service.engine.metrics import ServiceMetrics
from service.engine.profiling import AfterPass, PassProfiler
from service.engine.worker import BatchOutput, DeviceThread, Worker, select_structures
from service.graph.errors import InvalidStructureError
from service.graph.structures import (
    MAX_ATOMIC_NUMBER,
    Structures,
    lattice_volume,
    occupied_volume,
    open_box_volumes,
)

log = logging.getLogger("so2serve.engine")

REFERENCE_DENSITY = 0.1
"""Atoms per Å³ assumed where a structure has no full periodic cell to measure it (liquid
water is 0.10, close-packed metals ≈ 0.085, diamond 0.18): used only to estimate edges."""

GATHER_FRACTION = 0.25
"""Longest wait for returning clients, as a fraction of the last pass's duration: holding the
device idle for W before a pass of duration T loses at most W / (T + W) of its throughput (a
fifth here) when nobody comes, while gathering a crowd's two cohorts into one pass saves a
whole pass's fixed cost and takes the crowd's request handling off the event loop while the
worker runs."""

RETURN_MARGIN = 1.5
RETURN_SLACK_S = 0.002
"""A returning client is due back ``RETURN_MARGIN`` times its smoothed pace plus
``RETURN_SLACK_S`` after its result was delivered: its return waits for the event loop to
answer everyone ahead of it, so paces vary with the load."""

PACE_SMOOTHING = 0.3
"""Weight of the newest delivery → next-request gap in a client's smoothed pace."""

MAX_TRACKED_CLIENTS = 4096
"""Clients whose pace is remembered (least recently seen forgotten first)."""

INLINE_QUIET_S = 0.2
"""How long another client answered and not yet back keeps requests off the event loop: a
client of a crowd returns within milliseconds to tens of milliseconds (the loop answers the
others ahead of it); one that stays away longer is thinking, or gone."""


@dataclass(frozen=True)
class BatchLimits:
    """Admission and batching limits of one engine."""

    max_atoms: int = 100_000  # per structure; above it a request is refused (413)
    max_batch_atoms: int = 16_384  # atom budget of one device pass
    max_batch_edges: int = 2_000_000  # estimated-edge budget of one device pass
    window_s: float = 0.005  # longest wait for returning clients while the device is idle
    max_queue: int = 1024  # requests waiting; above it new ones get 503 + Retry-After
    inline_max_atoms: int = 2048  # largest pass of a lone client run on the loop (0: never)


@dataclass(frozen=True)
class EvaluationTimings:
    """Where a request's time went inside the engine."""

    queue_s: float  # admission → the worker thread began its first device pass
    compute_s: float  # wall time of the device passes that carried it (shared with others)
    passes: int
    finished_at: float = 0.0  # perf_counter() when its last pass ended (in the worker thread)
    delivered_at: float = 0.0  # perf_counter() when the event loop set its result
    admitted_at: float = 0.0  # perf_counter() when admission queued it (checks done)
    inline: bool = False  # its pass ran on the event loop thread (see the module docstring)


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


def _host(tensor: Tensor) -> np.ndarray:
    array: np.ndarray = tensor.detach().cpu().numpy()
    return array


_SCALAR_ESTIMATE_MAX = 32
"""Requests of up to this many structures are estimated in Python floats, larger ones in numpy."""


def estimate_edges(
    structures: Structures, rcut: float, atom_counts: np.ndarray | None = None
) -> np.ndarray:
    """(B,) expected directed neighbour pairs per structure, n·ρ·(4/3)πr³.

    ρ is measured from the cell of fully periodic structures. Elsewhere it is the density in
    the structure's ``occupied_volume`` (its extent along open directions), but at least
    ``REFERENCE_DENSITY``: a cluster or a slab packed tighter than a liquid is estimated at its
    own density, not a liquid's; and a finite molecule cannot have more than n−1 neighbours
    per atom. This runs on the event loop for every request, mostly of one structure, where
    two dozen numpy calls on one-row arrays cost ~40 µs against ~5 µs in Python floats (~20 µs
    for a structure not periodic along every axis, whose extent is measured); a request of
    many structures is estimated in numpy (a Python loop over 20,000 structures
    held the loop for 0.2 s). ``atom_counts``, (B,): when the caller has them already.
    """
    if atom_counts is None:
        atom_counts = np.diff(_host(structures.ptr))
    sphere = (4.0 / 3.0) * math.pi * rcut**3
    cells, pbc = _host(structures.cells), _host(structures.pbc)
    if len(atom_counts) > _SCALAR_ESTIMATE_MAX:
        counts = atom_counts.astype(np.float64)
        volumes = np.abs(np.einsum("bi,bi->b", cells[:, 0], np.cross(cells[:, 1], cells[:, 2])))
        periodic = pbc.all(axis=1)
        finite = ~pbc.any(axis=1)
        positions, starts = _host(structures.positions), _host(structures.ptr)[:-1]
        extent = np.maximum.reduceat(positions, starts) - np.minimum.reduceat(positions, starts)
        volumes[finite] = open_box_volumes(extent[finite])
        for row in np.flatnonzero(~periodic & ~finite):  # slabs and wires: few
            atoms = slice(starts[row], starts[row] + atom_counts[row])
            volumes[row] = occupied_volume(positions[atoms], cells[row], pbc[row])
        density = counts / volumes
        density[~periodic] = np.maximum(density[~periodic], REFERENCE_DENSITY)
        neighbours = density * sphere
        neighbours[finite] = np.minimum(neighbours[finite], counts[finite] - 1.0)
        estimates: np.ndarray = counts * neighbours
        return estimates
    rows = []
    first = 0
    for b, (n, cell, periodic_axes) in enumerate(
        zip(atom_counts.tolist(), cells.tolist(), pbc.tolist(), strict=True)
    ):
        if all(periodic_axes):
            rho = n / lattice_volume(cell)
        else:
            positions = _host(structures.positions[first : first + n])
            rho = max(n / occupied_volume(positions, cells[b], pbc[b]), REFERENCE_DENSITY)
        around = rho * sphere
        if not any(periodic_axes):
            around = min(around, n - 1.0)
        rows.append(n * around)
        first += n
    return np.array(rows, dtype=np.float64)


@dataclass
class _ClientPace:
    """How soon one sequential client sends its next request after an answer."""

    pace_s: float | None = None  # smoothed: result delivered → its next request admitted
    delivered_at: float | None = None  # perf_counter() of its last result, until it is back


@dataclass(eq=False)
class _Job:
    """One request in the engine."""

    structures: Structures
    properties: frozenset[str]
    client: Hashable | None
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
    delivered_at: float = 0.0
    inline: bool = False

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
    n_structures: int
    n_atoms: int
    n_edges: float
    inline: bool = False  # runs on the event loop thread
    # perf_counter() when the previous pass ended, if this batch's work was queued by then:
    # the device idled from that moment until this pass began (so2serve_pass_gap_seconds).
    follows_pass_at: float | None = None

    @property
    def jobs(self) -> set[_Job]:
        return {c.job for c in self.chunks}


def _relocated(reason: BaseException, index: int) -> BaseException:
    """The failure re-addressed to structure ``index`` of its request."""
    if isinstance(reason, StructureTooLargeError):
        return StructureTooLargeError(
            index=index, n_atoms=reason.n_atoms, device=reason.device, estimate=reason.estimate
        )
    if isinstance(reason, InvalidStructureError):
        where = re.sub(r"^structures\[\d+\]", f"structures[{index}]", reason.field or "")
        # The model's own checks name the structure by its place in the batch.
        message = re.sub(r"^structure \d+:", f"structure {index}:", str(reason))
        return InvalidStructureError(
            reason.code, message, field=where or f"structures[{index}]", index=index
        )
    return EvaluationFailedError(index=index, cause=reason)


@dataclass(eq=False)
class _Lane:
    """One device of the engine: its worker, its thread and the batch it runs."""

    worker: Worker
    rate: Gauge  # so2serve_atom_steps_per_second of this device
    thread: DeviceThread | None = None
    running: _Batch | None = None
    last_pass_end: float | None = None  # perf_counter() when its last pass ended


class Engine:
    """Admission, queue, batching and result routing around one ``Worker`` per device."""

    def __init__(
        self,
        workers: Sequence[Worker],
        limits: BatchLimits,
        metrics: ServiceMetrics,
        *,
        rcut: float,
        elements: Collection[int] | None = None,
        profiler: PassProfiler | None = None,
    ) -> None:
        if not workers:
            raise ValueError("an engine needs at least one worker")
        self._lanes = [
            _Lane(worker, metrics.atom_steps_per_second.labels(str(worker.device)))
            for worker in workers
        ]
        self._profiler = profiler
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
        self._atoms_per_second: float | None = None
        self._last_pass_s = 0.0
        self._clients: OrderedDict[Hashable, _ClientPace] = OrderedDict()
        # Clients the last pass served that are not back yet → when each is due at the latest.
        self._returning: dict[Hashable, float] = {}
        # Every client answered and not back yet → when it was answered (oldest first).
        self._away: OrderedDict[Hashable, float] = OrderedDict()
        # An inline pass ran and the loop has not turned since (see _start_pass).
        self._inline_unsettled = False
        self._window: asyncio.TimerHandle | None = None  # pending end of a gathering wait
        self._gathering_since: float | None = None  # perf_counter() when that wait began
        self._loop: asyncio.AbstractEventLoop | None = None
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

    @property
    def devices(self) -> list[str]:
        """The device of every lane, in lane order."""
        return [str(lane.worker.device) for lane in self._lanes]

    @property
    def faults(self) -> list[DeviceFaultError]:
        """Why each broken device stopped working (empty while every device works)."""
        return [lane.worker.fault for lane in self._lanes if lane.worker.fault is not None]

    async def start(self) -> None:
        """Start the worker threads; from now on requests are admitted on this event loop."""
        self._loop = asyncio.get_running_loop()
        if self._profiler is not None:  # its passes report this thread's CPU time too
            self._profiler.loop_thread = threading.get_ident()
        for k, lane in enumerate(self._lanes):
            lane.thread = DeviceThread(f"so2serve-device-{k}")
        self._open = True

    async def warm_up(self, numbers: Sequence[int]) -> None:
        """Run every worker's warm-up pass in its device thread, one device after the other
        (the first compiles the kernels; the others load them)."""
        for lane in self._lanes:
            await self._thread_of(lane).run(partial(lane.worker.warm_up, numbers))

    async def stop(self) -> None:
        """Stop scheduling; requests still queued or on the device get ``EngineClosedError``."""
        self._open = False
        self._cancel_window()
        closed = EngineClosedError("the server is shutting down")
        leftovers = list(self._queue)
        for lane in self._lanes:
            leftovers.extend([] if lane.running is None else lane.running.jobs)
        for job in leftovers:
            if not job.future.done():
                job.future.set_exception(closed)
        self._queue.clear()
        self._queued_atoms, self._queued_edges = 0, 0.0
        self._metrics.queue_depth.set(0)
        for lane in self._lanes:
            if lane.thread is not None:  # after the pass on its device, if any, has ended
                await asyncio.to_thread(lane.thread.close)
                lane.thread = None

    def submit(
        self,
        structures: Structures,
        properties: Collection[str],
        *,
        client: Hashable | None = None,
    ) -> asyncio.Future[EvaluationResult]:
        """Queue a validated request; the future resolves with its result or fails with the
        typed errors of ``service.engine.errors``. Refusals at admission (too many atoms, an
        element the model does not know: ``InvalidStructureError``, full queue) raise here.

        ``client`` identifies a sequential requester (one request at a time, e.g. a keep-alive
        connection) whose return the scheduler may wait for; None for anyone else.
        Cancelling the future (or a task awaiting it) withdraws whatever part of the request
        has not started. A bare future rather than a task: no extra scheduling step per request.
        """
        job = self._admit(structures, frozenset(properties), client)
        job.future.add_done_callback(lambda f: self._withdraw(job) if f.cancelled() else None)
        self._dispatch_when_due()
        return job.future

    async def evaluate(
        self,
        structures: Structures,
        properties: Collection[str],
        *,
        client: Hashable | None = None,
    ) -> EvaluationResult:
        """``submit`` and wait for the result."""
        return await self.submit(structures, properties, client=client)

    # admission

    def _admit(
        self, structures: Structures, properties: frozenset[str], client: Hashable | None
    ) -> _Job:
        if not self.running:
            raise EngineClosedError("the model is not loaded yet, or the server is stopping")
        if not self._working_lanes():
            raise self.faults[0].again()
        atom_ptr = _host(structures.ptr)
        atom_counts = atom_ptr[1:] - atom_ptr[:-1]
        self._check_sizes(atom_counts)
        self._check_elements(structures, atom_ptr)
        self.refuse_if_full()
        edges = estimate_edges(structures, self._rcut, atom_counts)
        edge_cumsum = np.empty(len(edges) + 1)
        edge_cumsum[0] = 0.0
        np.cumsum(edges, out=edge_cumsum[1:])
        job = _Job(
            structures=structures,
            properties=properties,
            client=client,
            atom_ptr=atom_ptr,
            edge_cumsum=edge_cumsum,
            future=asyncio.get_running_loop().create_future(),
            admitted_at=time.perf_counter(),
        )
        if client is not None:
            self._client_arrived(client, job.admitted_at)
        self._queue.append(job)
        self._queued_atoms += int(atom_ptr[-1])
        self._queued_edges += float(job.edge_cumsum[-1])
        self._metrics.queue_depth.set(len(self._queue))
        return job

    def refuse_if_full(self) -> None:
        """``QueueFullError`` (counted as rejected) while the queue is at its limit: what
        admission answers, for a caller that can refuse before reading a request's body."""
        if len(self._queue) >= self._limits.max_queue:
            self._metrics.rejected.labels("queue_full").inc()
            raise QueueFullError(
                f"the queue holds {len(self._queue)} requests, its limit (--max-queue); "
                "retry later",
                retry_after_s=self._retry_after_s(),
            )

    def _check_sizes(self, atom_counts: np.ndarray) -> None:
        if atom_counts.max() <= self._limits.max_atoms:
            return
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
        numbers = _host(structures.numbers)  # validated: 1..MAX_ATOMIC_NUMBER
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
        rate = self._atoms_per_second  # of one device: every lane works through the queue
        if not rate:
            return 1
        return int(min(60, max(1, math.ceil(self._queued_atoms / (rate * len(self._lanes))))))

    def _withdraw(self, job: _Job) -> None:
        self._metrics.cancelled.inc()
        self._dequeue(job)
        if job.client is not None:  # its connection is gone: forget its pace
            self._clients.pop(job.client, None)
            self._away.pop(job.client, None)

    # client pace

    def _client_arrived(self, client: Hashable, now: float) -> None:
        """A request from ``client``: learn its pace, and stop waiting for it."""
        pace = self._clients.get(client)
        if pace is None:
            self._clients[client] = _ClientPace()
            if len(self._clients) > MAX_TRACKED_CLIENTS:
                self._clients.popitem(last=False)
        else:
            self._clients.move_to_end(client)
            if pace.delivered_at is not None:
                gap = now - pace.delivered_at
                old = pace.pace_s
                pace.pace_s = gap if old is None else old + PACE_SMOOTHING * (gap - old)
                pace.delivered_at = None
        self._returning.pop(client, None)
        self._away.pop(client, None)

    def _expect_returns(self, batch: _Batch, now: float) -> None:
        """After a pass: the clients it has answered, and when each is due back at the latest
        (only those whose pace fits in the longest wait: nobody else is worth waiting for)."""
        self._returning.clear()
        self._forget_quiet_clients(now)  # here too: under load the inline check never runs
        longest = self._gather_limit_s()
        for job in batch.jobs:
            if job.client is None or not job.future.done() or job.future.cancelled():
                continue
            self._away[job.client] = now
            self._away.move_to_end(job.client)
            pace = self._clients.get(job.client)
            if pace is None:
                continue
            pace.delivered_at = now
            if pace.pace_s is None:
                continue
            due_in = RETURN_MARGIN * pace.pace_s + RETURN_SLACK_S
            if due_in <= longest:
                self._returning[job.client] = now + due_in

    def _gather_limit_s(self) -> float:
        return min(self._limits.window_s, GATHER_FRACTION * self._last_pass_s)

    def _others_away(self, now: float) -> bool:
        """Whether a client answered within ``INLINE_QUIET_S`` has not come back yet."""
        self._forget_quiet_clients(now)
        return bool(self._away)

    def _forget_quiet_clients(self, now: float) -> None:
        """Drop the clients answered before ``INLINE_QUIET_S`` (thinking, or gone: one-off
        connections never come back) from those away, oldest first."""
        away = self._away
        while away and next(iter(away.values())) < now - INLINE_QUIET_S:
            away.popitem(last=False)

    def _dequeue(self, job: _Job) -> None:
        """Forget the part of ``job`` that has not been dispatched yet."""
        if job in self._queue:
            self._queue.remove(job)
            atoms, edges = job.remaining()
            self._queued_atoms -= atoms
            self._queued_edges -= edges
            self._metrics.queue_depth.set(len(self._queue))

    # scheduling

    def _thread_of(self, lane: _Lane) -> DeviceThread:
        if lane.thread is None:
            raise EngineClosedError("the engine is not started")
        return lane.thread

    def _working_lanes(self) -> list[_Lane]:
        return [lane for lane in self._lanes if lane.worker.fault is None]

    def _idle_lane(self) -> _Lane | None:
        return next((lane for lane in self._working_lanes() if lane.running is None), None)

    def _all_idle(self) -> bool:
        return all(lane.running is None for lane in self._lanes)

    def _dispatch_when_due(self) -> None:
        """Start passes now on the idle devices while work is queued, unless a returning
        client is worth waiting for (see the module docstring).

        The first call that decides to wait arms a timer for the latest due time (bounded by
        the longest wait); every admission re-checks, and the last returner to arrive starts
        the pass before the timer fires.
        """
        while self._open and self._queue:
            if self._queue[0].future.done():
                # Cancelled, and its withdrawal (a done-callback) runs only on the loop's next
                # turn: computing it now would be a pass for nobody.
                self._dequeue(self._queue[0])
                continue
            lane = self._idle_lane()
            if lane is None:
                return
            now = time.perf_counter()
            wait_s = self._gather_wait_s(now)
            if wait_s > 0.0:
                if self._window is None:
                    self._gathering_since = now
                    self._window = self._require_loop().call_later(wait_s, self._window_closed)
                return
            self._start_pass(lane)

    def _gather_wait_s(self, now: float) -> float:
        """How much longer to hold the next pass for the clients still on their way back."""
        if not self._returning or self._budget_reached():
            return 0.0
        since = now if self._gathering_since is None else self._gathering_since
        latest = max(self._returning.values())
        return min(latest, since + self._gather_limit_s()) - now

    def _window_closed(self) -> None:
        self._window = None
        self._returning.clear()  # whoever is not back by now is late: not waited for again
        self._dispatch_when_due()
        self._gathering_since = None

    def _cancel_window(self) -> None:
        if self._window is not None:
            self._window.cancel()
            self._window = None

    def _start_pass(self, lane: _Lane) -> None:
        if self._gathering_since is not None:
            self._metrics.gather_wait.observe(time.perf_counter() - self._gathering_since)
            self._gathering_since = None
        self._cancel_window()
        batch = self._take_batch(lane)
        lane.running = batch
        loop = self._require_loop()
        if not batch.inline:
            self._thread_of(lane).submit(lambda: self._run_pass(lane, batch, loop))
            return
        self._metrics.inline_passes.inc()
        outcome, after = self._execute(lane, batch)
        self._finish_pass(lane, batch, outcome)
        # The caller resumes without yielding: a client in this process could send its next
        # request, find itself alone again and keep the loop from everyone else. Its next
        # pass goes to the worker unless the loop has turned first (it always has for an
        # HTTP client, whose next request comes through the loop's poll).
        self._inline_unsettled = True
        loop.call_soon(self._inline_settled)
        if after is not None:  # after the handler has answered
            loop.call_soon(after)

    def _inline_settled(self) -> None:
        self._inline_unsettled = False

    def _runs_inline(self, job: _Job, n_atoms: int) -> bool:
        """Whether the whole of ``job``, about to be taken, is alone (module docstring)."""
        return (
            n_atoms <= self._limits.inline_max_atoms
            and job.client is not None
            and not self._inline_unsettled
            and job.cursor == 0
            and len(self._queue) == 1
            and self._all_idle()
            and not self._returning
            and not self._others_away(time.perf_counter())
        )

    def _run_pass(self, lane: _Lane, batch: _Batch, loop: asyncio.AbstractEventLoop) -> None:
        """Worker thread: one device pass, then one hop back to the loop with its outcome."""
        outcome, after = self._execute(lane, batch)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(self._finish_pass, lane, batch, outcome)
        if after is not None:
            after()  # profiling bookkeeping, once the answer is on its way

    def _execute(
        self, lane: _Lane, batch: _Batch
    ) -> tuple[BatchOutput | BaseException, AfterPass | None]:
        """One device pass in this thread: its outcome (a failure outside the model's
        per-structure isolation as the exception), and the profiler's bookkeeping to do
        once the answer is on its way (None without a profiler)."""
        worker = lane.worker
        try:
            asked = [c.job.properties for c in batch.chunks]
            if self._profiler is None:
                return worker.run(batch.parts, batch.properties, asked), None
            return self._profiler.around(
                lambda: worker.run(batch.parts, batch.properties, asked),
                {
                    "structures": batch.n_structures,
                    "atoms": batch.n_atoms,
                    "requests": len(batch.chunks),
                    "inline": batch.inline,
                },
            )
        except Exception as exc:
            log.exception("device pass failed")
            return exc.with_traceback(None), None

    def _finish_pass(
        self, lane: _Lane, batch: _Batch, outcome: BatchOutput | BaseException
    ) -> None:
        lane.running = None
        lane.last_pass_end = None if isinstance(outcome, BaseException) else outcome.finished_at
        if not self._open:
            return  # stop() has already failed every request of this batch
        if isinstance(outcome, BaseException):
            self._fail(batch, outcome)
            self._require_loop().call_soon(self._record_batch, batch, 0, 0)
        else:
            self._deliver(lane, batch, outcome)
        self._expect_returns(batch, time.perf_counter())
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

    def _take_batch(self, lane: _Lane) -> _Batch:
        limits = self._limits
        head = self._queue[0]
        head_atoms, head_edges = head.remaining()
        fits = head_atoms <= limits.max_batch_atoms and head_edges <= limits.max_batch_edges
        if fits and self._runs_inline(head, head_atoms):
            return self._take_alone(head)
        atom_budget, edge_budget = self._pass_budget()
        chunks: list[_Chunk] = []
        parts: list[Structures] = []
        n_structures = n_atoms = 0
        n_edges = 0.0
        while self._queue:
            job = self._queue[0]
            if job.future.done():  # cancelled since the dispatch began (see above)
                self._dequeue(job)
                continue
            stop = job.fitting_stop(atom_budget - n_atoms, edge_budget - n_edges)
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
        waited = lane.last_pass_end
        if waited is not None and head.admitted_at > waited:
            waited = None  # the device was idle, waiting for work
        return _Batch(chunks, parts, properties, n_structures, n_atoms, n_edges, False, waited)

    def _pass_budget(self) -> tuple[int, float]:
        """Atoms and estimated edges the next pass may take: the limits, or an even share of
        the queued work where it would fit in fewer passes than there are idle devices (a
        request of 64 structures that fits one pass takes half the time on two)."""
        limits = self._limits
        idle = sum(lane.running is None for lane in self._working_lanes())
        if idle < 2:
            return limits.max_batch_atoms, limits.max_batch_edges
        return (
            min(limits.max_batch_atoms, math.ceil(self._queued_atoms / idle)),
            min(limits.max_batch_edges, self._queued_edges / idle),
        )

    def _take_alone(self, job: _Job) -> _Batch:
        """The whole of ``job``, the only request queued, as an inline batch."""
        self._queue.popleft()
        self._queued_atoms, self._queued_edges = 0, 0.0
        self._metrics.queue_depth.set(0)
        job.cursor = job.n_structures
        job.in_flight += 1
        n_atoms = int(job.atom_ptr[-1])
        chunk = _Chunk(job, 0, job.n_structures, 0, 0)
        properties = frozenset({"energy"}.union(job.properties))
        return _Batch(
            [chunk],
            [job.structures],
            properties,
            job.n_structures,
            n_atoms,
            float(job.edge_cumsum[-1]),
            inline=True,
        )

    def _record_batch(self, batch: _Batch, delivered_structures: int, delivered_atoms: int) -> None:
        """The pass's shape, and the structures and atoms of the requests it answered with
        results (a failed request gets none: it is no throughput)."""
        m, limits = self._metrics, self._limits
        m.batch_requests.observe(len(batch.jobs))
        m.batch_structures.observe(batch.n_structures)
        m.batch_atoms.observe(batch.n_atoms)
        m.batch_edges.observe(batch.n_edges)
        m.batch_fill.observe(
            max(batch.n_atoms / limits.max_batch_atoms, batch.n_edges / limits.max_batch_edges)
        )
        m.structures.inc(delivered_structures)
        m.atom_steps.inc(delivered_atoms)

    # results

    def _deliver(self, lane: _Lane, batch: _Batch, output: BatchOutput) -> None:
        self._last_pass_s = output.seconds
        queue_waits: list[float] = []  # of the requests this pass answers
        delivered = [0, 0]  # structures, atoms
        for chunk in batch.chunks:
            job = chunk.job
            job.in_flight -= 1
            # Its passes may run on several devices and come back in any order: the request
            # was queued until the first of them began and ran until the last one ended.
            started = output.started_at
            if job.started_at is not None:
                started = min(started, job.started_at)
            job.started_at = started
            job.compute_s += output.seconds
            job.finished_at = max(job.finished_at, output.finished_at)
            job.passes += 1
            job.inline = batch.inline
            if job.future.done():
                continue
            failed = chunk.failure(output)
            if failed is not None:
                self._abandon(job, _relocated(failed[1], failed[0]))
                queue_waits.append(started - job.admitted_at)
                continue
            job.parts.append((chunk.start, chunk.results(output)))
            if job.cursor == job.n_structures and job.in_flight == 0:
                job.delivered_at = time.perf_counter()
                job.future.set_result(self._assemble(job))
                # The whole request, when it is answered: a request split over passes may
                # still fail in a later one.
                delivered[0] += job.n_structures
                delivered[1] += int(job.atom_ptr[-1])
                queue_waits.append(started - job.admitted_at)
        # After the handlers this has woken, which answer their clients first.
        self._require_loop().call_soon(
            self._record_pass, lane, batch, output, queue_waits, delivered
        )

    def _record_pass(
        self,
        lane: _Lane,
        batch: _Batch,
        output: BatchOutput,
        queue_waits: list[float],
        delivered: list[int],
    ) -> None:
        # Not when the pass starts: the loop would hold the interpreter lock the worker
        # thread needs to begin the pass.
        self._record_batch(batch, *delivered)
        m = self._metrics
        m.pass_seconds.observe(output.seconds)
        if batch.follows_pass_at is not None:
            m.pass_gap.observe(max(0.0, output.started_at - batch.follows_pass_at))
        if output.seconds > 0:
            rate = batch.n_atoms / output.seconds
            lane.rate.set(rate)
            prev = self._atoms_per_second
            self._atoms_per_second = rate if prev is None else 0.8 * prev + 0.2 * rate
        for wait in queue_waits:  # once a request, when it is answered
            m.queue_wait.observe(wait)

    def _fail(self, batch: _Batch, exc: BaseException) -> None:
        """A pass failed as a whole (per-structure failures are isolated before this): no
        structure is named, so a client does not blame one and resend the rest. A broken
        device takes no more passes; once none works, what is queued fails with it too."""
        fault = exc if isinstance(exc, DeviceFaultError) else None
        for chunk in batch.chunks:
            chunk.job.in_flight -= 1
            if not chunk.job.future.done():
                reason = fault.again() if fault else EvaluationFailedError(index=None, cause=exc)
                self._abandon(chunk.job, reason)
        if fault is not None and not self._working_lanes():
            for job in list(self._queue):
                if not job.future.done():
                    self._abandon(job, fault.again())

    def _abandon(self, job: _Job, reason: BaseException) -> None:
        """Fail a request as a whole (no partial results) and drop what is still queued."""
        code = getattr(reason, "code", "evaluation_failed")
        self._metrics.evaluation_failures.labels(code).inc(job.n_structures)
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
                delivered_at=job.delivered_at,
                admitted_at=job.admitted_at,
                inline=job.inline,
            ),
        )
