"""What the engine needs from a model: the serving surface of ``service.model.Potential``.

Declared as protocols so the engine (and its tests, which inject a cheap analytic potential)
depend on the surface, not on the model package.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, Protocol

from ase.data import atomic_numbers
from torch import Tensor

from service.graph.structures import Structures


class ExecutionLike(Protocol):
    """Which code path produced the numbers (reported in every response)."""

    @property
    def path(self) -> str: ...  # "fused" | "reference"

    @property
    def precision(self) -> str: ...  # "fp32" | ...

    @property
    def device(self) -> str: ...  # "cuda:0", "cpu", ...


class PredictionLike(Protocol):
    """Batched outputs, float64; a property not asked for may be None."""

    @property
    def energy(self) -> Tensor: ...  # (B,) eV

    @property
    def energies(self) -> Tensor | None: ...  # (N,) eV

    @property
    def forces(self) -> Tensor | None: ...  # (N, 3) eV/Å

    @property
    def virial(self) -> Tensor | None: ...  # (B, 3, 3) eV

    @property
    def stress(self) -> Tensor | None: ...  # (B, 6) eV/Å³, ASE Voigt order


class Evaluator(Protocol):
    """A model resident on one device that evaluates batches of structures."""

    @property
    def execution(self) -> ExecutionLike: ...

    def predict(self, structures: Structures, properties: Collection[str]) -> PredictionLike:
        """``structures`` arrive on the host; the evaluator moves what it needs to its device."""
        ...

    def info(self) -> Mapping[str, Any]: ...


def model_elements(info: Mapping[str, Any]) -> list[int]:
    """Atomic numbers of the elements an evaluator's ``info()`` lists (symbols or numbers)."""
    return [atomic_numbers[s] if isinstance(s, str) else int(s) for s in info["elements"]]
