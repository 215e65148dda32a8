"""``SO2LocalCalculator``: the model in this process, no service in between."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from ase import Atoms
from ase.calculators.calculator import CalculationFailed

from clients._properties import IMPLEMENTED_PROPERTIES, SerialCalculator
from service.engine.evaluator import Evaluator
from service.engine.kernel_sets import preload_recorded_kernels
from service.graph.errors import InvalidStructureError
from service.graph.structures import Structures
from service.model.errors import non_finite_fields


class RejectedStructureError(InvalidStructureError, CalculationFailed):
    """The model refused the structure: an ``InvalidStructureError`` (a ValueError) that is
    also ASE's CalculationFailed, as the HTTP calculator's refusal is, so that one ``except``
    serves both calculators."""


def _host(value: Any) -> np.ndarray:
    return np.asarray(value.detach().cpu().double().numpy())


class SO2LocalCalculator(SerialCalculator):
    """ASE calculator evaluating the SO(2) potential in this process.

    Args:
        model: a model file, None for the shipped default model, or an already loaded
            potential (anything with ``predict(structures, properties)``, e.g. ``Potential``).
        device: ``"auto"`` (CUDA if available), ``"cpu"``, ``"cuda"``, ``"cuda:N"``.
        path: execution path, ``"auto"``, ``"fused"`` or ``"reference"``.
        precision: ``"fp32"`` (exact), ``"fp64"`` (reference path) or ``"fp16x3"`` (opt-in
            fast mixing-stack GEMMs, fused path only); reported in the potential's execution info.

    A model loaded here on a GPU has its recorded kernel set compiled at once, before the
    first calculation (``service.engine.kernel_sets``). A structure the model refuses raises
    ``RejectedStructureError``: a ``service.graph.errors.InvalidStructureError`` (a ValueError)
    and ASE's ``CalculationFailed``, as the HTTP calculator's refusal is; a result with NaN or
    inf raises ``CalculationFailed`` instead of being returned.
    """

    implemented_properties = IMPLEMENTED_PROPERTIES

    def __init__(
        self,
        model: str | Path | Evaluator | None = None,
        device: str = "auto",
        path: str = "auto",
        *,
        precision: str = "fp32",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if model is None or isinstance(model, str | Path):
            from service.model.potential import load_potential

            self.potential: Evaluator = load_potential(
                model, device=device, path=path, precision=precision
            )
            # On a GPU with an empty Triton cache, one batch compile up front costs about half
            # of what the first calculation would pay compiling kernel after kernel.
            preload_recorded_kernels(self.potential)
        else:
            self.potential = model

    def evaluate(self, atoms: Atoms, wanted: frozenset[str]) -> dict[str, Any]:
        try:
            prediction = self.potential.predict(Structures.from_atoms([atoms]), wanted)
        except InvalidStructureError as exc:
            raise RejectedStructureError(
                exc.code, exc.message, field=exc.field, index=exc.index
            ) from exc
        energy = float(prediction.energy[0])
        results: dict[str, Any] = {"energy": energy, "free_energy": energy}
        if prediction.forces is not None:
            results["forces"] = _host(prediction.forces)
        if "stress" in wanted and prediction.stress is not None:
            results["stress"] = _host(prediction.stress[0])
        if "energies" in wanted and prediction.energies is not None:
            results["energies"] = _host(prediction.energies)
        bad = non_finite_fields({k: np.asarray(v) for k, v in results.items()})
        if bad:
            raise CalculationFailed(f"the model returned non-finite {', '.join(bad)}")
        return results
