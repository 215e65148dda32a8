"""One energy+force step issues no host round trip once warm (the CPU stand-in for the CUDA
sync audit of ``benchmarks/sync_audit.py``): no upload of host data, no scalar read, no
data-dependent shape, on the reference path and on the fused path (Triton interpreter). On
CUDA, a step replayed from a recorded graph, neighbour search included, makes exactly one: the
copy of its outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase import Atoms

from benchmarks.sync_audit import audit_step, audited
from service.graph.structures import Structures
from service.model.config import ModelConfig
from so2kernels._dispatch import INTERPRET
from so2kernels.segment import csr_from_index, validate_csr
from tests.model.randomized import randomized_model

CONFIG = ModelConfig(
    type_map=("O", "H"), channels=32, lmax=2, n_blocks=1, mixing_layers=2, n_focus=1,
    focus_dim=32, radial_so2_mode="degree_channel", radial_so2_rank=1, n_atten_head=1,
    ffn="s2", n_radial=8, rcut=3.0,
)  # fmt: skip


def _two_waters() -> Structures:
    molecule = np.array([[0.0, 0.0, 0.0], [0.96, 0.0, 0.0], [-0.24, 0.93, 0.0]])
    positions = np.concatenate([molecule + 1.0, molecule + np.array([2.6, 2.2, 1.9])])
    atoms = Atoms("OH2OH2", positions=positions, cell=np.eye(3) * 4.5, pbc=True)
    return Structures.from_atoms([atoms])


def test_audit_detects_a_scalar_read() -> None:
    order, row_ptr = csr_from_index(torch.tensor([0, 1, 1]), 2)
    with audited(torch.device("cpu")) as log:
        validate_csr(order, row_ptr)
    assert log.events and log.events[0].kind == "aten::_local_scalar_dense"
    assert any("so2kernels/segment.py" in frame for frame in log.events[0].stack)


@pytest.mark.parametrize(
    "fused",
    [
        False,
        pytest.param(
            True,
            marks=[
                pytest.mark.slow,
                pytest.mark.skipif(not INTERPRET, reason="fused path on CPU needs the interpreter"),
            ],
        ),
    ],
)
def test_energy_force_step_has_no_host_round_trip(fused: bool) -> None:
    model = randomized_model(CONFIG).eval()
    structures = _two_waters()
    types = torch.tensor([0, 1, 1, 0, 1, 1])
    log = audit_step(model, structures, types, torch.device("cpu"), fused=fused, warmup=1)
    report = "\n".join(f"{e.kind}: {' <- '.join(reversed(e.stack[-4:]))}" for e in log.events)
    assert not log.events, report


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
def test_cuda_step_has_no_sync(fused: bool) -> None:
    """On the device: CUDA's own sync detector and the dispatch audit, one water pair box."""
    model = randomized_model(CONFIG).to("cuda").eval()
    types = torch.tensor([0, 1, 1, 0, 1, 1])
    log = audit_step(model, _two_waters(), types, torch.device("cuda"), fused=fused)
    report = "\n".join(f"{e.kind}: {' <- '.join(reversed(e.stack[-4:]))}" for e in log.events)
    assert not log.events, report


@pytest.mark.gpu
def test_replayed_step_makes_one_round_trip() -> None:
    """A host batch replayed in its predicted bucket, search included: one synchronising call
    (the copy of the outputs, which carries the edge count) and the eager step's results."""
    from service.model.captured import RECORD_AFTER
    from service.model.potential import Potential, Prediction
    from tests.graph.helpers import cuda_syncs

    model = randomized_model(CONFIG)
    eager = Potential(model, device="cuda", capture=False)
    replayed = Potential(model, device="cuda")
    props = ("energy", "forces", "stress")
    waters = _two_waters()
    for _ in range(RECORD_AFTER + 1):
        replayed.predict(waters, props)
    torch.cuda.synchronize()
    rng = np.random.default_rng(5)
    for _ in range(3):
        noise = torch.from_numpy(rng.normal(0.0, 0.02, (waters.n_atoms, 3)))
        moved = Structures(
            waters.numbers, waters.positions + noise, waters.cells, waters.pbc, waters.ptr
        )
        results: list[Prediction] = []
        syncs = cuda_syncs(lambda: results.append(replayed.predict(moved, props)))  # noqa: B023
        assert len(syncs) == 1, syncs
        want = eager.predict(moved, props)
        for name in props:
            got, expected = getattr(results[0], name).cpu(), getattr(want, name).cpu()
            # The replay sums in its padded bucket's order: fp32 rounding relative to the
            # property's scale (this random model's energy is ~3.2 keV: 5e-4 eV is 3 ulps).
            tolerance = max(1e-5, 1e-6 * float(expected.abs().max()))
            assert float((got - expected).abs().max()) <= tolerance, name
