"""Where the host time of a speculatively replayed small step goes (issue #4, 192 atoms).

A replayed step's device work is one CUDA-graph launch; everything the host does before that
launch is time the device idles (0.78 ms at 192 atoms on the H200, 2026-11-30, against a 5.68 ms
step). This script serves the bar model in the fp16x3 tier as ``benchmarks/model.py`` does,
records the bucket, then over ``--steps`` predicts of one 192-atom water box measures:

- the wall time of a step and the time from ``predict`` to the graph launch (medians);
- a cProfile of the same steps: the functions with the most own time, and the cumulative time of
  the stages of the replay path (types, search table, staging, copy in, launch, copy out);
- the same timed steps with the search table rebuilt every step instead of taken from the
  potential's :class:`~service.graph.pair_search.ImageWindowMemo`, alternating with the memo
  (``memo_ab``: what reusing the table of an unchanged cell saves).

Results go to ``benchmarks/results/replay_host_probe_<date>.json``.

    python3 benchmarks/replay_host_probe.py --steps 300
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as dt
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.model import bar_config, water_box  # noqa: E402
from service.graph.pair_search import ImageWindowMemo, image_windows  # noqa: E402
from service.model.captured import RECORD_AFTER  # noqa: E402
from service.model.potential import Potential  # noqa: E402
from tests.model.randomized import randomized_model  # noqa: E402

STAGES = (
    "atom_types", "_replay_batch", "image_windows", "speculate", "_drop_stale_graphs", "stage",
    "_load", "replay", "fetch",
)  # fmt: skip
"""Functions of the replay path whose cumulative time is reported (by name, any module)."""


def timed_steps(pot: Potential, steps: int) -> dict[str, float]:
    """Medians of the step's wall time and of its time until the graph launch, in ms."""
    structures = water_box(192)
    marks: dict[str, float] = {}
    replay = torch.cuda.CUDAGraph.replay

    def marked_replay(graph: torch.cuda.CUDAGraph) -> None:
        marks["launch"] = time.perf_counter()
        replay(graph)

    step_ms, launch_ms = [], []
    torch.cuda.CUDAGraph.replay = marked_replay  # type: ignore[method-assign, assignment]
    try:
        for _ in range(steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            pot.predict(structures, ("energy", "forces"))
            step_ms.append((time.perf_counter() - start) * 1e3)
            launch_ms.append((marks["launch"] - start) * 1e3)
    finally:
        torch.cuda.CUDAGraph.replay = replay  # type: ignore[method-assign]
    return {
        "step_ms": statistics.median(step_ms),
        "until_launch_ms": statistics.median(launch_ms),
    }


def profiled_steps(pot: Potential, steps: int, top: int) -> dict[str, Any]:
    """cProfile of ``steps`` predicts: per-step own time of the top functions and cumulative
    time of :data:`STAGES`, in µs."""
    structures = water_box(192)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        pot.predict(structures, ("energy", "forces"))
    profile.disable()
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    rows = []
    stages: dict[str, float] = {}
    for (filename, line, name), (_cc, calls, own, cumulative, _callers) in stats.items():
        where = f"{Path(filename).name}:{line}({name})"
        per_step = {"own_us": own / steps * 1e6, "cumulative_us": cumulative / steps * 1e6}
        rows.append({"function": where, "calls_per_step": calls / steps, **per_step})
        if name in STAGES:
            stages[name] = max(stages.get(name, 0.0), cumulative / steps * 1e6)
    rows.sort(key=lambda r: -r["own_us"])
    return {"top_own": rows[:top], "stages_cumulative_us": stages}


def memo_ab(pot: Potential, steps: int) -> list[dict[str, Any]]:
    """:func:`timed_steps` with the search table rebuilt each step (``rebuilt``) and memoised
    (``memo``), alternating twice in this process."""
    runs = []
    for variant in ("rebuilt", "memo", "rebuilt", "memo"):
        pot._search_tables = image_windows if variant == "rebuilt" else ImageWindowMemo()  # type: ignore[assignment]
        runs.append({"variant": variant, **timed_steps(pot, steps)})
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--precision", default="fp16x3", choices=["fp32", "fp16x3"])
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    pot = Potential(
        randomized_model(bar_config()), device="cuda", path="fused", precision=args.precision
    )
    structures = water_box(192)
    for _ in range(RECORD_AFTER + 2):  # record the bucket, then predict it
        pot.predict(structures, ("energy", "forces"))
    torch.cuda.synchronize()
    timed = timed_steps(pot, args.steps)
    print(json.dumps(timed), flush=True)  # before the profile: a time box keeps this much
    doc: dict[str, Any] = {
        "benchmark": "replay_host_probe",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": dt.datetime.now(dt.UTC).isoformat(),
        "command": " ".join(sys.argv),
        "timed": timed,
        "profiled": profiled_steps(pot, args.steps, args.top),
    }
    print(json.dumps(doc["profiled"]["stages_cumulative_us"]))
    doc["memo_ab"] = memo_ab(pot, args.steps)
    print(json.dumps(doc["memo_ab"]))
    for row in doc["profiled"]["top_own"][:15]:
        print(f"{row['own_us']:8.1f} us own {row['cumulative_us']:8.1f} cum  {row['function']}")
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"replay_host_probe_{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%S}.json"
    path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
