"""Experiment (issue #2): where the fast tier's bar-case step spends the time its kernels do not.

At the bar case (E = 1,051,392, lmax 2, Cf 128, F 1, 3 layers) one fp16x3 forward+backward
measures 52.6-52.7 ms with ``triton.testing.do_bench`` (``rep=20``, so one timed repetition of
a ~52 ms step), while its kernels sum to 49.4 ms in a profile of the same step
(``kernels_mixing_stack_20261201T003029Z.json``). The 47 ms target is 5.6 ms away; those ~3 ms
are either idle GPU time inside the step (host work the GPU waits for, an allocator call) or the
way the step is timed. This probe tells them apart, on the same operands in one process:

* the shipped timing: ``do_bench(step, warmup=3, rep=20)``, three times;
* ``do_bench`` with ``rep=600`` (about 11 repetitions, median);
* CUDA events around each of 10 steps, synchronised between them (no L2 flush);
* 10 steps back to back between two events, per step;
* a profile of one step with host and device activity: the device's busy time, the step's
  window from its host start to its last kernel's end, the time before the first kernel, and the
  largest idle gaps between kernels with the kernels on either side;
* the step's device time alone: the stream is held by a sleep kernel while the host queues the
  whole step, so no host work lies inside the two events (alternated with synced steps);
* the host's own time for the forward and the backward call while the device is held, and the
  functions that spend it (``cProfile``, top entries by own time);
* synced steps after the device rested (0.25 s idle before each): the host's latency alone,
  against the device-only time of a rested device;
* the thermal trajectory: after a 1 s rest, 30 steps queued back to back with an event between
  each (the host stays ahead), while ``nvidia-smi`` samples SM clock, power and throttle reasons.

``python3 benchmarks/stack_gap_probe.py [--precision fp16x3|ieee]`` →
``results/stack_gap_probe_<stamp>.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import time_ms, write_results
from benchmarks.kernels_mixing_stack import all_cases, make_operands
from so2kernels.mixing_stack import so2_mixing_stack

RESULTS = Path(__file__).resolve().parent / "results"
STEP_LABEL = "stack_fwd_bwd_step"


def back_to_back_ms(step: Any, n_steps: int) -> float:
    """Mean ms per step of ``n_steps`` steps queued without a synchronisation between them."""
    step()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n_steps):
        step()
    stop.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(stop) / n_steps)


_HOLD_CYCLES = 400_000_000
"""Sleep-kernel length that keeps the device busy while the host queues one step (~0.2 s)."""


def device_only_ms(step: Any) -> float:
    """ms between two events around one step queued behind a sleep kernel: device time only."""
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(_HOLD_CYCLES)
    start.record()
    step()
    stop.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(stop))


def rested_synced_ms(step: Any, rest_s: float = 0.25) -> float:
    """One synced step (events around it, host work inside) after the device idled ``rest_s``."""
    torch.cuda.synchronize()
    time.sleep(rest_s)
    return time_ms(step, warmup=0, iters=1)


def _smi_fields() -> str:
    """nvidia-smi's query fields; newer drivers name the throttle reasons clock-event reasons."""
    for reasons in ("clocks_event_reasons.active", "clocks_throttle_reasons.active"):
        fields = f"clocks.sm,power.draw,temperature.gpu,{reasons}"
        probe = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
            capture_output=True, check=False,
        )  # fmt: skip
        if probe.returncode == 0:
            return fields
    return "clocks.sm,power.draw,temperature.gpu"


def trajectory(step: Any, n_steps: int = 30) -> dict[str, Any]:
    """Per-step device ms of ``n_steps`` back-to-back steps after a rest, with the clocks,
    power and throttle reasons ``nvidia-smi`` sampled meanwhile (every 20 ms)."""
    torch.cuda.synchronize()
    time.sleep(1.0)
    query = [f"--query-gpu={_smi_fields()}", "--format=csv,noheader,nounits", "-lms", "20"]
    smi = subprocess.Popen(["nvidia-smi", *query], stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)  # idle samples first
    events = [torch.cuda.Event(enable_timing=True) for _ in range(n_steps + 1)]
    events[0].record()
    for k in range(n_steps):
        step()
        events[k + 1].record()
    torch.cuda.synchronize()
    time.sleep(0.1)
    smi.terminate()
    lines = smi.communicate()[0].strip().splitlines()
    samples = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        try:
            sample = {"sm_mhz": float(parts[0]), "power_w": float(parts[1]),
                      "temp_c": float(parts[2])}  # fmt: skip
        except (ValueError, IndexError):
            continue
        samples.append({**sample, "throttle": parts[3] if len(parts) > 3 else ""})
    per_step = [float(events[k].elapsed_time(events[k + 1])) for k in range(n_steps)]
    return {"per_step_ms": per_step, "smi_samples": samples}


def host_split_ms(forward: Any, backward: Any) -> dict[str, float]:
    """Host seconds of the forward call and of the backward call, the device held meanwhile."""
    torch.cuda.synchronize()
    torch.cuda._sleep(_HOLD_CYCLES)
    t0 = time.perf_counter()
    out = forward()
    t1 = time.perf_counter()
    backward(out)
    t2 = time.perf_counter()
    torch.cuda.synchronize()
    return {"forward": (t1 - t0) * 1e3, "backward": (t2 - t1) * 1e3}


def host_profile(step: Any, top: int = 25) -> list[dict[str, Any]]:
    """``cProfile`` of one step with the device held: functions by own host time."""
    torch.cuda.synchronize()
    torch.cuda._sleep(_HOLD_CYCLES)
    profiler = cProfile.Profile()
    profiler.enable()
    step()
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler)
    entries = stats.stats.items()  # type: ignore[attr-defined]
    rows = []
    for (file, line, name), (_cc, calls, own, cumulative, _callers) in entries:
        rows.append({"function": f"{Path(file).name}:{line}:{name}", "calls": calls,
                     "own_ms": own * 1e3, "cumulative_ms": cumulative * 1e3})  # fmt: skip
    rows.sort(key=lambda r: -r["own_ms"])
    return rows[:top]


def profiled_gaps(step: Any, top: int = 12) -> dict[str, Any]:
    """Device busy time, host-to-device window and the largest idle gaps of one profiled step."""
    step()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        with torch.profiler.record_function(STEP_LABEL):
            step()
        torch.cuda.synchronize()
    events = prof.events()
    host = [e for e in events if e.name == STEP_LABEL and e.device_type.name == "CPU"]
    # The step's own label also appears on the device timeline, spanning every kernel.
    on_device = (e for e in events if e.device_type.name == "CUDA" and e.name != STEP_LABEL)
    kernels = sorted(
        (e for e in on_device if e.time_range.elapsed_us() > 0), key=lambda e: e.time_range.start
    )
    if not host or not kernels:
        return {"error": "no step or no kernels in the profile"}
    host_start, host_end = host[0].time_range.start, host[0].time_range.end
    busy = 0.0
    gaps: list[dict[str, Any]] = []
    frontier = kernels[0].time_range.start
    previous = "(step start)"
    for event in kernels:
        start, end = event.time_range.start, event.time_range.end
        if start > frontier:
            gaps.append({"us": start - frontier, "after": previous[:70], "before": event.name[:70]})
        busy += max(0.0, end - max(start, frontier))
        if end > frontier:
            frontier, previous = end, event.name
    gaps.sort(key=lambda g: -g["us"])
    return {
        "kernel_count": len(kernels),
        "device_busy_ms": busy / 1000,
        "window_ms": (frontier - host_start) / 1000,
        "host_step_ms": (host_end - host_start) / 1000,
        "before_first_kernel_ms": (kernels[0].time_range.start - host_start) / 1000,
        "idle_between_kernels_ms": sum(g["us"] for g in gaps) / 1000,
        "largest_gaps": gaps[:top],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--precision", choices=("fp16x3", "ieee"), default="fp16x3")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    case = all_cases("bar", 0)[0]
    ops = make_operands(case)
    u0 = ops[0].detach().requires_grad_()
    alpha = ops[1].detach().requires_grad_()
    weights = [t.detach() for t in ops[2:]]
    grad_out = torch.randn(case.n_edge, case.n_focus, ops[0].shape[2], device="cuda")

    def forward() -> torch.Tensor:
        return so2_mixing_stack(
            u0, alpha, *weights, case.lmax, case.focus_dim, True, args.precision
        )[0]

    def backward(x_local: torch.Tensor) -> object:
        return torch.autograd.grad(x_local, (u0, alpha), grad_out)

    def step() -> object:
        return backward(forward())

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    row: dict[str, Any] = {"case": case.name, "precision": args.precision}
    row["do_bench_rep20_ms"] = [float(do_bench(step, warmup=3, rep=20)) for _ in range(3)]
    row["do_bench_rep600_ms"] = float(do_bench(step, warmup=3, rep=600))
    samples = [time_ms(step, warmup=0, iters=1) for _ in range(10)]
    row["events_synced_ms"] = {"median": statistics.median(samples), "all": samples}
    row["back_to_back_ms"] = back_to_back_ms(step, 10)
    device, synced = [], []
    for _ in range(8):
        device.append(device_only_ms(step))
        synced.append(time_ms(step, warmup=0, iters=1))
    row["device_only_ms"] = {"median": statistics.median(device), "all": device}
    row["synced_alternating_ms"] = {"median": statistics.median(synced), "all": synced}
    row["rested_synced_ms"] = [rested_synced_ms(step) for _ in range(6)]
    row["rested_device_only_ms"] = []
    for _ in range(6):
        time.sleep(0.25)
        row["rested_device_only_ms"].append(device_only_ms(step))
    row["trajectory"] = trajectory(step)
    splits = [host_split_ms(forward, backward) for _ in range(5)]
    row["host_ms"] = {k: statistics.median(s[k] for s in splits) for k in ("forward", "backward")}
    row["host_profile"] = host_profile(step)
    row["profile"] = profiled_gaps(step)
    print({k: v for k, v in row.items() if k not in ("trajectory", "host_profile")}, flush=True)
    print("trajectory ms:", [round(t, 1) for t in row["trajectory"]["per_step_ms"]], flush=True)
    smi = row["trajectory"]["smi_samples"]
    compact = [(s["sm_mhz"], s["power_w"], s["temp_c"], s["throttle"]) for s in smi]
    print("smi (MHz, W, C, reasons):", compact, flush=True)
    path = write_results(RESULTS, "stack_gap_probe", [row])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
