"""The shipped default water model loads and gives physically sane numbers for a water frame."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from service.graph.structures import StructureArrays, Structures
from service.model.potential import default_model_path, load_potential
from service.training.data import load_deepmd_system
from tests.conftest import shared_path


def test_default_model_on_a_water_frame() -> None:
    if not default_model_path().is_file():
        pytest.skip(f"no default model shipped at {default_model_path()}")
    frame = load_deepmd_system(shared_path("data", "water", "data_2"))[0]
    potential = load_potential(None, device="cpu", path="reference")
    structures = Structures.from_arrays(
        [StructureArrays(frame.numbers, frame.positions, frame.cell, frame.pbc)]
    )
    prediction = potential.predict(structures, ("energy", "forces", "stress"))
    assert prediction.forces is not None and prediction.stress is not None
    for value in (prediction.energy, prediction.forces, prediction.stress):
        assert torch.isfinite(value).all()
    assert frame.energy is not None and frame.forces is not None
    # a trained model: within 20 meV/atom of DFT and forces of the right size
    assert abs(float(prediction.energy[0]) - frame.energy) / frame.n_atoms < 0.02
    forces = prediction.forces.numpy()
    assert np.abs(forces.sum(axis=0)).max() < 1e-6 * len(forces) * np.abs(forces).max() + 1e-8
    assert np.sqrt(np.mean((forces - frame.forces) ** 2)) < 0.3
