"""Prometheus metrics of one service instance.

Every app gets its own ``CollectorRegistry`` (no process globals), so several apps (tests,
one process per GPU) never share or collide on counters.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)

_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
    30.0,
    120.0,
)
_PHASE_BUCKETS = (
    0.00001,
    0.00002,
    0.00005,
    0.0001,
    0.0002,
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.05,
    0.2,
    1.0,
)
_COUNT_BUCKETS = tuple(float(2**k) for k in range(0, 21))  # 1 … ~1M (atoms, structures)
_EDGE_BUCKETS = tuple(float(4**k) for k in range(3, 15))  # 64 … ~270M edges
_FILL_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 2.0, 10.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServiceMetrics:
    """The service's counters, gauges and histograms, all in ``self.registry``."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "so2serve_requests",
            "HTTP requests by route and status.",
            ["route", "status"],
            registry=r,
        )
        self.request_latency = Histogram(
            "so2serve_request_latency_seconds",
            "HTTP request latency (server side).",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.rejected = Counter(
            "so2serve_rejected_requests",
            "Requests refused before evaluation, by reason (queue_full, too_many_atoms, ...).",
            ["reason"],
            registry=r,
        )
        self.cancelled = Counter(
            "so2serve_cancelled_requests",
            "Requests whose client went away before the answer.",
            registry=r,
        )
        self.queue_depth = Gauge(
            "so2serve_queue_depth", "Requests waiting for a device pass.", registry=r
        )
        self.queue_wait = Histogram(
            "so2serve_queue_wait_seconds",
            "Time from admission to the first device pass.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.gather_wait = Histogram(
            "so2serve_gather_wait_seconds",
            "Time the idle device was held for clients on their way back before a pass.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.pass_gap = Histogram(
            "so2serve_pass_gap_seconds",
            "Device idle between the end of a pass and the start of the next, for a next pass "
            "whose work was already queued when the first ended (handing the results back to "
            "the event loop, forming the batch, the hop to the worker; a gathering wait "
            "included).",
            buckets=_PHASE_BUCKETS,
            registry=r,
        )
        self.pass_seconds = Histogram(
            "so2serve_pass_seconds",
            "Wall time of one device pass (one batch).",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inline_passes = Counter(
            "so2serve_inline_passes",
            "Passes of a lone client run on the event loop thread (no worker-thread hop).",
            registry=r,
        )
        self.batch_requests = Histogram(
            "so2serve_batch_requests",
            "Requests coalesced into one device pass.",
            buckets=_COUNT_BUCKETS,
            registry=r,
        )
        self.batch_structures = Histogram(
            "so2serve_batch_structures",
            "Structures in one device pass.",
            buckets=_COUNT_BUCKETS,
            registry=r,
        )
        self.batch_atoms = Histogram(
            "so2serve_batch_atoms",
            "Atoms in one device pass.",
            buckets=_COUNT_BUCKETS,
            registry=r,
        )
        self.batch_edges = Histogram(
            "so2serve_batch_edges",
            "Estimated edges (neighbour pairs) in one device pass.",
            buckets=_EDGE_BUCKETS,
            registry=r,
        )
        self.batch_fill = Histogram(
            "so2serve_batch_fill_ratio",
            "Fill of the batch budget: max(atoms / atom budget, edges / edge budget).",
            buckets=_FILL_BUCKETS,
            registry=r,
        )
        self.structures = Counter("so2serve_structures", "Structures evaluated.", registry=r)
        self.atom_steps = Counter(
            "so2serve_atom_steps", "Atoms evaluated (rate() of this is atom-steps/s).", registry=r
        )
        self.atom_steps_per_second = Gauge(
            "so2serve_atom_steps_per_second",
            "Atoms per second of device time, last pass of each device.",
            ["device"],
            registry=r,
        )
        self.gpu_memory_peak = Gauge(
            "so2serve_gpu_memory_peak_bytes",
            "High-water mark of memory allocated on each GPU.",
            ["device"],
            registry=r,
        )
        self.oom_splits = Counter(
            "so2serve_oom_splits",
            "Batches bisected after a device out-of-memory error.",
            registry=r,
        )
        self.device_faults = Counter(
            "so2serve_device_faults",
            "Devices found broken after a failed pass (a sticky CUDA error; /health/ready "
            "answers 503 from then on).",
            ["device"],
            registry=r,
        )
        self.evaluation_failures = Counter(
            "so2serve_evaluation_failures",
            "Structures of requests answered with an error after admission, by error code.",
            ["code"],
            registry=r,
        )
        self.oom_failures = Counter(
            "so2serve_oom_failures",
            "Single structures that did not fit even alone (HTTP 507).",
            registry=r,
        )
        self.encode_seconds = Histogram(
            "so2serve_encode_seconds",
            "Building and serialising one /evaluate answer (the other phases are in each "
            "answer's provenance.timings).",
            buckets=_PHASE_BUCKETS,
            registry=r,
        )
        self.respond_seconds = Histogram(
            "so2serve_respond_seconds",
            "Handing one encoded /evaluate answer to the HTTP server (until its bytes are "
            "written to the socket or buffered).",
            buckets=_PHASE_BUCKETS,
            registry=r,
        )
        self.model = Info("so2serve_model", "The served model and its execution path.", registry=r)
        # Labelled children, looked up once: labels() validates and locks on every call.
        self._request_counts: dict[tuple[str, int], Any] = {}
        self._request_latencies: dict[str, Any] = {}

    def record_request(self, route: str, status: int, seconds: float) -> None:
        """Count one HTTP request and observe its latency (event-loop thread only)."""
        count = self._request_counts.get((route, status))
        if count is None:
            count = self.requests.labels(route, str(status))
            self._request_counts[route, status] = count
        count.inc()
        latency = self._request_latencies.get(route)
        if latency is None:
            latency = self._request_latencies[route] = self.request_latency.labels(route)
        latency.observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
