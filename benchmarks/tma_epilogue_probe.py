"""Experiment (issue #2): fast-tier block GEMM epilogues through tensor descriptors (TMA).

The fast tier's block GEMMs load their products' operands through tensor descriptors but finish
each tile with pointer loads and stores from the accumulator layout. Here the gated layers'
epilogues read the residual and the gates and store ``z`` and the activation through 3-d
descriptors ``(F, E, W)`` (boxes ``(1, BLOCK_M, BLOCK_N)``, so a box never crosses into
another focus's rows and is clipped at the block's width), against the shipped kernels on the
same operands at the bar case (E = 1,051,392, lmax 2, Cf 128, F 1), outputs compared.

Kernels: the forward block GEMM of a gated layer (m=0: scalar rows finished with SiLU; |m|=1:
``u + z·σ``) and the residual backward GEMM of a gated layer (``g_in = g + gz Wᵀ`` on split
planes). The descriptor epilogue needs ``BLOCK_N`` to divide ``Cf`` (so the scalar rows and the
gate columns are whole boxes), which holds at the bar case.

``python3 benchmarks/tma_epilogue_probe.py`` → ``results/tma_epilogue_probe_<stamp>.json``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import astuple
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl
from triton.testing import do_bench
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_results
from so2kernels.mixing_stack_kernels import (
    StackPrecision,
    TileConfig,
    _desc_matmul,
    _flat_tile,
    _n_flat_tiles,
    block_bwd_desc_kernel,
    block_fwd_desc_kernel,
    desc_block_k,
    persistent_grid,
    row_descriptor,
    tile_config,
    weight_descriptors,
    weight_operands,
)

BAR_EDGES = 1_051_392
FWD_TILES = [TileConfig(64, 128, 64, 4, 3), TileConfig(64, 128, 32, 4, 4),
             TileConfig(128, 128, 32, 8, 3), TileConfig(128, 128, 64, 8, 3)]  # fmt: skip
BWD_TILES = [TileConfig(64, 128, 32, 4, 3), TileConfig(128, 128, 32, 8, 3),
             TileConfig(128, 128, 64, 8, 4), TileConfig(64, 128, 64, 4, 3)]  # fmt: skip


@triton.jit
def block_fwd_tma_kernel(
    u_desc, w_desc, w_lo_desc, res_desc, z_desc, sig_desc, out_desc, n_edge, n_focus, layer,
    L: tl.constexpr, FD: tl.constexpr, M1_BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Gated-layer ``block_fwd_desc_kernel`` with the epilogue through descriptors over the
    block's columns: ``res_desc``/``out_desc`` (F, E, W), ``z_desc`` (NG·F, E, W), ``sig_desc``
    (F, E, GWD)."""
    GWD: tl.constexpr = L * FD
    M0: tl.constexpr = FD + GWD
    WIDTH: tl.constexpr = 2 * GWD if M1_BLOCK else M0
    COL0: tl.constexpr = M0 if M1_BLOCK else 0
    n_tiles = _n_flat_tiles(n_edge, n_focus, WIDTH, BLOCK_M, BLOCK_N)
    for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        focus, first, _rows, _row_mask, _cols, _col_mask, pid_n = _flat_tile(
            tile, n_edge, WIDTH, BLOCK_M, BLOCK_N
        )
        focus32 = focus.to(tl.int32)
        n0 = pid_n * BLOCK_N
        acc = _desc_matmul(
            u_desc, focus32 * n_edge + first, 0, COL0, w_desc, w_lo_desc,
            (layer * n_focus + focus32) * WIDTH, n0, WIDTH, False, False, BLOCK_K,
            BLOCK_M, BLOCK_N,
        )  # fmt: skip
        z_desc.store([layer * n_focus + focus32, first, n0], acc.reshape(1, BLOCK_M, BLOCK_N))
        if M1_BLOCK:
            u_tile = res_desc.load([focus32, first, n0]).reshape(BLOCK_M, BLOCK_N)
            gate = sig_desc.load([focus32, first, n0 % GWD]).reshape(BLOCK_M, BLOCK_N)
            out_desc.store([focus32, first, n0], (u_tile + acc * gate).reshape(1, BLOCK_M, BLOCK_N))
        elif n0 < FD:
            u_tile = res_desc.load([focus32, first, n0]).reshape(BLOCK_M, BLOCK_N)
            silu = acc * tl.sigmoid(acc)
            out_desc.store([focus32, first, n0], (u_tile + silu).reshape(1, BLOCK_M, BLOCK_N))


@triton.jit
def block_bwd_tma_kernel(
    a_desc, wt_desc, wt_lo_desc, res_desc, out_desc, n_edge, n_focus, layer,
    L: tl.constexpr, FD: tl.constexpr, M1_BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Gated-layer ``block_bwd_desc_kernel`` (A = split planes) with ``g`` read and ``g_in``
    stored through (F, E, W) descriptors."""
    GWD: tl.constexpr = L * FD
    M0: tl.constexpr = FD + GWD
    WIDTH: tl.constexpr = 2 * GWD if M1_BLOCK else M0
    COL0: tl.constexpr = M0 if M1_BLOCK else 0
    n_tiles = _n_flat_tiles(n_edge, n_focus, WIDTH, BLOCK_M, BLOCK_N)
    for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        focus, first, _rows, _row_mask, _cols, _col_mask, pid_n = _flat_tile(
            tile, n_edge, WIDTH, BLOCK_M, BLOCK_N
        )
        focus32 = focus.to(tl.int32)
        n0 = pid_n * BLOCK_N
        acc = _desc_matmul(
            a_desc, focus32 * n_edge + first, n_focus * n_edge, COL0, wt_desc, wt_lo_desc,
            (layer * n_focus + focus32) * WIDTH, n0, WIDTH, True, False, BLOCK_K, BLOCK_M,
            BLOCK_N,
        )  # fmt: skip
        res = res_desc.load([focus32, first, n0]).reshape(BLOCK_M, BLOCK_N)
        out_desc.store([focus32, first, n0], (res + acc).reshape(1, BLOCK_M, BLOCK_N))


def _bench(fn: Any, dev: str) -> float:
    return float(do_bench(fn, warmup=3, rep=30)) if dev == "cuda" else 0.0


def _tile_meta(tile: TileConfig) -> dict[str, int]:
    return {"BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n, "BLOCK_K": tile.block_k,
            "num_warps": tile.num_warps, "num_stages": tile.num_stages}  # fmt: skip


def _candidates(table_tile: TileConfig, extra: list[TileConfig], dev: str) -> list[TileConfig]:
    """The table's tile first, then (on the GPU) the extra candidates."""
    return [table_tile] + ([t for t in extra if t != table_tile] if dev == "cuda" else [])


def _record(rows: list[dict[str, Any]], kernel: str, upper: bool, tile: TileConfig,
            base_ms: float, cand: TileConfig, ms: float, diff: float) -> None:  # fmt: skip
    row = {"kernel": kernel, "m1": upper, "shipped_tile": list(astuple(tile)),
           "shipped_ms": base_ms, "tma_tile": list(astuple(cand)), "tma_ms": ms,
           "max_abs_diff": diff}  # fmt: skip
    rows.append(row)
    print(row, flush=True)


def block_columns(t: torch.Tensor, col0: int, width: int, block: list[int]) -> TensorDescriptor:
    """``t (..., E, ROW)`` seen as ``(lead, E, width)`` from column ``col0``, with ``block``
    boxes."""
    rows = t.reshape(-1, t.shape[-2], t.shape[-1])[:, :, col0 : col0 + width]
    return TensorDescriptor(rows, list(rows.shape), list(rows.stride()), block)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--edges", type=int, default=BAR_EDGES)
    parser.add_argument("--lmax", type=int, default=2)
    parser.add_argument("--focus-dim", type=int, default=128)
    parser.add_argument("--n-focus", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.manual_seed(0)
    lmax, fd, n_edge, n_focus, layer = args.lmax, args.focus_dim, args.edges, args.n_focus, 1
    gwd = lmax * fd
    m0, m1, row = fd + gwd, 2 * gwd, fd + 3 * gwd
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    fast = StackPrecision.FAST
    u = torch.randn(n_focus, n_edge, row, device=dev)
    g = torch.randn(n_focus, n_edge, row, device=dev)
    sig = torch.rand(n_focus, n_edge, gwd, device=dev)
    planes = (torch.randn(2, n_focus, n_edge, row, device=dev) * 4).to(torch.float16)
    w0 = torch.randn(3, n_focus, m0, m0, device=dev) / m0**0.5
    w1 = torch.randn(3, n_focus, m1, m1, device=dev) / m1**0.5
    rows: list[dict[str, Any]] = []

    def n_tiles_of(tile: TileConfig, width: int) -> int:
        return triton.cdiv(n_edge, tile.block_m) * triton.cdiv(width, tile.block_n) * n_focus

    for upper, w, width, col0 in ((False, w0, m0, 0), (True, w1, m1, m0)):
        # Forward, gated layer.
        tile = tile_config("fwd", fd, lmax, fast, u.device)
        bk = desc_block_k(width, tile)
        ops = weight_operands(w, fast)
        n_tiles = triton.cdiv(n_edge, tile.block_m) * triton.cdiv(width, tile.block_n) * n_focus
        grid = persistent_grid(n_tiles, tile, u.device)
        meta = {"L": lmax, "FD": fd, "M1_BLOCK": upper, "BLOCK_M": tile.block_m,
                "BLOCK_N": tile.block_n, "BLOCK_K": bk, "num_warps": tile.num_warps,
                "num_stages": tile.num_stages}  # fmt: skip
        outs = {k: (torch.full((2, n_focus, n_edge, row), float("nan"), device=dev),
                    torch.full_like(u, float("nan"))) for k in ("shipped", "tma")}  # fmt: skip
        box = [1, tile.block_m, tile.block_n]

        def shipped(z: torch.Tensor = outs["shipped"][0],
                    out: torch.Tensor = outs["shipped"][1], meta: dict[str, Any] = meta,
                    grid: tuple[int] = grid, bk: int = bk, tile: Any = tile,
                    ops: tuple[torch.Tensor, torch.Tensor] = ops) -> None:  # fmt: skip
            block_fwd_desc_kernel[grid](
                row_descriptor(u, tile.block_m, bk),
                *weight_descriptors(ops, bk, tile.block_n),
                u, z, sig, sig, out, n_edge, n_focus, layer, FINAL=False, APPLY_ALPHA=False,
                **meta,
            )  # fmt: skip

        def tma(z: torch.Tensor = outs["tma"][0], out: torch.Tensor = outs["tma"][1],
                meta: dict[str, Any] = meta, grid: tuple[int] = grid, bk: int = bk,
                ops: tuple[torch.Tensor, torch.Tensor] = ops, tile: Any = tile,
                col0: int = col0, width: int = width, box: list[int] = box) -> None:  # fmt: skip
            block_fwd_tma_kernel[grid](
                row_descriptor(u, tile.block_m, bk),
                *weight_descriptors(ops, bk, tile.block_n),
                block_columns(u, col0, width, box), block_columns(z, col0, width, box),
                block_columns(sig, 0, gwd, box), block_columns(out, col0, width, box),
                n_edge, n_focus, layer, **meta,
            )  # fmt: skip

        shipped()
        base_ms = _bench(shipped, dev)
        cols = slice(col0, col0 + width)
        out_cols = cols if upper else slice(0, fd)
        for cand in _candidates(tile, FWD_TILES, dev):
            cbk = desc_block_k(width, cand)
            cgrid = persistent_grid(n_tiles_of(cand, width), cand, u.device)
            cmeta = {**meta, **_tile_meta(cand), "BLOCK_K": cbk}
            cbox = [1, cand.block_m, cand.block_n]
            outs["tma"][0].fill_(float("nan"))
            outs["tma"][1].fill_(float("nan"))

            def tma_c(cmeta: dict[str, Any] = cmeta, cgrid: tuple[int] = cgrid, cbk: int = cbk,
                      cand: Any = cand, cbox: list[int] = cbox) -> None:  # fmt: skip
                tma(meta=cmeta, grid=cgrid, bk=cbk, tile=cand, box=cbox)

            try:
                tma_c()
                ms = _bench(tma_c, dev)
            except Exception as exc:  # a tile that does not compile is not a candidate
                print(f"fwd tma {cand} failed: {type(exc).__name__}: {exc}", flush=True)
                continue
            z_diff = (outs["tma"][0][layer, ..., cols] - outs["shipped"][0][layer, ..., cols]).abs()
            o_diff = (outs["tma"][1][..., out_cols] - outs["shipped"][1][..., out_cols]).abs()
            _record(rows, "fwd_gated", upper, tile, base_ms, cand, ms,
                    max(z_diff.max().item(), o_diff.max().item()))  # fmt: skip

        # Backward residual GEMM, gated layer.
        tile = tile_config("bwd", fd, lmax, fast, u.device)
        bk = desc_block_k(width, tile)
        ops_t = weight_operands(w, fast, transposed=True)
        n_tiles = triton.cdiv(n_edge, tile.block_m) * triton.cdiv(width, tile.block_n) * n_focus
        grid = persistent_grid(n_tiles, tile, u.device)
        meta = {"L": lmax, "FD": fd, "M1_BLOCK": upper, "BLOCK_M": tile.block_m,
                "BLOCK_N": tile.block_n, "BLOCK_K": bk, "num_warps": tile.num_warps,
                "num_stages": tile.num_stages}  # fmt: skip
        g_in = {k: torch.full_like(g, float("nan")) for k in ("shipped", "tma")}
        box = [1, tile.block_m, tile.block_n]

        def shipped_b(out: torch.Tensor = g_in["shipped"], meta: dict[str, Any] = meta,
                      grid: tuple[int] = grid, bk: int = bk, tile: Any = tile,
                      ops: tuple[torch.Tensor, torch.Tensor] = ops_t) -> None:  # fmt: skip
            block_bwd_desc_kernel[grid](
                row_descriptor(planes, tile.block_m, bk),
                *weight_descriptors(ops, bk, tile.block_n),
                g, g, g, g, g, out, n_edge, n_focus, layer, FINAL=False, APPLY_ALPHA=False,
                ALPHA_PARTIALS=False, **meta,
            )  # fmt: skip

        def tma_b(out: torch.Tensor = g_in["tma"], meta: dict[str, Any] = meta,
                  grid: tuple[int] = grid, bk: int = bk, tile: Any = tile,
                  ops: tuple[torch.Tensor, torch.Tensor] = ops_t, col0: int = col0,
                  width: int = width, box: list[int] = box) -> None:  # fmt: skip
            block_bwd_tma_kernel[grid](
                row_descriptor(planes, tile.block_m, bk),
                *weight_descriptors(ops, bk, tile.block_n),
                block_columns(g, col0, width, box), block_columns(out, col0, width, box),
                n_edge, n_focus, layer, **meta,
            )  # fmt: skip

        shipped_b()
        base_ms = _bench(shipped_b, dev)
        for cand in _candidates(tile, BWD_TILES, dev):
            cbk = desc_block_k(width, cand)
            cgrid = persistent_grid(n_tiles_of(cand, width), cand, u.device)
            cmeta = {**meta, **_tile_meta(cand), "BLOCK_K": cbk}
            cbox = [1, cand.block_m, cand.block_n]
            g_in["tma"].fill_(float("nan"))

            def tma_bc(cmeta: dict[str, Any] = cmeta, cgrid: tuple[int] = cgrid, cbk: int = cbk,
                       cand: Any = cand, cbox: list[int] = cbox) -> None:  # fmt: skip
                tma_b(meta=cmeta, grid=cgrid, bk=cbk, tile=cand, box=cbox)

            try:
                tma_bc()
                ms = _bench(tma_bc, dev)
            except Exception as exc:
                print(f"bwd tma {cand} failed: {type(exc).__name__}: {exc}", flush=True)
                continue
            diff = (g_in["tma"][..., cols] - g_in["shipped"][..., cols]).abs().max().item()
            _record(rows, "bwd_gated", upper, tile, base_ms, cand, ms, diff)
    if dev == "cuda":
        path = write_results(args.out, "tma_epilogue_probe", rows, n_edge=n_edge)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
