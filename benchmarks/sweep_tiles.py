"""Tune the rotate-mix launch tables on the local GPU and write so2kernels/tables/<gpu>.json.

Every candidate (block_e, num_warps[, variant]) is first validated against the float64 reference
on a small problem (a candidate that fails to compile or to match is dropped), then timed at the
sweep size. The forward entry is the fastest candidate, unless it beats the fallback by less than
``WIN_MARGIN`` (then the fallback is recorded). The backward times every schedule
(``--bwd-variants``), the CSR-chunk one ("csr"), the node-centric one ("node") and the
edge-parallel one with its CSR segment sum ("edge"), and writes the winner with its
``variant`` only when it beat the fallback (csr, per-edge steps, table-free) by at least
``WIN_MARGIN``; the best time of each variant is recorded beside it (``csr_ms``, ``node_ms``,
``edge_ms``). The csr chunk is left to the launcher (it follows E, and
a table entry is keyed by shape only).

    python benchmarks/sweep_tiles.py                        # default keys
    python benchmarks/sweep_tiles.py --keys 128,2,1,1 256,3,2,2 --edges 500000
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing
import sys
from pathlib import Path
from typing import Any

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import time_ms
from so2kernels._layout import n_coeff, n_kernel_slots, n_reduced
from so2kernels.mixing_stack_fast import normwise_rel_error
from so2kernels.rotate_mix import launch_rotate_mix_fwd, rotate_mix_reference
from so2kernels.rotate_mix_backward import (
    launch_rotate_mix_bwd,
    rotate_mix_backward_reference,
)
from so2kernels.segment import csr_from_index
from so2kernels.tiles import (
    TABLES_DIR,
    VARIANTS,
    LaunchTiles,
    device_slug,
    fallback_tiles,
    table_key,
)

FWD_CANDIDATES = [LaunchTiles(b, w) for b in (1, 2, 4, 8) for w in (2, 4, 8)]
BWD_CANDIDATES = (
    [LaunchTiles(b, w, "csr") for b in (1, 2) for w in (1, 2, 4)]
    + [LaunchTiles(b, w, "node") for b in (1, 2, 4) for w in (1, 4, 8)]
    + [LaunchTiles(b, w, "edge") for b in (1, 2, 4) for w in (1, 2, 4)]
)
VALIDATION_REL_TOL = 1e-5
WIN_MARGIN = 0.03
"""A candidate replaces the fallback only when it is this much faster: closer timings are noise
(repeated runs of one launch spread by ~1-2 %), and a table entry should record a real win."""


def operands(c_wide: int, lmax: int, n_focus: int, rank: int, n_edge: int, n_node: int,
             dtype: torch.dtype = torch.float32) -> tuple[Any, ...]:  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(1)
    dim = n_coeff(lmax)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=gen, dtype=torch.float64).to(dtype)

    src = torch.randint(0, n_node, (n_edge,), device="cuda", generator=gen)
    order, row_ptr = csr_from_index(src, n_node)
    kc = draw(n_edge, n_kernel_slots(lmax) * rank) if rank else draw(n_edge, lmax + 1, c_wide)
    return (draw(n_node, dim, c_wide), src, order, row_ptr, draw(n_edge, dim, dim), kc,
            draw(rank, c_wide), lmax, n_focus, rank)  # fmt: skip


def validate(direction: str, tiles: LaunchTiles, key: tuple[int, int, int, int]) -> bool:
    c_wide, lmax, n_focus, rank = key
    ops = operands(c_wide, lmax, n_focus, rank, 3000, 100)
    ref = tuple(t.double() if torch.is_tensor(t) and t.is_floating_point() else t for t in ops)
    x, src, order, row_ptr, wigner, kc, cb = ops[:7]
    try:
        if direction == "fwd":
            got = launch_rotate_mix_fwd(x, src, wigner, kc, cb, lmax, n_focus, rank, tiles)
            return normwise_rel_error(got, rotate_mix_reference(*ref)) <= VALIDATION_REL_TOL
        grad_u = torch.randn(n_focus, 3000, n_reduced(lmax) * (c_wide // n_focus), device="cuda")
        wants = rotate_mix_backward_reference(grad_u.double(), *ref)
        # Both builds: with the basis gradient (training) and without it (forces, the one timed).
        for want_cb in (True, False):
            outs = launch_rotate_mix_bwd(grad_u, x, src, order, row_ptr, wigner, kc, cb, lmax,
                                         n_focus, rank, want_cb, tiles)  # fmt: skip
            checked = zip(outs[: 4 if want_cb else 3], wants, strict=False)  # no basis grad
            if not all(normwise_rel_error(g, w) <= VALIDATION_REL_TOL for g, w in checked):
                return False
        return True
    except Exception as err:  # a candidate that does not compile or launch is simply dropped
        print(f"  {direction} {tiles}: failed ({type(err).__name__}: {str(err)[:100]})")
        return False


def time_candidate(direction: str, tiles: LaunchTiles, ops: tuple[Any, ...], grad_u: torch.Tensor,
                   iters: int) -> float:  # fmt: skip
    x, src, order, row_ptr, wigner, kc, cb, lmax, n_focus, rank = ops

    def run() -> object:
        if direction == "fwd":
            return launch_rotate_mix_fwd(x, src, wigner, kc, cb, lmax, n_focus, rank, tiles)
        return launch_rotate_mix_bwd(grad_u, x, src, order, row_ptr, wigner, kc, cb, lmax,
                                     n_focus, rank, False, tiles)  # fmt: skip

    return time_ms(run, warmup=2, iters=iters)


def validate_in_workers(jobs: list[tuple[str, LaunchTiles, tuple[int, int, int, int]]],
                        workers: int) -> dict[tuple[str, LaunchTiles], bool]:  # fmt: skip
    """Validate (and so compile) every candidate in ``workers`` fresh processes at once.

    Compiling is what makes a sweep long (~40 candidates of 3-6 s each, one after another);
    the workers fill Triton's on-disk cache, so the timing process below only loads kernels.
    Validation runs at 3,000 edges, so the workers barely touch the GPU the timings use later.
    """
    if workers <= 1:
        return {(d, t): validate(d, t, k) for d, t, k in jobs}
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        verdicts = pool.starmap(validate, jobs, chunksize=1)
    return {(d, t): ok for (d, t, _), ok in zip(jobs, verdicts, strict=True)}


def sweep_key(key: tuple[int, int, int, int], args: argparse.Namespace) -> dict[str, Any]:
    c_wide, lmax, n_focus, rank = key
    bwd_candidates = [t for t in BWD_CANDIDATES if t.variant in args.bwd_variants]
    # Each direction's list starts with its fallback, which is timed first.
    plan = [
        (d, list(dict.fromkeys([fallback_tiles(d, c_wide, lmax), *candidates])))  # type: ignore[arg-type]
        for d, candidates in (("fwd", FWD_CANDIDATES), ("bwd", bwd_candidates))
    ]
    valid = validate_in_workers([(d, t, key) for d, ts in plan for t in ts], args.compile_workers)
    ops = operands(c_wide, lmax, n_focus, rank, args.edges, args.edges // args.degree)
    grad_u = torch.randn(n_focus, args.edges, n_reduced(lmax) * (c_wide // n_focus), device="cuda")
    result: dict[str, Any] = {}
    for direction, candidates in plan:
        fallback = candidates[0]
        timings: dict[LaunchTiles, float] = {}
        for tiles in candidates:
            if valid[(direction, tiles)]:
                timings[tiles] = time_candidate(direction, tiles, ops, grad_u, args.iters)
                print(f"  {direction} {tiles}: {timings[tiles]:.3f} ms", flush=True)
        if not timings:
            continue
        best = min(timings, key=timings.__getitem__)
        if fallback in timings and timings[best] > (1.0 - WIN_MARGIN) * timings[fallback]:
            best = fallback
        entry: dict[str, Any] = {"block_e": best.block_e, "num_warps": best.num_warps,
                                 "ms": timings[best],
                 "fallback_ms": timings.get(fallback)}  # fmt: skip
        if direction == "bwd":
            entry["variant"] = best.variant
            for variant in VARIANTS:
                times = [ms for tiles, ms in timings.items() if tiles.variant == variant]
                entry[f"{variant}_ms"] = min(times, default=None)
            print(f"  bwd winner {best}: {timings[best]:.3f} ms", flush=True)
        if direction == "fwd" or best != fallback:
            result[direction] = entry
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    # A table key has no focus count: one key per (C_wide, lmax, rank), at the served F.
    parser.add_argument("--keys", nargs="*", default=["128,2,2,1", "128,3,2,2", "256,2,2,1",
                        "256,3,2,2"], help="c_wide,lmax,n_focus,rank")  # fmt: skip
    parser.add_argument("--edges", type=int, default=500_000)
    parser.add_argument("--degree", type=int, default=64)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--tables", type=Path, default=TABLES_DIR)
    parser.add_argument("--bwd-variants", nargs="+", default=list(VARIANTS), choices=VARIANTS,
                        help="backward schedules to time (every candidate compiles)")  # fmt: skip
    parser.add_argument("--compile-workers", type=int, default=8,
                        help="processes that validate (compile) candidates at once")  # fmt: skip
    args = parser.parse_args()
    gpu = torch.cuda.get_device_name()
    path = args.tables / f"{device_slug(gpu)}.json"
    table: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    stamp = dt.datetime.now(dt.UTC).isoformat()
    table.update({"device": gpu, "torch": torch.__version__, "triton": triton.__version__,
                  "date": stamp, "command": " ".join(sys.argv)})  # fmt: skip
    keys = [tuple(int(v) for v in text.split(",")) for text in args.keys]
    assert all(len(key) == 4 for key in keys), "want keys as c_wide,lmax,n_focus,rank"
    names = [table_key(key[0], key[1], key[3]) for key in keys]
    assert len(set(names)) == len(names), f"keys share a table entry (no focus count): {names}"
    for key, name in zip(keys, names, strict=True):
        print(f"key {key}", flush=True)
        found = sweep_key(key, args)  # type: ignore[arg-type]
        for direction in ("fwd", "bwd"):
            entries = table.setdefault(f"rotate_mix_{direction}", {})
            # A re-sweep the fallback wins removes the old entry: no key means the fallback.
            entries.pop(name, None)
            if direction in found:
                entries[name] = found[direction]
    args.tables.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1, sort_keys=True))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
