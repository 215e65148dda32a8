"""Error statistics shared by validation during training and by ``so2serve eval``.

Conventions (DeePMD's): energy errors are per atom, ``(E_pred − E_ref)/n`` in eV/atom; force
errors are over Cartesian components in eV/Å; virial errors are per atom over the 9 components
in eV/atom. RMSE and MAE pool every labelled item of the set (not a mean of per-batch values).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from service.training.data import LabelBatch


def finite_or_none(values: Mapping[str, float]) -> dict[str, float | None]:
    """``values`` for JSON: NaN and inf (a metric without data, a diverged run) become None."""
    return {k: v if math.isfinite(v) else None for k, v in values.items()}


__all__ = ["ErrorStats", "PropertyErrors", "batch_errors"]


@dataclass
class ErrorStats:
    """Running sums for RMSE and MAE of one quantity."""

    sum_sq: float = 0.0
    sum_abs: float = 0.0
    count: int = 0

    def add(self, errors: torch.Tensor) -> None:
        """Accumulate a tensor of signed errors (any shape, every element counts once)."""
        values = errors.detach().to(torch.float64)
        self.sum_sq += float(values.square().sum())
        self.sum_abs += float(values.abs().sum())
        self.count += values.numel()

    def merge(self, other: ErrorStats) -> None:
        self.sum_sq += other.sum_sq
        self.sum_abs += other.sum_abs
        self.count += other.count

    @property
    def rmse(self) -> float:
        return math.sqrt(self.sum_sq / self.count) if self.count else math.nan

    @property
    def mae(self) -> float:
        return self.sum_abs / self.count if self.count else math.nan

    def summary(self) -> dict[str, float | int]:
        return {"rmse": self.rmse, "mae": self.mae, "count": self.count}

    def state(self) -> list[float]:
        return [self.sum_sq, self.sum_abs, float(self.count)]

    @classmethod
    def from_state(cls, state: list[float]) -> ErrorStats:
        return cls(float(state[0]), float(state[1]), int(state[2]))


@dataclass
class PropertyErrors:
    """Energy, force and virial error statistics of one data set."""

    energy: ErrorStats = field(default_factory=ErrorStats)
    forces: ErrorStats = field(default_factory=ErrorStats)
    virial: ErrorStats = field(default_factory=ErrorStats)

    def add(self, errors: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """Accumulate the ``(energy, forces, virial)`` errors of :func:`batch_errors`."""
        self.energy.add(errors[0])
        self.forces.add(errors[1])
        self.virial.add(errors[2])

    def merge(self, other: PropertyErrors) -> None:
        self.energy.merge(other.energy)
        self.forces.merge(other.forces)
        self.virial.merge(other.virial)

    def state(self) -> dict[str, list[float]]:
        """Plain numbers (for checkpoints)."""
        return {
            "energy": self.energy.state(),
            "forces": self.forces.state(),
            "virial": self.virial.state(),
        }

    @classmethod
    def from_state(cls, state: dict[str, list[float]]) -> PropertyErrors:
        return cls(*(ErrorStats.from_state(state[k]) for k in ("energy", "forces", "virial")))

    def summary(self) -> dict[str, dict[str, float | int]]:
        """``{"energy": {...}, "forces": {...}, "virial": {...}}``; labels absent → omitted."""
        parts = {"energy": self.energy, "forces": self.forces, "virial": self.virial}
        return {name: stats.summary() for name, stats in parts.items() if stats.count}

    def flat(self) -> dict[str, float]:
        """``energy_rmse``, ``energy_mae``, ``forces_rmse``, ... for logs (NaN when unlabelled)."""
        parts = {"energy": self.energy, "forces": self.forces, "virial": self.virial}
        flat: dict[str, float] = {}
        for name, stats in parts.items():
            flat[f"{name}_rmse"] = stats.rmse
            flat[f"{name}_mae"] = stats.mae
        return flat


def batch_errors(
    labels: LabelBatch,
    energy: torch.Tensor,
    forces: torch.Tensor | None,
    virial: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Signed errors of the labelled items of one batch, in the units of the module docstring.

    ``energy`` (B,), ``forces`` (N, 3), ``virial`` (B, 3, 3) are predictions; ``None`` means not
    predicted (empty errors). Returns ``(energy (B_e,), forces (N_f, 3), virial (B_v, 3, 3))``.
    """
    energy_err = ((energy - labels.energy) / labels.n_atoms)[labels.energy_mask]
    if forces is None:
        force_err = energy.new_zeros((0, 3))
    else:
        force_err = (forces - labels.forces)[labels.forces_mask]
    if virial is None:
        virial_err = energy.new_zeros((0, 3, 3))
    else:
        per_atom = (virial - labels.virial) / labels.n_atoms[:, None, None]
        virial_err = per_atom[labels.virial_mask]
    return energy_err, force_err, virial_err
