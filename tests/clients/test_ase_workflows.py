"""The in-process calculator the way ASE drives it: relaxations (atoms and cell), MD
integrators, constraints, vibrations, ASE's caching rules, the stress convention, file
output, and clear errors for what it cannot compute.

Most tests run on the analytic ``PairPotential`` (float64, milliseconds per call); those that
check the model's own conventions (stress, image invariance) use a tiny random DPA4 model in
float64, and one relaxation runs on the shipped default model."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ase import Atoms, units
from ase.build import bulk, molecule
from ase.calculators.calculator import Calculator, PropertyNotImplementedError
from ase.calculators.fd import calculate_numerical_forces, calculate_numerical_stress
from ase.constraints import FixAtoms, FixBondLength
from ase.filters import FrechetCellFilter, UnitCellFilter
from ase.io import read, write
from ase.md.langevin import Langevin
from ase.md.npt import NPT
from ase.md.nptberendsen import NPTBerendsen
from ase.md.verlet import VelocityVerlet
from ase.optimize import BFGS, FIRE
from ase.vibrations import Vibrations

from clients import SO2LocalCalculator
from service.graph.errors import InvalidStructureError
from tests.clients.test_calculators import water_box
from tests.service.fakes import PairPotential, rattled_copper, small_molecule


@pytest.fixture(scope="module")
def tiny_fp64() -> Any:
    """A tiny random DPA4 model for H and O, float64 on the CPU (finite differences exact to
    ~1e-9)."""
    from service.model.config import preset
    from service.model.dpa4 import DPA4Model
    from service.model.potential import Potential

    torch.manual_seed(3)
    return Potential(DPA4Model(preset("tiny", ["H", "O"])), device="cpu", precision="fp64")


def pair_calc() -> SO2LocalCalculator:
    return SO2LocalCalculator(PairPotential())


# conventions


def test_stress_and_forces_are_ases_derivatives(tiny_fp64: Any) -> None:
    """stress = (1/V) ∂E/∂ε in ASE's Voigt order (xx, yy, zz, yz, xz, xy), 3×3 on request;
    forces = −∂E/∂r; on a sheared cell, so every component is non-trivial (the random
    model's stresses are small, hence the relative tolerance)."""
    atoms = water_box(shear=0.3)
    atoms.calc = SO2LocalCalculator(tiny_fp64)
    stress = atoms.get_stress()
    assert stress.shape == (6,)
    scale = np.abs(stress).max()
    numerical = calculate_numerical_stress(atoms, eps=1e-5)
    np.testing.assert_allclose(stress, numerical, atol=1e-4 * scale)
    shear = np.abs(stress[3:])
    assert shear.min() > 0.01 * scale and np.ptp(shear) > 0.05 * scale  # order is testable
    full = atoms.get_stress(voigt=False)
    assert full.shape == (3, 3)
    np.testing.assert_allclose(full[[1, 0, 0], [2, 2, 1]], stress[3:], rtol=1e-12)
    np.testing.assert_array_equal(full, full.T)
    forces = atoms.get_forces()
    numerical = calculate_numerical_forces(atoms, eps=1e-5, iatoms=[0, 4])
    np.testing.assert_allclose(forces[[0, 4]], numerical, atol=1e-4 * np.abs(forces).max())


def test_unwrapped_positions_give_the_wrapped_results(tiny_fp64: Any) -> None:
    """Atoms that MD has carried out of the cell are the same structure."""
    wrapped = water_box(shear=0.2)
    unwrapped = wrapped.copy()
    unwrapped.positions[0] += 2 * wrapped.cell[0] - wrapped.cell[1]
    unwrapped.positions[4] -= 3 * wrapped.cell[2]
    for atoms in (wrapped, unwrapped):
        atoms.calc = SO2LocalCalculator(tiny_fp64)
    assert unwrapped.get_potential_energy() == pytest.approx(
        wrapped.get_potential_energy(), abs=1e-10
    )
    np.testing.assert_allclose(unwrapped.get_forces(), wrapped.get_forces(), atol=1e-10)
    np.testing.assert_allclose(unwrapped.get_stress(), wrapped.get_stress(), atol=1e-10)


def test_results_have_ases_types_and_shapes_and_survive_file_output(tmp_path: Path) -> None:
    atoms = rattled_copper(1, seed=4)
    atoms.calc = pair_calc()
    energies = atoms.get_potential_energies()
    results = atoms.calc.results
    assert type(results["energy"]) is float and results["free_energy"] == results["energy"]
    assert atoms.get_potential_energy(force_consistent=True) == results["energy"]
    for name, shape in {"forces": (4, 3), "stress": (6,), "energies": (4,)}.items():
        assert results[name].shape == shape and results[name].dtype == np.float64, name
    assert energies.sum() == pytest.approx(results["energy"], rel=1e-12)
    for name in ("out.extxyz", "out.traj"):
        write(tmp_path / name, atoms)
        back = read(tmp_path / name)
        assert back.get_potential_energy() == pytest.approx(results["energy"], rel=1e-12)
        np.testing.assert_allclose(back.get_forces(), results["forces"], atol=1e-7)
        np.testing.assert_allclose(back.get_stress(), results["stress"], atol=1e-9)


# ASE's caching rules


def test_recomputes_exactly_when_ase_says_the_system_changed() -> None:
    potential = PairPotential()
    atoms = rattled_copper(1, seed=6)
    atoms.calc = SO2LocalCalculator(potential)

    def evaluations_for(change: Any) -> int:
        atoms.get_forces()
        before = len(potential.calls)
        change(atoms)
        atoms.get_potential_energy()
        atoms.get_forces()
        atoms.get_stress()
        return len(potential.calls) - before

    def move(a: Atoms) -> None:
        a.positions[1, 2] += 0.01

    def strain(a: Atoms) -> None:
        a.set_cell(a.cell.array * 1.001, scale_atoms=True)

    def swap(a: Atoms) -> None:
        a.numbers[0] = 1

    def annotate(a: Atoms) -> None:
        a.info["step"] = 3
        a.set_momenta(np.ones((len(a), 3)))

    assert [evaluations_for(f) for f in (move, strain, swap, annotate)] == [1, 1, 1, 0]
    atoms.calc.reset()
    before = len(potential.calls)
    atoms.get_forces()
    atoms.get_stress()
    assert len(potential.calls) == before + 1
    # the same calculator on an identical copy answers from its cache
    twin = atoms.copy()
    twin.calc = atoms.calc
    before = len(potential.calls)
    assert twin.get_potential_energy() == atoms.get_potential_energy()
    assert len(potential.calls) == before


def test_pbc_change_recomputes_and_mixed_pbc_has_no_stress() -> None:
    atoms = rattled_copper(1, seed=8)
    atoms.calc = pair_calc()
    bulk_energy = atoms.get_potential_energy()
    atoms.pbc = [True, True, False]
    assert atoms.get_potential_energy() != bulk_energy
    assert atoms.get_forces().shape == (4, 3)
    with pytest.raises(PropertyNotImplementedError, match=r"pbc=\[True, True, False\]"):
        atoms.get_stress()


# refusals


@pytest.mark.parametrize("name", ["magmom", "magmoms", "dipole", "charges", "virial"])
def test_calculate_refuses_properties_it_cannot_compute(name: str) -> None:
    """``calculate`` (called directly, as ASE's ``calculate_properties`` and some drivers do)
    must not answer a question it was not able to compute with silence."""
    atoms = small_molecule("H2O")
    calc = pair_calc()
    with pytest.raises(PropertyNotImplementedError, match=name):
        calc.calculate(atoms, ["energy", name])


def test_calculate_takes_a_single_property_name() -> None:
    atoms = rattled_copper(1, seed=5)
    calc = pair_calc()
    calc.calculate(atoms, "stress")
    assert calc.results["stress"].shape == (6,)
    with pytest.raises(PropertyNotImplementedError, match="magmom"):
        calc.calculate(atoms, "magmom")


def test_an_unknown_element_or_no_atoms_is_a_clear_error(tiny_fp64: Any) -> None:
    methane = molecule("CH4")
    methane.calc = SO2LocalCalculator(tiny_fp64)
    with pytest.raises(InvalidStructureError, match=r"Z=6 .*elements: H, O"):
        methane.get_potential_energy()
    for empty in (Atoms(), Atoms(cell=np.eye(3) * 5, pbc=True)):
        empty.calc = SO2LocalCalculator(tiny_fp64)
        with pytest.raises(InvalidStructureError, match="at least one atom"):
            empty.get_potential_energy()


# workflows


def test_position_and_cell_relaxations_lower_the_energy() -> None:
    for optimizer, wrap in ((BFGS, FrechetCellFilter), (FIRE, UnitCellFilter)):
        atoms = bulk("Cu", "fcc", a=2.5, cubic=True)  # far from the pair potential's minimum
        atoms.rattle(0.05, seed=1)
        atoms.calc = pair_calc()
        start = atoms.get_potential_energy()
        start_stress = np.abs(atoms.get_stress()).max()
        volume = atoms.get_volume()
        optimizer(wrap(atoms), logfile=None).run(fmax=1e-3, steps=60)  # type: ignore[operator]
        assert atoms.get_potential_energy() < start - 1e-3
        # the cell followed the stress downhill
        assert atoms.get_volume() != pytest.approx(volume, rel=1e-3)
        assert np.abs(atoms.get_stress()).max() < 0.02 * start_stress


def test_the_shipped_model_relaxes_a_water_molecule() -> None:
    from service.model.potential import default_model_path

    if not default_model_path().is_file():
        pytest.skip("no default model shipped")
    water = molecule("H2O")
    water.positions[1] *= 1.1
    water.calc = SO2LocalCalculator(device="cpu")
    start = water.get_potential_energy()
    optimizer = BFGS(water, logfile=None)
    optimizer.run(fmax=0.05, steps=30)
    assert optimizer.converged() and water.get_potential_energy() < start


@pytest.mark.filterwarnings("ignore:NPT thermostat has been moved:FutureWarning")
def test_md_integrators_with_and_without_a_barostat() -> None:
    for make in (
        lambda a: VelocityVerlet(a, 2 * units.fs, logfile=None),
        lambda a: Langevin(a, 2 * units.fs, temperature_K=300, friction=0.02, fixcm=False),
        lambda a: NPTBerendsen(
            a, 2 * units.fs, temperature_K=300, pressure_au=units.bar,
            compressibility_au=1e-2 / units.bar, logfile=None,
        ),
        lambda a: NPT(
            a, 2 * units.fs, temperature_K=300, externalstress=0.0, ttime=20 * units.fs,
            pfactor=1e3 * units.fs**2, logfile=None,
        ),
    ):  # fmt: skip
        atoms = rattled_copper(2, seed=2)
        atoms.set_velocities(np.random.default_rng(0).normal(scale=0.02, size=(32, 3)))
        atoms.calc = pair_calc()
        volume = atoms.get_volume()
        dynamics = make(atoms)
        dynamics.run(8)
        assert np.isfinite(atoms.get_potential_energy())
        if isinstance(dynamics, NPTBerendsen | NPT):
            assert atoms.get_volume() != volume  # the barostat saw the stress


def test_constraints_see_the_unconstrained_forces() -> None:
    fixed = small_molecule("CH3OH", seed=4)
    fixed.set_constraint(FixAtoms([0, 1]))
    fixed.calc = pair_calc()
    raw = fixed.get_forces(apply_constraint=False)
    assert np.abs(raw[:2]).max() > 1e-3 and np.all(fixed.get_forces()[:2] == 0)
    np.testing.assert_array_equal(raw, fixed.calc.results["forces"])
    start = fixed.positions[:2].copy()
    BFGS(fixed, logfile=None).run(fmax=1e-2, steps=20)
    np.testing.assert_array_equal(fixed.positions[:2], start)

    bonded = small_molecule("CH3OH", seed=5)
    length = bonded.get_distance(0, 1)
    bonded.set_constraint(FixBondLength(0, 1))
    bonded.calc = pair_calc()
    BFGS(bonded, logfile=None).run(fmax=1e-2, steps=20)
    assert bonded.get_distance(0, 1) == pytest.approx(length, abs=1e-8)


def test_vibrations_give_a_symmetric_hessian(tmp_path: Path) -> None:
    water = small_molecule("H2O", seed=1)
    water.calc = pair_calc()
    BFGS(water, logfile=None).run(fmax=1e-5, steps=200)
    vibrations = Vibrations(water, name=str(tmp_path / "vib"), delta=1e-3)
    vibrations.run()
    hessian = vibrations.get_vibrations().get_hessian_2d()
    np.testing.assert_allclose(hessian, hessian.T, atol=1e-4)
    assert len(vibrations.get_frequencies()) == 9


def test_a_calculator_copies_and_pickles_for_worker_processes(tiny_fp64: Any) -> None:
    calc = SO2LocalCalculator(tiny_fp64)
    atoms = water_box()
    expected = calc.get_potential_energy(atoms)
    for clone in (copy.deepcopy(calc), pickle.loads(pickle.dumps(calc))):
        assert isinstance(clone, Calculator)
        assert clone.get_potential_energy(atoms.copy()) == expected


@pytest.mark.gpu
def test_a_gpu_calculator_with_recorded_graphs_copies_and_pickles() -> None:
    # On a GPU the potential replays CUDA graphs under a lock; neither pickles nor deep-copies,
    # so the CPU test above could not see a calculator for worker processes failing there.
    from service.model.config import preset
    from service.model.dpa4 import DPA4Model
    from service.model.potential import Potential

    torch.manual_seed(3)
    calc = SO2LocalCalculator(Potential(DPA4Model(preset("tiny", ["H", "O"])), device="cuda"))
    atoms = water_box()

    def energies(calc: SO2LocalCalculator) -> list[float]:
        out = []
        for _ in range(3):  # recorded, then replayed
            calc.reset()
            out.append(calc.get_potential_energy(atoms.copy()))
        return out

    expected = energies(calc)
    for clone in (copy.deepcopy(calc), pickle.loads(pickle.dumps(calc))):
        assert energies(clone) == pytest.approx(expected, rel=1e-6)
