"""Accuracy of a model on labelled data: RMSE/MAE per system and overall, parity plots, JSON.

``so2serve eval MODEL DATA...`` runs :func:`evaluate_model`; training's validation uses
:func:`evaluate_frames`. Units and per-atom conventions are those of
:mod:`service.training.metrics`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import numpy as np
from ase.data import atomic_numbers

from service.model.errors import ModelFileError
from service.model.potential import Potential, Prediction, load_potential
from service.training.data import (
    DataError,
    FrameDataset,
    TrainingBatch,
    iterate_batches,
    load_dataset,
)
from service.training.metrics import PropertyErrors, batch_errors, finite_or_none
from service.training.state import file_problem

__all__ = [
    "EvalReport",
    "ParityData",
    "SetResult",
    "evaluate_batches",
    "evaluate_frames",
    "evaluate_model",
    "predict_batch",
    "properties_for",
    "write_parity_plot",
]


def properties_for(dataset: FrameDataset) -> tuple[str, ...]:
    """What to predict so every label of the data can be compared."""
    return ("energy", "forces", "virial") if dataset.has_virial else ("energy", "forces")


def predict_batch(
    potential: Potential,
    batch: TrainingBatch,
    properties: Sequence[str],
    *,
    create_graph: bool = False,
) -> Prediction:
    """Predict one batch on the potential's device (labels stay where they are)."""
    return potential.predict(
        batch.structures.to(potential.device), properties, create_graph=create_graph
    )


@dataclass
class ParityData:
    """Reference vs predicted values gathered for parity plots (float64 numpy)."""

    energy_ref: list[np.ndarray] = field(default_factory=list)  # eV/atom per frame
    energy_pred: list[np.ndarray] = field(default_factory=list)
    forces_ref: list[np.ndarray] = field(default_factory=list)  # eV/Å per component
    forces_pred: list[np.ndarray] = field(default_factory=list)

    def add(self, batch: TrainingBatch, prediction: Prediction) -> None:
        labels = batch.labels
        per_atom = labels.n_atoms.cpu()
        mask = labels.energy_mask.cpu()
        self.energy_ref.append((labels.energy.cpu() / per_atom)[mask].numpy())
        energy = prediction.energy.detach().cpu()
        self.energy_pred.append((energy / per_atom)[mask].numpy())
        if prediction.forces is not None:
            fmask = labels.forces_mask.cpu()
            self.forces_ref.append(labels.forces.cpu()[fmask].numpy().ravel())
            self.forces_pred.append(prediction.forces.detach().cpu()[fmask].numpy().ravel())


@dataclass
class SetResult:
    errors: PropertyErrors
    parity: ParityData | None


def evaluate_batches(
    potential: Potential,
    batches: Iterable[TrainingBatch],
    properties: Sequence[str],
    *,
    collect_parity: bool = False,
) -> SetResult:
    """Errors of ``potential`` over every labelled item of the batches (no parameter gradients)."""
    errors = PropertyErrors()
    parity = ParityData() if collect_parity else None
    for batch in batches:
        prediction = predict_batch(potential, batch, properties)
        labels = batch.labels.to(potential.device)
        errors.add(batch_errors(labels, prediction.energy, prediction.forces, prediction.virial))
        if parity is not None:
            parity.add(batch, prediction)
    return SetResult(errors, parity)


def evaluate_frames(
    potential: Potential,
    dataset: FrameDataset,
    *,
    batch_size: int,
    collect_parity: bool = False,
) -> SetResult:
    """:func:`evaluate_batches` over a dataset, batched in order."""
    return evaluate_batches(
        potential,
        iterate_batches(dataset, batch_size),
        properties_for(dataset),
        collect_parity=collect_parity,
    )


@dataclass
class EvalReport:
    """Per-system and overall errors, as written to the JSON output."""

    model: str
    model_sha256: str
    execution: dict[str, str]
    systems: dict[str, dict[str, Any]]
    overall: dict[str, Any]

    def to_json(self) -> str:
        return json.dumps(
            {
                "model": self.model,
                "model_sha256": self.model_sha256,
                "execution": self.execution,
                "units": {"energy": "eV/atom", "forces": "eV/Å", "virial": "eV/atom"},
                "overall": self.overall,
                "systems": self.systems,
            },
            indent=2,
            allow_nan=False,
        )


def _finite_summary(errors: PropertyErrors, n_frames: int) -> dict[str, Any]:
    summary: dict[str, Any] = {"frames": n_frames}
    for name, stats in errors.summary().items():
        summary[name] = finite_or_none(stats)
    return summary


def evaluate_model(
    model: str | Path | None,
    data: Sequence[str | Path],
    *,
    device: str = "auto",
    path: str = "auto",
    precision: str = "fp32",
    batch_size: int = 8,
    parity_plot: Path | None = None,
    json_output: Path | None = None,
    type_map: Sequence[str] | None = None,
) -> EvalReport:
    """Load a model file and report its errors on each data system and overall.

    ``model=None`` evaluates the shipped default model. A DeePMD system without ``type_map.raw``
    is read with ``type_map`` (element symbols in type-index order), or when that is not given
    with the model's type map (as ``dp test`` does). Writes the JSON report and a parity plot when
    paths are given; their folders are checked (and created) before anything is evaluated, so an
    unusable path fails at once with a ``ValueError``, as do ``batch_size`` < 1 and a
    ``type_map`` with unknown or repeated symbols.
    """
    if batch_size < 1:
        raise ValueError(f"batch size must be ≥ 1, got {batch_size}")
    if type_map is not None:
        _check_type_map(type_map)
    for output, what in ((json_output, "JSON report"), (parity_plot, "parity plot")):
        if output is not None:
            _check_output_file(output, what)
    if parity_plot is not None and parity_plot.suffix.lower() != ".png":
        raise ValueError(f"the parity plot is written as PNG: give a .png path, not {parity_plot}")
    if parity_plot is not None and not can_plot():
        raise ValueError(
            "the parity plot needs matplotlib, which this install lacks: "
            "pip install 'so2serve[plot]'"
        )
    potential = load_potential(model, device=device, path=path, precision=precision)
    dataset = load_dataset(list(data), type_map=type_map or potential.config.type_map)
    if all(f.energy is None and f.forces is None and f.virial is None for f in dataset):
        raise DataError(
            ", ".join(dataset.sources),
            "no reference energy, forces or virial to compare with (to compute them for "
            "unlabelled structures, use `so2serve screen`)",
        )
    for source, frames in dataset.by_source().items():
        unknown = sorted(set(frames.elements) - set(potential.config.type_map))
        if unknown:
            raise DataError(
                source, f"element(s) {unknown} unknown to the model ({potential.config.type_map})"
            )
    overall = PropertyErrors()
    all_parity = ParityData()
    systems: dict[str, dict[str, Any]] = {}
    for source, frames in dataset.by_source().items():
        result = evaluate_frames(potential, frames, batch_size=batch_size, collect_parity=True)
        _require_finite(result.errors, source)
        overall.merge(result.errors)
        assert result.parity is not None
        for name in ("energy_ref", "energy_pred", "forces_ref", "forces_pred"):
            getattr(all_parity, name).extend(getattr(result.parity, name))
        systems[source] = _finite_summary(result.errors, len(frames))
    execution = potential.execution
    report = EvalReport(
        model=str(model) if model is not None else "default",
        model_sha256=potential.metadata.sha256,
        execution={
            "path": execution.path,
            "precision": execution.precision,
            "device": execution.device,
        },
        systems=systems,
        overall=_finite_summary(overall, len(dataset)),
    )
    try:
        if json_output is not None:
            json_output.write_text(report.to_json() + "\n")
        if parity_plot is not None:
            write_parity_plot(all_parity, parity_plot, title=report.model)
    except OSError as exc:  # checked before the run, but a disk can fill or a mount vanish
        raise ValueError(f"cannot write the results: {exc}") from exc
    return report


def _require_finite(errors: PropertyErrors, source: str) -> None:
    """Labels are finite when loaded, so a labelled property whose error statistics are not
    comes from a NaN or inf prediction (it would otherwise read as a missing label)."""
    bad = [name for name, stats in errors.summary().items() if not math.isfinite(stats["rmse"])]
    if bad:
        raise ModelFileError(
            f"the model predicted non-finite {' and '.join(bad)} (NaN or inf) on {source}: its "
            "weights or the structures are unusable"
        )


def _check_type_map(type_map: Sequence[str]) -> None:
    """``ValueError`` unless ``type_map`` is a non-empty list of distinct element symbols."""
    if not type_map:
        raise ValueError("type_map is empty: give the element symbols in type-index order")
    unknown = [s for s in type_map if s not in atomic_numbers]
    if unknown:
        raise ValueError(f"type_map {list(type_map)}: unknown element symbol(s) {unknown}")
    repeated = sorted({s for s in type_map if list(type_map).count(s) > 1})
    if repeated:
        raise ValueError(f"type_map {list(type_map)}: element(s) {repeated} listed twice")


def _check_output_file(path: Path, what: str) -> None:
    """Create ``path``'s folder if needed; ``ValueError`` if ``path`` cannot be written there."""
    problem = file_problem(path)
    if problem is not None:
        raise ValueError(f"cannot write the {what} to {path}: {problem}")


def can_plot() -> bool:
    """Whether matplotlib (the ``plot`` extra) is installed."""
    return find_spec("matplotlib") is not None


def write_parity_plot(parity: ParityData, path: Path, *, title: str = "") -> None:
    """Energy and force parity panels side by side, as a PNG.

    Energies are per atom in meV/atom, shifted by the mean reference energy per atom (total
    energies per atom differ from each other only in the last digits).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def joined(parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts) if parts else np.zeros(0)

    energy_ref, energy_pred = joined(parity.energy_ref), joined(parity.energy_pred)
    shift = float(energy_ref.mean()) if energy_ref.size else 0.0
    panels = (
        (
            "energy",
            "energy per atom − mean (meV/atom)",
            1000.0 * (energy_ref - shift),
            1000.0 * (energy_pred - shift),
            "meV/atom",
        ),
        (
            "forces",
            "force component (eV/Å)",
            joined(parity.forces_ref),
            joined(parity.forces_pred),
            "eV/Å",
        ),
    )
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6), constrained_layout=True)
    for ax, (name, label, ref, pred, unit) in zip(axes, panels, strict=True):
        if ref.size:
            rmse = float(np.sqrt(np.mean((pred - ref) ** 2)))
            lo, hi = float(min(ref.min(), pred.min())), float(max(ref.max(), pred.max()))
            ax.plot([lo, hi], [lo, hi], color="0.6", lw=1)
            ax.scatter(ref, pred, s=4, alpha=0.5, rasterized=True)
            ax.set_title(f"{name}: RMSE {rmse:.4g} {unit}, n={ref.size}")
        ax.set_xlabel(f"reference {label}")
        ax.set_ylabel(f"predicted {label}")
    if title:
        fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
