"""Physical consistency of Potential on random (fully active) models.

Finite differences run in float64 (precision="fp64", reference path) so they test the exact
gradient; invariances run in the production fp32 path at 1e-6 relative.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from ase import Atoms
from ase.build import make_supercell

from service.model.config import preset

pytest.importorskip("service.graph.edge_cache")
pytest.importorskip("service.graph.assembly")

from service.graph.structures import Structures
from service.model.potential import Potential
from tests.model.randomized import randomized_model

CONFIG = preset("tiny", ["O", "H"], rcut=4.0, channels=32, n_focus=2, focus_dim=32, n_blocks=2)


@pytest.fixture(scope="module")
def model():  # type: ignore[no-untyped-def]
    return randomized_model(CONFIG, seed=1)


def _pot(model, precision: str = "fp32") -> Potential:  # type: ignore[no-untyped-def]
    return Potential(copy.deepcopy(model), device="cpu", path="reference", precision=precision)


def _molecule() -> Atoms:
    rng = np.random.default_rng(3)
    pos = np.array([[0.0, 0.0, 0.0], [0.96, 0.0, 0.0], [-0.24, 0.93, 0.0]])
    offsets = np.array([[0.0, 0.0, 0.0], [2.1, 0.4, 0.3], [0.3, 2.4, -0.5]])
    pos = (pos[None] + offsets[:, None]).reshape(-1, 3) + rng.normal(0, 0.05, (9, 3))
    return Atoms("OH2OH2OH2", positions=pos)


def _cubic() -> Atoms:
    rng = np.random.default_rng(4)
    return Atoms("O2H4", positions=rng.uniform(0, 3.6, (6, 3)), cell=np.eye(3) * 3.6, pbc=True)


def _triclinic() -> Atoms:
    cell = np.array([[4.0, 0, 0], [0.7, 4.1, 0], [0.4, 0.5, 4.2]])
    pos = np.array([[0.0, 0.0, 0.0], [0.96, 0.0, 0.0], [-0.24, 0.93, 0.0], [2.0, 2.1, 1.9]])
    return Atoms("OHHO", positions=pos, cell=cell, pbc=True)


SYSTEMS = {"molecule": _molecule, "cubic_small_cell": _cubic, "triclinic": _triclinic}


def _predict(pot: Potential, atoms: Atoms, props=("energy", "forces")):  # type: ignore[no-untyped-def]
    return pot.predict(Structures.from_atoms([atoms]), props)


def _energy(pot: Potential, atoms: Atoms) -> float:
    return float(_predict(pot, atoms, ("energy",)).energy[0])


@pytest.mark.parametrize("name", list(SYSTEMS))
def test_forces_are_minus_energy_gradient(model, name: str) -> None:  # type: ignore[no-untyped-def]
    pot = _pot(model, "fp64")
    atoms = SYSTEMS[name]()
    forces = _predict(pot, atoms).forces.numpy()
    h = 1e-4
    fd = np.zeros_like(forces)
    for i in range(len(atoms)):
        for k in range(3):
            plus, minus = atoms.copy(), atoms.copy()
            plus.positions[i, k] += h
            minus.positions[i, k] -= h
            fd[i, k] = -(_energy(pot, plus) - _energy(pot, minus)) / (2 * h)
    assert np.abs(forces - fd).max() <= 1e-4 * max(np.abs(fd).max(), 1e-3)


@pytest.mark.parametrize("name", ["cubic_small_cell", "triclinic"])
def test_stress_is_strain_derivative(model, name: str) -> None:  # type: ignore[no-untyped-def]
    pot = _pot(model, "fp64")
    atoms = SYSTEMS[name]()
    stress = _predict(pot, atoms, ("energy", "stress")).stress.numpy()[0]
    h = 1e-5
    volume = atoms.get_volume()
    fd = np.zeros((3, 3))
    for i in range(3):
        for j in range(3):
            energies = []
            for sign in (1, -1):
                strain = np.eye(3)
                strain[i, j] += sign * h
                strained = atoms.copy()
                strained.set_cell(atoms.cell.array @ strain, scale_atoms=False)
                strained.positions = atoms.positions @ strain
                energies.append(_energy(pot, strained))
            fd[i, j] = (energies[0] - energies[1]) / (2 * h) / volume
    sym = 0.5 * (fd + fd.T)
    voigt = np.array([sym[0, 0], sym[1, 1], sym[2, 2], sym[1, 2], sym[0, 2], sym[0, 1]])
    assert np.abs(stress - voigt).max() <= 1e-4 * max(np.abs(voigt).max(), 1e-4)


def _random_rotation(seed: int) -> np.ndarray:
    q, r = np.linalg.qr(np.random.default_rng(seed).normal(size=(3, 3)))
    q = q * np.sign(np.diag(r))
    return q if np.linalg.det(q) > 0 else -q


@pytest.mark.parametrize("name", list(SYSTEMS))
def test_invariances(model, name: str) -> None:  # type: ignore[no-untyped-def]
    pot = _pot(model)
    atoms = SYSTEMS[name]()
    ref = _predict(pot, atoms)
    e0, f0 = float(ref.energy[0]), ref.forces.numpy()
    rot = _random_rotation(7)
    moved = atoms.copy()
    moved.positions = atoms.positions @ rot.T + np.array([0.3, -1.2, 2.5])
    if atoms.pbc.any():
        moved.set_cell(atoms.cell.array @ rot.T, scale_atoms=False)
    out = _predict(pot, moved)
    assert abs(float(out.energy[0]) - e0) <= 1e-6 * abs(e0)
    # fp32 forces of this random model reach ~20 eV/Å: compare relative to that scale
    # (in fp64 the same check holds to 1e-13).
    f_scale = float(np.abs(f0).max())
    np.testing.assert_allclose(out.forces.numpy(), f0 @ rot.T, atol=1e-5 * f_scale)
    perm = np.random.default_rng(1).permutation(len(atoms))
    out = _predict(pot, atoms[perm])
    assert abs(float(out.energy[0]) - e0) <= 1e-6 * abs(e0)
    np.testing.assert_allclose(out.forces.numpy(), f0[perm], atol=1e-5 * f_scale)
    if atoms.pbc.all():
        wrapped = atoms.copy()
        wrapped.positions += np.array([1, -2, 1]) @ atoms.cell.array
        assert abs(_energy(pot, wrapped) - e0) <= 1e-6 * abs(e0)


def test_supercell_is_extensive(model) -> None:  # type: ignore[no-untyped-def]
    pot = _pot(model)
    atoms = _triclinic()
    e1 = _energy(pot, atoms)
    e8 = _energy(pot, make_supercell(atoms, 2 * np.eye(3)))
    assert abs(e8 - 8 * e1) <= 1e-6 * abs(8 * e1)


def test_continuity_across_cutoff(model) -> None:  # type: ignore[no-untyped-def]
    pot = _pot(model, "fp64")
    rcut = CONFIG.rcut

    def dimer(r: float):  # type: ignore[no-untyped-def]
        return _predict(pot, Atoms("OH", positions=[[0, 0, 0], [r, 0.0, 0.0]]))

    inside, outside = dimer(rcut - 1e-4), dimer(rcut + 1e-4)
    assert abs(float(inside.energy[0] - outside.energy[0])) < 1e-8
    assert float(inside.forces.abs().max()) < 1e-8
    assert float(outside.forces.abs().max()) == 0.0


def test_fp64_path_is_rotation_invariant_to_fp64_rounding() -> None:
    """fp64 validation runs every constant in float64: the S2-grid FFN's Lebedev projectors and
    the norms' degree weights are computed in float64 and must not come back from the model's
    default float32 with float32's rounding (that left ~3e-8 eV/Å of rotation error)."""
    config = preset("tiny", ["O", "H"], rcut=4.0, channels=32, n_focus=2, focus_dim=32,
                    n_blocks=2, ffn="s2")  # fmt: skip
    pot = _pot(randomized_model(config, seed=2), "fp64")
    atoms = _molecule()
    ref = _predict(pot, atoms)
    rot = _random_rotation(11)
    moved = atoms.copy()
    moved.positions = atoms.positions @ rot.T
    out = _predict(pot, moved)
    f_scale = float(np.abs(ref.forces.numpy()).max())
    assert abs(float(out.energy[0]) - float(ref.energy[0])) <= 1e-12 * abs(float(ref.energy[0]))
    np.testing.assert_allclose(out.forces.numpy(), ref.forces.numpy() @ rot.T, atol=1e-12 * f_scale)


def test_skewed_basis_gives_the_reduced_cells_results(model) -> None:  # type: ignore[no-untyped-def]
    """A skewed basis of the triclinic lattice (its (c, a) planes 0.43 Å apart, where the
    lattice's own spacing is 4.1 Å) is evaluated like the lattice itself: energy, forces and
    stress."""
    pot = _pot(model, "fp64")
    atoms = _triclinic()
    skewed = atoms.copy()
    skewed.set_cell(np.array([[1, 9, 0], [0, 1, 0], [0, 0, 1]]) @ atoms.cell.array)
    props = ("energy", "forces", "stress")
    ref, out = _predict(pot, atoms, props), _predict(pot, skewed, props)
    assert float(out.energy[0]) == pytest.approx(float(ref.energy[0]), rel=1e-12)
    np.testing.assert_allclose(out.forces.numpy(), ref.forces.numpy(), atol=1e-11)
    np.testing.assert_allclose(out.stress.numpy(), ref.stress.numpy(), atol=1e-11)
