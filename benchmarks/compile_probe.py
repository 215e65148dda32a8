"""Why ``torch.compile(reference)`` aborts on CUDA beyond its first shape; which setting avoids it.

``benchmarks/model.py``'s compiled series (``torch.compile(model, dynamic=True)`` of the reference
path, energy + forces through ``torch.autograd.grad``) compiled and ran at 192 atoms on the H200,
then killed the process at 1,536 atoms with a C++ ``c10::Error`` ("trying to set the current
FakeTensorMode, but one already exists") raised outside Python. The same script runs on CPU.

Each variant runs in its own subprocess (an abort kills only that variant) over the sizes given;
the parent prints one JSON line per variant (return code, rows, the error's last lines) and writes
them to ``benchmarks/results/compile_probe_<date>.json``. Variants:

- ``baseline``: as ``model.py`` runs it;
- ``single-thread-backward``: the backward runs on the calling thread
  (``torch.autograd.set_multithreading_enabled(False)``), so AOTAutograd's lazy backward
  compile of a new shape happens there rather than in the autograd engine's device thread;
- ``static``: ``dynamic=False`` with ``torch._dynamo.reset()`` between sizes (a fresh compile per
  shape: what a user without dynamic shapes gets).

    python3 benchmarks/compile_probe.py --config small --sizes 192 1536
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("baseline", "single-thread-backward", "static")


def run_variant(variant: str, config: str, sizes: list[int], device: str) -> list[dict[str, Any]]:
    """In this process: compile the reference model of ``config`` as ``variant`` says and time
    one step per size (first call = compile), printing each row as it completes."""
    import torch

    sys.path.insert(0, str(ROOT))
    from benchmarks.model import CONFIGS, water_box
    from service.model.config import preset
    from service.model.potential import Potential
    from tests.model.randomized import randomized_model

    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = CONFIGS[config]() if config in CONFIGS else preset(config, ["O", "H"])
    pot = Potential(randomized_model(cfg), device=device, path="reference", capture=False)
    sync = torch.cuda.synchronize if pot.device.type == "cuda" else (lambda: None)
    eager_model = pot.model
    rows = []
    for n in sizes:
        if variant == "static":
            torch._dynamo.reset()
        if variant == "static" or n == sizes[0]:
            pot.model = torch.compile(eager_model, dynamic=variant != "static")  # type: ignore[assignment]
        structures = water_box(n)
        threads = variant != "single-thread-backward"
        with torch.autograd.set_multithreading_enabled(threads):
            t0 = time.perf_counter()
            pot.predict(structures, ("energy", "forces"))
            sync()
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in range(3):
                pot.predict(structures, ("energy", "forces"))
            sync()
            step_ms = (time.perf_counter() - t0) / 3 * 1e3
        row = {"n_atoms": n, "first_call_s": first, "ms_per_step": step_ms}
        print("ROW " + json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="small", help="a benchmark config or a preset")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sizes", type=int, nargs="+", default=[192, 1536])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--timeout-s", type=float, default=400.0)
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_variant(args.child, args.config, args.sizes, args.device)
        return
    import torch

    doc: dict[str, Any] = {
        "benchmark": "compile_probe",
        "gpu": torch.cuda.get_device_name() if args.device != "cpu" else "cpu",
        "torch": torch.__version__,
        "date": dt.datetime.now(dt.UTC).isoformat(),
        "command": " ".join(sys.argv),
        "variants": [],
    }
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"compile_probe_{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%S}.json"
    for variant in args.variants:
        cmd = [sys.executable, __file__, "--child", variant, "--config", args.config,
               "--device", args.device, "--sizes", *map(str, args.sizes)]  # fmt: skip
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
            rc, stdout, stderr = done.returncode, done.stdout, done.stderr
        except subprocess.TimeoutExpired as exc:
            rc, stdout, stderr = None, str(exc.stdout or ""), str(exc.stderr or "")
        rows = [json.loads(line[4:]) for line in stdout.splitlines() if line.startswith("ROW ")]
        result = {
            "variant": variant,
            "returncode": rc,
            "rows": rows,
            "stderr_tail": stderr.strip().splitlines()[-6:],
        }
        print(json.dumps(result), flush=True)
        doc["variants"].append(result)
        path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
