"""What a fresh server process pays before and on its first requests.

    python3 benchmarks/cold_start.py [--scenarios record fresh-serial fresh-cache warm-cache]
                                     [--precisions fp32 fp16x3] [--out-dir ...]

Each scenario runs in its own interpreter (cold imports, empty in-process kernel caches) with
``TRITON_CACHE_DIR`` pointing at an empty directory (a new machine or container) or, for
``warm-cache``, at the one the previous scenario filled (a restart on the same machine):

* ``record``: empty cache; records the kernels the warm-up compiles into this GPU's kernel set
  (``so2kernels/tables/<gpu>.kernels.json``, :mod:`so2kernels.precompile`), which the server
  then compiles up front on a thread pool;
* ``fresh-serial``: empty cache, the warm-up without that preload (each kernel compiles at its
  first launch, one after the other);
* ``fresh-cache``: empty cache, the server's own warm-up (preload, then the passes);
* ``warm-cache``: the previous scenario's cache, the server's own warm-up.

The child times, in order: importing torch and the service, loading the shipped default model onto
the GPU, the server's warm-up pass (:meth:`service.engine.worker.Worker.warm_up`), and then the
first and second evaluation of each workload below, through the same ``Worker.run`` the server
calls. Every in-process kernel-cache miss of a Triton kernel (a compile, or a load from the disk
cache) is counted per step through Triton's ``jit_cache_hook``, with the kernel's name and the
argument specialisation that missed, so a step that compiles can be traced to the cause. The
preload's compiles count as misses of the warm-up step; the passes after it should add none.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # before benchmarks/, whose service.py would shadow the package

WORKLOADS = (
    "water-12288",
    "molecule-96",
    "water-192",
    "water-192-x21",
    "water-1536",
    "water-1535",
    "triclinic-12",
)
"""First-request shapes a server meets: a box too large for graph replay (eager path), a molecule
without a cell, one liquid box, a screening batch (21 boxes, 4,032 atoms), a larger box and the
same with one atom removed (odd sizes), and a small sheared cell (several periodic images)."""


def _workload(name: str) -> Any:
    import numpy as np
    from ase import Atoms

    from benchmarks.service import water_atoms
    from service.graph.structures import Structures

    if name == "water-192-x21":
        return Structures.from_atoms([water_atoms(192, seed=k) for k in range(21)])
    if name == "water-1535":
        atoms = water_atoms(1536, seed=1)
        del atoms[-1]
        return Structures.from_atoms([atoms])
    if name == "molecule-96":
        atoms = water_atoms(192, seed=2)[:96]
        atoms.pbc, atoms.cell = False, np.zeros((3, 3))
        return Structures.from_atoms([atoms])
    if name == "triclinic-12":
        rng = np.random.default_rng(3)
        cell = np.array([[4.6, 0.0, 0.0], [1.1, 4.4, 0.0], [0.7, 0.9, 4.8]])
        frac = (np.arange(12)[:, None] * np.array([0.37, 0.61, 0.23])) % 1.0
        positions = frac @ cell + rng.normal(scale=0.02, size=(12, 3))
        atoms = Atoms(numbers=[8, 1, 1] * 4, positions=positions, cell=cell, pbc=True)
        return Structures.from_atoms([atoms])
    n_atoms = int(name.split("-")[1])
    return Structures.from_atoms([water_atoms(n_atoms, seed=0)])


def _child(args: argparse.Namespace) -> None:
    """One scenario in this (fresh) interpreter; writes its row as JSON to ``args.child``."""
    out, repeats, device, workloads = args.child, args.repeats, args.device, args.workloads
    started = time.perf_counter()
    steps: list[dict[str, Any]] = []
    misses: list[str] = []

    def step(name: str, t0: float, **extra: Any) -> None:
        took = time.perf_counter() - t0
        row = {"step": name, "s": round(took, 3), "kernel_misses": len(misses), **extra}
        if misses:
            row["kernels"] = sorted(set(misses))
        steps.append(row)
        print(f"  {name:<28} {took:8.2f} s  {len(misses):3d} kernel misses", flush=True)
        misses.clear()

    t0 = time.perf_counter()
    import torch

    step("import torch", t0)
    t0 = time.perf_counter()
    import triton
    from triton import knobs

    from service.engine import ServiceMetrics, Worker
    from service.engine.evaluator import model_elements
    from service.engine.kernel_sets import kernel_set_fingerprint
    from service.model.potential import load_potentials
    from so2kernels.precompile import record_compiles, save_kernel_set

    step("import service", t0)

    def on_miss(*_: Any, **kw: Any) -> bool:
        fn, key = kw.get("fn"), kw.get("key")
        jit = getattr(fn, "jit_function", None)
        name = getattr(fn, "name", str(fn))
        try:  # key[0]: one (type, specialisation) pair per parameter, constexprs as such
            specs = [
                f"{arg}={kind}:{spec}"
                for arg, (kind, spec) in zip(jit.arg_names, key[0], strict=True)
                if kind != "constexpr"
            ]
            consts = [
                f"{arg}={spec}"
                for arg, (kind, spec) in zip(jit.arg_names, key[0], strict=True)
                if kind == "constexpr"
            ]
            misses.append(f"{name}({', '.join(specs)}) [{', '.join(consts)}] {key[1]}")
        except (AttributeError, TypeError, ValueError):  # another Triton's hook arguments
            misses.append(f"{name} {key}"[:3000])
        return False

    knobs.runtime.jit_cache_hook = on_miss

    t0 = time.perf_counter()
    (potential,) = load_potentials(None, devices=device, precision=args.precision)
    worker = Worker(potential, ServiceMetrics())
    step("load default model", t0)
    t0 = time.perf_counter()
    # Keyed as a server keys it, before its warm-up (a failed graph capture changes the info).
    fingerprint = kernel_set_fingerprint(potential.info())
    with record_compiles() as recorded:
        worker.warm_up(
            model_elements(potential.info()), preload=args.scenario in ("fresh-cache", "warm-cache")
        )
    step("server warm-up", t0)
    if args.scenario == "record" and device.startswith("cuda"):
        name = torch.cuda.get_device_name(device)
        path = save_kernel_set(name, fingerprint, recorded)
        print(f"  recorded {len(recorded)} kernels in {path}", flush=True)
    properties = frozenset(("energy", "forces", "stress"))
    for name in workloads:
        structures = _workload(name)
        for k in range(repeats):
            t0 = time.perf_counter()
            output = worker.run([structures], properties)
            if output.failures:
                raise next(iter(output.failures.values()))
            step(f"{name} #{k + 1}", t0, atoms=int(structures.n_atoms))
    report = {
        "precision": args.precision,
        "warm_up_kernels": len(recorded),
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else device,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR"),
        "total_s": round(time.perf_counter() - started, 2),
        "steps": steps,
    }
    out.write_text(json.dumps(report, indent=1))


SCENARIOS = ("record", "fresh-serial", "fresh-cache", "warm-cache")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", nargs="+", default=["fresh-cache", "warm-cache"],
                        choices=SCENARIOS)  # fmt: skip
    parser.add_argument("--precisions", nargs="+", default=["fp32"], choices=["fp32", "fp16x3"])
    parser.add_argument("--repeats", type=int, default=2, help="evaluations of each workload")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--device", default="cuda:0", help="cpu: a smoke test of the script")
    parser.add_argument("--label", default="", help="recorded with the results (e.g. a commit)")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--scenario", choices=SCENARIOS, help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        _child(args)
        return

    from benchmarks.common import write_results

    cache = Path(tempfile.mkdtemp(prefix="so2serve-triton-cache-"))
    rows = []
    for precision in args.precisions:
        for scenario in args.scenarios:
            if scenario != "warm-cache":
                cache = Path(tempfile.mkdtemp(prefix="so2serve-triton-cache-"))
            print(f"{scenario}, {precision} (TRITON_CACHE_DIR={cache})", flush=True)
            result = Path(tempfile.mkstemp(suffix=".json")[1])
            env = {**os.environ, "TRITON_CACHE_DIR": str(cache)}
            command = [sys.executable, __file__, "--child", str(result), "--scenario", scenario]
            command += ["--precision", precision, "--repeats", str(args.repeats)]
            command += ["--device", args.device, "--workloads", *args.workloads]
            t0 = time.perf_counter()
            subprocess.run(command, env=env, check=True, cwd=ROOT)
            row = {"scenario": scenario, "process_s": round(time.perf_counter() - t0, 2)}
            rows.append({**row, **json.loads(result.read_text())})
    write_results(args.out_dir, "cold_start", rows, label=args.label)


if __name__ == "__main__":
    main()
