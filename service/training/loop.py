"""``train(config)``: fit a DPA4 model to energies, forces and virials; export the model file.

One step: a batch of frames → ``Potential.predict(create_graph=True)`` → loss on per-atom energy,
force components and per-atom virial (masked to what is labelled) → backward through the forces
(second order) → gradient clip → AdamW → EMA update. Every ``eval_every`` steps the EMA weights
are validated and a log row is written (CSV + JSON lines); every ``checkpoint_every`` steps (and at
the end) the full state is checkpointed. The exported model file holds EMA weights (best
validation loss or final, ``run.export``) with provenance.

Before the first step of a new run the per-element energy reference is fitted by least squares
on the training energies and written into the model's energy bias (minus the untrained network's
mean per-element output), so the network only learns the small interaction energy. When
fine-tuning (``model.init_from``) the loaded bias is kept and corrected instead: the per-element
least-squares fit of the residual (labels − the loaded model's predictions) on the new training
data is added to it, as DeePMD-kit's fine-tuning does (``model.refit_energy_reference``). A
resumed run restores its bias from the checkpoint and fits nothing.
"""

from __future__ import annotations

import copy
import csv
import json
import logging
import math
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
import triton
from ase.data import atomic_numbers

from service.model.config import preset
from service.model.dpa4 import DPA4Model
from service.model.io import load_model, save_model
from service.model.potential import Potential, Prediction, resolve_device
from service.training.config import (
    CHECKPOINT_NAME,
    ConfigError,
    DataConfig,
    RunConfig,
    TrainConfig,
    TrainResult,
)
from service.training.data import (
    DataError,
    Frame,
    FrameDataset,
    TrainingBatch,
    collate,
    iterate_batches,
    load_dataset,
)
from service.training.evaluate import evaluate_batches, predict_batch, properties_for
from service.training.metrics import PropertyErrors, batch_errors, finite_or_none
from service.training.schedule import LossWeights, learning_rate, loss_weights
from service.training.state import (
    EpochSampler,
    ExponentialMovingAverage,
    file_problem,
    folder_problem,
    load_checkpoint,
    restore_rng_state,
    rng_state,
    save_checkpoint,
)

__all__ = [
    "PreparedData",
    "Trainer",
    "choose_training_path",
    "compute_loss",
    "fit_energy_reference",
    "force_loss_gradients",
    "initialize_energy_bias",
    "prepare_data",
    "refit_energy_reference",
    "resolve_data_path",
    "train",
]

log = logging.getLogger("so2serve.training")

LOG_COLUMNS = (
    "step",
    "epoch",
    "elapsed_s",
    "lr",
    "w_energy",
    "w_forces",
    "w_virial",
    "train_loss",
    "train_energy_rmse",
    "train_forces_rmse",
    "train_virial_rmse",
    "val_loss",
    "val_energy_rmse",
    "val_energy_mae",
    "val_forces_rmse",
    "val_forces_mae",
    "val_virial_rmse",
    "val_virial_mae",
)


# Data and model preparation


def resolve_data_path(entry: str, roots: Sequence[str]) -> Path:
    """An absolute path as is; a relative one under the first root holding it, else the cwd."""
    path = Path(entry).expanduser()
    if path.is_absolute():
        candidates = [path]
    else:
        candidates = [Path(root).expanduser() / path for root in roots] + [path]
    for candidate in candidates:
        if candidate.exists():
            return candidate.resolve()
    tried = ", ".join(str(c) for c in candidates)
    raise DataError(entry, f"not found (looked at: {tried})")


@dataclass(frozen=True)
class PreparedData:
    train: FrameDataset
    validation: FrameDataset
    type_map: list[str]
    train_paths: list[str]
    validation_paths: list[str]


def prepare_data(config: DataConfig) -> PreparedData:
    """Load, split and check the training/validation frames and fix the element order."""
    type_map_hint = config.type_map or None
    train_paths = [str(resolve_data_path(p, config.roots)) for p in config.train]
    pool = load_dataset(train_paths, type_map=type_map_hint, require_energy=True)
    if config.validation:
        validation_paths = [str(resolve_data_path(p, config.roots)) for p in config.validation]
        train_set = pool
        validation = load_dataset(validation_paths, type_map=type_map_hint, require_energy=True)
        _refuse_shared_sources(train_set, validation)
    else:
        validation_paths = []
        train_set, validation = pool.split(config.valid_fraction, config.split_seed)
    if len(train_set) == 0:
        raise DataError(train_paths[0], "no training frames left after the validation split")
    present = sorted(
        set(train_set.elements) | set(validation.elements), key=lambda s: atomic_numbers[s]
    )
    type_map = list(config.type_map) or present
    missing = [s for s in present if s not in type_map]
    if missing:
        raise DataError(train_paths[0], f"elements {missing} are not in data.type_map {type_map}")
    return PreparedData(train_set, validation, type_map, train_paths, validation_paths)


def _refuse_shared_sources(train: FrameDataset, validation: FrameDataset) -> None:
    """An explicit validation set must not hold a system or file that is trained on."""
    trained = {Path(source).resolve() for source in train.sources}
    shared = [source for source in validation.sources if Path(source).resolve() in trained]
    if shared:
        problem = "in both data.train and data.validation: it would be validated on after training"
        raise DataError(shared[0], problem)


def fit_energy_reference(
    frames: FrameDataset, type_map: Sequence[str], targets: np.ndarray | None = None
) -> np.ndarray:
    """Per-element energies ``e`` (T,) minimising Σ_f (y_f − Σ_t n_ft e_t)², eV.

    ``y`` (F,) is ``targets`` when given (e.g. residuals of a model), else the frames' energy
    labels. Uses the minimum-norm least-squares solution: when compositions do not separate the
    elements (e.g. every frame is (H₂O)₆₄) only the composition-weighted sum is determined, and
    the minimum-norm choice is the stable, reproducible one.
    """
    index = {atomic_numbers[s]: t for t, s in enumerate(type_map)}
    counts = np.zeros((len(frames), len(type_map)))
    for f, frame in enumerate(frames):
        for z, n in zip(*np.unique(frame.numbers, return_counts=True), strict=True):
            counts[f, index[int(z)]] = n
    if targets is None:
        targets = np.array([_energy_label(frame) for frame in frames], dtype=np.float64)
    solution, *_ = np.linalg.lstsq(counts, targets, rcond=None)
    return np.asarray(solution, dtype=np.float64)


def _energy_label(frame: Frame) -> float:
    assert frame.energy is not None  # prepare_data requires energies on training frames
    return frame.energy


def _spread_sample(frames: FrameDataset, size: int) -> FrameDataset:
    """About ``size`` frames evenly spaced over the dataset, plus the first frame of every source
    and of every element the spacing steps over (a mixed-type source's composition changes
    from frame to frame): every source and every element is in the sample."""
    if len(frames) <= size:
        return frames
    spread = set(np.linspace(0, len(frames) - 1, size).round().astype(int).tolist())
    first: dict[str | int, int] = {}
    for k, frame in enumerate(frames):
        first.setdefault(frame.source, k)
        for number in np.unique(frame.numbers).tolist():
            first.setdefault(number, k)
    return frames.subset(sorted(spread | set(first.values())))


def build_model(config: TrainConfig, type_map: Sequence[str]) -> DPA4Model:
    """A fresh model from the preset (+ overrides), or the ``init_from`` model file."""
    section = config.model
    if section.init_from:
        model = load_model(Path(section.init_from))
        missing = [s for s in type_map if s not in model.config.type_map]
        if missing:
            raise DataError(section.init_from, f"model has no element(s) {missing} of the data")
        return model
    torch.manual_seed(config.run.seed)
    return DPA4Model(preset(section.preset, list(type_map), **section.overrides))


def initialize_energy_bias(
    model: DPA4Model,
    frames: FrameDataset,
    type_map: Sequence[str],
    *,
    device: torch.device,
    path: str,
    sample_frames: int = 32,
    batch_size: int = 8,
) -> dict[str, float]:
    """Set the model's per-element energy bias before training; returns it by symbol (eV).

    The bias is the least-squares reference of :func:`fit_energy_reference` minus the mean
    per-element output of the freshly initialised network on the first ``sample_frames``
    training frames, so the untrained model already predicts the reference energies on average
    (a random network adds an offset of order 0.1 eV/atom that training would otherwise spend
    its first steps removing).
    """
    reference = dict(zip(type_map, fit_energy_reference(frames, type_map).tolist(), strict=True))
    model_types = model.config.type_map
    bias = model.get_buffer("energy_bias")
    with torch.no_grad():
        # In the buffer's float64: a float32 tensor would round the reference (~1e-5 eV of
        # ~100 eV per element) before the copy.
        bias.copy_(torch.tensor([reference.get(s, 0.0) for s in model_types], dtype=bias.dtype))
    potential = Potential(model, device=device, path=path, capture=False)
    # Potential moved the model: take the buffer again, the one fetched above may be a stale copy.
    bias = model.get_buffer("energy_bias")
    totals = torch.zeros(len(model_types), dtype=torch.float64, device=potential.device)
    counts = torch.zeros_like(totals)
    sample = frames.subset(range(min(sample_frames, len(frames))))
    for batch in iterate_batches(sample, batch_size):
        structures = batch.structures.to(potential.device)
        prediction = potential.predict(structures, ("energy", "energies"))
        assert prediction.energies is not None
        types = potential.atom_types(structures)
        network_part = prediction.energies - bias[types]
        totals.index_add_(0, types, network_part)
        counts.index_add_(0, types, torch.ones_like(network_part))
    with torch.no_grad():
        bias.sub_(totals / counts.clamp_min(1.0))
    return dict(zip(model_types, bias.tolist(), strict=True))


def refit_energy_reference(
    model: DPA4Model,
    frames: FrameDataset,
    *,
    device: torch.device,
    path: str,
    sample_frames: int = 256,
    batch_size: int = 8,
) -> dict[str, float]:
    """Fine-tuning: add to the loaded model's energy bias the per-element least-squares fit of
    the residual ``E_label − E_model`` on about ``sample_frames`` training frames (spread over
    the data, every source in it); returns the correction by symbol (eV, 0 for elements absent
    from the data).

    A model trained on another DFT setup differs from the new labels mostly by per-element
    constants; in the non-trainable bias they would otherwise stay as error all along.
    """
    sample = _spread_sample(frames, sample_frames)
    potential = Potential(model, device=device, path=path, capture=False)
    predicted: list[np.ndarray] = []
    for batch in iterate_batches(sample, batch_size):
        prediction = potential.predict(batch.structures.to(potential.device), ("energy",))
        predicted.append(prediction.energy.detach().cpu().to(torch.float64).numpy())
    labels = np.array([_energy_label(frame) for frame in sample], dtype=np.float64)
    residual = labels - np.concatenate(predicted)
    present = sample.elements
    fitted = dict(
        zip(present, fit_energy_reference(sample, present, residual).tolist(), strict=True)
    )
    correction = [fitted.get(s, 0.0) for s in model.config.type_map]
    # Potential moved the model: take the buffer only now.
    bias = model.get_buffer("energy_bias")
    with torch.no_grad():
        bias.add_(torch.tensor(correction, dtype=bias.dtype, device=bias.device))
    return dict(zip(model.config.type_map, correction, strict=True))


# Loss


def compute_loss(
    prediction: Prediction, batch: TrainingBatch, weights: LossWeights
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Weighted MSE of per-atom energy, force components and per-atom virial (float64).

    Each term averages over the labelled items of the batch only and is skipped when there are
    none. Returns the loss and the signed errors (for running training metrics).
    """
    errors = batch_errors(batch.labels, prediction.energy, prediction.forces, prediction.virial)
    loss = prediction.energy.new_zeros(())
    for weight, error in zip(weights, errors, strict=True):
        if weight > 0.0 and error.numel() > 0:
            loss = loss + weight * error.square().mean()
    return loss, errors


def validation_loss(errors: PropertyErrors, weights: LossWeights) -> float:
    """The loss of the whole validation set with the given weights (missing terms count 0)."""
    total = 0.0
    for weight, stats in zip(weights, (errors.energy, errors.forces, errors.virial), strict=True):
        if stats.count:
            total += weight * stats.rmse**2
    return total


# The trainer


def _schedule_progress(run: RunConfig, step: int, elapsed_s: float) -> float:
    """Where the LR and loss-weight schedules are after ``step`` steps and ``elapsed_s``
    seconds: ``step / run.steps``, or the elapsed fraction of ``run.max_time_s`` if larger."""
    by_steps = step / run.steps
    if run.max_time_s > 0.0:
        return max(by_steps, elapsed_s / run.max_time_s)
    return by_steps


@dataclass
class _Best:
    loss: float = math.inf
    step: int = -1
    state: dict[str, torch.Tensor] | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class Trainer:
    """Holds everything that evolves during training; ``state_dict`` is the checkpoint."""

    def __init__(self, config: TrainConfig, data: PreparedData, model: DPA4Model) -> None:
        self.config = config
        self.data = data
        self.device = resolve_device(config.run.device)
        self.model = model.to(self.device)
        self.properties = properties_for(data.train)
        self.valid_properties = properties_for(data.validation)
        self._valid_batches: list[TrainingBatch] | None = None
        optim = config.optim
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=optim.lr,
            betas=(optim.betas[0], optim.betas[1]),
            eps=optim.eps,
            weight_decay=optim.weight_decay,
        )
        self.ema = ExponentialMovingAverage(self.model, optim.ema_decay)
        self.sampler = EpochSampler(len(data.train), config.data.batch_size, config.run.seed)
        self.step = 0
        # The LR and loss weights the last step ran with: what its log row reports.
        self.step_lr = learning_rate(0.0, optim)
        self.step_weights = loss_weights(0.0, optim, config.loss)
        self.elapsed_s = 0.0
        self.best = _Best()
        self.potential = Potential(
            self.model, device=self.device, path=config.run.path, capture=False
        )
        self.ema_potential = Potential(
            self.ema.module, device=self.device, path=config.run.path, capture=False
        )
        self._running = PropertyErrors()
        self._running_loss = 0.0
        self._running_steps = 0

    # schedule
    def progress(self) -> float:
        return _schedule_progress(self.config.run, self.step, self.elapsed_s)

    def finished(self) -> bool:
        return self.progress() >= 1.0

    def evaluated_weights(self) -> DPA4Model:
        return self.ema.module if self.config.optim.ema_decay > 0.0 else self.model

    # one optimisation step
    def train_step(self) -> float:
        progress = self.progress()
        lr = learning_rate(progress, self.config.optim)
        weights = loss_weights(progress, self.config.optim, self.config.loss)
        self.step_lr, self.step_weights = lr, weights
        # Set from the config every step: after a resume the LR stored in the checkpointed
        # optimizer state gives way to the current optim.lr (which a resume may change).
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batch = collate([self.data.train[i] for i in self.sampler.next_batch()])
        batch = batch.to(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        prediction = predict_batch(self.potential, batch, self.properties, create_graph=True)
        loss, errors = compute_loss(prediction, batch, weights)
        loss.backward()  # type: ignore[no-untyped-call]
        if self.config.optim.clip_norm > 0.0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.optim.clip_norm)
        self.optimizer.step()
        if self.config.optim.ema_decay > 0.0:
            self.ema.update(self.model)
        self.step += 1
        value = float(loss.detach())
        if not math.isfinite(value):
            raise FloatingPointError(f"training loss became {value} at step {self.step}")
        self._running.add(errors)
        self._running_loss += value
        self._running_steps += 1
        return value

    # validation
    def validate(self) -> dict[str, float]:
        """Validate the EMA weights; track the best. Returns the log row's ``val_*`` fields."""
        if len(self.data.validation) == 0:
            return {}
        potential = self.ema_potential if self.config.optim.ema_decay > 0.0 else self.potential
        if self._valid_batches is None:  # collated and moved to the device once
            batches = iterate_batches(self.data.validation, self.config.data.valid_batch_size)
            self._valid_batches = [batch.to(self.device) for batch in batches]
        result = evaluate_batches(potential, self._valid_batches, self.valid_properties)
        final_weights = loss_weights(1.0, self.config.optim, self.config.loss)
        loss = validation_loss(result.errors, final_weights)
        metrics = {"val_loss": loss, **{f"val_{k}": v for k, v in result.errors.flat().items()}}
        if loss < self.best.loss:
            state = self.evaluated_weights().state_dict()
            self.best = _Best(loss, self.step, {k: v.detach().clone() for k, v in state.items()})
            self.best.metrics = metrics
        return metrics

    def log_row(self, validation: dict[str, float]) -> dict[str, float]:
        """The row after step ``self.step``: its schedule values, running training errors since
        the previous row, and ``validation``. Resets the running errors."""
        w = self.step_weights
        running = self._running.flat()
        row: dict[str, float] = {
            "step": self.step,
            "epoch": self.sampler.epoch,
            "elapsed_s": round(self.elapsed_s, 3),
            "lr": self.step_lr,
            "w_energy": w[0],
            "w_forces": w[1],
            "w_virial": w[2],
            "train_loss": self._running_loss / max(self._running_steps, 1),
            "train_energy_rmse": running["energy_rmse"],
            "train_forces_rmse": running["forces_rmse"],
            "train_virial_rmse": running["virial_rmse"],
            **validation,
        }
        self._running = PropertyErrors()
        self._running_loss = 0.0
        self._running_steps = 0
        return row

    # checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            "config": json.dumps(self.config.to_dict(), sort_keys=True),
            "type_map": list(self.data.type_map),
            "step": self.step,
            "elapsed_s": self.elapsed_s,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "ema": self.ema.state_dict(),
            "sampler": self.sampler.state_dict(),
            "rng": rng_state(),
            "running": {
                "errors": self._running.state(),
                "loss": self._running_loss,
                "steps": self._running_steps,
            },
            "best": {
                "loss": self.best.loss,
                "step": self.best.step,
                "state": self.best.state or {},
                "metrics": self.best.metrics,
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_resumable(json.loads(state["config"]), self.config.to_dict())
        if list(state["type_map"]) != list(self.data.type_map):
            raise ConfigError(f"checkpoint type_map {state['type_map']} != {self.data.type_map}")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.ema.load_state_dict(state["ema"])
        self.sampler.load_state_dict(state["sampler"])
        restore_rng_state(state["rng"])
        self._running = PropertyErrors.from_state(state["running"]["errors"])
        self._running_loss = float(state["running"]["loss"])
        self._running_steps = int(state["running"]["steps"])
        self.step = int(state["step"])
        self.elapsed_s = float(state["elapsed_s"])
        best = state["best"]
        self.best = _Best(
            float(best["loss"]), int(best["step"]), best["state"] or None, dict(best["metrics"])
        )


# Where and how the run executes, and what it writes; not what it learns.
# (device/path change only floating-point rounding; a copied run folder resumes from its copy.)
_RESUME_MAY_CHANGE = {
    "run": {
        "output_dir",
        "device",
        "path",
        "check_second_order",
        "session_steps",
        "eval_every",
        "checkpoint_every",
        "resume",
        "progress",
        "export",
        "export_path",
    },
    "data": {"valid_batch_size"},
}

# What a resume may change although it changes what is learned from there on; the resume logs
# it. The ways out of a diverged run (a lower LR, a tighter clip) and of an out-of-memory stop
# (a smaller batch) must be open, and so must a longer or shorter run, which moves the run along
# the schedules (functions of step / run.steps).
_RESUME_MAY_RETUNE = {
    "optim": {"lr", "min_lr_ratio", "clip_norm"},
    "data": {"batch_size"},
    "run": {"steps", "max_time_s"},
}


def _check_resumable(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """A resumed run must train the same model on the same data with the same optimiser,
    but for the settings of ``_RESUME_MAY_RETUNE``."""
    for section, values in saved.items():
        allowed = _RESUME_MAY_CHANGE.get(section, set()) | _RESUME_MAY_RETUNE.get(section, set())
        for key, value in values.items():
            if key not in allowed and current.get(section, {}).get(key) != value:
                raise ConfigError(
                    f"cannot resume: {section}.{key} was {value!r} in the checkpoint, "
                    f"now {current.get(section, {}).get(key)!r}"
                )


def _retuned(saved: dict[str, Any], current: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """The settings of ``_RESUME_MAY_RETUNE`` that differ from the checkpoint's ``saved``
    config, as ``{"optim.lr": (was, now)}``."""
    now = current.to_dict()
    return {
        f"{section}.{key}": (saved[section][key], now[section][key])
        for section, keys in _RESUME_MAY_RETUNE.items()
        for key in sorted(keys)
        if key in saved.get(section, {}) and saved[section][key] != now[section][key]
    }


def _with_settings(config: TrainConfig, settings: dict[str, Any]) -> TrainConfig:
    """A copy of ``config`` with ``{"optim.lr": value}`` settings replaced."""
    changed = copy.deepcopy(config)
    for name, value in settings.items():
        section, key = name.split(".")
        setattr(getattr(changed, section), key, value)
    return changed


def _report_retuned(trainer: Trainer, saved: dict[str, Any]) -> dict[str, Any]:
    """Log what a resume changed of ``_RESUME_MAY_RETUNE`` and the LR the next step gets with
    and without the change; returns that for the run log (empty when nothing changed)."""
    retuned = _retuned(saved, trainer.config)
    if not retuned:
        return {}
    checkpointed = _with_settings(trainer.config, {name: was for name, (was, _) in retuned.items()})
    progress = _schedule_progress(checkpointed.run, trainer.step, trainer.elapsed_s)
    lr_before = learning_rate(progress, checkpointed.optim)
    lr_after = learning_rate(trainer.progress(), trainer.config.optim)
    changes = ", ".join(f"{name} {was} → {now}" for name, (was, now) in retuned.items())
    moved = {"run.steps", "run.max_time_s"} & retuned.keys()
    log.warning(
        "resuming at step %d with %s: the next step's LR is %.4g (%.4g with the checkpoint's)%s",
        trainer.step,
        changes,
        lr_after,
        lr_before,
        "; the LR and loss-weight schedules are functions of step / run.steps" if moved else "",
    )
    return {
        "retuned": {name: list(pair) for name, pair in retuned.items()},
        "lr": {"checkpointed": lr_before, "now": lr_after},
    }


# Execution path for the force loss


def force_loss_gradients(
    potential: Potential, model: torch.nn.Module, batch: TrainingBatch, properties: Sequence[str]
) -> tuple[torch.Tensor, float]:
    """Flattened parameter gradients of the unit-weight loss on one batch, and the seconds taken."""
    start = time.perf_counter()
    model.zero_grad(set_to_none=True)
    prediction = predict_batch(potential, batch, properties, create_graph=True)
    loss, _ = compute_loss(prediction, batch, (1.0, 1.0, 1.0))
    loss.backward()  # type: ignore[no-untyped-call]
    grads = [p.grad.detach().flatten() for p in model.parameters() if p.grad is not None]
    if batch.labels.energy.is_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return torch.cat(grads), seconds


def choose_training_path(trainer: Trainer, *, rtol: float = 1e-3) -> str:
    """Keep the fused path for training only if its second order matches and is faster.

    Compares the force-loss parameter gradients of the fused and reference paths on the first
    batch (second call of each timed, after kernel compilation) and switches the trainer to the
    reference path when the fused one fails, disagrees beyond ``rtol`` (relative L2) or is slower.
    """
    if trainer.potential.execution.path != "fused" or not trainer.config.run.check_second_order:
        return trainer.potential.execution.path
    batch = collate([trainer.data.train[i] for i in range(min(len(trainer.data.train), 2))])
    batch = batch.to(trainer.device)
    reference = Potential(trainer.model, device=trainer.device, path="reference", capture=False)
    ref_grad, _ = force_loss_gradients(reference, trainer.model, batch, trainer.properties)
    _, ref_seconds = force_loss_gradients(reference, trainer.model, batch, trainer.properties)
    reason = ""
    try:
        fused_grad, _ = force_loss_gradients(
            trainer.potential, trainer.model, batch, trainer.properties
        )
        _, fused_seconds = force_loss_gradients(
            trainer.potential, trainer.model, batch, trainer.properties
        )
        mismatch = float((fused_grad - ref_grad).norm() / ref_grad.norm().clamp_min(1e-30))
        if not mismatch <= rtol:
            reason = f"its force-loss gradients differ from the reference by {mismatch:.2e}"
        elif fused_seconds > ref_seconds:
            reason = f"it is slower ({fused_seconds:.3f} s vs {ref_seconds:.3f} s per step)"
    # Triton's CompilationError and OutOfResources derive from TritonError, not RuntimeError.
    except (RuntimeError, NotImplementedError, ValueError, triton.errors.TritonError) as exc:
        reason = f"its double backward failed ({type(exc).__name__}: {exc})"
    if not reason:
        log.info(
            "training on the fused path (second order checked: rel. gradient error %.1e, "
            "%.3f s vs reference %.3f s per step)",
            mismatch,
            fused_seconds,
            ref_seconds,
        )
        return "fused"
    log.warning("training on the reference path: the fused path was rejected because %s", reason)
    trainer.potential = reference
    trainer.ema_potential = Potential(
        trainer.ema.module, device=trainer.device, path="reference", capture=False
    )
    return "reference"


# Logs, provenance, export


class RunLog:
    """``log.csv`` (one row per validation) and ``log.jsonl`` (rows and run events)."""

    def __init__(self, output_dir: Path, *, resume_step: int | None) -> None:
        self.csv_path = output_dir / "log.csv"
        self.jsonl_path = output_dir / "log.jsonl"
        if resume_step is None:
            self.csv_path.write_text(",".join(LOG_COLUMNS) + "\n")
            self.jsonl_path.write_text("")
        else:
            self._truncate_after(resume_step)

    def _truncate_after(self, step: int) -> None:
        """Drop rows written after the checkpoint we resume from (they will be redone)."""
        if self.csv_path.exists():
            lines = self.csv_path.read_text().splitlines(keepends=True)
            kept = lines[:1] + [ln for ln in lines[1:] if int(ln.split(",", 1)[0]) <= step]
            self.csv_path.write_text("".join(kept))
        else:
            self.csv_path.write_text(",".join(LOG_COLUMNS) + "\n")
        if self.jsonl_path.exists():
            rows = self.jsonl_path.read_text().splitlines(keepends=True)
            self.jsonl_path.write_text(
                "".join(r for r in rows if json.loads(r).get("step", 0) <= step)
            )

    def event(self, name: str, step: int, **details: Any) -> None:
        with self.jsonl_path.open("a") as fh:
            fh.write(json.dumps({"event": name, "step": step, **details}) + "\n")

    def row(self, row: dict[str, float]) -> None:
        with self.csv_path.open("a", newline="") as fh:
            csv.writer(fh).writerow([_csv_value(row.get(c, math.nan)) for c in LOG_COLUMNS])
        with self.jsonl_path.open("a") as fh:
            fh.write(json.dumps({"event": "validation", **finite_or_none(row)}) + "\n")


def _csv_value(value: float) -> str:
    return "" if isinstance(value, float) and math.isnan(value) else f"{value:.8g}"


def hardware_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "device": str(device),
        "host_cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    info["triton"] = triton.__version__
    return info


def _provenance(trainer: Trainer, exported_step: int, metrics: dict[str, float]) -> dict[str, Any]:
    data = trainer.data
    execution = trainer.potential.execution
    return {
        "producer": "so2serve train",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "data": {
            "train": data.train_paths,
            "validation": data.validation_paths or "held out from train",
            "frames": {"train": len(data.train), "validation": len(data.validation)},
            "atoms": {"train": data.train.n_atoms, "validation": data.validation.n_atoms},
        },
        "config": trainer.config.to_dict(),
        **_parent(trainer),
        "steps": trainer.step,
        "exported_step": exported_step,
        "weights": "ema" if trainer.config.optim.ema_decay > 0.0 else "raw",
        "wall_s": round(trainer.elapsed_s, 1),
        "metrics": {"validation": finite_or_none(metrics)},
        "execution": {"path": execution.path, "precision": execution.precision},
        "hardware": hardware_info(trainer.device),
    }


def _parent(trainer: Trainer) -> dict[str, Any]:
    """The model a fine-tuning started from, by identity as well as path (the file at that
    path may be replaced later)."""
    init_from = trainer.config.model.init_from
    if not init_from:
        return {}
    loaded = trainer.model.file_metadata or {}
    return {"init_from": {"path": init_from, "model_sha256": loaded.get("model_sha256")}}


def _export(
    trainer: Trainer, output_dir: Path, *, finished: bool
) -> tuple[Path, int, dict[str, float]]:
    """Save the chosen EMA weights as the model file; returns (path, step, metrics). A session
    that stops before the end (``run.session_steps``) writes its snapshot into the run folder:
    ``run.export_path`` (which may be a model others load, e.g. the shipped default) gets only
    a finished run's weights."""
    use_best = trainer.config.run.export == "best" and trainer.best.state is not None
    weights = trainer.evaluated_weights()
    final_state = {k: v.detach().clone() for k, v in weights.state_dict().items()}
    if use_best:
        assert trainer.best.state is not None
        weights.load_state_dict(trainer.best.state)
        step, metrics = trainer.best.step, trainer.best.metrics
    else:
        step, metrics = trainer.step, trainer.validate()
    export_path = trainer.config.run.export_path if finished else None
    path = Path(export_path or output_dir / "model.safetensors")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_model(weights, path, provenance=_provenance(trainer, step, metrics))
    if use_best:
        weights.load_state_dict(final_state)
    return path, step, metrics


# Entry point


def train(config: TrainConfig) -> TrainResult:
    """Run (or resume) a training as configured; returns where everything was written."""
    config.validate()
    device = _run_device(config.run.device)
    output_dir = Path(config.run.output_dir)
    _ensure_writable_dir(output_dir, "run.output_dir")
    _check_export_path(config.run.export_path)
    checkpoint_path = output_dir / CHECKPOINT_NAME
    if not config.run.resume:
        _refuse_to_overwrite(checkpoint_path)
    data = prepare_data(config.data)
    log.info(
        "data: %d training / %d validation frames, elements %s",
        len(data.train),
        len(data.validation),
        data.type_map,
    )
    model = build_model(config, data.type_map)
    resume = config.run.resume and checkpoint_path.exists()
    if config.run.resume and not resume:
        log.warning("no checkpoint at %s to resume from: training from the start", checkpoint_path)
    if not resume and not config.model.init_from:
        bias = initialize_energy_bias(
            model,
            data.train,
            data.type_map,
            device=device,
            path=config.run.path,
            batch_size=config.data.valid_batch_size,
        )
        log.info("per-element energy bias (eV): %s", {s: round(e, 6) for s, e in bias.items()})
    elif not resume and config.model.refit_energy_reference:
        correction = refit_energy_reference(
            model,
            data.train,
            device=device,
            path=config.run.path,
            batch_size=config.data.valid_batch_size,
        )
        log.info(
            "fine-tuning: per-element energy bias corrected by (eV): %s",
            {s: round(e, 6) for s, e in correction.items()},
        )
    trainer = Trainer(config, data, model)
    retuned: dict[str, Any] = {}
    if resume:
        checkpoint = load_checkpoint(checkpoint_path)
        trainer.load_state_dict(checkpoint)
        log.info("resumed from %s at step %d", checkpoint_path, trainer.step)
        retuned = _report_retuned(trainer, json.loads(checkpoint["config"]))
    run_log = RunLog(output_dir, resume_step=trainer.step if resume else None)
    path = choose_training_path(trainer)
    execution = trainer.potential.execution
    log.info(
        "execution: %s path, %s, on %s; force loss differentiated by %s",
        path,
        execution.precision,
        execution.device,
        "the fused ops' second order" if path == "fused" else "autograd double backward",
    )
    run_log.event(
        "resume" if resume else "start",
        trainer.step,
        execution={"path": path, "precision": execution.precision, "device": execution.device},
        hardware=hardware_info(trainer.device),
        **retuned,
    )
    _run_steps(trainer, run_log, checkpoint_path)
    finished = trainer.finished()
    model_path, exported_step, metrics = _export(trainer, output_dir, finished=finished)
    run_log.event("export", trainer.step, model=str(model_path), exported_step=exported_step,
                  finished=finished)  # fmt: skip
    log.info("wrote %s (weights of step %d): %s", model_path, exported_step, _brief(metrics))
    if not finished:
        later = f" and write {config.run.export_path}" if config.run.export_path else ""
        log.info("session over at step %d of %d: resume (--resume) to finish the run%s",
                 trainer.step, config.run.steps, later)  # fmt: skip
    return TrainResult(
        output_dir=output_dir,
        model_path=model_path,
        checkpoint_path=checkpoint_path,
        steps=trainer.step,
        wall_s=trainer.elapsed_s,
        execution={"path": path, "precision": execution.precision, "device": execution.device},
        validation={k.removeprefix("val_"): v for k, v in metrics.items()},
        exported_step=exported_step,
        log_csv=run_log.csv_path,
        log_jsonl=run_log.jsonl_path,
        finished=finished,
    )


def _run_device(name: str) -> torch.device:
    try:
        return resolve_device(name)
    except ValueError as exc:
        raise ConfigError(f"run.device: {exc}") from exc


def _ensure_writable_dir(folder: Path, key: str) -> None:
    problem = folder_problem(folder)
    if problem is not None:
        raise ConfigError(f"{key}: {problem}")


def _check_export_path(export_path: str) -> None:
    """``run.export_path`` must name a file that can be written: checked before the run, as
    the model is written only at its end."""
    if not export_path:
        return
    # Path("newdir/") is Path("newdir"): the separator is seen on the string only.
    if export_path.endswith(tuple(sep for sep in (os.sep, os.altsep) if sep)):
        raise ConfigError(
            f"run.export_path {export_path!r} ends with a path separator: name the model file, "
            f"e.g. {export_path}model.safetensors"
        )
    problem = file_problem(Path(export_path))
    if problem is not None:
        raise ConfigError(f"run.export_path: cannot write the model file {export_path}: {problem}")


def _refuse_to_overwrite(checkpoint_path: Path) -> None:
    """A fresh run in a folder that holds one would truncate its logs and replace its
    checkpoint and model file."""
    if not checkpoint_path.exists():
        return
    try:
        held = f"{CHECKPOINT_NAME} at step {load_checkpoint(checkpoint_path)['step']}"
    except ConfigError:  # unreadable, or of another format: still not ours to replace
        held = f"an unreadable {CHECKPOINT_NAME}"
    raise ConfigError(
        f"run.output_dir {checkpoint_path.parent} holds a run ({held}): pass --resume "
        "(run.resume=true) to continue it, or another -o / run.output_dir"
    )


def _run_steps(trainer: Trainer, run_log: RunLog, checkpoint_path: Path) -> None:
    from tqdm import tqdm

    run = trainer.config.run
    bar = tqdm(
        total=run.steps,
        initial=trainer.step,
        disable=not run.progress,
        unit="step",
        dynamic_ncols=True,
    )
    session_end = trainer.step + run.session_steps if run.session_steps else None
    while not trainer.finished() and trainer.step != session_end:
        start = time.perf_counter()
        loss = trainer.train_step()
        trainer.elapsed_s += time.perf_counter() - start
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3g}", refresh=False)
        done = trainer.finished()
        if trainer.step % run.eval_every == 0 or done:
            start = time.perf_counter()
            validation = trainer.validate()
            trainer.elapsed_s += time.perf_counter() - start
            run_log.row(trainer.log_row(validation))
            if validation:
                bar.set_postfix_str(_brief(validation))
        if trainer.step % run.checkpoint_every == 0 or done or trainer.step == session_end:
            save_checkpoint(checkpoint_path, trainer.state_dict())
    bar.close()


def _brief(metrics: dict[str, float]) -> str:
    e = metrics.get("val_energy_rmse", math.nan)
    f = metrics.get("val_forces_rmse", math.nan)
    return f"E {1000 * e:.2f} meV/atom, F {1000 * f:.1f} meV/Å"
