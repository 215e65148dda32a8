"""GPU benchmark of so2_attention_aggregate: fused vs eager reference vs torch.compile(reference).

At the bar shape (C_wide 128, lmax 2, F 1, G 1) for E = 1,051,392 (64 edges per node) and
E = 17,064 (192 nodes): forward, forward+backward and backward-alone times (median of CUDA-event
timings), effective HBM bandwidth of the fused backward against a minimal-traffic model, peak
memory above the inputs, the fused backward at every launch shape of ``BWD_SWEEP_TILES``, and
the fused error against float64 on sampled nodes (outputs and the three gradients). Writes one
JSON under benchmarks/results/. About a minute on an H200, most of it compilation.

    python benchmarks/kernels_aggregate.py
    python benchmarks/kernels_aggregate.py --sizes 1051392:16428 --no-compile
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.ceilings import H200_HBM_GBPS
from benchmarks.common import peak_mb, time_ms, write_results
from so2kernels._layout import n_coeff, n_reduced
from so2kernels.aggregate import (
    BwdTiles,
    attention_aggregate,
    attention_aggregate_backward_reference,
    attention_aggregate_reference,
    launch_aggregate_bwd,
)
from so2kernels.segment import segment_of_position

BWD_SWEEP_TILES = (
    BwdTiles(2, 2, 3),
    BwdTiles(4, 4, 1),
    BwdTiles(4, 4, 3),
    BwdTiles(8, 4, 3),
    BwdTiles(8, 8, 3),
    BwdTiles(16, 8, 3),
)
"""Launch shapes (block_e, num_warps, col_stages) of the edge-parallel backward timed at every
size; (4, 4, 3) is the default at 128 lanes, (4, 4, 1) the same without pipelined gathers."""

PREVIOUS_NODE_CENTRIC_BWD_MS = {
    "note": "node-centric backward (one program per node) in the bar model step profile, "
    "H200, torch 2.11, Triton 3.6, before this kernel",
    "1.09M_edges_12288_atoms": 19.7,
    "17k_edges_192_atoms": 0.68,
}

Operands = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def make_operands(
    n_edge: int, n_node: int, c_wide: int, lmax: int, n_focus: int, n_groups: int
) -> Operands:
    """``(x_local, wigner, weights, dst_rowptr)`` with uniformly random destinations (a
    Poisson-like degree spread around E/N) and edges sorted by destination."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    dim, focus_dim = n_coeff(lmax), c_wide // n_focus
    x_local = torch.randn(
        n_edge, n_focus, n_reduced(lmax) * focus_dim, device="cuda", generator=gen
    )
    wigner = torch.randn(n_edge, dim, dim, device="cuda", generator=gen) * 0.5
    weights = torch.rand(n_edge, n_groups, device="cuda", generator=gen)
    dst = torch.randint(0, n_node, (n_edge,), device="cuda", generator=gen)
    rowptr = torch.zeros(n_node + 1, dtype=torch.int64, device="cuda")
    rowptr[1:] = torch.cumsum(torch.bincount(dst, minlength=n_node), 0)
    return x_local, wigner, weights, rowptr


def bwd_traffic_bytes(ops: Operands, lmax: int) -> int:
    """Minimal HBM bytes of the fused backward: x_local read and grad x_local written once,
    the structural Wigner entries read, the whole grad wigner written (zero fill), weights read
    and their gradient written, dst written and read, grad_out read once."""
    x_local, wigner, weights, rowptr = ops
    n_edge = x_local.shape[0]
    dim = n_coeff(lmax)
    c_wide = x_local.shape[1] * (x_local.shape[2] // n_reduced(lmax))
    per_edge = (
        2 * x_local[0].numel() + (3 * dim - 2) + wigner[0].numel() + 2 * weights.shape[1]
    ) * 4 + 2 * 8
    return n_edge * per_edge + (rowptr.shape[0] - 1) * dim * c_wide * 4


def sampled_errors(ops: Operands, grad_out: torch.Tensor, lmax: int) -> dict[str, float]:
    """Max normwise error ``max|fused - fp64| / max|fp64|`` of the output and each gradient on
    64 random nodes plus the first and last: the sub-problem of those nodes and all their edges
    is exact for their outputs and their edges' gradients."""
    x_local, wigner, weights, rowptr = ops
    n_node = rowptr.shape[0] - 1
    gen = torch.Generator(device="cuda").manual_seed(1)
    picked = torch.randint(0, n_node, (64,), device="cuda", generator=gen).tolist()
    nodes_list = sorted({0, n_node - 1, *picked})
    bounds = rowptr.tolist()
    edges = torch.cat([torch.arange(bounds[n], bounds[n + 1]) for n in nodes_list]).cuda()
    nodes = torch.tensor(nodes_list, device="cuda")
    sub_ptr = torch.zeros(len(nodes_list) + 1, dtype=torch.int64, device="cuda")
    sub_ptr[1:] = torch.cumsum(rowptr[nodes + 1] - rowptr[nodes], 0)
    x, w, wt = (t.detach().requires_grad_() for t in (x_local, wigner, weights))
    out = attention_aggregate(x, w, wt, rowptr, lmax)
    grads = torch.autograd.grad(out, (x, w, wt), grad_out)
    rx, rw, rwt = (t.detach()[edges].double().requires_grad_() for t in (x_local, wigner, weights))
    ref = attention_aggregate_reference(rx, rw, rwt, sub_ptr, lmax)
    ref_grads = torch.autograd.grad(ref, (rx, rw, rwt), grad_out[nodes].double())
    pairs = {
        "out": (out[nodes], ref),
        "grad_x_local": (grads[0][edges], ref_grads[0]),
        "grad_wigner": (grads[1][edges], ref_grads[1]),
        "grad_weights": (grads[2][edges], ref_grads[2]),
    }
    return {
        name: float((got.detach().double() - want.detach()).abs().max() / want.abs().max())
        for name, (got, want) in pairs.items()
    }


def time_impls(
    ops: Operands, grad_out: torch.Tensor, lmax: int, args: argparse.Namespace
) -> dict[str, Any]:
    """Forward (no grad) and forward+backward (gradients of all three float operands) of the
    fused op, the eager reference and, unless --no-compile, torch.compile(reference)."""
    x, w, wt, rowptr = ops
    leaves = (x.detach().requires_grad_(), w.detach().requires_grad_(),
              wt.detach().requires_grad_())  # fmt: skip
    impls: dict[str, Callable[..., torch.Tensor]] = {
        "fused": attention_aggregate,
        "eager": attention_aggregate_reference,
    }
    if args.compile:
        impls["compiled"] = args.compiled_reference
    row: dict[str, Any] = {}
    for name, fn in impls.items():

        def forward(fn: Callable[..., torch.Tensor] = fn) -> torch.Tensor:
            return fn(*leaves, rowptr, lmax)

        def fwd_bwd(fn: Callable[..., torch.Tensor] = fn) -> None:
            torch.autograd.grad(fn(*leaves, rowptr, lmax), leaves, grad_out)

        try:
            with torch.no_grad():
                row[f"{name}_fwd_ms"] = time_ms(forward, args.warmup, args.iters)
                row[f"{name}_fwd_peak_mb"] = peak_mb(forward)
            row[f"{name}_fwdbwd_ms"] = time_ms(fwd_bwd, args.warmup, args.iters)
            row[f"{name}_fwdbwd_peak_mb"] = peak_mb(fwd_bwd)
        except torch.OutOfMemoryError as err:
            row[f"{name}_error"] = f"OOM: {str(err)[:120]}"
        except Exception as err:  # a compiler failure is a result, not a crash
            if name != "compiled":
                raise
            row[f"{name}_error"] = f"{type(err).__name__}: {str(err)[:200]}"
        torch.cuda.empty_cache()
    return row


def time_backward(
    ops: Operands, grad_out: torch.Tensor, lmax: int, args: argparse.Namespace
) -> dict[str, Any]:
    """The backward alone: the fused op (dst derivation and zero fill included), the eager
    closed form, the edges' destinations (segment_of_position) alone, and the kernel at every
    launch shape of BWD_SWEEP_TILES; plus whether two fused calls agree bitwise."""
    x, w, wt, rowptr = (t.detach() for t in ops)
    n_edge = x.shape[0]
    fused_bwd = torch.ops.so2kernels.so2_attention_aggregate_bwd

    def timed(fn: Callable[[], object]) -> float:
        return time_ms(fn, args.warmup, args.iters)

    row: dict[str, Any] = {}
    with torch.no_grad():
        row["fused_bwd_ms"] = timed(lambda: fused_bwd(grad_out, x, w, wt, rowptr, lmax))
        row["eager_bwd_ms"] = timed(
            lambda: attention_aggregate_backward_reference(grad_out, x, w, wt, rowptr, lmax)
        )
        row["dst_of_edges_ms"] = timed(lambda: segment_of_position(rowptr, n_edge))
        # Keys "BLOCK_E x num_warps x col_stages".
        sweep: dict[str, float] = {}
        for tiles in BWD_SWEEP_TILES:
            launch = partial(launch_aggregate_bwd, grad_out, x, w, wt, rowptr, lmax, tiles)
            sweep["x".join(map(str, tiles))] = timed(launch)
        row["fused_bwd_tiles_ms"] = sweep
        first = fused_bwd(grad_out, x, w, wt, rowptr, lmax)
        again = fused_bwd(grad_out, x, w, wt, rowptr, lmax)
    row["fused_bwd_bitwise_reproducible"] = all(
        torch.equal(a, b) for a, b in zip(first, again, strict=True)
    )
    row["fused_bwd_GBps"] = bwd_traffic_bytes(ops, lmax) / row["fused_bwd_ms"] / 1e6
    row["fused_bwd_fraction_of_hbm_peak"] = row["fused_bwd_GBps"] / H200_HBM_GBPS
    return row


def run_size(n_edge: int, n_node: int, args: argparse.Namespace) -> dict[str, Any]:
    c_wide, lmax, n_focus, n_groups = args.c_wide, args.lmax, args.n_focus, args.n_groups
    row: dict[str, Any] = {"n_edge": n_edge, "n_node": n_node, "c_wide": c_wide, "lmax": lmax,
                           "n_focus": n_focus, "n_groups": n_groups}  # fmt: skip
    ops = make_operands(n_edge, n_node, c_wide, lmax, n_focus, n_groups)
    grad_out = torch.randn(n_node, n_coeff(lmax), c_wide, device="cuda")
    row.update(time_impls(ops, grad_out, lmax, args))
    row.update(time_backward(ops, grad_out, lmax, args))
    for other in ("eager", "compiled"):
        for phase in ("fwd", "fwdbwd", "bwd"):
            if f"{other}_{phase}_ms" in row and f"fused_{phase}_ms" in row:
                row[f"speedup_{phase}_vs_{other}"] = (
                    row[f"{other}_{phase}_ms"] / row[f"fused_{phase}_ms"]
                )
    row["fused_max_rel_err_vs_fp64"] = sampled_errors(ops, grad_out, lmax)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--sizes", nargs="*", default=["1051392:16428", "17064:192"], help="edges:nodes"
    )
    parser.add_argument("--c-wide", type=int, default=128)
    parser.add_argument("--lmax", type=int, default=2)
    parser.add_argument("--n-focus", type=int, default=1)
    parser.add_argument("--n-groups", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    # A compiled reference past Dynamo's recompile limit must fail, not time eager code.
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    torch.backends.cudnn.allow_tf32 = False
    # One dynamic-shape compilation per autograd mode serves both sizes (keeps the run short).
    args.compiled_reference = torch.compile(attention_aggregate_reference, dynamic=True)
    rows = []
    for size in args.sizes:
        n_edge, n_node = (int(v) for v in size.split(":"))
        row = run_size(n_edge, n_node, args)
        print(json.dumps(row), flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    write_results(
        args.out,
        "kernels_aggregate",
        rows,
        previous_node_centric_bwd_ms=PREVIOUS_NODE_CENTRIC_BWD_MS,
    )


if __name__ == "__main__":
    main()
