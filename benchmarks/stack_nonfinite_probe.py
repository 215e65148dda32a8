"""Experiment: where the fast-tier mixing stack writes non-finite values, per forward tile.

Under Triton 3.7.1 on an H200 the bar shape's fp16x3 forward (Cf 128, lmax 2, F 1, the shipped
``fwd`` tile) left NaN in ``x_local`` while Triton 3.6.0 did not, when the final layer's epilogue
ran on column halves of the tile (``--variants halves``; the shipped kernel now takes the whole
tile). This maps the bad elements of each output (edge rows, columns, which block) and re-runs
the forward under candidate ``fwd`` tiles (a temporary table through ``SO2_STACK_TABLE``), each
timed, with its error against the exact tier on the finite elements. Writes one JSON under
benchmarks/results/.

    python3 benchmarks/stack_nonfinite_probe.py [--edges 100003 131072] [--shipped-only]
        [--variants halves barrier explicit]   # the forward's epilogue, rewritten
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernels_mixing_stack import Case, make_operands
from so2kernels import mixing_stack as ms
from so2kernels import mixing_stack_kernels as msk
from so2kernels.mixing_stack import so2_mixing_stack

LMAX, FOCUS_DIM, N_FOCUS, N_LAYERS = 2, 128, 1, 3
KEY = "fwd|cf128|l2|fp16x3"
CANDIDATES = [
    None,  # the shipped entry
    [64, 128, 32, 4, 2],
    [64, 128, 32, 4, 4],
    [64, 128, 64, 4, 3],
    [64, 64, 32, 4, 3],
    [128, 64, 32, 8, 3],
    [128, 128, 32, 8, 3],
    [128, 128, 32, 8, 2],
]


_SHIPPED = """        _block_fwd_epilogue(
            acc, rows, row_mask, cols, col_mask, focus, n_focus, n_edge, layer, u_ptr, z_ptr,
            sig_ptr, alpha_ptr, out_ptr, L, FD, M1_BLOCK, FINAL, APPLY_ALPHA,
        )  # fmt: skip
"""
_NOT_FINAL = """        else:
            _block_fwd_epilogue(
                acc, rows, row_mask, cols, col_mask, focus, n_focus, n_edge, layer, u_ptr, z_ptr,
                sig_ptr, alpha_ptr, out_ptr, L, FD, M1_BLOCK, False, False,
            )  # fmt: skip
"""
_HALVES_LOOP = """            halves = _column_halves(acc, BLOCK_M, BLOCK_N)
            half_cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N // 2)
            for h in tl.static_range(2):
                part_cols = half_cols + h * (BLOCK_N // 2)
                _block_fwd_epilogue(
                    halves[h], rows, row_mask, part_cols, part_cols < WIDTH, focus, n_focus,
                    n_edge, layer, u_ptr, z_ptr, sig_ptr, alpha_ptr, out_ptr, L, FD, M1_BLOCK,
                    True, APPLY_ALPHA,
                )  # fmt: skip
"""
_TAIL = """n_edge, layer, u_ptr, z_ptr, sig_ptr, alpha_ptr, out_ptr,
                L, FD, M1_BLOCK, True, APPLY_ALPHA)
"""
VARIANTS = {
    # the final layer's epilogue of block_fwd_desc_kernel on column halves, as shipped until
    # 2026-12-02 ("halves"), after a barrier, and as two named calls
    "halves": "        if FINAL:\n" + _HALVES_LOOP + _NOT_FINAL,
    "barrier": "        if FINAL:\n            tl.debug_barrier()\n" + _HALVES_LOOP + _NOT_FINAL,
    "explicit": """        if FINAL:
            left, right = _column_halves(acc, BLOCK_M, BLOCK_N)
            left_cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N // 2)
            right_cols = left_cols + BLOCK_N // 2
            _block_fwd_epilogue(left, rows, row_mask, left_cols, left_cols < WIDTH, focus, n_focus,
                """
    + _TAIL
    + """            _block_fwd_epilogue(right, rows, row_mask, right_cols,
                right_cols < WIDTH, focus, n_focus, """
    + _TAIL
    + _NOT_FINAL,
}


_LAUNCHED = "block_fwd_desc_kernel"


def load_variant(name: str) -> Any:
    """``block_fwd_desc_kernel`` with its epilogue replaced by ``VARIANTS[name]``, from a
    patched copy of the kernels module (Triton reads a kernel's source from its file)."""
    source = Path(msk.__file__).read_text()
    assert _SHIPPED in source, "the shipped epilogue changed"
    path = Path(tempfile.mkdtemp()) / f"stack_variant_{name}.py"
    path.write_text(source.replace(_SHIPPED, VARIANTS[name]))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module.block_fwd_desc_kernel


def bad_map(t: torch.Tensor, edge_dim: int, m0: int) -> dict[str, Any]:
    """Counts and positions of the non-finite elements of ``t`` (edge axis ``edge_dim``)."""
    bad = ~torch.isfinite(t)
    n_bad = int(bad.sum())
    info: dict[str, Any] = {"non_finite": n_bad, "elements": t.numel()}
    if n_bad == 0:
        return info
    rows = bad.movedim(edge_dim, 0).flatten(1).any(1).nonzero().flatten()
    cols = bad.flatten(0, -2).any(0).nonzero().flatten()
    info.update(
        rows=int(rows.numel()),
        first_rows=rows[:16].tolist(),
        last_row=int(rows[-1]),
        rows_mod_64=torch.bincount(rows % 64, minlength=64).nonzero().flatten().tolist(),
        cols=int(cols.numel()),
        cols_m0=int((cols < m0).sum()),
        cols_m1=int((cols >= m0).sum()),
        first_cols=cols[:16].tolist(),
    )
    return info


def run_case(n_edge: int, entry: list[int] | None, table: dict[str, Any]) -> dict[str, Any]:
    configs = dict(table["configs"])
    if entry is not None:
        configs[KEY] = entry
    table_file = Path(tempfile.gettempdir()) / "stack_nonfinite_probe_table.json"
    table_file.write_text(json.dumps({"configs": configs, "meta": {}}))
    os.environ["SO2_STACK_TABLE"] = str(table_file)
    msk._load_table.cache_clear()
    ops = make_operands(Case("bar_shape", LMAX, FOCUS_DIM, N_FOCUS, n_edge, N_LAYERS), seed=13)
    m0 = (LMAX + 1) * FOCUS_DIM
    row: dict[str, Any] = {"edges": n_edge, "fwd_tile": entry or table["configs"][KEY]}
    with torch.no_grad():
        exact = so2_mixing_stack(*ops, LMAX, FOCUS_DIM, True, "ieee")
        for apply_alpha in (True, False):
            for rep in range(2):
                got = so2_mixing_stack(*ops, LMAX, FOCUS_DIM, apply_alpha, "fp16x3")
                names = ("x_local", "z_all", "u_final")
                dims = (0, 2, 1)
                row[f"alpha{int(apply_alpha)}_rep{rep}"] = {
                    n: bad_map(t, d, m0) for n, t, d in zip(names, got, dims, strict=True)
                }
            if apply_alpha:
                x, ref = got[0], exact[0]
                ok = torch.isfinite(x)
                diff = (x - ref).where(ok, 0.0).norm() / ref.where(ok, 0.0).norm()
                row["rel_err_vs_exact_finite"] = float(diff)
        row["fwd_ms"] = do_bench(
            lambda: so2_mixing_stack(*ops, LMAX, FOCUS_DIM, True, "fp16x3"), rep=200
        )
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--edges", type=int, nargs="+", default=[100_003, 131_072])
    parser.add_argument("--shipped-only", action="store_true")
    parser.add_argument("--variants", nargs="*", default=[], choices=sorted(VARIANTS))
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    table_path = msk.stack_table_path(torch.cuda.get_device_name())
    table = json.loads(table_path.read_text())
    rows = []
    # the launcher's binding of the kernel, swapped for each variant and then restored
    shipped = getattr(ms, _LAUNCHED)
    for name in args.variants:
        setattr(ms, _LAUNCHED, load_variant(name))
        for n_edge in args.edges:
            rows.append({"variant": name, **run_case(n_edge, None, table)})
    setattr(ms, _LAUNCHED, shipped)
    for n_edge in args.edges:
        for entry in CANDIDATES[: 1 if args.shipped_only else None]:
            try:
                rows.append(run_case(n_edge, entry, table))
            except Exception as exc:  # a tile this shape cannot take: recorded, not fatal
                rows.append({"edges": n_edge, "fwd_tile": entry, "error": repr(exc)[:300]})
                print(rows[-1], flush=True)
    out = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(sys.argv),
        "rows": rows,
    }
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = Path(__file__).resolve().parent / "results" / f"stack_nonfinite_probe_{stamp}.json"
    path.write_text(json.dumps(out, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
