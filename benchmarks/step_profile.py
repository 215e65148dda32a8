"""Where the GPU time of one small replayed step goes: kernel families, launches, idle gaps.

For each case (default: the bar model at 192 atoms, fast tier ``fused-fp16x3`` and exact
``fused``; energy + forces; CUDA graphs as served) the step is warmed up, recorded as a CUDA
graph, timed, and one replayed step is profiled. Every CUDA kernel of that step is put into a
family (each so2kernels Triton kernel its own; ATen elementwise kernels by functor, with the
non-vectorised ``elementwise_kernel`` — broadcast or strided operands — apart from the
vectorised ones; cuBLAS GEMM/GEMV; reductions, copies, casts, fills, cats, memcpys), and the
table of families (launches, kernel ms) is printed and saved with the device span of the step
(first kernel start → last kernel end) and its idle part (span − kernel time: launch gaps).

Results go to ``benchmarks/results/step_profile_<date>.json``. ``--baseline`` (an earlier
step_profile JSON, or a ``benchmarks/model.py --profile`` one: its top-30 kernels) prints the
change per family next to the new numbers.
``--segment-programs-per-sm`` runs every case once per value given (the segment-splitting
target of the node-segment kernels, ``so2kernels.aggregate.SEGMENT_PROGRAMS_PER_SM``; 0 = never
split, one program per node), so the split is measured against the unsplit launch in one call.

    python3 benchmarks/step_profile.py \\
        --baseline benchmarks/results/model_20261130T025709.json
    python3 benchmarks/step_profile.py --segment-programs-per-sm 16 0 8 32
    python3 benchmarks/step_profile.py --cases bar:192,1536 --paths fused-fp16x3 \\
        --baseline benchmarks/results/step_profile_<earlier>.json
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import so2kernels.aggregate as aggregate_module  # noqa: E402
from benchmarks.common import write_results  # noqa: E402
from benchmarks.model import (  # noqa: E402
    CONFIGS,
    _device_us,
    parse_bench_path,
    so2kernels_kernel_names,
    water_box,
)
from service.model.captured import RECORD_AFTER  # noqa: E402
from service.model.potential import Potential  # noqa: E402
from tests.model.randomized import randomized_model  # noqa: E402

# (family, pattern) in order: the first pattern found in a kernel name names its family.
_ATEN_FAMILIES: tuple[tuple[str, str], ...] = (
    ("cublas gemv", r"gemv"),
    ("cublas gemm", r"gemm|xmma|cutlass|sm\d+_"),
    ("memcpy", r"^Memcpy|^Memset"),
    ("cat", r"CatArrayBatchedCopy"),
    ("fp16 cast", r"float16_copy|Half"),
    ("fill", r"FillFunctor"),
    ("sum/mean reduce", r"reduce_kernel.*(sum|mean)"),
    ("other reduce", r"reduce_kernel"),
    ("index/gather/scatter", r"index|scatter|gather"),
    ("addcmul", r"addcmul"),
    ("copy", r"copy"),
    ("mul scalar", r"AUnaryFunctor.*Mul|BUnaryFunctor.*Mul"),
    ("mul", r"MulFunctor"),
    ("add", r"add"),
    ("sub", r"sub"),
    ("div", r"Div"),
)


def kernel_family(name: str, triton_kernels: frozenset[str]) -> str:
    """The family of one CUDA kernel name (see the module docstring)."""
    if name in triton_kernels:
        return f"so2kernels {name}"
    for family, pattern in _ATEN_FAMILIES:
        if re.search(pattern, name):
            if family in ("cublas gemm", "cublas gemv", "memcpy"):
                return family
            strided = name.startswith("void at::native::elementwise_kernel")
            return f"aten {family}" + (" (strided/broadcast)" if strided else "")
    # Other ATen kernels by the functor or kernel they instantiate (elementwise kernels name
    # the operation only in their template arguments).
    inner = re.findall(r"at::native::(?:\(anonymous namespace\)::)?(\w+)", name.partition("<")[2])
    named = [n for n in inner if n.endswith(("Functor", "_kernel_cuda", "_kernel"))]
    plain = re.sub(r"[<(].*", "", name.removeprefix("void "))[:60]
    return "other " + (named[0] if named else plain)


def _replayed_step(pot: Potential, structures: Any, props: tuple[str, ...]) -> None:
    pot.predict(structures, props)  # compile, autotune
    for _ in range(RECORD_AFTER):  # small shapes are recorded as a CUDA graph on a later hit
        pot.predict(structures, props)
    torch.cuda.synchronize()


def _median_ms(pot: Potential, structures: Any, props: tuple[str, ...], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        pot.predict(structures, props)
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1000.0)
    return float(statistics.median(samples))


def profile_families(
    pot: Potential, structures: Any, props: tuple[str, ...]
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """One profiled step → (families sorted by time, span summary)."""
    from torch.autograd import DeviceType  # type: ignore[attr-defined]
    from torch.profiler import ProfilerActivity, profile

    triton_kernels = so2kernels_kernel_names()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        pot.predict(structures, props)
        torch.cuda.synchronize()
    count: collections.Counter[str] = collections.Counter()
    ms: dict[str, float] = collections.defaultdict(float)
    starts, ends = [], []
    for evt in prof.events():
        if evt.device_type != DeviceType.CUDA:
            continue
        family = kernel_family(evt.name, triton_kernels)
        count[family] += 1
        ms[family] += _device_us(evt, True) / 1e3
        starts.append(evt.time_range.start)
        ends.append(evt.time_range.end)
    families = [
        {"family": f, "launches": count[f], "ms": ms[f], "us_per_launch": 1e3 * ms[f] / count[f]}
        for f in sorted(count, key=lambda f: -ms[f])
    ]
    kernel_ms = sum(ms.values())
    span_ms = (max(ends) - min(starts)) / 1e3 if starts else 0.0
    summary = {
        "kernel_ms": kernel_ms,
        "launches": float(sum(count.values())),
        "device_span_ms": span_ms,
        "idle_ms": span_ms - kernel_ms,
    }
    return families, summary


def run_case(cfg_name: str, n_atoms: int, path: str, repeats: int) -> dict[str, Any]:
    value_path, precision, eager = parse_bench_path(path)
    props = ("energy", "forces")
    pot = Potential(
        randomized_model(CONFIGS[cfg_name]()), device="cuda", path=value_path,
        precision=precision, memory="fast", capture=False if eager else None,
    )  # fmt: skip
    structures = water_box(n_atoms)
    try:
        _replayed_step(pot, structures, props)
        step_ms = _median_ms(pot, structures, props, repeats)
        families, summary = profile_families(pot, structures, props)
    finally:
        pot.model = pot.model.cpu()
        torch.cuda.empty_cache()
    return {
        "config": cfg_name,
        "n_atoms": int(structures.n_atoms),
        "path": path,
        "precision": precision,
        "ms_per_step": step_ms,
        **summary,
        "families": families,
    }


def _baseline_families(path: Path | None) -> dict[tuple[str, int, str], dict[str, Any]]:
    """``(config, n_atoms, path)`` → {family: row} of an earlier step_profile JSON, or of a
    ``benchmarks/model.py --profile`` JSON (its top-30 kernels only: the rest reads as 0)."""
    if path is None:
        return {}
    baseline: dict[tuple[str, int, str], dict[str, Any]] = {}
    triton_kernels = so2kernels_kernel_names()
    for r in json.loads(path.read_text())["rows"]:
        if "families" in r:
            families = {f["family"]: f for f in r["families"]}
        elif "top_kernels" in r.get("profile", {}):
            families = collections.defaultdict(lambda: {"launches": 0, "ms": 0.0})
            for k in r["profile"]["top_kernels"]:
                family = families[kernel_family(k["name"], triton_kernels)]
                family["launches"] += k["count"]
                family["ms"] += k["ms"]
        else:
            continue
        baseline[(r["config"], r["n_atoms"], r["path"])] = dict(families)
    return baseline


def print_row(row: dict[str, Any], before: dict[str, Any] | None) -> None:
    print(
        f"\n== {row['config']} {row['n_atoms']} atoms {row['path']}: {row['ms_per_step']:.2f} ms"
        f"/step (host included), kernels {row['kernel_ms']:.3f} ms in {int(row['launches'])} "
        f"launches, device span {row['device_span_ms']:.3f} ms (idle {row['idle_ms']:.3f} ms)"
    )
    print(
        f"{'launches':>8} {'ms':>8} {'µs/launch':>9}  family"
        + ("   [Δ launches, Δ ms]" * bool(before))
    )
    families = {f["family"]: f for f in row["families"]}
    earlier = before or {}

    def larger_ms(name: str) -> float:
        now, then = families.get(name, {"ms": 0.0}), earlier.get(name, {"ms": 0.0})
        return float(max(now["ms"], then["ms"]))

    for name in sorted({*families, *earlier}, key=lambda f: -larger_ms(f)):
        f = families.get(name, {"launches": 0, "ms": 0.0, "us_per_launch": 0.0})
        line = f"{f['launches']:8d} {f['ms']:8.3f} {f['us_per_launch']:9.2f}  {name}"
        if before is not None:
            b = before.get(name, {"launches": 0, "ms": 0.0})
            line += f"   [{f['launches'] - b['launches']:+d}, {f['ms'] - b['ms']:+.3f}]"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=["bar:192"], help="config:size,size")
    parser.add_argument("--paths", nargs="+", default=["fused-fp16x3", "fused"])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--baseline", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument(
        "--segment-programs-per-sm", type=int, nargs="+",
        default=[aggregate_module.SEGMENT_PROGRAMS_PER_SM],
    )  # fmt: skip
    args = parser.parse_args()
    baseline = _baseline_families(args.baseline)
    rows: list[dict[str, Any]] = []
    out_file: Path | None = None
    for case in args.cases:
        cfg_name, sizes = case.split(":")
        for n_atoms in (int(s) for s in sizes.split(",")):
            for path in args.paths:
                for per_sm in args.segment_programs_per_sm:
                    aggregate_module.SEGMENT_PROGRAMS_PER_SM = per_sm
                    row = run_case(cfg_name, n_atoms, path, args.repeats)
                    row["segment_programs_per_sm"] = per_sm
                    print(f"\n[segment parts target: {per_sm} programs per SM]", end="")
                    print_row(row, baseline.get((cfg_name, row["n_atoms"], path)))
                    rows.append(row)
                    out_file = write_results(args.out, "step_profile", rows, out_file)


if __name__ == "__main__":
    main()
