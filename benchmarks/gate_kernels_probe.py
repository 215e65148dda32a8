"""Experiment (issue #2): load order of the fast tier's gate kernels, at the bar case.

The gate kernels of the fp16x3 mixing stack (forward gate, gate-row backward, scalar-row
backward) each run a small gate GEMM (K = Cf or L·Cf) and then stream whole activation rows.
At the bar case (E = 1,051,392, lmax 2, Cf 128, F 1) they move 4.7 / 11.3 / 2.6 GB in 1.5 /
3.8 / 1.0 ms, 2.7-3.1 TB/s against the H200's 4.26 TB/s copy rate: about 2.5 ms of the
fwd+bwd's 53 ms over its two gated layers. The question: does issuing the streamed loads
before the gate GEMM (so their latency hides behind it) recover that bandwidth?

Variants, each timed against the shipped kernel on the same operands in one process and
checked for equal outputs:

* ``shipped``: ``so2kernels.mixing_stack_kernels`` as is;
* ``early``: every streamed row loaded before the GEMM and kept in registers;
* ``early_dot`` (gate backward only): the rows' ``Σ g·z`` formed before the GEMM, ``g``
  reloaded after it (an L2 hit, fewer live registers);
* ``no_gemm`` (gate backward only): the streamed part alone with a constant gate, the ceiling
  the load order can approach.

``python3 benchmarks/gate_kernels_probe.py`` → ``results/gate_kernels_probe_<stamp>.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_results
from so2kernels.mixing_stack_kernels import (
    StackPrecision,
    _focus_coords,
    _store_split,
    _tile_coords,
    _tile_matmul,
    gate_bwd_split_kernel,
    gate_fwd_kernel,
    scalar_bwd_split_kernel,
    weight_operands,
)

BAR_EDGES = 1_051_392
TILES = [(64, 64, 32, 4, 3), (64, 64, 32, 4, 2), (32, 64, 32, 4, 3), (128, 64, 32, 8, 3)]


@triton.jit
def gate_bwd_early_kernel(
    z_ptr, gw_ptr, gw_lo_ptr, g_ptr, gzs_ptr, q_ptr, n_edge, layer,
    L: tl.constexpr, FD: tl.constexpr, MODE: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """``gate_bwd_split_kernel`` (force path: no z cotangent, no recovery) with the rows loaded
    first. MODE 0: rows kept; 1: Σ g·z first, g reloaded; 2: no GEMM (gate = 0.5)."""
    GWD: tl.constexpr = L * FD
    ROW: tl.constexpr = FD + 3 * GWD
    focus, n_focus = _focus_coords()
    rows, row_mask, cols, col_mask, _pid_n = _tile_coords(n_edge, GWD, BLOCK_M, BLOCK_N)
    mask = row_mask[:, None] & col_mask[None, :]
    z_at = ((layer * n_focus + focus) * n_edge + rows) * ROW
    act_rows = (focus * n_edge + rows) * ROW
    z_tiles = z_ptr + z_at[:, None] + (cols + FD)[None, :]
    g_tiles = g_ptr + act_rows[:, None] + (cols + FD)[None, :]
    g0 = tl.load(g_tiles, mask=mask, other=0.0)
    g1 = tl.load(g_tiles + GWD, mask=mask, other=0.0)
    g2 = tl.load(g_tiles + 2 * GWD, mask=mask, other=0.0)
    dot_gz = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    dot_gz += g0 * tl.load(z_tiles, mask=mask, other=0.0)
    dot_gz += g1 * tl.load(z_tiles + GWD, mask=mask, other=0.0)
    dot_gz += g2 * tl.load(z_tiles + 2 * GWD, mask=mask, other=0.0)
    if MODE == 2:
        gate = tl.full((BLOCK_M, BLOCK_N), 0.5, tl.float32)
    else:
        g_off = (layer * n_focus + focus) * FD * GWD
        logit = _tile_matmul(
            z_ptr + z_at, row_mask, gw_ptr + g_off, gw_lo_ptr + g_off, cols, col_mask,
            FD, GWD, True, BLOCK_K, BLOCK_M, BLOCK_N,
        )  # fmt: skip
        gate = tl.sigmoid(logit)
    if MODE == 1:
        g0 = tl.load(g_tiles, mask=mask, other=0.0)
        g1 = tl.load(g_tiles + GWD, mask=mask, other=0.0)
        g2 = tl.load(g_tiles + 2 * GWD, mask=mask, other=0.0)
    tail = n_focus.to(tl.int64) * n_edge * ROW
    out = gzs_ptr + act_rows[:, None] + (cols + FD)[None, :]
    _store_split(out, tail, g0 * gate, mask)
    _store_split(out + GWD, tail, g1 * gate, mask)
    _store_split(out + 2 * GWD, tail, g2 * gate, mask)
    q_rows = q_ptr + (focus * n_edge + rows) * GWD
    tl.store(q_rows[:, None] + cols[None, :], dot_gz * gate * (1.0 - gate), mask=mask)


@triton.jit
def scalar_bwd_early_kernel(
    q_ptr, gwt_ptr, gwt_lo_ptr, z_ptr, g_ptr, gzs_ptr, n_edge, layer,
    L: tl.constexpr, FD: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """``scalar_bwd_split_kernel`` (force path) with the scalar rows loaded before the GEMM."""
    GWD: tl.constexpr = L * FD
    ROW: tl.constexpr = FD + 3 * GWD
    focus, n_focus = _focus_coords()
    rows, row_mask, cols, col_mask, _pid_n = _tile_coords(n_edge, FD, BLOCK_M, BLOCK_N)
    mask = row_mask[:, None] & col_mask[None, :]
    z_at = ((layer * n_focus + focus) * n_edge + rows)[:, None] * ROW + cols[None, :]
    act_at = ((focus * n_edge + rows) * ROW)[:, None] + cols[None, :]
    s = tl.load(z_ptr + z_at, mask=mask, other=0.0)
    g_tile = tl.load(g_ptr + act_at, mask=mask, other=0.0)
    phi = tl.sigmoid(s)
    direct = g_tile * phi * (1.0 + s * (1.0 - phi))
    q_rows = q_ptr + (focus * n_edge + rows) * GWD
    g_off = (layer * n_focus + focus) * GWD * FD
    acc = _tile_matmul(
        q_rows, row_mask, gwt_ptr + g_off, gwt_lo_ptr + g_off, cols, col_mask,
        GWD, FD, True, BLOCK_K, BLOCK_M, BLOCK_N,
    )  # fmt: skip
    _store_split(gzs_ptr + act_at, n_focus.to(tl.int64) * n_edge * ROW, direct + acc, mask)


@triton.jit
def gate_fwd_early_kernel(
    z_ptr, gw_ptr, gw_lo_ptr, res_ptr, sig_ptr, out_ptr, n_edge, layer,
    L: tl.constexpr, FD: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """``gate_fwd_kernel`` of the stack (l>=1 m=0 rows, σ stored) with its rows loaded first."""
    GWD: tl.constexpr = L * FD
    ROW: tl.constexpr = FD + 3 * GWD
    focus, n_focus = _focus_coords()
    rows, row_mask, cols, col_mask, _pid_n = _tile_coords(n_edge, GWD, BLOCK_M, BLOCK_N)
    mask = row_mask[:, None] & col_mask[None, :]
    z_rows = z_ptr + ((layer * n_focus + focus) * n_edge + rows) * ROW
    at = ((focus * n_edge + rows) * ROW)[:, None] + (cols + FD)[None, :]
    z_tile = tl.load(z_rows[:, None] + (cols + FD)[None, :], mask=mask, other=0.0)
    res = tl.load(res_ptr + at, mask=mask, other=0.0)
    g_off = (layer * n_focus + focus) * FD * GWD
    logit = _tile_matmul(
        z_rows, row_mask, gw_ptr + g_off, gw_lo_ptr + g_off, cols, col_mask,
        FD, GWD, True, BLOCK_K, BLOCK_M, BLOCK_N,
    )  # fmt: skip
    gate = tl.sigmoid(logit)
    sig_rows = sig_ptr + (focus * n_edge + rows) * GWD
    tl.store(sig_rows[:, None] + cols[None, :], gate, mask=mask)
    tl.store(out_ptr + at, res + z_tile * gate, mask=mask)


def _meta(tile: tuple[int, ...], lmax: int, focus_dim: int) -> dict[str, Any]:
    bm, bn, bk, warps, stages = tile
    return {"L": lmax, "FD": focus_dim, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
            "num_warps": warps, "num_stages": stages}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--edges", type=int, default=BAR_EDGES)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.manual_seed(0)
    lmax, fd, n_edge, n_focus, layer = 2, 128, args.edges, 1, 1
    gwd, row = lmax * fd, fd + 3 * lmax * fd
    dev = "cuda"
    z_all = torch.randn(2, n_focus, n_edge, row, device=dev)
    g = torch.randn(n_focus, n_edge, row, device=dev)
    res = torch.randn(n_focus, n_edge, row, device=dev)
    gw_all = torch.randn(2, n_focus, fd, gwd, device=dev) * 0.1
    gws = weight_operands(gw_all, StackPrecision.FAST)
    gwts = weight_operands(gw_all, StackPrecision.FAST, transposed=True)
    q = torch.randn(n_focus, n_edge, gwd, device=dev)
    rows: list[dict[str, Any]] = []
    copy_src = torch.empty(n_edge * (row + gwd) // 2, device=dev)
    copy_dst = torch.empty_like(copy_src)
    copy_ms = do_bench(lambda: copy_dst.copy_(copy_src), warmup=5, rep=50)
    copy_gbs = 2 * copy_src.numel() * 4 / copy_ms / 1e6
    print(f"copy {copy_ms:.3f} ms = {copy_gbs:.0f} GB/s", flush=True)

    def record(kernel: str, variant: str, tile: tuple[int, ...], ms: float, diff: float,
               gbytes: float) -> None:  # fmt: skip
        rows.append({"kernel": kernel, "variant": variant, "tile": list(tile), "ms": ms,
                     "max_abs_diff_vs_shipped": diff, "gb_per_s": gbytes / ms * 1e3})  # fmt: skip
        print(f"{kernel:10s} {variant:9s} {tile} {ms:.3f} ms diff {diff:.2e} "
              f"{gbytes / ms * 1e3:.0f} GB/s", flush=True)  # fmt: skip

    # Gate-row backward: reads z (3 rows + scalars) and g (3 rows), writes gz planes and q.
    gb_gate_bwd = n_edge * 4 * (3 * gwd + fd + 3 * gwd + 3 * gwd + gwd) / 1e9
    gz_ref = torch.zeros(2, n_focus, n_edge, row, device=dev, dtype=torch.float16)
    q_ref = torch.zeros(n_focus, n_edge, gwd, device=dev)
    for tile in TILES:
        meta = _meta(tile, lmax, fd)
        grid = (triton.cdiv(n_edge, tile[0]) * triton.cdiv(gwd, tile[1]), n_focus)

        def shipped(meta: dict[str, Any] = meta, grid: tuple[int, int] = grid) -> None:
            gate_bwd_split_kernel[grid](
                z_all, gws[0], gws[1], g, z_all, gz_ref, q_ref, g, g, n_edge, layer,
                HAS_GZ_UP=False, RECOVER=False, **meta,
            )  # fmt: skip

        try:
            shipped()
            ms = do_bench(shipped, warmup=5, rep=40)
        except Exception as exc:  # a tile that does not compile is not a candidate
            print(f"gate_bwd {tile} failed: {exc}", flush=True)
            continue
        record("gate_bwd", "shipped", tile, ms, 0.0, gb_gate_bwd)
        for mode, name in ((0, "early"), (1, "early_dot"), (2, "no_gemm")):
            gz = torch.zeros_like(gz_ref)
            qv = torch.zeros_like(q_ref)

            def early(
                meta: dict[str, Any] = meta,
                grid: tuple[int, int] = grid,
                mode: int = mode,
                out: tuple[torch.Tensor, ...] = (gz, qv),
            ) -> None:
                gate_bwd_early_kernel[grid](
                    z_all, gws[0], gws[1], g, *out, n_edge, layer, MODE=mode, **meta
                )

            try:
                early()
                ms = do_bench(early, warmup=5, rep=40)
            except Exception as exc:
                print(f"gate_bwd {name} {tile} failed: {exc}", flush=True)
                continue
            cols = slice(fd, row)
            diff = max(
                (gz[:, :, :, cols].float() - gz_ref[:, :, :, cols].float()).abs().max().item(),
                (qv - q_ref).abs().max().item(),
            ) if mode != 2 else float("nan")  # fmt: skip
            record("gate_bwd", name, tile, ms, diff, gb_gate_bwd)

    # Scalar-row backward: reads q, z and g scalars, writes the gz scalar planes.
    gb_scalar = n_edge * 4 * (gwd + 3 * fd) / 1e9
    for tile in TILES:
        meta = _meta(tile, lmax, fd)
        grid = (triton.cdiv(n_edge, tile[0]) * triton.cdiv(fd, tile[1]), n_focus)
        gz_a = torch.zeros_like(gz_ref)
        gz_b = torch.zeros_like(gz_ref)

        def shipped_s(meta: dict[str, Any] = meta, grid: tuple[int, int] = grid,
                      out: torch.Tensor = gz_a) -> None:  # fmt: skip
            scalar_bwd_split_kernel[grid](
                q, gwts[0], gwts[1], z_all, g, z_all, out, g, g, n_edge, layer,
                HAS_GZ_UP=False, RECOVER=False, **meta,
            )  # fmt: skip

        def early_s(meta: dict[str, Any] = meta, grid: tuple[int, int] = grid,
                    out: torch.Tensor = gz_b) -> None:  # fmt: skip
            scalar_bwd_early_kernel[grid](q, gwts[0], gwts[1], z_all, g, out, n_edge, layer, **meta)

        try:
            shipped_s()
            early_s()
            ms_a = do_bench(shipped_s, warmup=5, rep=40)
            ms_b = do_bench(early_s, warmup=5, rep=40)
        except Exception as exc:
            print(f"scalar_bwd {tile} failed: {exc}", flush=True)
            continue
        diff = (gz_a[..., :fd].float() - gz_b[..., :fd].float()).abs().max().item()
        record("scalar_bwd", "shipped", tile, ms_a, 0.0, gb_scalar)
        record("scalar_bwd", "early", tile, ms_b, diff, gb_scalar)

    # Forward gate (stack): reads z scalars, z and the residual on l>=1 m=0 rows; writes the
    # activation rows and σ.
    gb_gate_fwd = n_edge * 4 * (fd + 2 * gwd + 2 * gwd) / 1e9
    for tile in TILES:
        meta = _meta(tile, lmax, fd)
        grid = (triton.cdiv(n_edge, tile[0]) * triton.cdiv(gwd, tile[1]), n_focus)
        outs = [torch.zeros_like(g) for _ in range(2)]
        sigs = [torch.zeros(n_focus, n_edge, gwd, device=dev) for _ in range(2)]

        def shipped_f(
            meta: dict[str, Any] = meta,
            grid: tuple[int, int] = grid,
            sig: torch.Tensor = sigs[0],
            out: torch.Tensor = outs[0],
        ) -> None:
            gate_fwd_kernel[grid](
                z_all, gws[0], gws[1], res, sig, out, n_edge, layer,
                HAS_RES=True, ALL_ROWS=False, STORE_SIG=True, FAST=True, **meta,
            )  # fmt: skip

        def early_f(meta: dict[str, Any] = meta, grid: tuple[int, int] = grid,
                    sig: torch.Tensor = sigs[1], out: torch.Tensor = outs[1]) -> None:  # fmt: skip
            gate_fwd_early_kernel[grid](z_all, gws[0], gws[1], res, sig, out, n_edge, layer, **meta)

        try:
            shipped_f()
            early_f()
            ms_a = do_bench(shipped_f, warmup=5, rep=40)
            ms_b = do_bench(early_f, warmup=5, rep=40)
        except Exception as exc:
            print(f"gate_fwd {tile} failed: {exc}", flush=True)
            continue
        cols = slice(fd, fd + gwd)
        diff = max((outs[0][..., cols] - outs[1][..., cols]).abs().max().item(),
                   (sigs[0] - sigs[1]).abs().max().item())  # fmt: skip
        record("gate_fwd", "shipped", tile, ms_a, 0.0, gb_gate_fwd)
        record("gate_fwd", "early", tile, ms_b, diff, gb_gate_fwd)

    path = write_results(args.out, "gate_kernels_probe", rows, copy_ms=copy_ms,
                         copy_gb_per_s=copy_gbs, n_edge=n_edge)  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
