"""GPU benchmark of so2_rotate_mix: fused vs eager reference vs torch.compile(reference).

For C_wide 128/256, lmax 2/3, F 1/2, rank 1/2 at E edges (default 1M, ~64 edges per node):
forward and forward+backward time (median of CUDA-event timings), effective GB/s of the fused
kernels against a minimal-traffic model, peak memory above the inputs, and the fused error
against a float64 reference on the first edges. Each row names the backward schedule the tile
table picked (``fused_bwd_variant``, ``fused_bwd_tiles``).

``--compare-variants`` times the backward launch alone (no basis gradient, as in force
evaluation) under every schedule in VARIANT_SCHEDULES (``bwd_<name>_ms``, with each one's
largest gradient difference from the table's pick), and repeats that comparison on a small graph
(``--small-edges``/``--small-degree``, default the 192-atom water box: 17,064 edges, 89 per
node), one more JSON row per case. It leaves torch.compile out (its compile time dominates);
the main comparison keeps it. Writes one JSON under benchmarks/results/.

    python benchmarks/kernels_rotate_mix.py                      # full grid, E = 1M
    python benchmarks/kernels_rotate_mix.py --edges 1051392 --cases 128,2,1,1 128,3,1,1 \
        --compare-variants
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.ceilings import H200_HBM_GBPS
from benchmarks.common import peak_mb, time_ms, write_results
from so2kernels._layout import SUPPORTED_FOCUS_DIMS, n_coeff, n_kernel_slots, n_reduced
from so2kernels.rotate_mix import rotate_mix, rotate_mix_reference
from so2kernels.rotate_mix_backward import launch_rotate_mix_bwd
from so2kernels.segment import csr_from_index
from so2kernels.tiles import LaunchTiles, csr_chunk, rotate_mix_tiles

VARIANT_SCHEDULES = {
    "node": LaunchTiles(block_e=1, num_warps=4, variant="node"),
    "edge": LaunchTiles(block_e=2, num_warps=4, variant="edge"),
    "csr": LaunchTiles(block_e=1, num_warps=1, variant="csr"),
    "csr_chunk32": LaunchTiles(block_e=1, num_warps=1, variant="csr", chunk=32),
    "csr_chunk256": LaunchTiles(block_e=1, num_warps=1, variant="csr", chunk=256),
}
"""Backward schedules timed by --compare-variants besides the table's pick: the node and edge
schedules as the H200 ran them before the csr schedule (node: the old fallback; edge: its best
measured tiles), and the csr schedule with its automatic chunk and two fixed ones."""

Operands = tuple[Any, ...]


def make_operands(c_wide: int, lmax: int, n_focus: int, rank: int, n_edge: int,
                  n_node: int) -> Operands:  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(0)
    dim = n_coeff(lmax)
    x = torch.randn(n_node, dim, c_wide, device="cuda", generator=gen)
    src = torch.randint(0, n_node, (n_edge,), device="cuda", generator=gen)
    order, row_ptr = csr_from_index(src, n_node)
    wigner = torch.randn(n_edge, dim, dim, device="cuda", generator=gen) * 0.5
    kc = torch.randn(n_edge, n_kernel_slots(lmax) * rank, device="cuda", generator=gen) * 0.5
    cb = torch.randn(rank, c_wide, device="cuda", generator=gen)
    return (x, src, order, row_ptr, wigner, kc, cb, lmax, n_focus, rank)


def traffic_bytes(c_wide: int, lmax: int, rank: int, n_edge: int, n_node: int) -> dict[str, int]:
    """Minimal HBM traffic: node rows once, Wigner structural rows, kernel, output (fp32)."""
    dim, red = n_coeff(lmax), n_reduced(lmax)
    structural = 3 * dim - 2
    per_edge_in = structural + n_kernel_slots(lmax) * rank
    fwd = 4 * (n_node * dim * c_wide + n_edge * (per_edge_in + red * c_wide))
    # Backward: read grad_u, x, W, kc; write grad_x, grad W (full zero-filled block), grad kc.
    bwd = 4 * (
        n_edge * (red * c_wide + per_edge_in + dim * dim + n_kernel_slots(lmax) * rank)
        + 2 * n_node * dim * c_wide
    )
    return {"fwd": fwd, "bwd": bwd}


def run_case(
    c_wide: int, lmax: int, n_focus: int, rank: int, args: argparse.Namespace
) -> dict[str, Any]:
    row: dict[str, Any] = {"c_wide": c_wide, "lmax": lmax, "n_focus": n_focus, "rank": rank,
                           "n_edge": args.edges, "n_node": args.edges // args.degree}  # fmt: skip
    focus_dim = c_wide // n_focus
    if focus_dim not in SUPPORTED_FOCUS_DIMS:
        row["skipped"] = f"focus_dim {focus_dim} outside the fused regime {SUPPORTED_FOCUS_DIMS}"
        return row
    ops = make_operands(c_wide, lmax, n_focus, rank, args.edges, row["n_node"])
    leaves = [ops[0], ops[4], ops[5], ops[6]]
    for t in leaves:
        t.requires_grad_(True)
    impls: dict[str, Callable[..., torch.Tensor]] = {
        "fused": rotate_mix,
        "eager": rotate_mix_reference,
    }
    if args.compile_reference and not args.compare_variants:
        # Each case compiles afresh: the reference's code object would otherwise hit Dynamo's
        # recompile limit after four cases and run eager under the "compiled" label.
        torch._dynamo.reset()
        impls["compiled"] = torch.compile(rotate_mix_reference, dynamic=False)
    grad_u = torch.randn(n_focus, args.edges, n_reduced(lmax) * focus_dim, device="cuda")

    for name, fn in impls.items():
        try:
            with torch.no_grad():
                row[f"{name}_fwd_ms"] = time_ms(lambda fn=fn: fn(*ops), args.warmup, args.iters)

            def fwd_bwd(fn: Callable[..., torch.Tensor] = fn) -> None:
                torch.autograd.grad(fn(*ops), leaves, grad_u)

            row[f"{name}_fwdbwd_ms"] = time_ms(fwd_bwd, args.warmup, args.iters)
            row[f"{name}_fwdbwd_peak_mb"] = peak_mb(fwd_bwd)
            if name == "fused":
                # The bar's gradients (force evaluation): x, wigner and kc, no basis gradient.
                row["fused_fwdbwd_force_ms"] = time_ms(
                    lambda fn=fn: torch.autograd.grad(fn(*ops), leaves[:3], grad_u),
                    args.warmup, args.iters,
                )  # fmt: skip
        except torch.OutOfMemoryError as err:
            row[f"{name}_error"] = f"OOM: {str(err)[:120]}"
            torch.cuda.empty_cache()
    bytes_moved = traffic_bytes(c_wide, lmax, rank, args.edges, row["n_node"])
    if "fused_fwd_ms" in row:
        row["fused_fwd_GBps"] = bytes_moved["fwd"] / row["fused_fwd_ms"] / 1e6
        bwd_ms = row["fused_fwdbwd_ms"] - row["fused_fwd_ms"]
        row["fused_bwd_GBps"] = bytes_moved["bwd"] / max(bwd_ms, 1e-6) / 1e6
        row["fused_fwd_fraction_of_hbm_peak"] = row["fused_fwd_GBps"] / H200_HBM_GBPS
    for other in ("eager", "compiled"):
        for phase in ("fwd", "fwdbwd"):
            if f"{other}_{phase}_ms" in row and f"fused_{phase}_ms" in row:
                row[f"speedup_{phase}_vs_{other}"] = (
                    row[f"{other}_{phase}_ms"] / row[f"fused_{phase}_ms"]
                )
    row["fused_max_rel_err_vs_fp64"] = fused_error(ops)
    tiles = rotate_mix_tiles("bwd", c_wide, lmax, rank, ops[0].device)
    row["fused_bwd_variant"] = tiles.variant
    row["fused_bwd_tiles"] = dataclasses.asdict(tiles)
    if args.compare_variants:
        row.update(time_variants(ops, grad_u, tiles, args))
    return row


def time_variants(
    ops: Operands, grad_u: torch.Tensor, picked: LaunchTiles, args: argparse.Namespace
) -> dict[str, Any]:
    """Backward launch alone (no basis gradient, as in force evaluation) under the table's pick
    and every VARIANT_SCHEDULES entry; each with its tiles (csr: the chunk it ran with) and its
    largest gradient difference from the pick, relative to the pick's largest entry."""
    x, src, order, row_ptr, wigner, kc, cb, lmax, n_focus, rank = ops
    n_edge = src.shape[0]
    bwd_bytes = traffic_bytes(x.shape[2], lmax, rank, n_edge, x.shape[0])["bwd"]
    operands = (x.detach(), src, order, row_ptr, wigner.detach(), kc.detach(), cb.detach(),
                lmax, n_focus, rank, False)  # fmt: skip
    out: dict[str, Any] = {}
    with torch.no_grad():
        want = launch_rotate_mix_bwd(grad_u, *operands, picked)[:3]
        for name, tiles in {"picked": picked, **VARIANT_SCHEDULES}.items():

            def launch(tiles: LaunchTiles = tiles) -> object:
                return launch_rotate_mix_bwd(grad_u, *operands, tiles)

            try:
                out[f"bwd_{name}_ms"] = time_ms(launch, args.warmup, args.iters)
                out[f"bwd_{name}_GBps"] = bwd_bytes / out[f"bwd_{name}_ms"] / 1e6
            except torch.OutOfMemoryError as err:
                out[f"bwd_{name}_error"] = f"OOM: {str(err)[:120]}"
                torch.cuda.empty_cache()
                continue
            chunk = csr_chunk(n_edge, tiles) if tiles.variant == "csr" else None
            out[f"bwd_{name}_tiles"] = {**dataclasses.asdict(tiles), "chunk": chunk}
            got = launch_rotate_mix_bwd(grad_u, *operands, tiles)[:3]
            out[f"bwd_{name}_max_rel_diff"] = max(
                float((g - w).abs().max() / w.abs().max().clamp_min(1e-30))
                for g, w in zip(got, want, strict=True)
            )
            del got
    return out


def run_small_graph(
    c_wide: int, lmax: int, n_focus: int, rank: int, args: argparse.Namespace
) -> dict[str, Any]:
    """The variant comparison alone on the small graph: few nodes, so the node schedule has few
    programs; this is where the csr schedule's E-proportional parallelism shows."""
    n_edge, n_node = args.small_edges, args.small_edges // args.small_degree
    row: dict[str, Any] = {"c_wide": c_wide, "lmax": lmax, "n_focus": n_focus, "rank": rank,
                           "n_edge": n_edge, "n_node": n_node, "graph": "small"}  # fmt: skip
    ops = make_operands(c_wide, lmax, n_focus, rank, n_edge, n_node)
    grad_u = torch.randn(n_focus, n_edge, n_reduced(lmax) * (c_wide // n_focus), device="cuda")
    picked = rotate_mix_tiles("bwd", c_wide, lmax, rank, ops[0].device)
    row["fused_bwd_variant"] = picked.variant
    return {**row, **time_variants(ops, grad_u, picked, args)}


def fused_error(ops: Operands, n_check: int = 20_000) -> float:
    """Normwise error of the fused forward against float64 on the first n_check edges."""
    x, src, _, _, wigner, kc, cb, lmax, n_focus, rank = ops
    sub_src = src[:n_check]
    order, row_ptr = csr_from_index(sub_src, x.shape[0])
    with torch.no_grad():
        got = rotate_mix(x, sub_src, order, row_ptr, wigner[:n_check], kc[:n_check], cb, lmax,
                         n_focus, rank)  # fmt: skip
        want = rotate_mix_reference(
            x.double(), sub_src, order, row_ptr, wigner[:n_check].double(),
            kc[:n_check].double(), cb.double(), lmax, n_focus, rank,
        )  # fmt: skip
    return float((got.double() - want).abs().max() / want.abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--edges", type=int, default=1_000_000)
    parser.add_argument("--degree", type=int, default=64, help="edges per node")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument(
        "--cases", nargs="*", default=None, help="c_wide,lmax,n_focus,rank (default: full grid)"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument(
        "--compare-variants",
        action="store_true",
        help="time the backward launch under every schedule, also on the small graph "
        "(leaves torch.compile out)",
    )
    parser.add_argument("--no-compile", dest="compile_reference", action="store_false")
    parser.add_argument("--small-edges", type=int, default=17_064, help="0: no small graph")
    parser.add_argument("--small-degree", type=int, default=89)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    # A compiled reference past Dynamo's recompile limit must fail, not time eager code.
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    torch.backends.cudnn.allow_tf32 = False
    if args.cases:
        cases = [tuple(int(v) for v in c.split(",")) for c in args.cases]
    else:
        cases = [(cw, lmax, f, r) for cw in (128, 256) for lmax in (2, 3) for f in (1, 2)
                 for r in (1, 2)]  # fmt: skip
    rows: list[dict[str, Any]] = []
    path: Path | None = None
    for c_wide, lmax, n_focus, rank in cases:
        case_rows = [run_case(c_wide, lmax, n_focus, rank, args)]
        torch.cuda.empty_cache()
        if args.compare_variants and args.small_edges > 0:
            case_rows.append(run_small_graph(c_wide, lmax, n_focus, rank, args))
        for row in case_rows:
            print(json.dumps(row), flush=True)
        rows.extend(case_rows)
        path = write_results(args.out, "rotate_mix", rows, path=path)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
