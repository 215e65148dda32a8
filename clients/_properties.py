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
    answers the usual follow-up questions without another evaluation.

    ``PropertyNotImplementedError`` for a property these calculators do not compute (ASE
    checks that in ``get_property``, but not when ``calculate`` is called directly)."""
    if isinstance(requested, str):  # calculate(atoms, "forces"): one name, not its letters
        requested = {requested}
    unknown = sorted(set(requested) - set(IMPLEMENTED_PROPERTIES))
    if unknown:
        raise PropertyNotImplementedError(
            f"{', '.join(unknown)} not implemented; these calculators compute "
            f"{', '.join(IMPLEMENTED_PROPERTIES)}"
        )
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
