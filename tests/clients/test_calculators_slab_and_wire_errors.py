"""The ASE calculators as a chemist uses them on the shipped water model: a slab (mixed
periodicity) checked against finite differences, and bad input refused with the same error
code whichever wire format the HTTP calculator speaks."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from ase import Atoms
from ase.build import molecule
from ase.calculators.calculator import PropertyNotImplementedError
from ase.calculators.fd import calculate_numerical_forces

from clients import SO2Calculator, SO2LocalCalculator
from clients.http import ServiceError
from service.api import ServiceSettings, create_app
from tests.clients.test_calculators import water_box
from tests.service.fakes import PairPotential, running_server


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with running_server(create_app(ServiceSettings(), evaluator=PairPotential())) as base:
        yield base


def test_the_shipped_model_on_a_slab_is_consistent() -> None:
    """pbc [T, T, F]: forces are −dE/dx (central differences of 1e-3 Å at fp64), per-atom
    energies sum to the energy, stress is refused, and the vector of the non-periodic axis
    (none, tilted, or parallel to a periodic one) changes nothing."""
    from service.model.potential import default_model_path

    if not default_model_path().is_file():
        pytest.skip("no default model shipped")
    calc = SO2LocalCalculator(device="cpu", precision="fp64")
    slab = water_box()
    slab.pbc = [True, True, False]
    slab.rattle(0.02, seed=5)
    slab.calc = calc
    energy, forces = slab.get_potential_energy(), slab.get_forces()
    assert slab.get_potential_energies().sum() == pytest.approx(energy, abs=1e-9)
    numerical = calculate_numerical_forces(slab, eps=1e-3, iatoms=[0, 4])
    np.testing.assert_allclose(forces[[0, 4]], numerical, atol=2e-4)
    with pytest.raises(PropertyNotImplementedError):
        slab.get_stress()
    a, b = slab.cell[0], slab.cell[1]
    for c in ([0.0, 0.0, 0.0], [2.0, 0.0, 10.0], a):
        other = slab.copy()
        other.cell = [a, b, c]
        other.calc = calc
        assert other.get_potential_energy() == pytest.approx(energy, abs=1e-9)
        np.testing.assert_allclose(other.get_forces(), forces, atol=1e-9)


@pytest.mark.parametrize(
    ("spoil", "code"),
    [("positions", "non_finite_positions"), ("cell", "non_finite_cell")],
)
def test_non_finite_input_gets_the_same_code_over_json_and_msgpack(
    url: str, spoil: str, code: str
) -> None:
    """In process and over msgpack a NaN coordinate is ``non_finite_positions`` naming the
    atom. Over ``wire="json"`` orjson writes NaN as ``null``; the server used to answer
    ``invalid_request: positions must contain only numbers``, so a client branching on the
    code (as the docs' error table invites) saw another error for the same structure."""
    codes = {}
    for wire in ("msgpack", "json"):
        atoms: Atoms = molecule("H2O")
        if spoil == "positions":
            atoms.positions[1, 0] = np.nan
        else:
            atoms.cell = [[np.nan, 0, 0], [0, 5, 0], [0, 0, 5]]
            atoms.pbc = True
        atoms.calc = SO2Calculator(url, wire=wire)
        with pytest.raises(ServiceError) as info:
            atoms.get_potential_energy()
        codes[wire] = info.value.code
    assert codes == {"msgpack": code, "json": code}


def test_stress_refused_on_a_slab_keeps_its_results() -> None:
    """Asking a slab for stress raises, and the energy and forces already computed for the
    same atoms stay: the next question is answered without a request."""
    pair = PairPotential()
    with running_server(create_app(ServiceSettings(), evaluator=pair)) as base:
        slab = molecule("H2O")
        slab.cell = [6.0, 6.0, 10.0]
        slab.pbc = [True, True, False]
        slab.calc = SO2Calculator(base)
        energy = slab.get_potential_energy()
        calls = len(pair.calls)
        with pytest.raises(PropertyNotImplementedError):
            slab.get_stress()
        assert slab.get_potential_energy() == energy
        slab.get_forces()
        assert len(pair.calls) == calls
