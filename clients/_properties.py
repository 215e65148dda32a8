"""What the ASE calculators compute per call, shared by the HTTP and in-process ones."""

from __future__ import annotations

from collections.abc import Collection

from ase import Atoms
from ase.calculators.calculator import PropertyNotImplementedError

IMPLEMENTED_PROPERTIES = ["energy", "free_energy", "forces", "stress", "energies"]


def has_full_cell(atoms: Atoms) -> bool:
    """Stress (a derivative per volume) exists only for cells periodic along all three axes."""
    return bool(atoms.pbc.all())


def properties_to_compute(atoms: Atoms, requested: Collection[str]) -> frozenset[str]:
    """Energy and forces always (they share one backward pass), stress whenever the cell is
    periodic (the virial comes from the same pass), per-atom energies on demand; so ASE's cache
    answers the usual follow-up questions without another evaluation."""
    if "stress" in requested and not has_full_cell(atoms):
        raise PropertyNotImplementedError(
            "stress needs a cell periodic along all three axes; "
            f"these atoms have pbc={atoms.pbc.tolist()}"
        )
    wanted = {"energy", "forces"}
    if has_full_cell(atoms):
        wanted.add("stress")
    if "energies" in requested:
        wanted.add("energies")
    return frozenset(wanted)
