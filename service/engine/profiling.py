"""Opt-in profiling of device passes: where a pass's wall time goes inside the serving process.

A pass that takes longer behind the server than the same pass in another process has four
candidate causes, and each record below measures one of them:

* the worker thread computing more (``worker_cpu_ms``: its own CPU time, and the top aten /
  Python-range ops by self CPU time from ``torch.profiler``, started in the worker thread so
  only its ops are recorded);
* the worker waiting (``worker_blocked_ms`` = wall − its CPU time: device synchronisations,
  but also the interpreter lock held by another thread, and the OS scheduler);
* other threads of the process running at the same time (``loop_cpu_ms``: the event loop
  thread's CPU time during the pass; ``other_threads_cpu_ms``: the rest of the process, e.g.
  intra-op pools), and garbage collections (``gc``: count, time and thread);
* the device itself (``cuda_kernel_ms``: the sum of kernel times the profiler saw).

In ``top_cpu_ops`` the self time of the ``so2serve::pass`` range is the worker's Python
between ops (and whatever the profiler does not see as an op: numpy, vesin, syncs outside
aten). The profiler's own cost inflates the profiled passes a little, equally in every
process, so compare profiles with profiles and plain timings with plain timings.

``PassProfiler`` skips ``skip`` passes, records the next ``passes`` and then writes one compact
JSON document (``profile-<label>-<pid>.json`` in ``out_dir``) and goes idle. The engine calls
``around`` in the thread that runs the pass: the worker thread, or the event loop thread for
a lone client's pass (``inline`` in the record; ``worker_*`` then describe the loop thread and
``loop_cpu_ms`` is None). Without a profiler nothing here runs.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch.autograd import DeviceType  # type: ignore[attr-defined]
from torch.profiler import ProfilerActivity, profile, record_function

log = logging.getLogger("so2serve.profiling")

T = TypeVar("T")
AfterPass = Callable[[], None]

TOP_OPS = 15
"""Ops listed per pass (by self CPU time in the worker thread)."""

PASS_RANGE = "so2serve::pass"


@dataclass(frozen=True)
class ProfileRequest:
    """What to record: ``passes`` passes after skipping ``skip``, written under ``out_dir``."""

    passes: int
    skip: int
    out_dir: Path
    label: str = "server"


@dataclass
class _GcLog:
    """Garbage collections seen while a pass runs (``gc.callbacks``; any thread)."""

    started: dict[int, float] = field(default_factory=dict)
    collections: list[dict[str, Any]] = field(default_factory=list)

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        ident = threading.get_ident()
        if phase == "start":
            self.started[ident] = time.perf_counter()
        elif ident in self.started:
            self.collections.append(
                {
                    "generation": info.get("generation"),
                    "ms": (time.perf_counter() - self.started.pop(ident)) * 1e3,
                    "thread": threading.current_thread().name,
                }
            )


def _thread_cpu_s(pthread_ident: int | None) -> float | None:
    """CPU seconds of another thread of this process (Linux); None where unavailable."""
    if pthread_ident is None or not hasattr(time, "pthread_getcpuclockid"):
        return None
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(pthread_ident))
    except (OSError, ProcessLookupError):
        return None


def _event_self_device_us(event: Any) -> float:
    value = getattr(event, "self_device_time_total", None)
    if value is None:  # torch < 2.4 spelled it for CUDA only
        value = getattr(event, "self_cuda_time_total", None)
    return 0.0 if value is None else float(value)


def _summarise_events(prof: profile) -> dict[str, Any]:
    """Top ops by self CPU time (this thread only: the profiler ran in it) and device time."""
    self_cpu: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    kernel_us = 0.0
    kernels = 0
    events: list[Any] = prof.events()  # type: ignore[no-untyped-call]
    for event in events:
        if event.device_type == DeviceType.CPU:
            self_cpu[event.name] += event.self_cpu_time_total
            calls[event.name] += 1
        else:
            kernel_us += _event_self_device_us(event)
            kernels += 1
    top = sorted(self_cpu.items(), key=lambda item: item[1], reverse=True)[:TOP_OPS]
    return {
        "cuda_kernel_ms": kernel_us * 1e-3,
        "cuda_kernels": kernels,
        "profiled_cpu_ops": sum(calls.values()),
        "top_cpu_ops": [
            {"name": name, "self_ms": us * 1e-3, "calls": calls[name]} for name, us in top
        ],
    }


def process_context() -> dict[str, Any]:
    """Settings of this process that change how a pass runs on the host."""
    return {
        "pid": os.getpid(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "switch_interval_s": sys.getswitchinterval(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "threads_alive": threading.active_count(),
        "gc_frozen": gc.get_freeze_count(),
        "gc_thresholds": gc.get_threshold(),
        "cpu_affinity": sorted(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else None,
        "env": {
            k: os.environ[k]
            for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_LAUNCH_BLOCKING", "PYTHONPATH")
            if k in os.environ
        },
        "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


@dataclass
class PassProfiler:
    """Records passes run through ``around`` (one thread) and writes their summary once."""

    request: ProfileRequest
    loop_thread: int | None = None  # threading.get_ident() of the event loop, for its CPU time
    seen: int = 0
    records: list[dict[str, Any]] = field(default_factory=list)
    written: Path | None = None
    _pending: list[tuple[dict[str, Any], profile]] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return self.written is None and len(self._pending) < self.request.passes

    def around(self, run: Callable[[], T], describe: dict[str, Any]) -> tuple[T, AfterPass]:
        """``run()``, profiled if this pass is one to record; also returns the bookkeeping to
        do once the pass's result has been handed back (summarising takes milliseconds, which
        must not delay the answer)."""
        self.seen += 1
        if not self.active or self.seen <= self.request.skip:
            return run(), _nothing
        return self._record(run, describe)

    def _record(self, run: Callable[[], T], describe: dict[str, Any]) -> tuple[T, AfterPass]:
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        gc_log = _GcLog()
        prof = profile(activities=activities)
        try:
            prof.start()  # outside the timed region: its start-up is not the pass's
        except Exception:  # diagnostics never fail a request: profile nothing from now on
            log.exception("the profiler did not start; profiling is off")
            self.request = replace(self.request, passes=0)
            return run(), _nothing
        gc.callbacks.append(gc_log)
        # A pass run inline is on the loop thread itself: its CPU time is the worker's.
        other_loop = None if self.loop_thread == threading.get_ident() else self.loop_thread
        loop_before = _thread_cpu_s(other_loop)
        process_before = time.process_time()
        worker_before = time.thread_time()
        start = time.perf_counter()
        try:
            with record_function(PASS_RANGE):
                result = run()
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
        finally:
            wall = time.perf_counter() - start
            worker = time.thread_time() - worker_before
            process = time.process_time() - process_before
            loop_after = _thread_cpu_s(other_loop)
            gc.callbacks.remove(gc_log)
            prof.stop()
        loop = None if loop_before is None or loop_after is None else loop_after - loop_before
        record: dict[str, Any] = {
            **describe,
            "wall_ms": wall * 1e3,
            "worker_cpu_ms": worker * 1e3,
            "worker_blocked_ms": (wall - worker) * 1e3,
            "loop_cpu_ms": None if loop is None else loop * 1e3,
            "other_threads_cpu_ms": (process - worker - (loop or 0.0)) * 1e3,
            "gc": gc_log.collections,
            "worker_thread": threading.get_native_id(),
        }

        self._pending.append((record, prof))
        if len(self._pending) < self.request.passes:
            return result, _nothing
        return result, self._finish

    def _finish(self) -> None:
        """Summarise every recorded pass's events and write the document: once, after the
        last profiled pass (summarising takes milliseconds of the interpreter lock, which
        would otherwise hold up the event loop after every profiled pass)."""
        for record, prof in self._pending:
            record.update(_summarise_events(prof))
            self.records.append(record)
        self._pending.clear()
        self.written = self.write()

    def summary(self) -> dict[str, Any]:
        """The recorded passes with their medians, and the process's settings."""
        numeric = (
            "wall_ms",
            "worker_cpu_ms",
            "worker_blocked_ms",
            "loop_cpu_ms",
            "other_threads_cpu_ms",
            "cuda_kernel_ms",
        )
        medians = {
            name: statistics.median(values)
            for name in numeric
            if (values := [r[name] for r in self.records if r.get(name) is not None])
        }
        return {
            "label": self.request.label,
            "request": {**asdict(self.request), "out_dir": str(self.request.out_dir)},
            "context": process_context(),
            "loop_thread": self.loop_thread,
            "medians": medians,
            "gc_collections": sum(len(r["gc"]) for r in self.records),
            "passes": self.records,
        }

    def write(self) -> Path:
        out = self.request.out_dir / f"profile-{self.request.label}-{os.getpid()}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_suffix(".part")
        partial.write_text(json.dumps(self.summary(), indent=1))
        partial.replace(out)  # readers never see a half-written file
        return out


def _nothing() -> None:
    return None
