"""CUDA-graph replay of the step: inert padding (CPU, both paths) and capture vs eager (GPU)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import types
from collections.abc import Callable

import numpy as np
import pytest
import torch
from ase import Atoms

from service.graph.cell_list import COINCIDENT_DISTANCE
from service.graph.neighbors import build_graph
from service.graph.pair_search import image_windows
from service.graph.structures import Structures
from service.model.captured import (
    RECORD_AFTER,
    BatchKey,
    Bucket,
    CapturedSteps,
    ReplayBatch,
    StaticBatch,
    StepInputs,
    StepOutputs,
    StepShape,
    _PackedOutputs,
    _Recorded,
    _WeightVersions,
    bucket_size,
    pad_inputs,
    search_and_pad,
    stage,
)
from service.model.config import preset
from service.model.potential import Potential, Prediction
from tests.graph.helpers import cuda_syncs
from tests.model.randomized import randomized_model
from tests.offline_compile import run_without_interpreter

CONFIG = preset("tiny", ["O", "H"], rcut=4.0, channels=32, n_focus=2, focus_dim=32, n_blocks=2)


def _batch() -> Structures:
    return Structures.from_atoms(_systems())


def _systems() -> list[Atoms]:
    """A molecule, a triclinic crystal and a slab (15 atoms)."""
    rng = np.random.default_rng(7)
    molecule = Atoms("OH2OH2", positions=rng.normal(0, 1.2, (6, 3)) + np.arange(6)[:, None] * 0.4)
    cell = np.array([[4.0, 0, 0], [0.7, 4.1, 0], [0.4, 0.5, 4.2]])
    triclinic = Atoms("OHHOHH", positions=rng.uniform(0, 4, (6, 3)), cell=cell, pbc=True)
    slab = Atoms("OHH", positions=[[0, 0, 0], [0.96, 0, 0], [-0.24, 0.93, 0]], cell=np.eye(3) * 3.5)
    slab.pbc = (True, True, False)
    return [molecule, triclinic, slab]


def test_bucket_sizes() -> None:
    assert bucket_size(1) == 64
    for n in [65, 100, 192, 1000, 1537, 12_289, 1_000_003]:
        b = bucket_size(n)
        assert n <= b <= 1.125 * n + 1
        assert bucket_size(b) == b  # a bucket is its own bucket
    shape = StepShape.padded(n_atoms=192, n_edges=17_064, n_structures=1)
    assert shape.n_atoms > 192 and shape.n_edges >= 17_064 and shape.n_structures == 2


@pytest.mark.parametrize(
    ("path", "precision", "rel"),
    [("reference", "fp64", 1e-13), pytest.param("fused", "fp32", 1e-5, marks=pytest.mark.slow)],
)
def test_padding_is_inert(path: str, precision: str, rel: float) -> None:
    """Real energies/forces/virials of a padded step equal the unpadded step's: exactly in fp64
    (padding touches no real atom), to fp32 rounding in fp32 (GEMM blocking follows the padded
    row count)."""
    pot = Potential(
        randomized_model(CONFIG, seed=3), device="cpu", path=path, precision=precision,
        capture=False,
    )  # fmt: skip
    structures = _batch()
    graph = build_graph(structures, CONFIG.rcut)
    types = pot.atom_types(structures)
    inputs = StepInputs(graph, structures.positions, structures.cells, types)
    plain = pot._step(inputs)
    shape = StepShape.padded(graph.n_atoms, graph.n_edges + 37, graph.n_structures)
    padded = pot._step(pad_inputs(inputs, shape, CONFIG.rcut))
    n, b = graph.n_atoms, graph.n_structures
    for got, want in [
        (padded.energy[:b], plain.energy),
        (padded.atom_energy[:n], plain.atom_energy),
        (padded.forces[:n], plain.forces),
        (padded.virial[:b], plain.virial),
    ]:
        assert float((got - want).abs().max()) <= rel * float(want.abs().max())
    assert torch.isfinite(padded.forces).all()


def test_padded_csr_is_consistent() -> None:
    structures = _batch()
    graph = build_graph(structures, CONFIG.rcut)
    inputs = StepInputs(graph, structures.positions, structures.cells, torch.zeros(15).long())
    shape = StepShape.padded(graph.n_atoms, graph.n_edges, graph.n_structures)
    g = pad_inputs(inputs, shape, CONFIG.rcut).graph
    assert g.src.shape[0] == shape.n_edges and g.atom_batch.shape[0] == shape.n_atoms
    counts = torch.bincount(g.dst, minlength=shape.n_atoms)
    torch.testing.assert_close(torch.diff(g.dst_rowptr), counts)
    torch.testing.assert_close(torch.diff(g.src_rowptr), torch.bincount(g.src, minlength=g.n_atoms))
    assert torch.equal(g.src[g.src_order].sort().values, g.src[g.src_order])
    assert bool((torch.diff(g.dst) >= 0).all())
    torch.testing.assert_close(g.edge_batch, g.atom_batch[g.dst])
    torch.testing.assert_close(
        torch.diff(g.edge_ptr), torch.bincount(g.edge_batch, minlength=shape.n_structures)
    )
    assert int(counts[graph.n_atoms :].max()) <= int(counts[: graph.n_atoms].max()) + 1


def _assert_same_inputs(got: StepInputs, want: StepInputs) -> None:
    for name in STEP_GRAPH_TENSORS:
        a, b = getattr(got.graph, name), getattr(want.graph, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for name in ("positions", "cells", "types"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name


STEP_GRAPH_TENSORS = (
    "src", "dst", "shifts", "edge_batch", "atom_batch", "dst_rowptr", "src_order", "src_rowptr",
    "edge_ptr",
)  # fmt: skip


def _replay_batch(structures: Structures, rcut: float) -> ReplayBatch:
    types = torch.arange(structures.n_atoms) % 2
    windows = image_windows(structures.cells, structures.pbc, structures.ptr, rcut, 1e-4)
    return ReplayBatch(structures, types, windows)


def _searched(batch: ReplayBatch, shape: StepShape, rcut: float) -> tuple[StepInputs, list[int]]:
    """What a recorded graph computes from the staged batch, run eagerly (interpreter)."""
    static = StaticBatch.view(stage(batch, shape, rcut, pin_memory=False), shape)
    inputs, totals = search_and_pad(static, shape, batch.windows.single_image)
    return inputs, totals.tolist()


def _single_image_batch() -> Structures:
    """Cells of at least twice the cutoff in height: one image per pair (the fast variant)."""
    rng = np.random.default_rng(11)
    box = Atoms("OH2" * 5, positions=rng.uniform(0, 12, (15, 3)), cell=np.eye(3) * 12, pbc=True)
    slab = Atoms("OHH", positions=[[0, 0, 0], [0.96, 0, 0], [-0.24, 0.93, 0]], cell=np.eye(3) * 12)
    slab.pbc = (True, True, False)
    return Structures.from_atoms([_systems()[0], box, slab])


@pytest.mark.parametrize("variant", ["multi_image", "single_image"])
def test_searched_padding_equals_pad_inputs(variant: str) -> None:
    """The recorded graph's search and padding (run eagerly here) build exactly what
    :func:`pad_inputs` builds from the graph of the host search, for a molecule, a triclinic
    crystal and a slab: a roomy bucket, a full edge bucket (no padded edge), a single dummy
    atom, several empty padding structures, an rcut/2 that is not a round number."""
    rcut = 4.0 + 1.0 / 3.0
    structures = _batch() if variant == "multi_image" else _single_image_batch()
    batch = _replay_batch(structures, rcut)
    assert batch.windows.single_image == (variant == "single_image")
    graph = build_graph(structures, rcut, backend="torch")
    n, e, b = graph.n_atoms, graph.n_edges, graph.n_structures
    plain = StepInputs(graph, structures.positions, structures.cells, batch.types)
    for shape in (
        StepShape.padded(n, e, b),
        StepShape(n_atoms=64, n_edges=e, n_structures=8),
        StepShape(n_atoms=n + 1, n_edges=e + 1, n_structures=b + 1),
    ):
        got, totals = _searched(batch, shape, rcut)
        assert totals == [e, 0]
        _assert_same_inputs(got, pad_inputs(plain, shape, rcut))


def test_overflow_and_close_pairs_are_flagged() -> None:
    """Edges beyond the bucket are counted, not stored, and leave an in-bounds graph; a pair
    closer than the minimum distance raises the flag."""
    rcut = CONFIG.rcut
    structures = _batch()
    batch = _replay_batch(structures, rcut)
    n_edges = build_graph(structures, rcut, backend="torch").n_edges
    shape = StepShape(n_atoms=64, n_edges=n_edges - 20, n_structures=4)
    inputs, totals = _searched(batch, shape, rcut)
    assert totals == [n_edges, 0]
    g = inputs.graph
    for rowptr in (g.dst_rowptr, g.src_rowptr, g.edge_ptr):
        assert int(rowptr[0]) == 0 and int(rowptr[-1]) == shape.n_edges
        assert bool((torch.diff(rowptr) >= 0).all())
    assert int(g.src.max()) < shape.n_atoms and int(g.dst.max()) < shape.n_atoms
    assert torch.equal(g.src_order.sort().values, torch.arange(shape.n_edges))

    positions = structures.positions.clone()
    positions[1] = positions[0] + torch.tensor([5e-5, 0.0, 0.0], dtype=torch.float64)
    close = Structures(
        structures.numbers, positions, structures.cells, structures.pbc, structures.ptr
    )
    _, totals = _searched(_replay_batch(close, rcut), StepShape.padded(15, 400, 3), rcut)
    assert totals[1] == 1


def test_padded_sources_keep_the_source_order() -> None:
    """The claim :func:`search_and_pad` relies on: a stable argsort of the padded ``src`` is
    the real edges' source order followed by the padded edges in place."""
    structures = _batch()
    graph = build_graph(structures, CONFIG.rcut, backend="torch")
    inputs = StepInputs(graph, structures.positions, structures.cells, torch.zeros(15).long())
    for extra in (0, 1, 37, 1000):
        shape = StepShape.padded(graph.n_atoms, graph.n_edges + extra, graph.n_structures)
        padded = pad_inputs(inputs, shape, CONFIG.rcut).graph
        assert torch.equal(torch.argsort(padded.src, stable=True), padded.src_order), extra


def test_batch_keys_and_buckets() -> None:
    structures = _batch()
    key = BatchKey.of(_replay_batch(structures, CONFIG.rcut))
    assert (key.n_atoms, key.n_structures, key.single_image) == (64, 4, False)
    shape = StepShape.padded(structures.n_atoms, 188, structures.n_structures)
    assert key.bucket(188).shape == shape and not key.bucket(188).single_image
    assert key.bucket(0).shape.n_edges == bucket_size(1)


_SM90_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from service.model import captured

kernel = captured._pad_graph_kernel
signature = {}
for name in kernel.arg_names:
    if name == "BLOCK":
        signature[name] = "constexpr"
    elif name in captured._PAD_SIZES:
        signature[name] = "i32"
    else:
        signature[name] = "*i64"
source = ASTSource(fn=kernel, signature=signature, constexprs={"BLOCK": captured._PAD_BLOCK})
compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
assert compiled.asm["cubin"]
print("ok")
"""


def test_pad_graph_kernel_compiles_for_sm90() -> None:
    """The padding kernel lowers for the H200 (CPU runs only interpret it)."""
    assert run_without_interpreter(_SM90_COMPILE).split()[-1] == "ok"


def test_packed_outputs_give_back_the_real_rows() -> None:
    generator = torch.Generator().manual_seed(1)
    padded = StepOutputs(
        energy=torch.randn(4, dtype=torch.float64, generator=generator),
        atom_energy=torch.randn(64, generator=generator),  # fp32: kept in its own dtype
        forces=torch.randn(64, 3, dtype=torch.float64, generator=generator),
        virial=torch.randn(4, 3, 3, dtype=torch.float64, generator=generator),
    )
    packed = _PackedOutputs.pack(padded, torch.tensor([17_064, 1]))
    got, n_edges, close = packed.fetch(n_atoms=15, n_structures=3)
    assert (n_edges, close) == (17_064, True)
    packed.buffer.zero_()  # a later replay overwrites the buffer, not the returned copy
    for name, rows in (("energy", 3), ("atom_energy", 15), ("forces", 15), ("virial", 3)):
        a, b = getattr(got, name), getattr(padded, name)[:rows]
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_weight_versions_see_in_place_and_replaced_weights() -> None:
    model = randomized_model(CONFIG)
    versions = _WeightVersions(model)
    key = versions.key()
    assert versions.key() == key
    with torch.no_grad():
        model.energy_bias.add_(1.0)
    assert versions.key() != key
    key = versions.key()
    model.energy_bias = torch.nn.Parameter(model.energy_bias.detach().clone())
    assert versions.key() != key


def _water(n_rep: int) -> Structures:
    from service.training.data import load_dataset
    from tests.conftest import shared_path

    frame = load_dataset([shared_path("data", "water", "data_0")])[0]
    atoms = Atoms(numbers=frame.numbers, positions=frame.positions, cell=frame.cell, pbc=True)
    return Structures.from_atoms([atoms.repeat(n_rep)])


def _max_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """Replayed outputs are on the host, eager ones on the device."""
    assert a is not None and b is not None
    return float((a.cpu() - b.cpu()).abs().max())


def _moved(s: Structures, rng: np.random.Generator, scale: float = 1.0) -> Structures:
    """``s`` with jittered positions, positions and cells scaled by ``scale``."""
    noise = torch.from_numpy(rng.normal(0, 0.02, (s.n_atoms, 3)))
    return Structures(s.numbers, (s.positions + noise) * scale, s.cells * scale, s.pbc, s.ptr)


PROPS = ("energy", "forces", "stress", "energies")


def _assert_agree(eager: Potential, replayed: Potential, s: Structures, energy_tol: float) -> None:
    a, b = eager.predict(s, PROPS), replayed.predict(s, PROPS)
    assert _max_diff(a.forces, b.forces) <= 1e-5
    assert _max_diff(a.energy, b.energy) <= energy_tol
    assert _max_diff(a.stress, b.stress) <= 1e-7


@pytest.mark.gpu
def test_captured_matches_eager_on_gpu() -> None:
    from service.model.potential import load_potential

    eager = load_potential(None, device="cuda", capture=False)
    replayed = load_potential(None, device="cuda")
    assert replayed._captured is not None
    rng = np.random.default_rng(0)
    water = _water(1)
    for _ in range(RECORD_AFTER + 2):  # new positions each time: the replay reads fresh inputs
        _assert_agree(eager, replayed, _moved(water, rng), 1e-4)
    assert replayed._captured.n_graphs == 1
    # a batch of two structures falls in another bucket and is still right; so do 1,536 atoms
    two = Structures.concat([water, water])
    for batch in (two, _water(2)):
        for _ in range(RECORD_AFTER + 1):  # recorded on the third hit, speculated on the fourth
            _assert_agree(eager, replayed, _moved(batch, rng), 1e-3)
    assert replayed._captured.n_graphs == 3
    # changing a weight drops the recorded graphs
    with torch.no_grad():
        replayed.model.energy_bias.add_(1.0)
        eager.model.energy_bias.add_(1.0)
    for _ in range(RECORD_AFTER + 1):
        _assert_agree(eager, replayed, two, 1e-4)
    assert replayed._captured.n_graphs == 1


def _collect(results: list[Prediction], pot: Potential, s: Structures) -> list[str]:
    results.append(pot.predict(s, PROPS))
    return []


EDGE_BUCKET_WALK = (0, 0, 0, 0, 1, 0, 1, 1, 1, 0, 0)
"""A batch (0) and a denser one of the same key in a bigger edge bucket (1), in this order ..."""
EDGE_BUCKET_TRACE = (
    "missed eager", "missed eager", "missed replayed", "speculated",  # recorded on the 3rd hit
    "missed eager",  # overflow of the predicted bucket: outputs discarded, host read
    "missed replayed",  # the dense bucket was predicted but has no graph; host read
    "missed eager", "missed replayed", "speculated",
    "speculated",  # predicted the dense bucket, accepted in it, the sparse one predicted next
    "speculated",
)  # fmt: skip
"""... and what each step goes through: ``CapturedSteps.speculate`` (``speculated`` or
``missed``), then, after a miss, ``CapturedSteps.run`` (``replayed`` or ``eager``)."""


def _walk_edge_buckets(
    eager: Potential, replayed: Potential, batches: tuple[Structures, Structures],
    tolerance: float, check_syncs: bool,
) -> list[Prediction]:  # fmt: skip
    """Predict :data:`EDGE_BUCKET_WALK` with both potentials; check the path each step takes,
    its agreement with the eager step within ``tolerance`` (forces and energies, stress a
    hundredth of it), and with ``check_syncs`` one host round trip per speculative replay."""
    from service.model.captured import CapturedSteps

    trace: list[str] = []
    speculate, run = CapturedSteps.speculate, CapturedSteps.run

    def traced_speculate(self: CapturedSteps, batch: ReplayBatch) -> StepOutputs | None:
        out = speculate(self, batch)
        trace.append("speculated" if out is not None else "missed")
        return out

    def traced_run(self: CapturedSteps, batch: ReplayBatch, n_edges: int) -> StepOutputs | None:
        out = run(self, batch, n_edges)
        trace.append("replayed" if out is not None else "eager")
        return out

    wanted = [eager.predict(batch, PROPS) for batch in batches]
    results: list[Prediction] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CapturedSteps, "speculate", traced_speculate)
        patch.setattr(CapturedSteps, "run", traced_run)
        for step, which in enumerate(EDGE_BUCKET_WALK):
            trace.clear()
            want = wanted[which]
            predict = functools.partial(_collect, results, replayed, batches[which])
            syncs = cuda_syncs(predict) if check_syncs else predict()
            assert " ".join(trace) == EDGE_BUCKET_TRACE[step], (step, trace)
            got = results[-1]
            assert _max_diff(got.forces, want.forces) <= tolerance, step
            assert _max_diff(got.energy, want.energy) <= 10 * tolerance, step
            assert _max_diff(got.stress, want.stress) <= tolerance / 100, step
            if check_syncs and trace == ["speculated"]:
                assert len(syncs) == 1, syncs  # the outputs' copy
    # The same batch in the same bucket, replayed after a host read or speculatively: the same
    # graph on the same padded inputs.
    for step in (3, 5, 10):
        assert _max_diff(results[step].forces, results[2].forces) == 0.0, step
    return results


class _EagerGraph:
    """A recorded graph's stand-in on the CPU: a replay runs the searched step again and
    writes its outputs where the graph would."""

    def __init__(self, run: Callable[[], _PackedOutputs], outputs: _PackedOutputs):
        self._run = run
        self._outputs = outputs

    def replay(self) -> None:
        self._outputs.buffer.copy_(self._run().buffer)


def _record_eagerly(self: CapturedSteps, bucket: Bucket, batch: ReplayBatch) -> _Recorded:
    static = StaticBatch.empty(bucket.shape, torch.device("cpu"))
    self._load(static, bucket, batch)
    outputs = self._searched_step(static, bucket)
    graph = _EagerGraph(functools.partial(self._searched_step, static, bucket), outputs)
    return _Recorded(graph, static, outputs, pool_bytes=0)  # type: ignore[arg-type]


def _water_box(scale: float) -> Structures:
    """24 atoms in a 7 Å cell (several images per pair within 4 Å), scaled by ``scale``."""
    from tests.graph.helpers import random_structure

    rng = np.random.default_rng(3)
    item = random_structure(rng, 24, np.eye(3) * 7.0, (True,) * 3, min_sep=1.0)
    positions = np.asarray(item.positions) * scale
    atoms = Atoms("OH2" * 8, positions=positions, cell=np.eye(3) * 7.0 * scale, pbc=True)
    return Structures.from_atoms([atoms])


def test_speculative_replay_follows_the_edge_bucket_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The replay logic of :class:`Potential` and :class:`CapturedSteps` on the CPU, each
    "graph" an eager run of the searched step (fp64: equal to the eager step to rounding),
    ending with a coincident pair in a batch that would have been replayed."""
    from service.graph.errors import InvalidStructureError
    from service.model import potential as potential_module
    from service.model.captured import CapturedSteps

    config = dataclasses.replace(CONFIG, n_blocks=1)
    model = randomized_model(config)
    eager, replayed = (
        Potential(model, device="cpu", path="reference", precision="fp64", capture=False)
        for _ in range(2)
    )
    properties = types.SimpleNamespace(total_memory=2**34)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: properties)
    monkeypatch.setattr(CapturedSteps, "_record", _record_eagerly)
    monkeypatch.setattr(potential_module, "resolve_backend", lambda *_: "direct")
    replayed._captured = CapturedSteps(model, replayed._step, config.rcut, torch.device("cpu"))
    batches = (_water_box(1.0), _water_box(0.85))
    edges = [build_graph(s, config.rcut, backend="torch").n_edges for s in batches]
    assert bucket_size(edges[0]) < bucket_size(edges[1])  # same key, another edge bucket
    results = _walk_edge_buckets(eager, replayed, batches, 1e-10, check_syncs=False)
    assert results[-1].forces is not None and results[-1].forces.device.type == "cpu"
    assert replayed._captured.n_graphs == 2

    positions = batches[0].positions.clone()
    positions[1] = positions[0] + 1e-5
    with pytest.raises(InvalidStructureError) as info:
        replayed.predict(dataclasses.replace(batches[0], positions=positions), PROPS)
    assert info.value.code == "coincident_atoms"


@pytest.mark.gpu
def test_speculative_replay_follows_the_edge_bucket() -> None:
    """The walk of :data:`EDGE_BUCKET_WALK` with the shipped model on the H200: predictions
    missing, an overflow, a bucket change, a smaller bucket than predicted."""
    from service.model.potential import load_potential

    eager = load_potential(None, device="cuda", capture=False)
    replayed = load_potential(None, device="cuda")
    water = _water(1)
    # Compressed 3.2 %: ~10 % more edges, and the 12.04 Å cell still holds one image per pair
    # within 6 Å (0.9 gave a multi-image search: another key, no bucket change to follow).
    dense = _moved(water, np.random.default_rng(1), scale=0.968)
    edges = [build_graph(s, 6.0, backend="torch").n_edges for s in (water, dense)]
    assert bucket_size(edges[0]) < bucket_size(edges[1])  # another edge bucket ...
    single = [
        image_windows(s.cells, s.pbc, s.ptr, 6.0, COINCIDENT_DISTANCE).single_image
        for s in (water, dense)
    ]
    assert single == [True, True]  # ... of the same key
    _walk_edge_buckets(eager, replayed, (water, dense), 1e-5, check_syncs=True)


@pytest.mark.gpu
def test_bar_model_fast_tier_replays_with_one_round_trip() -> None:
    """The bar model in the fp16x3 tier, as benchmarks/model.py times it: once its bucket is
    recorded and predicted, a 192-atom step synchronises once (the outputs' copy, which
    carries the edge count) and gives the eager step's forces."""
    from benchmarks.model import bar_config

    model = randomized_model(bar_config())
    pot = Potential(model, device="cuda", path="fused", precision="fp16x3")
    eager = Potential(model, device="cuda", path="fused", precision="fp16x3", capture=False)
    water = _water(1)
    props = ("energy", "forces")
    for _ in range(RECORD_AFTER + 1):
        pot.predict(water, props)
    results: list[Prediction] = []
    syncs = cuda_syncs(lambda: results.append(pot.predict(water, props)))
    assert len(syncs) == 1, syncs
    want = eager.predict(water, props)
    scale = float(want.forces.abs().max()) if want.forces is not None else 1.0
    assert _max_diff(results[0].forces, want.forces) <= 1e-5 * scale


def test_capture_needs_cuda() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        Potential(copy.deepcopy(randomized_model(CONFIG)), device="cpu", capture=True)


@pytest.mark.gpu
def test_threads_sharing_a_potential_get_their_own_results() -> None:
    """Two threads evaluating different same-size structures through one potential (two
    calculators sharing a loaded model) replay the same recorded graph: each must get its own
    structure's energy and forces, bit for bit what it gets alone. Energies are bitwise
    repeatable (a CSR sum, no atomics)."""
    import threading

    from service.model.potential import load_potential

    shared = load_potential(None, device="cuda")
    rng = np.random.default_rng(5)
    frames = [_moved(_water(1), rng) for _ in range(2)]
    for _ in range(RECORD_AFTER + 2):  # record the bucket; from here on every step replays it
        for s in frames:
            shared.predict(s, ("energy", "forces"))
    alone = [shared.predict(s, ("energy", "forces")) for s in frames]
    for s, want in zip(frames, alone, strict=True):
        again = shared.predict(s, ("energy", "forces"))
        assert torch.equal(again.energy.cpu(), want.energy.cpu())
    mismatches: list[object] = []  # a thread's failures (an exception would end only it)

    def evaluate(k: int) -> None:
        want = alone[k]
        assert want.forces is not None
        for _ in range(50):
            try:
                got = shared.predict(frames[k], ("energy", "forces"))
            except Exception as exc:  # reported below, in the test's own thread
                mismatches.append(exc)
                return
            same_energy = torch.equal(got.energy.cpu(), want.energy.cpu())
            if not (
                same_energy
                and got.forces is not None
                and torch.equal(got.forces.cpu(), want.forces.cpu())
            ):
                mismatches.append(k)

    threads = [threading.Thread(target=evaluate, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert shared._captured is not None and shared._captured.n_graphs >= 1
    assert mismatches == []
