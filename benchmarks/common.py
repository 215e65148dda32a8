"""Shared by the kernel benchmarks: CUDA-event timing, peak memory, the raw-results JSON."""

from __future__ import annotations

import datetime as dt
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton


def time_ms(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Median wall time of ``fn`` on the current stream in ms, each call bracketed by events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(stop))
    return float(statistics.median(samples))


def peak_mb(fn: Callable[[], object]) -> float:
    """Peak device memory one call of ``fn`` allocates above what was live before it, in MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def write_results(
    out_dir: Path, benchmark: str, rows: list[Any], path: Path | None = None, **extra: Any
) -> Path:
    """``<out_dir>/<benchmark>_<UTC stamp>.json`` with the GPU, versions, date and command.

    Pass the ``path`` an earlier call returned to rewrite that file: a benchmark that saves after
    every case keeps what finished when its time box cuts it short."""
    stamp = dt.datetime.now(dt.UTC)
    report = {
        "benchmark": benchmark,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": stamp.isoformat(),
        "command": " ".join(sys.argv),
        **extra,
        "rows": rows,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    if path is None:
        path = out_dir / f"{benchmark}_{stamp.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    return path
