"""Throughput of the engine over one GPU against all GPUs of the host (GPU; the lead runs it).

    python benchmarks/devices.py [--model FILE] [--sizes 192 1536] [--total-atoms 196608]
                                 [--precision fp32] [--repeats 3] [--phases engine screen]

A screening workload of water boxes (``--total-atoms`` in structures of each ``--sizes``) goes
through ``service.engine.Engine`` in this process (no HTTP: what the engine's lanes add is
the subject) in two shapes: one request holding every structure (``so2serve screen`` with a
large batch), and concurrent requests of 8 structures each (several screening clients). Each
is timed on ``cuda:0`` alone and on every visible GPU (one model copy and worker thread each,
one queue), after a warm-up pass per device and one untimed round; medians of ``--repeats``
rounds, atoms per second, and the speed-up of all GPUs over one. The results of both engines
are compared (max |ΔE| per atom, max |ΔF|).

The ``screen`` phase times what a user runs, ``so2serve screen`` (extxyz in, extxyz and
journal out, a process per run), over the same workload: through a server started with
``--device cuda:0`` and with ``--device cuda:all``, and in process on the same devices (model
loading included, as a user waits for it), at ``--screen-concurrency`` requests in flight,
with the result frames written in the screening process and by worker processes, alternated.
The first run of each setting is untimed.
Raw numbers go to ``benchmarks/results/devices_<stamp>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from ase import Atoms
from ase.io import write

from benchmarks.common import write_results
from benchmarks.service import free_port, model_file, start_server, water_atoms
from clients.screen import default_format_processes
from service.engine import BatchLimits, Engine, EvaluationResult, ServiceMetrics, Worker
from service.graph.structures import Structures
from service.model.potential import Potential, load_potential

ROOT = Path(__file__).resolve().parents[1]
PROPERTIES = frozenset(("energy", "forces", "stress"))
REQUEST_STRUCTURES = 8
"""Structures per request in the concurrent shape."""


def workload(n_atoms: int, total_atoms: int) -> list[Atoms]:
    count = max(2, total_atoms // n_atoms)
    return [water_atoms(n_atoms, seed=k) for k in range(count)]


async def _timed_rounds(
    potentials: list[Potential], requests: list[Structures], repeats: int
) -> tuple[list[float], list[EvaluationResult]]:
    metrics = ServiceMetrics()
    engine = Engine(
        [Worker(p, metrics) for p in potentials],
        BatchLimits(inline_max_atoms=0),
        metrics,
        rcut=potentials[0].config.rcut,
    )
    await engine.start()
    try:
        await engine.warm_up([1, 8])
        seconds: list[float] = []
        results: list[EvaluationResult] = []
        for k in range(repeats + 1):  # the first round is untimed (graph capture, allocator)
            started = time.perf_counter()
            results = list(
                await asyncio.gather(*(engine.evaluate(r, PROPERTIES) for r in requests))
            )
            if k:
                seconds.append(time.perf_counter() - started)
        return seconds, results
    finally:
        await engine.stop()


def _largest_difference(a: list[EvaluationResult], b: list[EvaluationResult]) -> dict[str, float]:
    energy = max(
        float(np.max(np.abs(x.energy - y.energy) / np.diff(x.atom_ptr)))
        for x, y in zip(a, b, strict=True)
    )
    forces = max(
        float(np.max(np.abs(x.forces - y.forces)))
        for x, y in zip(a, b, strict=True)
        if x.forces is not None and y.forces is not None
    )
    return {"max_abs_de_per_atom_ev": energy, "max_abs_df_ev_per_a": forces}


def run_case(
    potentials: list[Potential], atoms: list[Atoms], shape: str, repeats: int
) -> dict[str, Any]:
    if shape == "one_request":
        requests = [Structures.from_atoms(atoms)]
    else:
        requests = [
            Structures.from_atoms(atoms[i : i + REQUEST_STRUCTURES])
            for i in range(0, len(atoms), REQUEST_STRUCTURES)
        ]
    n_atoms = sum(len(a) for a in atoms)
    row: dict[str, Any] = {
        "shape": shape,
        "structure_atoms": len(atoms[0]),
        "structures": len(atoms),
        "requests": len(requests),
        "atoms": n_atoms,
    }
    outcomes = {}
    for label, lanes in (("one_gpu", potentials[:1]), ("all_gpus", potentials)):
        seconds, results = asyncio.run(_timed_rounds(lanes, requests, repeats))
        median = statistics.median(seconds)
        row[f"{label}_s"] = median
        row[f"{label}_atoms_per_s"] = n_atoms / median
        row[f"{label}_rounds_s"] = seconds
        outcomes[label] = results
    row["speedup"] = row["one_gpu_s"] / row["all_gpus_s"]
    row.update(_largest_difference(outcomes["one_gpu"], outcomes["all_gpus"]))
    print(
        f"{shape:12s} {len(atoms[0]):5d} atoms × {len(atoms):4d}: 1 GPU {row['one_gpu_s']:.3f} s, "
        f"{len(potentials)} GPUs {row['all_gpus_s']:.3f} s → {row['speedup']:.2f}×"
    )
    return row


_SCREEN_SECONDS = re.compile(r" in ([0-9.]+) s → ")


def _timed_screens(inputs: Path, workdir: Path, runs: list[int], *flags: str) -> list[float]:
    """Seconds of one ``so2serve screen`` run per entry of ``runs`` (its
    ``--format-processes``), each into a fresh output folder, as the command reports them
    (reading to summary; the interpreter's start and imports are not counted). A subprocess
    each: the frame writers are spawned, and would import this script's torch."""
    seconds: list[float] = []
    for k, processes in enumerate(runs):
        command = [
            sys.executable, "-m", "service.cli", "screen", str(inputs),
            "--out", str(workdir / f"out{k}"), "--no-progress",
            "--format-processes", str(processes), *flags,
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=False, cwd=ROOT)
        found = _SCREEN_SECONDS.search(done.stderr)
        if done.returncode or found is None or " 0 failed" not in done.stderr:
            raise RuntimeError(f"screening failed ({done.returncode}): {done.stderr[-2000:]}")
        seconds.append(float(found.group(1)))
    return seconds


def screen_case(
    model: Path, atoms: list[Atoms], devices: list[str], repeats: int, concurrency: int
) -> dict[str, Any]:
    """``so2serve screen`` over HTTP (a server per device setting), then in process, each with
    its result frames written in this process and by ``default_format_processes()`` workers,
    alternated after an untimed run."""
    n_atoms = sum(len(a) for a in atoms)
    writers = default_format_processes()
    row: dict[str, Any] = {
        "shape": "screen",
        "structure_atoms": len(atoms[0]),
        "structures": len(atoms),
        "atoms": n_atoms,
        "concurrency": concurrency,
        "format_processes": writers,
    }
    runs = [writers] + [0, writers] * repeats
    labels = list(zip(("one_gpu", "all_gpus"), devices, strict=True))
    timed: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        inputs = workdir / "inputs.extxyz"
        write(inputs, atoms, format="extxyz")
        for label, device in labels:
            port = free_port()
            server = start_server(model, device, port, window_ms=None, switch_ms=None)
            try:
                timed[f"http_{label}"] = _timed_screens(
                    inputs, workdir / f"http_{label}", runs,
                    "--url", f"http://127.0.0.1:{port}", "--concurrency", str(concurrency),
                )  # fmt: skip
            finally:
                server.terminate()
                server.wait(timeout=60)
        for label, device in labels:
            timed[f"in_process_{label}"] = _timed_screens(
                inputs, workdir / f"local_{label}", runs,
                "--model", str(model), "--device", device, "--concurrency", str(concurrency),
            )  # fmt: skip
    for key, seconds in timed.items():
        for variant, picked in (("inline", seconds[1::2]), ("pool", seconds[2::2])):
            median = statistics.median(picked)
            row[f"{key}_{variant}_s"] = median
            row[f"{key}_{variant}_atoms_per_s"] = n_atoms / median
        row[f"{key}_rounds_s"] = seconds
    for where in ("http", "in_process"):
        row[f"{where}_speedup"] = row[f"{where}_one_gpu_pool_s"] / row[f"{where}_all_gpus_pool_s"]
    print(
        f"screen       {len(atoms[0]):5d} atoms × {len(atoms):4d}, frames written here / by "
        f"{writers} processes: HTTP 1 GPU {row['http_one_gpu_inline_s']:.2f} / "
        f"{row['http_one_gpu_pool_s']:.2f} s, all {row['http_all_gpus_inline_s']:.2f} / "
        f"{row['http_all_gpus_pool_s']:.2f} s; in process 1 GPU "
        f"{row['in_process_one_gpu_inline_s']:.2f} / {row['in_process_one_gpu_pool_s']:.2f} s, "
        f"all {row['in_process_all_gpus_inline_s']:.2f} / {row['in_process_all_gpus_pool_s']:.2f} s"
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model file (default: shipped)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[192, 1536])
    parser.add_argument("--total-atoms", type=int, default=196_608)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "fp16x3"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--phases", nargs="+", default=["engine", "screen"])
    parser.add_argument("--screen-concurrency", type=int, default=8)
    args = parser.parse_args()
    n_gpus = torch.cuda.device_count()
    if n_gpus < 2:
        raise SystemExit(f"needs two or more CUDA devices, found {n_gpus}")
    path = model_file(args.model, ROOT / "runs")
    rows: list[dict[str, Any]] = []
    out: Path | None = None

    def save(row: dict[str, Any]) -> None:
        nonlocal out
        rows.append(row)
        out = write_results(args.out, "devices", rows, out, gpus=n_gpus, precision=args.precision)

    if "engine" in args.phases:
        potentials = [
            load_potential(path, device=f"cuda:{k}", precision=args.precision)
            for k in range(n_gpus)
        ]
        for size in args.sizes:
            atoms = workload(size, args.total_atoms)
            for shape in ("one_request", "concurrent"):
                save(run_case(potentials, atoms, shape, args.repeats))
        del potentials
        torch.cuda.empty_cache()
    if "screen" in args.phases:
        if args.precision != "fp32":
            raise SystemExit("the screen phase runs the served default precision (fp32) only")
        for size in args.sizes:
            atoms = workload(size, args.total_atoms)
            devices = ["cuda:0", "cuda:all"]
            save(screen_case(path, atoms, devices, args.repeats, args.screen_concurrency))


if __name__ == "__main__":
    main()
