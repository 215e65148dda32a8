"""Training configuration: typed sections loaded from TOML or JSON, with ``key=value`` overrides.

A config file has the sections ``[data]``, ``[model]``, ``[loss]``, ``[optim]`` and ``[run]``
(fields below, all optional except ``data.train``). Overrides use dotted keys and TOML values,
e.g. ``run.steps=2000``, ``optim.lr=5e-4``, ``data.train=["a", "b"]``; a value that is not
valid TOML is taken as a string (``run.device=cuda``).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

from service.model.config import ModelConfig, preset
from service.model.errors import ModelConfigError

__all__ = [
    "CHECKPOINT_NAME",
    "ConfigError",
    "DataConfig",
    "LossConfig",
    "ModelSection",
    "OptimConfig",
    "RunConfig",
    "TrainConfig",
    "TrainResult",
    "apply_overrides",
    "load_config",
]

Schedule = Literal["cosine", "wsd", "constant"]
Export = Literal["best", "final"]


CHECKPOINT_NAME = "checkpoint.pt"
"""The run's resumable state, in ``run.output_dir``."""


class ConfigError(ValueError):
    """A training config that cannot be used; the message names the key."""


@dataclass
class DataConfig:
    train: list[str] = field(default_factory=list)
    """DeePMD systems, folders of systems, or ASE-readable files."""
    validation: list[str] = field(default_factory=list)
    """Explicit validation data; when empty, ``valid_fraction`` of the training frames."""
    valid_fraction: float = 0.1
    split_seed: int = 0
    roots: list[str] = field(default_factory=list)
    """Relative data paths are looked up under these folders in order, then in the cwd."""
    type_map: list[str] = field(default_factory=list)
    """Element order of the model; default: the elements in the data, by atomic number."""
    batch_size: int = 1
    """Frames per optimisation step."""
    valid_batch_size: int = 8


@dataclass
class ModelSection:
    preset: str = "small"
    overrides: dict[str, Any] = field(default_factory=dict)
    """``ModelConfig`` fields that replace the preset's."""
    init_from: str = ""
    """A model file to start from (fine-tuning); its architecture wins over preset/overrides."""
    refit_energy_reference: bool = True
    """Fine-tuning only: before the first step, add to the loaded model's per-element energy bias
    the least-squares per-element fit of the training energies' residual (labels − the loaded
    model's predictions), as DeePMD-kit's fine-tuning does, so data from another DFT setup do not
    start with a constant per-element offset. ``false`` keeps the loaded bias. Not redone on
    resume."""


@dataclass
class LossConfig:
    """Weights as ``[start, end]``; they move from start to end as the LR decays.

    The defaults let forces lead early and energies catch up (1:100 → 10:1), which suits runs of
    minutes to hours; DeePMD's own ``[0.02, 1]`` / ``[1000, 1]`` is meant for ~10⁶ steps.
    """

    energy_weight: list[float] = field(default_factory=lambda: [1.0, 10.0])
    """On the per-atom energy error (eV/atom)²."""
    force_weight: list[float] = field(default_factory=lambda: [100.0, 1.0])
    """On the force component error (eV/Å)²."""
    virial_weight: list[float] = field(default_factory=lambda: [1.0, 10.0])
    """On the per-atom virial error (eV/atom)², frames with virial labels only."""


@dataclass
class OptimConfig:
    lr: float = 1e-3
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.01
    """Final LR as a fraction of the peak."""
    schedule: Schedule = "cosine"
    """After warm-up: ``cosine`` decay, ``wsd`` (hold, then cosine over the last
    ``decay_fraction``) or ``constant``."""
    warmup_fraction: float = 0.02
    decay_fraction: float = 0.2
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    clip_norm: float = 10.0
    """Gradient-norm clip; 0 disables."""
    ema_decay: float = 0.999
    """EMA of the weights (evaluated and exported); 0 disables."""


@dataclass
class RunConfig:
    steps: int = 1000
    """Length of the run. The LR and loss-weight schedules are functions of ``step / steps``:
    resuming with another value moves the run to another point of them (a longer run goes back
    up towards the peak LR), which the resume logs with the LR before and after."""
    max_time_s: float = 0.0
    """Wall-clock budget; when > 0 the schedule runs on elapsed time and training stops at the
    budget or at ``steps``, whichever comes first (not bit-reproducible across machines)."""
    session_steps: int = 0
    """Stop this invocation after this many steps (checkpointing), e.g. to fit a job slot;
    resume later with ``run.resume``. 0 runs to the end. A session that stops early writes its
    model to the run folder only, never to ``export_path``."""
    eval_every: int = 100
    checkpoint_every: int = 500
    output_dir: str = "runs/train"
    device: str = "auto"
    """auto | cpu | cuda | cuda:N; checked against this machine when training starts."""
    path: str = "auto"
    """Execution path for training: auto | fused | reference."""
    check_second_order: bool = True
    """Before a fused-path run, compare its force-loss gradients with the reference path's on
    one batch and fall back to the reference path if they disagree or it is slower."""
    seed: int = 0
    resume: bool = False
    """Continue from ``output_dir/checkpoint.pt`` if present."""
    export: Export = "best"
    """Which EMA weights the model file holds: the best validation loss seen, or the final ones."""
    export_path: str = ""
    """Where the model file goes; empty: ``output_dir/model.safetensors``."""
    progress: bool = True


@dataclass
class TrainConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelSection = field(default_factory=ModelSection)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> TrainConfig:
        config: TrainConfig = _build_dataclass(cls, raw, "")
        config.validate()
        return config

    def validate(self) -> None:
        checks: list[tuple[bool, str]] = [
            (bool(self.data.train), "data.train: at least one data path is required"),
            (0.0 <= self.data.valid_fraction < 1.0, "data.valid_fraction must be in [0, 1)"),
            (self.data.batch_size >= 1, "data.batch_size must be ≥ 1"),
            (self.data.valid_batch_size >= 1, "data.valid_batch_size must be ≥ 1"),
            (self.optim.lr > 0.0, "optim.lr must be > 0"),
            (0.0 <= self.optim.min_lr_ratio <= 1.0, "optim.min_lr_ratio must be in [0, 1]"),
            (0.0 <= self.optim.warmup_fraction < 1.0, "optim.warmup_fraction must be in [0, 1)"),
            (0.0 < self.optim.decay_fraction <= 1.0, "optim.decay_fraction must be in (0, 1]"),
            (
                len(self.optim.betas) == 2 and all(0.0 <= b < 1.0 for b in self.optim.betas),
                "optim.betas must be [beta1, beta2], each in [0, 1)",
            ),
            (self.optim.eps > 0.0, "optim.eps must be > 0"),
            (self.optim.weight_decay >= 0.0, "optim.weight_decay must be ≥ 0"),
            (self.optim.clip_norm >= 0.0, "optim.clip_norm must be ≥ 0"),
            (0.0 <= self.optim.ema_decay < 1.0, "optim.ema_decay must be in [0, 1)"),
            (self.run.steps >= 1, "run.steps must be ≥ 1"),
            (self.run.session_steps >= 0, "run.session_steps must be ≥ 0"),
            (self.run.max_time_s >= 0.0, "run.max_time_s must be ≥ 0"),
            (self.run.eval_every >= 1, "run.eval_every must be ≥ 1"),
            (self.run.checkpoint_every >= 1, "run.checkpoint_every must be ≥ 1"),
            (self.run.path in ("auto", "fused", "reference"), "run.path: auto|fused|reference"),
            (
                _DEVICE_PATTERN.fullmatch(self.run.device) is not None,
                f"run.device must be auto, cpu, cuda or cuda:N, got {self.run.device!r}",
            ),
        ]
        for name in ("energy_weight", "force_weight", "virial_weight"):
            weights = getattr(self.loss, name)
            checks.append(
                (
                    len(weights) == 2 and min(weights) >= 0.0,
                    f"loss.{name} must be [start, end] with both ≥ 0",
                )
            )
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        _check_model_section(self.model)


_DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:[0-9]+)?")


def _check_model_section(model: ModelSection) -> None:
    """Build the preset's architecture once (placeholder elements) so a bad name, an unknown
    override key or a bad override value fails here, before any data is loaded."""
    if "type_map" in model.overrides:
        raise ConfigError("model.overrides.type_map: set the element order with data.type_map")
    fields = {f.name for f in dataclasses.fields(ModelConfig)} - {"type_map"}
    unknown = sorted(set(model.overrides) - fields)
    if unknown:
        raise ConfigError(
            f"model.overrides: unknown model field(s) {unknown}; known: {', '.join(sorted(fields))}"
        )
    try:
        preset(model.preset, ("H",), **model.overrides)
    except ModelConfigError as exc:
        raise ConfigError(f"model: {exc}") from exc


def _build_dataclass(cls: type, raw: Mapping[str, Any], prefix: str) -> Any:
    """Instantiate a config dataclass from a mapping, checking keys and value types."""
    if not isinstance(raw, Mapping):
        where = prefix.rstrip(".") or "config"
        raise ConfigError(f"{where}: expected a table, got {type(raw).__name__}")
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        where = f" in [{prefix.rstrip('.')}]" if prefix else ""
        raise ConfigError(f"unknown key(s){where}: {', '.join(prefix + k for k in unknown)}")
    values = {key: _coerce(hints[key], value, prefix + key) for key, value in raw.items()}
    return cls(**values)


_CONSTANT_WEIGHT_KEYS = frozenset(f"loss.{f.name}" for f in dataclasses.fields(LossConfig))
"""The keys where a scalar ``w`` stands for ``[w, w]``; a scalar ``optim.betas`` is an error,
not ``[b, b]``."""


def _coerce(hint: Any, value: Any, key: str) -> Any:
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return _build_dataclass(hint, value, key + ".")
    origin = get_origin(hint)
    if origin is Literal:
        if value not in get_args(hint):
            raise ConfigError(f"{key}: expected one of {list(get_args(hint))}, got {value!r}")
        return value
    if origin is list:
        (item_type,) = get_args(hint)
        if isinstance(value, (int, float)) and key in _CONSTANT_WEIGHT_KEYS:
            return [float(value), float(value)]  # a scalar weight means start == end
        if not isinstance(value, Sequence) or isinstance(value, str):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(item_type, item, f"{key}[{i}]") for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a table, got {value!r}")
        return dict(value)
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint in (int, str, bool) and type(value) is hint:
        return value
    raise ConfigError(f"{key}: expected {getattr(hint, '__name__', hint)}, got {value!r}")


def _read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config ({exc})") from exc
    try:
        loaded = json.loads(text) if path.suffix.lower() == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: not valid {path.suffix.lstrip('.').upper()} ({exc})") from exc
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: the top level must be a table")
    return loaded


def _parse_override_value(text: str) -> Any:
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of ``raw`` with ``section.key=value`` overrides applied (value in TOML)."""
    merged: dict[str, Any] = copy.deepcopy(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        # Every top-level key is a section: `run=3` would replace the whole table.
        if not sep or len(parts) < 2 or not all(parts):
            raise ConfigError(f"override {item!r}: expected section.key=value")
        table = merged
        for part in parts[:-1]:
            table = table.setdefault(part, {})
            if not isinstance(table, dict):
                raise ConfigError(f"override {item!r}: {part} is not a table")
        table[parts[-1]] = _parse_override_value(text.strip())
    return merged


def load_config(path: Path | str | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Load a TOML/JSON config (defaults when ``path`` is None) and apply the overrides."""
    raw = _read_file(Path(path)) if path is not None else {}
    return TrainConfig.from_dict(apply_overrides(raw, overrides))


@dataclass(frozen=True)
class TrainResult:
    """What a finished training run wrote, and the validation of its exported weights."""

    output_dir: Path
    model_path: Path
    checkpoint_path: Path
    steps: int
    wall_s: float
    execution: dict[str, str]
    validation: dict[str, float]
    """Validation metrics of the exported weights (energy_rmse eV/atom, forces_rmse eV/Å, ...)."""
    exported_step: int
    log_csv: Path
    log_jsonl: Path
    finished: bool = True
    """False when ``run.session_steps`` stopped it early (the model is then a snapshot in the run
    folder; ``run.export_path`` is written when the resumed run finishes)."""
