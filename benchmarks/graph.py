"""Graph-build benchmark: neighbour list + edge cache on water boxes of 192 … ~1M atoms (rcut 6 Å).

Run on the GPU machine from the repository root:

    python benchmarks/graph.py                 # all sizes -> benchmarks/results/graph.json
    python benchmarks/graph.py --sizes 1 2 4   # replication factors n (192·n³ atoms)

Boxes tile the 192-atom frame 0 of ``water/data_0`` (from ../shared or the carried .gpu_data copy;
a random water-density box if neither exists). Reported per size: atoms, edges, median ms and
edges/s of (a) the neighbour list on the device (torch cell list), (b) edge vectors + edge cache
for lmax 2 and 3 without autograd and (c) with the edge-vector leaf requiring grad (what an
energy+force step builds), plus CPU validation and the CPU vesin path for the smaller boxes.
Sizes whose Wigner-D alone would not fit in free device memory are skipped and say so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from service.graph import (  # noqa: E402
    StructureArrays,
    Structures,
    build_edge_cache,
    build_graph,
    edge_vectors,
)

RCUT = 6.0
DEFAULT_SIZES = (1, 2, 4, 8, 17)  # 192, 1536, 12288, 98304, 943296 atoms
EDGES_PER_ATOM = 95.0  # water at rcut 6 Å (measured 88.9 on frame 0), with margin


def water_frame() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(positions (192,3), numbers (192,), cell (3,3)) of water frame 0, or a random stand-in."""
    for base in (ROOT.parent / "shared" / "data", ROOT / ".gpu_data" / "data", ROOT / ".gpu_data"):
        frame = base / "water" / "data_0"
        if (frame / "set.000" / "coord.npy").exists():
            coord = np.load(frame / "set.000" / "coord.npy")[0].reshape(-1, 3)
            cell = np.load(frame / "set.000" / "box.npy")[0].reshape(3, 3)
            types = np.loadtxt(frame / "type.raw", dtype=np.int64)
            return coord, np.where(types == 0, 8, 1), cell
    rng = np.random.default_rng(0)
    edge = 12.4447
    return rng.uniform(0, edge, (192, 3)), np.repeat([8, 1, 1], 64), np.eye(3) * edge


def tiled(n: int) -> StructureArrays:
    coord, numbers, cell = water_frame()
    grid = np.stack(np.meshgrid(*[np.arange(n)] * 3, indexing="ij"), -1).reshape(-1, 3)
    positions = (coord[None] + (grid @ cell)[:, None]).reshape(-1, 3)
    return StructureArrays(
        numbers=np.tile(numbers, len(grid)), positions=positions, cell=cell * n, pbc=True
    )


def timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> tuple[float, Any]:
    """Median wall ms over ``repeats`` runs after one warm-up; returns (ms, last result)."""
    result = fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples), result


def fits(n_atoms: int, lmax: int, device: torch.device, with_grad: bool) -> bool:
    if device.type != "cuda":
        return n_atoms <= 20_000
    free, _ = torch.cuda.mem_get_info(device)
    edges = EDGES_PER_ATOM * n_atoms
    per_edge = 4 * (lmax + 1) ** 4 + 200  # Wigner-D + graph/cache vectors
    if with_grad:
        per_edge *= 3  # float64 monomials and the index_copy output are kept for backward
    return edges * per_edge < 0.8 * free


def bench_size(n: int, device: torch.device, repeats: int) -> dict[str, Any]:
    item = tiled(n)
    row: dict[str, Any] = {"replication": n}
    validate_ms, structures = timed(lambda: Structures.from_arrays([item]), torch.device("cpu"), 1)
    row["n_atoms"] = structures.n_atoms
    row["validate_cpu_ms"] = validate_ms
    on_device = structures.to(device)
    nl_ms, graph = timed(lambda: build_graph(on_device, RCUT, backend="torch"), device, repeats)
    row["n_edges"] = graph.n_edges
    row["neighbor_ms"] = nl_ms
    row["neighbor_edges_per_s"] = graph.n_edges / (nl_ms * 1e-3)
    if structures.n_atoms <= 20_000:
        cpu_ms, _ = timed(
            lambda: build_graph(structures, RCUT, backend="vesin"), torch.device("cpu"), 1
        )
        row["neighbor_vesin_cpu_ms"] = cpu_ms
    for lmax in (2, 3):
        for with_grad in (False, True):
            key = f"edge_cache_l{lmax}{'_grad' if with_grad else ''}"
            if not fits(structures.n_atoms, lmax, device, with_grad):
                row[key + "_ms"] = None
                row[key + "_skipped"] = "estimated memory exceeds 80% of free device memory"
                continue

            def build(lmax: int = lmax, with_grad: bool = with_grad) -> Any:
                with torch.set_grad_enabled(with_grad):
                    vec = edge_vectors(graph, on_device.positions, on_device.cells)
                    return build_edge_cache(
                        graph, vec.requires_grad_(with_grad), rcut=RCUT, lmax=lmax
                    )

            ms, cache = timed(build, device, repeats)
            del cache
            row[key + "_ms"] = ms
            row[key + "_edges_per_s"] = graph.n_edges / (ms * 1e-3)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if device.type == "cuda":
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=list(DEFAULT_SIZES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "graph.json")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for n in args.sizes:
        repeats = args.repeats if n < 8 else max(1, args.repeats // 2)
        row = bench_size(n, device, repeats)
        print(json.dumps(row), flush=True)
        rows.append(row)
    report = {
        "benchmark": "graph",
        "rcut": RCUT,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
