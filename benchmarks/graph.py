"""Graph-build benchmark: neighbour list + edge cache on water boxes of 192 … ~1M atoms (rcut 6 Å).

Run on the GPU machine from the repository root:

    python benchmarks/graph.py                 # all sizes -> benchmarks/results/graph.json
    python benchmarks/graph.py --sizes 1 2 4   # replication factors n (192·n³ atoms)
    python benchmarks/graph.py --sizes 1 2 3 4 5 --neighbors-only   # the search crossover

Boxes tile the 192-atom frame 0 of ``water/data_0`` (from ../shared or the carried .gpu_data copy;
a random water-density box if neither exists). Reported per size: atoms, edges, median ms,
edges/s and peak device memory of (a) the neighbour list on the device (torch cell list,
``neighbor``), next to what a request from the host pays, the packed copy to the device
included: ``neighbor_direct`` (the Triton all-pairs search, with ``direct_candidates``),
``neighbor_host`` (vesin and the whole graph on the host, then one copy) and ``neighbor_auto``
(``auto``'s pick, in ``neighbor_auto_backend``); ``neighbor_direct_ms`` against ``neighbor_ms``
sets ``DIRECT_MAX_CANDIDATES``. Unless ``--neighbors-only``: (b) edge vectors + edge cache for
lmax 2 and 3 without autograd and (c) with the edge-vector leaf requiring grad (what an
energy+force step builds), (d) the float64 force/virial assembly from a stand-in ∂E/∂r, plus CPU
validation and the CPU vesin path for the smaller boxes.

Memory: sizes run smallest first; each case's peak bytes per edge, measured at the largest size
it ran, predicts the next size. A case predicted not to fit in the free device memory (or that
runs out anyway) is skipped with its reason recorded, and the remaining cases of that size still
run; everything is freed between cases.
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
    assemble_forces_virial,
    build_edge_cache,
    build_graph,
    edge_vectors,
)
from service.graph.cell_list import COINCIDENT_DISTANCE  # noqa: E402
from service.graph.neighbors import (  # noqa: E402
    Backend,
    Graph,
    place_and_build_graph,
    resolve_backend,
)
from service.graph.pair_search import image_windows  # noqa: E402

RCUT = 6.0
DEFAULT_SIZES = (1, 2, 4, 8, 17)  # 192, 1536, 12288, 98304, 943296 atoms
EDGES_PER_ATOM = 95.0  # water at rcut 6 Å (measured 88.9 on frame 0), with margin
DIRECT_BENCH_MAX_CANDIDATES = 2**34  # ~60k atoms of water: past any plausible crossover
HOST_BENCH_MAX_ATOMS = 20_000


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
    """Median wall ms over ``repeats`` runs after one warm-up; returns (ms, last result). The
    previous result is dropped before each run, so peak memory is one result's, not two."""
    result = fn()
    samples = []
    for _ in range(repeats):
        result = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples), result


class MemoryModel:
    """Peak device bytes per edge of each case, measured on the largest size that ran so far and
    extrapolated linearly (every term is per edge or per atom, and edges ∝ atoms)."""

    SAFETY = 1.15
    """Margin over the linear extrapolation (allocator rounding, chunk remainders)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.bytes_per_edge: dict[str, float] = {}

    def reason_to_skip(self, case: str, n_edges: int) -> str | None:
        """Why ``case`` cannot run at ``n_edges`` edges, or None if it is expected to fit."""
        if self.device.type != "cuda":
            return None if n_edges <= 2_000_000 else "CPU run: sizes above 2M edges skipped"
        per_edge = self.bytes_per_edge.get(case)
        if per_edge is None:
            return None  # first size: measure (an OOM is caught and recorded)
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(self.device)
        need = self.SAFETY * per_edge * n_edges
        if need > free:
            return (
                f"needs ~{need / 2**30:.1f} GiB ({per_edge:.0f} B/edge measured at a smaller "
                f"size) but {free / 2**30:.1f} GiB are free"
            )
        return None

    def start(self) -> int:
        """Reset the peak counter; returns the bytes allocated now (the case's baseline)."""
        if self.device.type != "cuda":
            return 0
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return int(torch.cuda.memory_allocated(self.device))

    def finish(self, case: str, baseline: int, n_edges: int) -> float | None:
        """Record the case's peak above ``baseline``; returns it in GiB (None off CUDA)."""
        if self.device.type != "cuda":
            return None
        peak = torch.cuda.max_memory_allocated(self.device) - baseline
        if n_edges:
            self.bytes_per_edge[case] = peak / n_edges
        return peak / 2**30


def run_case(
    row: dict[str, Any], key: str, fn: Callable[[], Any], n_edges: int, memory: MemoryModel,
    repeats: int,
) -> Any:  # fmt: skip
    """Time ``fn`` as ``row[key + "_ms"]`` with its peak memory, or record why it was skipped;
    returns the last result (None when skipped)."""
    reason = memory.reason_to_skip(key, n_edges)
    if reason is not None:
        row[key + "_ms"] = None
        row[key + "_skipped"] = reason
        return None
    baseline = memory.start()
    try:
        ms, result = timed(fn, memory.device, repeats)
    except torch.cuda.OutOfMemoryError as exc:
        row[key + "_ms"] = None
        row[key + "_skipped"] = f"out of memory: {str(exc).splitlines()[0]}"
        torch.cuda.empty_cache()
        return None
    row[key + "_ms"] = ms
    if n_edges:
        row[key + "_edges_per_s"] = n_edges / (ms * 1e-3)
    row[key + "_peak_gib"] = memory.finish(key, baseline, n_edges)
    return result


def edge_cache_builder(
    graph: Graph, structures: Structures, lmax: int, with_grad: bool
) -> Callable[[], Any]:
    def build() -> Any:
        with torch.set_grad_enabled(with_grad):
            vec = edge_vectors(graph, structures.positions, structures.cells)
            return build_edge_cache(graph, vec.requires_grad_(with_grad), rcut=RCUT, lmax=lmax)

    return build


def assembly_runner(graph: Graph, structures: Structures) -> Callable[[], Any]:
    """Force/virial assembly (float64 CSR sums, per-atom virials included) from a stand-in
    ∂E/∂r; the inputs live as long as the returned closure."""
    edge_vec = edge_vectors(graph, structures.positions, structures.cells)
    edge_grad = torch.randn_like(edge_vec)
    return lambda: assemble_forces_virial(graph, edge_grad, edge_vec)


def request_from_host(
    host: Structures, device: torch.device, backend: Backend
) -> Callable[[], Any]:
    return lambda: place_and_build_graph(host, RCUT, device, backend=backend)


def bench_search_paths(
    row: dict[str, Any], host: Structures, device: torch.device, n_edges: int,
    memory: MemoryModel, repeats: int,
) -> None:  # fmt: skip
    """Next to the device cell list (``neighbor``): what a request from the host pays for each
    search, the batch's packed copy to the device included (``place_and_build_graph``):
    ``neighbor_direct`` (the Triton all-pairs search), ``neighbor_host`` (vesin, canonical order
    and CSRs on the host, then one copy) and ``neighbor_auto`` (what ``auto`` picks, named in
    ``neighbor_auto_backend``); plus vesin's whole graph on the CPU."""
    windows = image_windows(host.cells, host.pbc, host.ptr, RCUT, COINCIDENT_DISTANCE)
    row["direct_candidates"] = windows.n_candidates
    row["neighbor_auto_backend"] = resolve_backend(device, "auto", windows)
    paths: dict[str, Backend] = {"neighbor_auto": "auto"}
    if device.type == "cuda" and windows.n_candidates <= DIRECT_BENCH_MAX_CANDIDATES:
        paths["neighbor_direct"] = "direct"
    if host.n_atoms <= HOST_BENCH_MAX_ATOMS:
        paths["neighbor_host"] = "vesin"
    for key, backend in paths.items():
        run_case(row, key, request_from_host(host, device, backend), n_edges, memory, repeats)
    if host.n_atoms <= HOST_BENCH_MAX_ATOMS:
        cpu_ms, _ = timed(lambda: build_graph(host, RCUT, backend="vesin"), torch.device("cpu"), 1)
        row["neighbor_vesin_cpu_ms"] = cpu_ms


def bench_size(
    n: int, device: torch.device, repeats: int, memory: MemoryModel, neighbors_only: bool
) -> dict[str, Any]:
    item = tiled(n)
    row: dict[str, Any] = {"replication": n}
    validate_ms, structures = timed(lambda: Structures.from_arrays([item]), torch.device("cpu"), 1)
    row["n_atoms"] = structures.n_atoms
    row["validate_cpu_ms"] = validate_ms
    on_device = structures.to(device)
    expected_edges = int(EDGES_PER_ATOM * structures.n_atoms)
    graph = run_case(
        row, "neighbor", lambda: build_graph(on_device, RCUT, backend="torch"), expected_edges,
        memory, repeats,
    )  # fmt: skip
    if graph is None:
        return row
    row["n_edges"] = graph.n_edges
    bench_search_paths(row, structures, device, graph.n_edges, memory, repeats)
    if neighbors_only:
        return row
    run_case(row, "assembly", assembly_runner(graph, on_device), graph.n_edges, memory, repeats)
    for lmax in (2, 3):
        for with_grad in (False, True):
            key = f"edge_cache_l{lmax}{'_grad' if with_grad else ''}"
            build = edge_cache_builder(graph, on_device, lmax, with_grad)
            cache = run_case(row, key, build, graph.n_edges, memory, repeats)
            del cache
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=list(DEFAULT_SIZES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--neighbors-only", action="store_true",
        help="only the neighbour-list columns (the crossover sweep), no edge cache or assembly",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "graph.json")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    memory = MemoryModel(device)
    for n in sorted(args.sizes):
        repeats = args.repeats if n < 8 else max(1, args.repeats // 2)
        row = bench_size(n, device, repeats, memory, args.neighbors_only)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the size's graph and boxes are gone with bench_size
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
