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

The ``screen`` phase times what users run, ``so2serve screen`` (extxyz in, extxyz and journal
out, a process per run), over the same workload split into files: through a server started
with ``--device cuda:0`` and with ``--device cuda:all``, by ``--screen-clients`` screening
processes at once (each with its share of the files, ``--screen-concurrency`` requests in
flight), after an untimed run; then once in process on the same devices (model loading
included, as a user waits for it).
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


def _screen_command(inputs: list[Path], out: Path, *flags: str) -> list[str]:
    return [
        sys.executable, "-m", "service.cli", "screen", *map(str, inputs),
        "--out", str(out), "--no-progress", *flags,
    ]  # fmt: skip


def _screens_at_once(commands: list[list[str]]) -> float:
    """Runs ``so2serve screen`` commands side by side; the longest run as the commands report
    it (reading to summary; the interpreter's start and imports are not counted)."""
    running = [subprocess.Popen(c, stderr=subprocess.PIPE, text=True, cwd=ROOT) for c in commands]
    seconds = []
    for process in running:
        _, stderr = process.communicate()
        found = _SCREEN_SECONDS.search(stderr)
        if process.returncode or found is None or " 0 failed" not in stderr:
            raise RuntimeError(f"screening failed ({process.returncode}): {stderr[-2000:]}")
        seconds.append(float(found.group(1)))
    return max(seconds)


def screen_case(
    model: Path,
    atoms: list[Atoms],
    devices: list[str],
    repeats: int,
    concurrency: int,
    client_counts: list[int],
) -> dict[str, Any]:
    """``so2serve screen`` through a server per device setting, by 1..N clients at once, each
    screening its share of the input files; then one in-process screen per device setting."""
    n_atoms = sum(len(a) for a in atoms)
    row: dict[str, Any] = {
        "shape": "screen",
        "structure_atoms": len(atoms[0]),
        "structures": len(atoms),
        "atoms": n_atoms,
        "concurrency": concurrency,
    }
    parts = max(client_counts)
    labels = list(zip(("one_gpu", "all_gpus"), devices, strict=True))
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        files = [workdir / f"part{k}.extxyz" for k in range(parts)]
        for k, path in enumerate(files):
            write(path, atoms[k::parts], format="extxyz")
        flags = ("--concurrency", str(concurrency))
        for label, device in labels:
            port = free_port()
            server = start_server(model, device, port, window_ms=None, switch_ms=None)
            url = ("--url", f"http://127.0.0.1:{port}")
            try:
                _screens_at_once([_screen_command(files, workdir / f"warm_{label}", *url, *flags)])
                for clients in client_counts:
                    rounds = [
                        _screens_at_once([
                            _screen_command(
                                files[c::clients], workdir / f"{label}_{clients}_{r}_{c}",
                                *url, *flags,
                            )
                            for c in range(clients)
                        ])
                        for r in range(repeats)
                    ]  # fmt: skip
                    key = f"http_{label}_{clients}_clients"
                    row[f"{key}_s"] = statistics.median(rounds)
                    row[f"{key}_atoms_per_s"] = n_atoms / row[f"{key}_s"]
                    row[f"{key}_rounds_s"] = rounds
            finally:
                server.terminate()
                server.wait(timeout=60)
        for label, device in labels:
            command = _screen_command(
                files, workdir / f"local_{label}", "--model", str(model), "--device", device,
                *flags,
            )  # fmt: skip
            row[f"in_process_{label}_s"] = _screens_at_once([command])
    for clients in client_counts:
        key = f"http_{{}}_{clients}_clients_s"
        row[f"http_{clients}_clients_speedup"] = (
            row[key.format("one_gpu")] / row[key.format("all_gpus")]
        )
    print(
        f"screen       {len(atoms[0]):5d} atoms × {len(atoms):4d}: "
        + "; ".join(
            f"{c} client(s) 1 GPU {row[f'http_one_gpu_{c}_clients_s']:.2f} s, all "
            f"{row[f'http_all_gpus_{c}_clients_s']:.2f} s"
            for c in client_counts
        )
        + f"; in process 1 GPU {row['in_process_one_gpu_s']:.1f} s, all "
        f"{row['in_process_all_gpus_s']:.1f} s (model loading included)"
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
    parser.add_argument("--screen-clients", type=int, nargs="+", default=[1, 2, 4])
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
            save(
                screen_case(
                    path, atoms, devices, args.repeats, args.screen_concurrency,
                    args.screen_clients,
                )
            )  # fmt: skip


if __name__ == "__main__":
    main()
