"""The shipped model's step on the CPU: time and peak resident memory per edge-chunk size.

A CPU server (or ``InProcessCalculator(device="cpu")``) runs the eager reference path. Its
``auto`` memory mode splits the per-edge pipeline into chunks of ``CPU_EDGE_CHUNK`` edges; this
measures that choice against the other sizes and against one unchunked step (``memory="fast"``),
and the potential's host-memory estimate against the peak actually reached. Every case runs in a
fresh process, so each peak is its own (``ru_maxrss`` only grows)::

    python3 benchmarks/cpu_step.py --atoms 192 768 1536 --chunks 0 1024 2048 4096 8192

``0`` is the unchunked step. Forces and stress are asked for, as MD and relaxations do.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import write_results  # noqa: E402
from benchmarks.model import water_box  # noqa: E402
from service.graph.neighbors import place_and_build_graph_carrying  # noqa: E402
from service.model import potential as potential_module  # noqa: E402
from service.model.potential import host_step_bytes, load_potential  # noqa: E402


def measure(n_atoms: int, chunk: int, repeats: int) -> dict[str, Any]:
    """One case in this process: its best step time and the step's peak resident memory."""
    if chunk:
        potential_module.CPU_EDGE_CHUNK = chunk
    potential = load_potential(device="cpu", path="reference", memory="lean" if chunk else "fast")
    structures = water_box(n_atoms)
    _, graph, _ = place_and_build_graph_carrying(
        structures, potential.config.rcut, potential.device, []
    )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        potential.predict(structures, ("energy", "forces", "stress"))
        seconds.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    estimate = host_step_bytes(potential.config, graph.n_edges, chunk or None)
    return {
        "atoms": structures.n_atoms,
        "edges": graph.n_edges,
        "chunk": chunk or None,
        "threads": torch.get_num_threads(),
        "step_s": min(seconds),
        "step_s_all": seconds,
        "peak_above_start_mib": (peak - before) / 2**20,
        "estimate_mib": estimate / 2**20,
        "estimate_over_peak": estimate / max(peak - before, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--atoms", type=int, nargs="+", default=[192, 768, 1536])
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 1024, 2048, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--case", type=int, nargs=2, help=argparse.SUPPRESS)  # child: atoms chunk
    args = parser.parse_args()
    if args.case:
        print(json.dumps(measure(*args.case, repeats=args.repeats)))
        return
    rows: list[dict[str, Any]] = []
    path = None
    for n_atoms in args.atoms:
        for chunk in args.chunks:
            child = subprocess.run(
                [sys.executable, __file__, "--case", str(n_atoms), str(chunk),
                 "--repeats", str(args.repeats)],
                capture_output=True, text=True, check=False,
            )  # fmt: skip
            if child.returncode != 0:
                rows.append({"atoms": n_atoms, "chunk": chunk or None,
                             "error": child.stderr.strip().splitlines()[-1:]})  # fmt: skip
            else:
                rows.append(json.loads(child.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
            path = write_results(args.out, "cpu_step", rows, path, cpu_count=os.cpu_count())
    fastest: dict[int, dict[str, Any]] = {}
    for row in rows:
        if "step_s" in row and (row["atoms"] not in fastest
                                or row["step_s"] < fastest[row["atoms"]]["step_s"]):  # fmt: skip
            fastest[row["atoms"]] = row
    for n_atoms, row in fastest.items():
        unchunked = next((r for r in rows if r["atoms"] == n_atoms and r["chunk"] is None
                          and "step_s" in r), None)  # fmt: skip
        ratio = (
            f", {unchunked['step_s'] / row['step_s']:.2f}× the unchunked step" if unchunked else ""
        )
        print(f"{n_atoms} atoms: fastest chunk {row['chunk']} ({row['step_s']:.2f} s{ratio})")


if __name__ == "__main__":
    main()
