"""CUDA-graph replay of the step: inert padding (CPU, both paths) and capture vs eager (GPU)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from ase import Atoms

from service.graph.neighbors import build_graph
from service.graph.structures import Structures
from service.model.captured import (
    RECORD_AFTER,
    StepInputs,
    StepShape,
    bucket_size,
    pad_inputs,
)
from service.model.config import preset
from service.model.potential import Potential
from tests.model.randomized import randomized_model

CONFIG = preset("tiny", ["O", "H"], rcut=4.0, channels=32, n_focus=2, focus_dim=32, n_blocks=2)


def _batch() -> Structures:
    rng = np.random.default_rng(7)
    molecule = Atoms("OH2OH2", positions=rng.normal(0, 1.2, (6, 3)) + np.arange(6)[:, None] * 0.4)
    cell = np.array([[4.0, 0, 0], [0.7, 4.1, 0], [0.4, 0.5, 4.2]])
    triclinic = Atoms("OHHOHH", positions=rng.uniform(0, 4, (6, 3)), cell=cell, pbc=True)
    slab = Atoms("OHH", positions=[[0, 0, 0], [0.96, 0, 0], [-0.24, 0.93, 0]], cell=np.eye(3) * 3.5)
    slab.pbc = (True, True, False)
    return Structures.from_atoms([molecule, triclinic, slab])


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


def _water(n_rep: int) -> Structures:
    from service.training.data import load_dataset
    from tests.conftest import shared_path

    frame = load_dataset([shared_path("data", "water", "data_0")])[0]
    atoms = Atoms(numbers=frame.numbers, positions=frame.positions, cell=frame.cell, pbc=True)
    return Structures.from_atoms([atoms.repeat(n_rep)])


@pytest.mark.gpu
def test_captured_matches_eager_on_gpu() -> None:
    from service.model.potential import load_potential

    eager = load_potential(None, device="cuda")
    eager._captured = None
    replayed = load_potential(None, device="cuda")
    assert replayed._captured is not None
    props = ("energy", "forces", "stress", "energies")
    rng = np.random.default_rng(0)
    for step in range(4):  # new positions each time: the replay must read fresh inputs
        s = _water(1)
        s = Structures(
            numbers=s.numbers,
            positions=s.positions + torch.from_numpy(rng.normal(0, 0.02, (s.n_atoms, 3))),
            cells=s.cells,
            pbc=s.pbc,
            ptr=s.ptr,
        )
        a, b = eager.predict(s, props), replayed.predict(s, props)
        assert a.forces is not None and b.forces is not None
        assert float((a.forces - b.forces).abs().max()) <= 1e-5, step
        assert float((a.energy - b.energy).abs().max()) <= 1e-4
        assert float((a.stress - b.stress).abs().max()) <= 1e-7  # type: ignore[operator]
    assert replayed._captured.n_graphs >= 1
    # a batch of two structures falls in another bucket and is still right; 1,536 atoms build
    # their graph on the device and are padded there
    two = Structures.concat([_water(1), _water(1)])
    for batch in (two, _water(2)):
        for _ in range(RECORD_AFTER):  # a bucket is recorded on its third hit
            a, b = eager.predict(batch, props), replayed.predict(batch, props)
        assert float((a.forces - b.forces).abs().max()) <= 1e-5  # type: ignore[operator]
        assert float((a.energy - b.energy).abs().max()) <= 1e-3
    # changing a weight drops the recorded graphs
    with torch.no_grad():
        replayed.model.energy_bias.add_(1.0)
        eager.model.energy_bias.add_(1.0)
    for _ in range(RECORD_AFTER):
        a, b = eager.predict(two, props), replayed.predict(two, props)
        assert float((a.energy - b.energy).abs().max()) <= 1e-4


def test_capture_needs_cuda() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        Potential(copy.deepcopy(randomized_model(CONFIG)), device="cpu", capture=True)
