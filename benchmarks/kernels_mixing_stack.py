"""GPU benchmark of ``so2_mixing_stack``: fused exact / fused fast vs eager and compiled reference.

Usage (on the GPU machine, from the repository root)::

    python benchmarks/kernels_mixing_stack.py                 # bar case + the C_wide/lmax/F grid
    python benchmarks/kernels_mixing_stack.py --cases bar     # DeePMD bar case only
    python benchmarks/kernels_mixing_stack.py --sweep         # tune tiles, write table, bench
    python benchmarks/kernels_mixing_stack.py --cases bar --no-compile --profile  # + ms per kernel

Per case and implementation: forward and forward+backward (the force path: gradients of u0 and
alpha) in ms (``triton.testing.do_bench`` median), achieved TFLOP/s, peak memory, and the
normwise relative error of ``x_local`` and ``grad_u0`` against float64 on sampled edges (the
stack acts on every edge independently, so a float64 reference on sampled edges is exact
ground truth). ``--profile`` adds, per fused tier, the GPU time of every kernel in one
forward+backward step (``kernels_ms``). Results go to
``benchmarks/results/kernels_mixing_stack_<date>.json``.

``--sweep`` times candidate launch tiles per kernel family (``fwd``, ``gate``, ``gbwd``, ``bwd``,
and for fp16x3 ``fbwd``) and precision, keeps only candidates whose outputs are finite and
within tolerance of float64 (some pipelined fp16 configurations are known to miscompile into NaN
rows), and writes the winners to ``so2kernels/tables/mixing_stack_<gpu>.json`` (under a Triton
release other than the one that table was swept with: to that release's overlay,
``mixing_stack_<gpu>.triton-<major.minor>.json``, whose entries override the base table's).
Re-run it after any kernel edit.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import sys
import tempfile
from collections.abc import Callable
from dataclasses import astuple, dataclass
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.ceilings import (
    FP16X3_PRODUCTS,
    H200_FP16_TENSOR_TFLOPS,
    H200_FP32_TFLOPS,
    H200_HBM_GBPS,
)
from so2kernels import mixing_stack_kernels as kernels
from so2kernels.mixing_stack import mixing_stack_reference, so2_mixing_stack
from so2kernels.mixing_stack_fast import normwise_rel_error
from so2kernels.mixing_stack_kernels import StackPrecision, TileConfig, table_key

RESULTS = Path(__file__).resolve().parent / "results"
BAR_EDGES = 1_051_392
BAR_MS = {"fwd": 65.6, "fwd_bwd": 141.0}
FAST_TARGET_MS = 47.0
FAST_TARGET_REL_ERR = 2e-6


@dataclass(frozen=True)
class Case:
    name: str
    lmax: int
    focus_dim: int
    n_focus: int
    n_edge: int
    n_layers: int = 3

    @property
    def widths(self) -> tuple[int, int, int]:
        return (
            (self.lmax + 1) * self.focus_dim,
            2 * self.lmax * self.focus_dim,
            self.lmax * self.focus_dim,
        )

    def flops(self) -> tuple[float, float]:
        """(forward, forward+backward) FLOPs of the GEMMs (force path: no weight gradients)."""
        m0, m1, gate = self.widths
        per_edge = 2.0 * self.n_focus * self.n_edge
        block = per_edge * (m0 * m0 + m1 * m1)
        gate_proj = per_edge * self.focus_dim * gate
        n_gated = self.n_layers - 1
        fwd = self.n_layers * block + n_gated * gate_proj
        bwd = self.n_layers * block + n_gated * 2 * gate_proj
        return fwd, fwd + bwd

    def min_bytes(self) -> tuple[float, float]:
        """(forward, forward+backward) bytes a step cannot avoid moving (force path): the
        forward reads u0 and writes x_local, z_all and u_final; the backward reads the
        cotangent, x_local (for grad alpha), z_all and u_final and writes grad u0."""
        m0, m1, _ = self.widths
        plane = 4.0 * self.n_focus * self.n_edge * (m0 + m1)
        fwd = (self.n_layers + 2) * plane
        return fwd, fwd + (self.n_layers + 3) * plane


def ceiling_rates(case: Case, implementation: str, result: dict[str, object]) -> dict[str, float]:
    """Achieved GB/s against the minimal traffic of :meth:`Case.min_bytes`, and the achieved
    TFLOP/s and GB/s as fractions of the H200's ceilings (the fast tier's compute ceiling is the
    fp16 tensor rate over its three products; every other implementation's is fp32 FMA)."""
    compute = (
        H200_FP16_TENSOR_TFLOPS / FP16X3_PRODUCTS
        if implementation == "fused_fast"
        else H200_FP32_TFLOPS
    )
    rates: dict[str, float] = {}
    for mode, moved in zip(("fwd", "fwd_bwd"), case.min_bytes(), strict=True):
        ms, tflops = result.get(f"{mode}_ms"), result.get(f"{mode}_tflops")
        if isinstance(ms, float) and isinstance(tflops, float):
            rates[f"{mode}_GBps"] = moved / ms / 1e6
            rates[f"{mode}_fraction_of_hbm_peak"] = rates[f"{mode}_GBps"] / H200_HBM_GBPS
            rates[f"{mode}_fraction_of_compute_peak"] = tflops / compute
    return rates


def all_cases(which: str, n_edge: int) -> list[Case]:
    bar = Case("bar_deepmd", 2, 128, 1, BAR_EDGES)
    if which == "bar":
        return [bar]
    if which == "served":  # the bar and the shipped default model's stack (Cf 64, lmax 2, F 2)
        return [bar, Case("default_cf64_l2_f2", 2, 64, 2, n_edge, n_layers=2)]
    grid = [
        Case(f"cw{n_focus * cf}_l{lmax}_f{n_focus}", lmax, cf, n_focus, n_edge)
        for lmax in (2, 3)
        for n_focus, cf in ((1, 128), (2, 64), (2, 128))
    ]
    return [bar, *grid]


def make_operands(case: Case, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    m0, m1, gate = case.widths
    f, e, n = case.n_focus, case.n_edge, case.n_layers
    u0 = torch.randn(f, e, m0 + m1, device="cuda", generator=gen)
    logits = torch.randn(e, f, device="cuda", generator=gen)
    alpha = 0.98 * torch.softmax(logits, dim=1) + 0.02 / f
    w0 = torch.randn(n, f, m0, m0, device="cuda", generator=gen) / math.sqrt(m0)
    w1 = torch.randn(n, f, m1, m1, device="cuda", generator=gen) / math.sqrt(m1)
    gw = torch.randn(n - 1, f, case.focus_dim, gate, device="cuda", generator=gen)
    return [u0, alpha, w0, w1, gw / math.sqrt(case.focus_dim)]


StackFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def implementations(case: Case, with_compile: bool) -> dict[str, StackFn]:
    def fused(precision: str) -> StackFn:
        def run(*ops: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return so2_mixing_stack(*ops, case.lmax, case.focus_dim, True, precision)

        return run

    def reference(*ops: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return mixing_stack_reference(*ops, case.lmax, case.focus_dim, True)

    impls: dict[str, StackFn] = {
        "fused_exact": fused("ieee"),
        "fused_fast": fused("fp16x3"),
        "eager_reference": reference,
    }
    if with_compile:
        # Each case compiles afresh: the reference's code object would otherwise hit Dynamo's
        # recompile limit after four cases and run eager under the "compiled" label.
        torch._dynamo.reset()
        impls["compiled_reference"] = torch.compile(reference, dynamic=False)
    return impls


def sampled_errors(
    case: Case, ops: list[torch.Tensor], x_local: torch.Tensor, grad_u0: torch.Tensor,
    grad_out: torch.Tensor,
) -> dict[str, float]:  # fmt: skip
    """Normwise relative error vs float64 on the first, last and 2048 random edges."""
    e = case.n_edge
    edges = torch.cat(
        [torch.arange(0, 256), torch.randint(0, e, (2048,)), torch.arange(e - 256, e)]
    ).cuda()
    u0 = ops[0][:, edges].double().requires_grad_()
    alpha = ops[1][edges].double()
    ref = mixing_stack_reference(
        u0, alpha, *(t.double() for t in ops[2:]), case.lmax, case.focus_dim, True
    )[0]
    (ref_grad,) = torch.autograd.grad(ref, u0, grad_out[edges].double())
    return {
        "rel_err_x_local": normwise_rel_error(x_local[edges], ref.detach()),
        "rel_err_grad_u0": normwise_rel_error(grad_u0[:, edges], ref_grad),
        "non_finite": bool(not torch.isfinite(x_local).all() or not torch.isfinite(grad_u0).all()),
    }


def kernel_profile(case: Case, fn: StackFn, ops: list[torch.Tensor]) -> dict[str, float]:
    """GPU time per kernel name (ms, summed over its launches) of one forward+backward step."""
    u0 = ops[0].detach().requires_grad_()
    alpha = ops[1].detach().requires_grad_()
    grad_out = torch.randn(case.n_edge, case.n_focus, ops[0].shape[2], device="cuda")

    def step() -> None:
        x_local = fn(u0, alpha, *ops[2:])[0]
        torch.autograd.grad(x_local, (u0, alpha), grad_out)

    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_time_total > 0:
            name = event.key[:80]
            times[name] = times.get(name, 0.0) + event.device_time_total / 1000
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def bench_impl(case: Case, fn: StackFn, ops: list[torch.Tensor]) -> dict[str, object]:
    """Times and memory of one implementation; ``{"error": ...}`` on OOM or failure."""
    u0 = ops[0].detach().requires_grad_()
    alpha = ops[1].detach().requires_grad_()
    weights = [t.detach() for t in ops[2:]]
    grad_out = torch.randn(case.n_edge, case.n_focus, ops[0].shape[2], device="cuda")

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return fn(u0, alpha, *weights)[0]

    def forward_backward() -> tuple[torch.Tensor, ...]:
        x_local = fn(u0, alpha, *weights)[0]
        return torch.autograd.grad(x_local, (u0, alpha), grad_out)

    row: dict[str, object] = {}
    try:
        for mode, step in (("fwd", forward), ("fwd_bwd", forward_backward)):
            step()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            row[f"{mode}_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
            row[f"{mode}_ms"] = do_bench(step, warmup=3, rep=20)
        x_local = fn(u0, alpha, *weights)[0]
        (grad_u0,) = torch.autograd.grad(x_local, u0, grad_out)
        row.update(sampled_errors(case, ops, x_local.detach(), grad_u0, grad_out))
    except torch.cuda.OutOfMemoryError as exc:
        row["error"] = f"OOM: {str(exc).splitlines()[0]}"
    except Exception as exc:  # a failing implementation is a result, not a crash of the run
        row["error"] = f"{type(exc).__name__}: {exc}"
    torch.cuda.empty_cache()
    fwd_flops, total_flops = case.flops()
    if "fwd_ms" in row:
        row["fwd_tflops"] = fwd_flops / (float(row["fwd_ms"]) * 1e-3) / 1e12  # type: ignore[arg-type]
    if "fwd_bwd_ms" in row:
        row["fwd_bwd_tflops"] = total_flops / (float(row["fwd_bwd_ms"]) * 1e-3) / 1e12  # type: ignore[arg-type]
    return row


# Tile sweep


# Candidates per tier. The exact list keeps the default and the three tiles within 2 % of the
# best in the first full exact sweep on the H200 (tile_sweeps_partial_h200_2026-11-29.json: every
# exact tile lay within 16-19 ms there). The fp16x3 list holds the per-kernel winners of the
# 2026-11-30 bar-case microbenchmark (64x128x32/4w/3s: forward and final-layer backward GEMMs;
# 64x64x32/4w/3s: gate kernels; 128x128x64/8w/3s: split-operand backward GEMMs) and the tiles
# within ~10 % of them. The fast tier's block GEMMs load their operands through tensor
# descriptors: a candidate whose stages overflow shared memory (128x128x64 with 4 stages) fails
# to compile and is skipped like any failing candidate.
_EXACT_CANDIDATES = [
    TileConfig(64, 64, 32, 4, 2), TileConfig(64, 64, 16, 4, 3), TileConfig(64, 64, 32, 4, 3),
    TileConfig(64, 128, 32, 4, 2),
]  # fmt: skip
_FAST_CANDIDATES = [
    TileConfig(64, 128, 32, 4, 3), TileConfig(64, 64, 32, 4, 3), TileConfig(128, 128, 64, 8, 3),
    TileConfig(128, 128, 32, 8, 3), TileConfig(128, 128, 64, 8, 4), TileConfig(64, 128, 64, 4, 3),
]  # fmt: skip
# The gate-row backward moves the most bytes per gate GEMM; at the bar case 32-edge tiles ran it
# 5 % faster than 64 (gate_kernels_probe_20261130T145604Z.json), the other gate kernels slower.
_GATE_BWD_CANDIDATES = [TileConfig(64, 64, 32, 4, 3), TileConfig(32, 64, 32, 4, 3)]
_KINDS = {
    StackPrecision.EXACT: ("fwd", "gate", "gbwd", "bwd"),
    StackPrecision.FAST: ("fwd", "gate", "gbwd", "bwd", "fbwd"),
}
"""Kernel families per tier (see ``so2kernels.mixing_stack_kernels.table_key``)."""


def _candidates(
    kind: str,
    tier_candidates: list[TileConfig],
    table: dict[str, list[int]],
    focus_dim: int,
    lmax: int,
    precision: StackPrecision,
) -> list[TileConfig]:
    """Tiles to try for ``kind``; the gate-row backward also tries the tile it runs today (the
    ``gate`` entry standing in), so a sweep never makes it slower."""
    if kind != "gbwd":
        return tier_candidates
    stand_in = table.get(table_key("gate", focus_dim, lmax, precision))
    extra = [TileConfig(*stand_in)] if stand_in is not None else []
    return list(dict.fromkeys([*_GATE_BWD_CANDIDATES, *extra]))


def _write_table(path: Path, configs: dict[str, list[int]], meta: dict[str, object]) -> None:
    path.write_text(json.dumps({"meta": meta, "configs": configs}, indent=1, sort_keys=True))
    kernels._load_table.cache_clear()


def _timed_if_valid(
    case: Case, precision: StackPrecision, ops: list[torch.Tensor], backward: bool
) -> float | None:
    """ms of the stack (fwd, or fwd+bwd) under the current table, or None if invalid/failing."""
    tol = 4 * FAST_TARGET_REL_ERR if precision is StackPrecision.FAST else 2e-6
    u0 = ops[0].detach().requires_grad_(backward)
    alpha, weights = ops[1], ops[2:]
    grad_out = torch.randn(case.n_edge, case.n_focus, ops[0].shape[2], device="cuda")

    def step() -> tuple[torch.Tensor, ...]:
        x_local = so2_mixing_stack(u0, alpha, *weights, case.lmax, case.focus_dim, True, precision)[
            0
        ]
        return (x_local, *torch.autograd.grad(x_local, u0, grad_out)) if backward else (x_local,)

    try:
        outputs = step()
        torch.cuda.synchronize()
    except Exception as exc:  # a launch config that fails to compile is simply not a candidate
        print(f"    failed: {type(exc).__name__}: {exc}", flush=True)
        return None
    x_local = outputs[0].detach()
    grad_u0 = outputs[1] if backward else torch.zeros_like(ops[0])
    err = sampled_errors(case, ops, x_local, grad_u0, grad_out)
    if err["non_finite"] or err["rel_err_x_local"] > tol:
        return None
    if backward and err["rel_err_grad_u0"] > 2 * tol:
        return None
    return float(do_bench(step, warmup=2, rep=10))


def sweep(
    cases: list[Case],
    n_edge: int,
    meta: dict[str, object],
    precisions: list[StackPrecision],
    skip_tuned: bool = False,
) -> Path:
    """Pick per (kind, Cf, lmax, precision) the fastest validated tile; write the GPU's table.

    Kinds are tuned in order (block GEMMs by the forward time; the gate GEMMs, which the
    backward launches too, and the backward by the fwd+bwd time), each with the winners so far
    in place. Entries of tiers not swept this time are kept from the existing table;
    ``skip_tuned`` also leaves alone every shape whose entries of the swept tiers all exist in
    the file this sweep writes (under another release: its overlay, not the base it inherits).

    Under the Triton release the base table was swept with (or with no base table yet) the
    winners go into the base table; under another release they go into that release's overlay,
    which holds only the entries swept under it (the rest stay the base's).
    """
    out_path, kept = _sweep_target(torch.cuda.get_device_name())
    table = dict(kernels._load_table(torch.cuda.get_device_name()))
    swept: set[str] = set()
    swept_meta = {**meta, "sweep_edges": n_edge}
    scratch = Path(tempfile.mkdtemp()) / "table.json"
    os.environ["SO2_STACK_TABLE"] = str(scratch)
    # The table key has no focus count: one sweep per (lmax, Cf), at the fewest focus streams
    # (the bar's F = 1), so an F = 2 case cannot overwrite the entry tuned for F = 1.
    fewest: dict[tuple[int, int], int] = {}
    for c in cases:
        shape = (c.lmax, c.focus_dim)
        fewest[shape] = min(fewest.get(shape, c.n_focus), c.n_focus)
    shapes = sorted((lmax, focus_dim, n_focus) for (lmax, focus_dim), n_focus in fewest.items())
    if skip_tuned:
        shapes = _untuned(shapes, set(table) if kept is None else kept, precisions)
    for lmax, focus_dim, n_focus in shapes:
        case = Case(f"sweep_l{lmax}_cf{focus_dim}", lmax, focus_dim, n_focus, n_edge)
        ops = make_operands(case, seed=1)
        for precision in precisions:
            tier_candidates = (
                _FAST_CANDIDATES if precision is StackPrecision.FAST else _EXACT_CANDIDATES
            )
            for kind in _KINDS[precision]:
                key = table_key(kind, focus_dim, lmax, precision)
                best: tuple[float, TileConfig] | None = None
                for cfg in _candidates(kind, tier_candidates, table, focus_dim, lmax, precision):
                    _write_table(scratch, {**table, key: list(astuple(cfg))}, meta)
                    ms = _timed_if_valid(case, precision, ops, backward=kind != "fwd")
                    print(f"  sweep {key} {cfg}: {ms} ms", flush=True)
                    if ms is not None and (best is None or ms < best[0]):
                        best = (ms, cfg)
                if best is not None:
                    table[key] = list(astuple(best[1]))
                    swept.add(key)
                # Written after every kind: a time-boxed sweep keeps the kinds it finished.
                _write_table(out_path, _written(table, kept, swept), swept_meta)
        del ops
        torch.cuda.empty_cache()
    del os.environ["SO2_STACK_TABLE"]
    _write_table(out_path, _written(table, kept, swept), swept_meta)
    return out_path


def _untuned(
    shapes: list[tuple[int, int, int]], own: set[str], precisions: list[StackPrecision]
) -> list[tuple[int, int, int]]:
    """The (lmax, Cf, F) shapes that lack an entry in ``own`` (the keys of the file the sweep
    writes) for some kind of a swept tier."""
    return [
        (lmax, focus_dim, n_focus)
        for lmax, focus_dim, n_focus in shapes
        if not all(
            table_key(kind, focus_dim, lmax, tier) in own
            for tier in precisions
            for kind in _KINDS[tier]
        )
    ]


def _sweep_target(device_name: str) -> tuple[Path, set[str] | None]:
    """Where a sweep under the running Triton writes, and the keys that file keeps besides the
    swept ones (None: every entry, for the base table)."""
    base = kernels.stack_table_path(device_name)
    release = kernels.triton_release()
    if base.is_file():
        swept_under = str(json.loads(base.read_text())["meta"].get("triton", ""))
        if ".".join(swept_under.split(".")[:2]) != release:
            overlay = kernels.stack_overlay_path(device_name, release)
            own = json.loads(overlay.read_text())["configs"] if overlay.is_file() else {}
            return overlay, set(own)
    return base, None


def _tables_in_effect(device_name: str) -> list[str]:
    """The table files the fused tiers read their tiles from in this process."""
    forced = os.environ.get("SO2_STACK_TABLE")
    if forced:
        return [forced]
    files = (
        kernels.stack_table_path(device_name),
        kernels.stack_overlay_path(device_name, kernels.triton_release()),
    )
    return [f.name for f in files if f.is_file()]


def _written(
    table: dict[str, list[int]], kept: set[str] | None, swept: set[str]
) -> dict[str, list[int]]:
    """The entries of ``table`` that the target file holds."""
    if kept is None:
        return dict(table)
    return {key: value for key, value in table.items() if key in kept | swept}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--cases", choices=("bar", "all"), default="all")
    parser.add_argument("--edges", type=int, default=1_000_000, help="E of the grid cases")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile(reference)")
    parser.add_argument(
        "--profile", action="store_true", help="also record per-kernel ms of the fused tiers"
    )
    parser.add_argument(
        "--only", nargs="+", metavar="IMPL",
        help="time only these implementations (fused_exact, fused_fast, eager_reference, "
        "compiled_reference)",
    )  # fmt: skip
    parser.add_argument("--sweep", action="store_true", help="tune tiles first (writes the table)")
    parser.add_argument("--sweep-edges", type=int, default=262_144)
    parser.add_argument(
        "--sweep-precisions", nargs="+", default=[p.value for p in StackPrecision],
        choices=[p.value for p in StackPrecision], help="GEMM tiers to tune",
    )  # fmt: skip
    parser.add_argument(
        "--sweep-cases",
        choices=("bar", "served", "all"),
        default="served",
        help="shapes to tune: the bar case (Cf 128, lmax 2), plus the shipped default model's "
        "(Cf 64, lmax 2) with 'served', or every benchmarked shape",
    )
    parser.add_argument(
        "--sweep-skip-tuned", action="store_true",
        help="sweep only the shapes the table lacks entries for",
    )  # fmt: skip
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    # A compiled reference past Dynamo's recompile limit must fail, not time eager code.
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    torch.backends.cudnn.allow_tf32 = False

    meta: dict[str, object] = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "bar_ms": BAR_MS,
        "fast_target": {"fwd_bwd_ms": FAST_TARGET_MS, "rel_err": FAST_TARGET_REL_ERR},
    }
    cases = all_cases(args.cases, args.edges)
    meta["stack_tables"] = _tables_in_effect(torch.cuda.get_device_name())
    if args.sweep:
        tuned = all_cases(args.sweep_cases, args.sweep_edges)
        tiers = [StackPrecision.parse(p) for p in args.sweep_precisions]
        meta["table"] = str(
            sweep(tuned, args.sweep_edges, meta, tiers, skip_tuned=args.sweep_skip_tuned)
        )
    rows = []
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    path = RESULTS / f"kernels_mixing_stack_{stamp}.json"
    for case in cases:
        ops = make_operands(case)
        row: dict[str, object] = {"case": case.name, **case.__dict__}
        for name, fn in implementations(case, not args.no_compile).items():
            if args.only and name not in args.only:
                continue
            result = bench_impl(case, fn, ops)
            result.update(ceiling_rates(case, name, result))
            if args.profile and name.startswith("fused") and "error" not in result:
                result["kernels_ms"] = kernel_profile(case, fn, ops)
            row[name] = result
            print(case.name, name, json.dumps(result), flush=True)
        exact = row.get("fused_exact")
        for mode in ("fwd_ms", "fwd_bwd_ms"):
            for name in ("fused_fast", "eager_reference", "compiled_reference"):
                other = row.get(name)
                if (
                    isinstance(other, dict)
                    and mode in other
                    and isinstance(exact, dict)
                    and mode in exact
                ):
                    row[f"ratio_{name}_over_exact_{mode}"] = other[mode] / exact[mode]
        if case.name == "bar_deepmd" and isinstance(exact, dict):
            row["bar_ratio_exact"] = {m: exact.get(f"{m}_ms", math.nan) / BAR_MS[m] for m in BAR_MS}
        del ops
        torch.cuda.empty_cache()
        rows.append(row)
        # Rewritten after every case: a time-boxed run keeps the cases it finished.
        path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
