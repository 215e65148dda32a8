"""Direct pair search: the same graph as the cell list and vesin, bit for bit (CPU interpreter,
an sm_90 compile, and a CUDA comparison at a few thousand atoms for the lead); its bounded,
host-read-free variant for recorded steps."""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from service.graph import pair_search
from service.graph.errors import InvalidStructureError
from service.graph.neighbors import (
    Graph,
    build_graph,
    place_and_build_graph,
    place_and_build_graph_carrying,
    resolve_backend,
    transfer_packed,
)
from service.graph.pair_search import (
    GPU_TILES,
    ImageWindowMemo,
    ImageWindows,
    Tiles,
    direct_pairs,
    image_windows,
)
from service.graph.structures import StructureArrays, Structures
from tests.conftest import shared_path
from tests.graph.helpers import cuda_syncs, random_cell, random_structure
from tests.offline_compile import run_without_interpreter

RCUT = 4.5
GRAPH_TENSORS = (
    "src", "dst", "shifts", "edge_batch", "atom_batch", "dst_rowptr", "src_order", "src_rowptr",
    "edge_ptr",
)  # fmt: skip


def assert_same_graph(got: Graph, want: Graph) -> None:
    assert (got.n_atoms, got.n_structures) == (want.n_atoms, want.n_structures)
    for name in GRAPH_TENSORS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == torch.int64, name
        assert torch.equal(a.cpu(), b.cpu()), name


def assert_all_backends_agree(structures: Structures, rcut: float = RCUT) -> Graph:
    direct = build_graph(structures, rcut, backend="direct")
    for other in ("torch", "vesin"):
        assert_same_graph(direct, build_graph(structures, rcut, backend=other))
    return direct


def windows_of(structures: Structures, rcut: float = RCUT) -> ImageWindows:
    return image_windows(structures.cells, structures.pbc, structures.ptr, rcut, 1e-4)


# Geometries


def water_frame() -> StructureArrays:
    frame = shared_path("data", "water", "data_0")
    coord = np.load(frame / "set.000" / "coord.npy")[0].reshape(-1, 3)
    cell = np.load(frame / "set.000" / "box.npy")[0].reshape(3, 3)
    types = np.loadtxt(frame / "type.raw", dtype=np.int64)
    return StructureArrays(numbers=np.where(types == 0, 8, 1), positions=coord, cell=cell)


def thin_cell(rng: np.random.Generator) -> StructureArrays:
    """One axis 2.1 Å thick, well below the cutoff: several images per pair along it."""
    cell = random_cell(rng, 7.0, skew=0.2)
    cell[2] *= 2.1 / np.linalg.norm(cell[2])
    return random_structure(rng, 10, cell, (True, True, True), min_sep=0.6)


def small_cell(rng: np.random.Generator) -> StructureArrays:
    """Below 2·rcut in every direction: atoms see their own images."""
    return random_structure(rng, 5, random_cell(rng, 3.0, skew=0.25), (True, True, True))


def slab_zero_c(rng: np.random.Generator) -> StructureArrays:
    cell = np.array([[6.0, 0.0, 0.0], [1.5, 5.5, 0.0], [0.0, 0.0, 0.0]])
    return random_structure(rng, 14, cell, (True, True, False))


def mixed_pbc(rng: np.random.Generator) -> StructureArrays:
    return random_structure(rng, 12, random_cell(rng, 5.0), (True, False, True))


def molecule(rng: np.random.Generator) -> StructureArrays:
    return random_structure(rng, 16, None, (False, False, False), spread=7.0)


def unwrapped(rng: np.random.Generator) -> StructureArrays:
    """Atoms dozens of cells away from the origin cell, on both sides (never wrapped)."""
    item = random_structure(rng, 18, random_cell(rng, 6.5), (True, True, True))
    cell = np.asarray(item.cell)
    far = rng.integers(-40, 40, (18, 3)) @ cell + rng.uniform(-3.0, 3.0, (18, 3))
    return replace(item, positions=np.asarray(item.positions) + far)


def no_pairs() -> StructureArrays:
    return StructureArrays(numbers=[1, 8], positions=[[0.0, 0.0, 0.0], [9.0, 1.0, -2.0]])


def one_atom_molecule() -> StructureArrays:
    return StructureArrays(numbers=[6], positions=[[0.3, -0.2, 7.0]])


def one_atom_crystal() -> StructureArrays:
    return StructureArrays(numbers=[29], positions=[[5.0, -3.0, 1.0]], cell=np.eye(3) * 2.55)


def geometries() -> list[tuple[str, StructureArrays]]:
    rng = np.random.default_rng(20261130)
    triclinic = [random_structure(rng, 24, random_cell(rng, 7.5), (True,) * 3) for _ in range(2)]
    return [
        ("triclinic0", triclinic[0]),
        ("triclinic1", triclinic[1]),
        ("thin_cell", thin_cell(rng)),
        ("small_cell", small_cell(rng)),
        ("slab_zero_c", slab_zero_c(rng)),
        ("mixed_pbc", mixed_pbc(rng)),
        ("molecule", molecule(rng)),
        ("unwrapped", unwrapped(rng)),
        ("no_pairs", no_pairs()),
        ("one_atom_molecule", one_atom_molecule()),
        ("one_atom_crystal", one_atom_crystal()),
    ]


GEOMETRIES = geometries()


# CPU (interpreter) tests


def test_water_frame_equals_cell_list_and_vesin() -> None:
    structures = Structures.from_arrays([water_frame()])
    assert windows_of(structures, 6.0).single_image  # rcut < half the box: one image per pair
    graph = assert_all_backends_agree(structures, 6.0)
    assert graph.n_edges > 192 * 60


@pytest.mark.parametrize(("name", "item"), GEOMETRIES, ids=[g[0] for g in GEOMETRIES])
def test_geometry_equals_cell_list_and_vesin(name: str, item: StructureArrays) -> None:
    assert_all_backends_agree(Structures.from_arrays([item]))


def test_window_sizes() -> None:
    """K = floor(2·c) + 1 per periodic axis (several where the cell is thin), 1 on open axes."""
    by_name = dict(GEOMETRIES)
    thin = windows_of(Structures.from_arrays([by_name["thin_cell"]]))
    assert thin.table[0, 14] >= 5 and not thin.single_image
    slab = windows_of(Structures.from_arrays([by_name["slab_zero_c"]]))
    assert slab.table[0, 14] == 1 and slab.table[0, 11] == 0.0
    assert not slab.table[0, 6:9].any()  # no dual vector on the open axis
    alone = windows_of(Structures.from_arrays([by_name["molecule"]]))
    assert alone.single_image and alone.n_candidates == 16**2


def test_window_memo_returns_the_table_of_the_same_inputs() -> None:
    """A repeated batch (MD at a fixed cell) gets its earlier table; another cell, periodicity,
    atom split or cutoff gets its own, equal to a fresh one; the oldest entries leave first."""
    memo = ImageWindowMemo(size=2)
    by_name = dict(GEOMETRIES)
    base = Structures.from_arrays([by_name["triclinic0"], by_name["thin_cell"]])

    def of(batch: Structures, rcut: float = RCUT) -> ImageWindows:
        return memo(batch.cells, batch.pbc, batch.ptr, rcut, 1e-4)

    first = of(base)
    moved = replace(base, positions=base.positions + 0.25)  # positions are not in the table
    assert of(moved) is first
    variants = [
        replace(base, cells=base.cells * 1.01),
        replace(base, pbc=base.pbc & torch.tensor([True, True, False])),
        replace(base, ptr=torch.tensor([0, 20, int(base.ptr[-1])])),
    ]
    for other in variants:
        got = of(other)
        assert got is not first
        want = windows_of(other)
        np.testing.assert_array_equal(got.table, want.table)
        assert (got.n_candidates, got.single_image) == (want.n_candidates, want.single_image)
    again = of(base)  # three other batches since: evicted, built afresh
    assert again is not first
    np.testing.assert_array_equal(again.table, first.table)
    assert of(base) is again
    assert of(base, RCUT + 1.0) is not again  # the cutoff is in the key


def test_window_memo_keeps_no_refusal() -> None:
    cell = torch.tensor([[[3.0, 0.0, 0.0], [6.0, 0.0, 0.0], [0.0, 0.0, 4.0]]], dtype=torch.float64)
    memo = ImageWindowMemo()
    for _ in range(2):
        with pytest.raises(InvalidStructureError, match="linearly dependent"):
            memo(cell, torch.ones(1, 3, dtype=torch.bool), torch.tensor([0, 2]), RCUT, 1e-4)


def test_mixed_batch_equals_cell_list_vesin_and_separate_graphs() -> None:
    items = [item for _, item in GEOMETRIES]
    batch = Structures.from_arrays(items)
    graph = assert_all_backends_agree(batch)
    ptr = batch.ptr.tolist()
    for b, item in enumerate(items):
        alone = build_graph(Structures.from_arrays([item]), RCUT, backend="direct")
        lo, hi = int(graph.edge_ptr[b]), int(graph.edge_ptr[b + 1])
        assert torch.equal(graph.src[lo:hi] - ptr[b], alone.src)
        assert torch.equal(graph.dst[lo:hi] - ptr[b], alone.dst)
        assert torch.equal(graph.shifts[lo:hi], alone.shifts)
        assert bool((graph.edge_batch[lo:hi] == b).all())


def test_gpu_tiles_and_multi_step_walks_agree() -> None:
    """The GPU launch shape (one destination per program) and blocks far smaller than a row's
    candidates (the running count across steps) give the same edges as the default tiles."""
    names = ("thin_cell", "small_cell", "slab_zero_c", "no_pairs")
    batch = Structures.from_arrays([item for name, item in GEOMETRIES if name in names])
    windows = windows_of(batch)
    table = torch.from_numpy(windows.table)
    results = []
    for tiles in (None, GPU_TILES, Tiles(rows=1, block=32), Tiles(rows=8, block=64)):
        args = (batch.positions, batch.cells, batch.ptr, batch.atom_batch, table)
        results.append(direct_pairs(*args, single_image=windows.single_image, tiles=tiles))
    first = results[0]
    assert first is not None
    for other in results[1:]:
        assert other is not None
        compared = ("dst", "src", "shifts", "edge_batch", "dst_rowptr", "src_rowptr", "edge_ptr")
        for name in compared:
            assert torch.equal(getattr(first, name), getattr(other, name)), name


def test_bounded_search_equals_the_direct_search() -> None:
    """The host-read-free search of a padded batch (dummy rows all at the origin, which would be
    close pairs if they were searched; a padding structure) into arrays of fixed capacity: the
    stored edges are the first ``min(E, capacity)`` of the direct search, the counts and the
    totals are the same whatever the capacity."""
    names = ("thin_cell", "small_cell", "slab_zero_c", "molecule")
    batch = Structures.from_arrays([item for name, item in GEOMETRIES if name in names])
    windows = windows_of(batch)
    table = torch.from_numpy(windows.table)
    want = direct_pairs(
        batch.positions, batch.cells, batch.ptr, batch.atom_batch, table,
        single_image=windows.single_image,
    )  # fmt: skip
    assert want is not None
    n, b, e = batch.n_atoms, batch.n_structures, want.src.shape[0]
    dummies = 5
    padded = (
        torch.cat([batch.positions, torch.zeros(dummies, 3, dtype=torch.float64)]),
        torch.cat([batch.cells, torch.eye(3, dtype=torch.float64)[None]]),
        torch.cat([batch.ptr, torch.tensor([n + dummies])]),
        torch.cat([batch.atom_batch, torch.full((dummies,), b)]),
        torch.cat([table, torch.zeros(1, table.shape[1], dtype=torch.float64)]),
        torch.tensor([n]),
    )
    for capacity, tiles in ((e + 7, None), (e, Tiles(rows=8, block=64)), (e - 9, None)):
        got = pair_search.bounded_direct_pairs(
            *padded, capacity, single_image=windows.single_image, tiles=tiles
        )
        kept = min(e, capacity)
        for name in ("dst", "src", "shifts", "edge_batch"):
            assert getattr(got, name).shape[0] == capacity, name
            assert torch.equal(getattr(got, name)[:kept], getattr(want, name)[:kept]), name
        for name in ("dst_rowptr", "src_rowptr"):
            counts = getattr(got, name)
            assert torch.equal(counts[: n + 1], getattr(want, name)), name
            assert bool((counts[n:] == e).all()), name
        assert got.totals.tolist() == [e, 0]


def test_float32_positions_equal_cell_list() -> None:
    items = [item for name, item in GEOMETRIES if name in ("triclinic0", "thin_cell", "molecule")]
    batch = Structures.from_arrays(items)
    single = replace(batch, positions=batch.positions.float(), cells=batch.cells.float())
    direct = build_graph(single, RCUT, backend="direct")
    assert_same_graph(direct, build_graph(single, RCUT, backend="torch"))


def test_coincident_atoms_raise_like_the_cell_list() -> None:
    close = StructureArrays(
        numbers=[1, 1, 1], positions=[[0.0, 0, 0], [1.0, 0, 0], [1.0, 0, 5e-5]], cell=np.eye(3) * 9
    )
    items = [GEOMETRIES[0][1], no_pairs(), close]
    batch = Structures.from_arrays(items, check_coincident=False)
    errors = []
    for backend in ("direct", "torch"):
        with pytest.raises(InvalidStructureError) as info:
            build_graph(batch, RCUT, backend=backend)
        errors.append(info.value)
    assert errors[0].code == "coincident_atoms" and errors[0].index == 2
    assert errors[0].to_dict() == errors[1].to_dict()


def test_singular_cell_is_refused() -> None:
    cell = torch.tensor([[[3.0, 0.0, 0.0], [6.0, 0.0, 0.0], [0.0, 0.0, 4.0]]], dtype=torch.float64)
    batch = Structures(
        numbers=torch.tensor([1, 1]),
        positions=torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64),
        cells=cell,
        pbc=torch.ones(1, 3, dtype=torch.bool),
        ptr=torch.tensor([0, 2]),
    )
    with pytest.raises(InvalidStructureError) as info:
        build_graph(batch, RCUT, backend="direct")
    assert info.value.code == "singular_cell" and info.value.index == 0


def test_place_and_build_graph_on_the_host_device() -> None:
    """A CPU target keeps the batch where it is and builds the host graph (vesin)."""
    host = Structures.from_arrays([item for _, item in GEOMETRIES[:4]])
    placed, graph = place_and_build_graph(host, RCUT, "cpu")
    assert placed.positions is host.positions
    assert_same_graph(graph, build_graph(host, RCUT, backend="vesin"))


def test_carried_tensors_come_back_unchanged() -> None:
    host = Structures.from_arrays([item for _, item in GEOMETRIES[:3]])
    types = torch.arange(host.n_atoms) % 3
    _, graph, (carried,) = place_and_build_graph_carrying(host, RCUT, "cpu", [types])
    assert torch.equal(carried, types)
    assert_same_graph(graph, place_and_build_graph(host, RCUT, "cpu")[1])


class _OpLog(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Names of the aten ops dispatched, ``"<host read>"`` where a tensor was read back and
    ``"<pass>"`` for each launch of the search kernel (whose own workings are not logged: the
    interpreter runs a kernel with aten ops)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(func._schema.name.removeprefix("aten::"))
        return func(*args, **(kwargs or {}))

    def read(self, tensor: torch.Tensor) -> Any:
        self.names.append("<host read>")
        return tensor.numpy().tolist()

    def kernel(self, kernel: Any) -> Any:
        log = self

        class Logged:
            def __getitem__(self, grid: Any) -> Any:
                def launch(*args: Any, **kwargs: Any) -> None:
                    log.names.append("<pass>")
                    with _disable_current_modes():
                        kernel[grid](*args, **kwargs)

                return launch

        return Logged()


def test_only_the_second_pass_follows_the_host_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device idles from the edge-count read until the host has launched what follows it
    (the request waits), so only the edge arrays' allocations and the second pass are left
    there: both CSRs and the structures' edge offsets are launched before the read."""
    batch = Structures.from_arrays([item for _, item in GEOMETRIES[:3]])
    windows = windows_of(batch)
    args = (batch.positions, batch.cells, batch.ptr, batch.atom_batch)
    table = torch.from_numpy(windows.table)
    log = _OpLog()
    monkeypatch.setattr(
        pair_search, "_direct_pairs_kernel", log.kernel(pair_search._direct_pairs_kernel)
    )
    monkeypatch.setattr(torch.Tensor, "tolist", lambda tensor: log.read(tensor))
    with log:
        found = direct_pairs(*args, table, single_image=windows.single_image)
    assert found is not None
    after = log.names[log.names.index("<host read>") + 1 :]
    assert [n for n in after if not n.startswith(("slice", "view", "detach"))] == [
        "empty", "empty_like", "empty", "empty_like", "<pass>",
    ]  # fmt: skip


def test_transfer_packed_round_trip() -> None:
    tensors = [
        torch.arange(7, dtype=torch.int64),
        torch.tensor([[True, False, True]]),
        torch.randn(5, 3, dtype=torch.float64),
        torch.randn(3, dtype=torch.float32),
        torch.zeros(0, 3, dtype=torch.int64),
        torch.arange(4, dtype=torch.int64),
    ]
    moved = transfer_packed(tensors, torch.device("cpu"))
    for a, b in zip(tensors, moved, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


_SM90_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from service.graph import pair_search as ps

pointers = {"positions": "*{x}", "cells": "*{x}", "table": "*fp64", "ptr": "*i64",
            "atom_batch": "*i64", "atom_count": "*i64", "rowptr": "*i64", "close_flag": "*i64",
            "src_out": "*i64", "dst_out": "*i64", "shift_out": "*i64", "batch_out": "*i64",
            "src_rowptr": "*i64", "edge_capacity": "i64"}
consts = ("TABLE_ROW", "ROWS", "BLOCK", "WRITE", "SINGLE_IMAGE")
contracted = 0
for dtype in ("fp64", "fp32"):
    for write in (False, True):
        for single in (False, True):
            signature = {k: v.format(x=dtype) for k, v in pointers.items()}
            signature.update(dict.fromkeys(consts, "constexpr"))
            values = {"TABLE_ROW": ps.TABLE_WIDTH, "ROWS": ps.GPU_TILES.rows,
                      "BLOCK": ps.GPU_TILES.block, "WRITE": write, "SINGLE_IMAGE": single}
            source = ASTSource(fn=ps._direct_pairs_kernel, signature=signature, constexprs=values)
            kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                    options={"num_warps": 4, "enable_fp_fusion": False})
            assert kernel.asm["cubin"]
            contracted += kernel.asm["ptx"].count("fma.rn.f")
print(contracted)
"""


def test_kernel_compiles_for_sm90_without_contraction() -> None:
    """The kernel lowers for the H200 in every variant, and no multiply-add is fused (the
    distances must round like the torch backend's separate products and sums)."""
    assert int(run_without_interpreter(_SM90_COMPILE).split()[-1]) == 0


# GPU (the lead runs these on the H200)


def _jittered_lattice(
    rng: np.random.Generator, per_axis: int, cell: np.ndarray, pbc: tuple[bool, bool, bool]
) -> StructureArrays:
    """per_axis³ atoms on a jittered grid of the cell (never closer than ~0.6 grid steps), a
    quarter of them moved by a few lattice vectors along the periodic axes."""
    grid = np.stack(np.meshgrid(*[np.arange(per_axis)] * 3, indexing="ij"), -1).reshape(-1, 3)
    frac = (grid + 0.5 + rng.uniform(-0.2, 0.2, grid.shape)) / per_axis
    moved = rng.integers(-3, 4, frac.shape) * np.asarray(pbc) * (rng.random((len(frac), 1)) < 0.25)
    positions = (frac + moved) @ cell
    numbers = rng.integers(1, 10, len(frac))
    return StructureArrays(numbers=numbers, positions=positions, cell=cell, pbc=pbc)


@functools.cache
def _gpu_batch() -> tuple[StructureArrays, ...]:
    rng = np.random.default_rng(99)
    return (
        _jittered_lattice(rng, 14, random_cell(rng, 26.0, skew=0.2), (True, True, True)),
        random_structure(rng, 60, random_cell(rng, 4.0), (True,) * 3, min_sep=0.8),
        _jittered_lattice(rng, 10, random_cell(rng, 20.0), (True, True, False)),
        random_structure(rng, 400, None, (False,) * 3, spread=16.0, min_sep=1.0),
        unwrapped(rng),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["triclinic", "thin", "slab", "molecule", "batch"])
def test_cuda_direct_equals_cell_list(which: str) -> None:
    items = _gpu_batch()
    chosen = {
        "triclinic": items[:1], "thin": items[1:2], "slab": items[2:3], "molecule": items[3:4],
        "batch": items,
    }[which]  # fmt: skip
    host = Structures.from_arrays(list(chosen))
    device = host.to("cuda")
    direct = build_graph(device, 6.0, backend="direct")
    assert direct.src.is_cuda
    assert_same_graph(direct, build_graph(device, 6.0, backend="torch"))
    numbers = host.numbers.clone()
    placed, auto, (carried,) = place_and_build_graph_carrying(host, 6.0, "cuda", [numbers])
    assert placed.positions.is_cuda and torch.equal(placed.positions.cpu(), host.positions)
    assert carried.is_cuda and torch.equal(carried.cpu(), numbers)
    assert_same_graph(auto, direct)


@pytest.mark.gpu
def test_cuda_water_tiles_equal_vesin() -> None:
    item = water_frame()
    cell = np.asarray(item.cell)
    grid = np.stack(np.meshgrid(*[np.arange(2)] * 3, indexing="ij"), -1).reshape(-1, 3)
    positions = (np.asarray(item.positions)[None] + (grid @ cell)[:, None]).reshape(-1, 3)
    big = StructureArrays(
        numbers=np.tile(np.asarray(item.numbers), 8), positions=positions, cell=cell * 2
    )
    host = Structures.from_arrays([item, big])
    placed, graph = place_and_build_graph(host, 6.0, "cuda", backend="direct")
    assert torch.equal(placed.cells.cpu(), host.cells)
    assert_same_graph(graph, build_graph(host, 6.0, backend="vesin"))
    _, again = place_and_build_graph(host, 6.0, "cuda", backend="direct")
    assert_same_graph(again, graph)  # deterministic (the source counts use atomics)


@pytest.mark.gpu
def test_cuda_request_path_reads_the_device_once() -> None:
    """A host batch's trip to the device and its direct search: one synchronising call (the
    edge count), no blocking copy."""
    host = Structures.from_arrays([water_frame()])
    assert resolve_backend(torch.device("cuda"), "auto", windows_of(host, 6.0)) == "direct"
    place_and_build_graph(host, 6.0, "cuda")  # compiles the kernels
    torch.cuda.synchronize()
    syncs = cuda_syncs(lambda: place_and_build_graph(host, 6.0, "cuda"))
    assert len(syncs) == 1, syncs
