"""The kernel grid of issue #2 in one command: every fused op vs eager vs torch.compile(reference).

Runs the per-op benchmarks, each in its own process (a CUDA OOM or a compile failure in one op
must not lose the others' rows), over the issue's grid at ``--edges`` (default 1M):

* ``so2_rotate_mix``: C_wide 128/256 × lmax 2/3 × F 1/2 × rank 1/2 (``kernels_rotate_mix.py``);
* ``so2_mixing_stack``: the DeePMD bar case plus lmax 2/3 × (F, Cf) in (1, 128), (2, 64),
  (2, 128), both precision tiers (``kernels_mixing_stack.py --cases all``);
* ``so2_attention_aggregate`` at the bar shape (``kernels_aggregate.py``).

Each op writes its own raw JSON under ``benchmarks/results/`` (time in ms per implementation,
the ratios, achieved TFLOP/s or GB/s, peak memory, error against float64); this driver prints
one summary line per op with the file it wrote and its exit status. ``--per-op-timeout`` bounds
each op (seconds), so a slow compile cannot starve the rest.

    python benchmarks/kernels.py                  # full grid with torch.compile
    python benchmarks/kernels.py --no-compile --ops rotate_mix mixing_stack
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

OP_SCRIPTS: dict[str, list[str]] = {
    "rotate_mix": ["kernels_rotate_mix.py"],
    "mixing_stack": ["kernels_mixing_stack.py", "--cases", "all"],
    "aggregate": ["kernels_aggregate.py"],
}


def op_command(op: str, edges: int, compile_reference: bool) -> list[str]:
    """The command line of one op's benchmark over its share of the grid."""
    script, *rest = OP_SCRIPTS[op]
    cmd = [sys.executable, str(HERE / script), *rest]
    if op != "aggregate":  # the aggregate benchmark fixes its graphs (1.05M and 17k edges)
        cmd += ["--edges", str(edges)]
    if not compile_reference:
        cmd.append("--no-compile")
    return cmd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ops", nargs="+", choices=list(OP_SCRIPTS), default=list(OP_SCRIPTS))
    parser.add_argument("--edges", type=int, default=1_000_000)
    parser.add_argument("--no-compile", dest="compile_reference", action="store_false")
    parser.add_argument("--per-op-timeout", type=float, default=None)
    args = parser.parse_args()
    for op in args.ops:
        cmd = op_command(op, args.edges, args.compile_reference)
        print("+", " ".join(cmd), flush=True)
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, timeout=args.per_op_timeout, check=False)
            status = f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            status = f"timed out after {args.per_op_timeout:.0f} s"
        print(f"== {op}: {status} in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
