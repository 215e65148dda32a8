"""What the ASE calculators compute per call, and how they take calls, shared by the HTTP
and in-process ones."""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Collection
from typing import Any

from ase import Atoms
from ase.calculators.calculator import Calculator, PropertyNotImplementedError, all_changes

IMPLEMENTED_PROPERTIES = ["energy", "free_energy", "forces", "stress", "energies"]


class SerialCalculator(Calculator):
    """An ASE calculator that takes one property call at a time. ASE keeps the last atoms and
    results on the calculator, between comparing, computing and reading them: two threads
    sharing one calculator got each other's forces (and the HTTP one, a shared connection).
    Threads that want to run in parallel take a calculator each."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)  # type: ignore[no-untyped-call]
        self._new_lock()

    def _new_lock(self) -> None:
        self._calls = threading.RLock()
        _SERIAL_CALCULATORS.add(self)

    def get_property(
        self, name: str, atoms: Atoms | None = None, allow_calculation: bool = True
    ) -> Any:
        with self._calls:
            base = super().get_property  # untyped in ASE
            return base(name, atoms, allow_calculation)  # type: ignore[no-untyped-call]

    def calculate_properties(self, atoms: Atoms, properties: Collection[str]) -> Any:
        """``Atoms.get_properties`` comes here, not through ``get_property``."""
        with self._calls:
            base = super().calculate_properties  # untyped in ASE
            return base(atoms, properties)  # type: ignore[no-untyped-call]

    def calculate(
        self,
        atoms: Atoms | None = None,
        properties: Collection[str] = ("energy",),
        system_changes: Collection[str] = all_changes,
    ) -> None:
        super().calculate(atoms, properties, system_changes)  # type: ignore[no-untyped-call]
        assert self.atoms is not None  # set by Calculator.calculate
        # ASE has already stored the new atoms: a failed evaluation that left the last results
        # in place would hand the previous structure's energy and forces to the next question.
        # A property these atoms cannot have (stress without a 3-D cell) changes nothing, and
        # where the atoms are the same their results stay.
        try:
            wanted = properties_to_compute(self.atoms, properties)
        except BaseException:
            if system_changes:
                self.reset()  # type: ignore[no-untyped-call]
            raise
        try:
            self.results = self.evaluate(self.atoms, wanted)
        except BaseException:
            self.reset()  # type: ignore[no-untyped-call]
            raise

    def evaluate(self, atoms: Atoms, wanted: frozenset[str]) -> dict[str, Any]:
        """ASE's results for ``atoms``: the properties ``wanted`` (``properties_to_compute``)."""
        raise NotImplementedError

    def __getstate__(self) -> dict[str, Any]:  # a lock does not pickle: a copy gets its own
        state = self.__dict__.copy()
        del state["_calls"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._new_lock()


_SERIAL_CALCULATORS: weakref.WeakSet[SerialCalculator] = weakref.WeakSet()


def _unlock_in_child() -> None:
    """A process forked while another thread was in a call inherits that thread's hold on the
    lock, but not the thread: it would wait forever. The child has one thread, so new locks."""
    for calc in list(_SERIAL_CALCULATORS):
        calc._new_lock()


if hasattr(os, "register_at_fork"):  # not on Windows, which does not fork
    os.register_at_fork(after_in_child=_unlock_in_child)


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
