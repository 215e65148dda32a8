"""Architecture configuration of the DPA4/SeZM energy model, its validation and the presets.

Every field mirrors a DeePMD-kit ``dpa4`` descriptor/fitting knob of the supported subset
(model-dpa4.md §6, §11); derived sizes (focus width, FFN widths, env-seed widths) are properties
so that a JSON document of the fields alone reconstructs the model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Literal

from service.model.errors import ModelConfigError

BasisKind = Literal["bessel", "gaussian"]
RadialMode = Literal["none", "degree_channel"]
FFNKind = Literal["plain", "s2"]

FUSED_FOCUS_DIMS = (32, 64, 96, 128)
"""Focus widths the fused SO(2) kernels implement (so2kernels/_layout.py)."""


def glu_hidden_width(channels: int) -> int:
    """DeePMD's automatic GLU width: ``32·ceil(8C/3/32)`` (C=16→64, 32→96, 64→192, 128→352)."""
    return 32 * math.ceil(8.0 * channels / 3.0 / 32.0)


@dataclass(frozen=True)
class EnvSeedSizes:
    """Widths of the environment-seed FiLM network (model-dpa4.md §3)."""

    embed: int
    type_dim: int
    axis: int
    rbf_out: int
    g_in: int
    hidden: int


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of one DPA4 model; immutable, JSON round-trippable, validated."""

    type_map: tuple[str, ...]
    rcut: float = 6.0
    n_radial: int = 16
    basis: BasisKind = "bessel"
    radial_mlp: tuple[int, ...] = (0,)
    channels: int = 64
    lmax: int = 2
    n_blocks: int = 2
    mixing_layers: int = 2
    n_focus: int = 1
    focus_dim: int = 0
    radial_so2_mode: RadialMode = "degree_channel"
    radial_so2_rank: int = 1
    n_atten_head: int = 1
    ffn: FFNKind = "s2"
    ffn_neurons: int = 0
    ffn_blocks: int = 1
    use_env_seed: bool = True
    fitting_neurons: tuple[int, ...] = (0,)
    version: float = 1.1
    """DeePMD ``version_tensor``: ≥1.1 multiplies radial features by the p=5 envelope and uses a
    degree-norm floor of 0.25; 1.0 (legacy) does neither and uses the floor ``eps``."""
    env_exponents: tuple[int, int] = (7, 5)
    eps: float = 1e-7
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    """Free-form annotations (e.g. the DeePMD option values seen on import); not architectural."""

    def __post_init__(self) -> None:
        _check_field_types(self)
        # Normalise accepted numeric kinds (numpy scalars, JSON ints for reals) to plain Python
        # values so that equality, hashing and the JSON form do not depend on the input's kinds.
        for name in _INT_FIELDS:
            object.__setattr__(self, name, int(getattr(self, name)))
        for name in _REAL_FIELDS:
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "type_map", tuple(str(s) for s in self.type_map))
        for name in _INT_TUPLE_FIELDS:
            object.__setattr__(self, name, tuple(int(w) for w in getattr(self, name)))
        _validate(self)

    @property
    def n_types(self) -> int:
        return len(self.type_map)

    @property
    def focus_width(self) -> int:
        """Per-focus width ``Cf`` (``focus_dim``, 0 meaning ``channels``)."""
        return self.focus_dim or self.channels

    @property
    def hidden_channels(self) -> int:
        """Wide SO(2) width ``C_wide = n_focus·Cf``."""
        return self.n_focus * self.focus_width

    @property
    def head_dim(self) -> int:
        return self.focus_width // max(self.n_atten_head, 1)

    @property
    def ffn_hidden(self) -> int:
        return self.ffn_neurons or glu_hidden_width(self.channels)

    @property
    def readout_hidden(self) -> int:
        return glu_hidden_width(self.channels)

    @property
    def fitting_widths(self) -> tuple[int, ...]:
        """Hidden GLU widths of the fitting net; 0 means the automatic GLU width of its input."""
        widths: list[int] = []
        dim_in = self.channels
        for w in self.fitting_neurons:
            width = w or glu_hidden_width(dim_in)
            widths.append(width)
            dim_in = width
        return tuple(widths)

    @property
    def radial_widths(self) -> tuple[int, ...]:
        """Hidden widths of the radial MLP; 0 means ``channels``."""
        return tuple(w or self.channels for w in self.radial_mlp)

    @property
    def degree_norm_floor(self) -> float:
        return 0.25 if self.version >= 1.1 else self.eps

    @property
    def env_seed_sizes(self) -> EnvSeedSizes:
        embed = min(self.channels, 128)
        type_dim = min(max(self.channels // 4, 8), 32)
        axis = min(4 if embed < 64 else 8, embed - 1)
        rbf_out = max(32, embed - 2 * type_dim)
        g_in = rbf_out + 2 * type_dim
        hidden = min(256, max(2 * embed, g_in))
        return EnvSeedSizes(embed, type_dim, axis, rbf_out, g_in, hidden)

    @property
    def fused_eligible(self) -> bool:
        """Whether the fused SO(2) kernels can run this architecture (model-dpa4.md §6.1)."""
        return (
            1 <= self.lmax <= 6
            and self.focus_width in FUSED_FOCUS_DIMS
            and self.mixing_layers >= 2
            and (self.radial_so2_mode == "none" or 1 <= self.radial_so2_rank <= 4)
        )

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for key in ("type_map", "radial_mlp", "fitting_neurons", "env_exponents"):
            out[key] = list(out[key])
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        if not isinstance(data, dict):
            raise ModelConfigError(f"model config must be an object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(key) for key in set(data) - known)
        if unknown:
            raise ModelConfigError(f"unknown model config field(s): {', '.join(unknown)}")
        if "type_map" not in data:
            raise ModelConfigError("model config needs 'type_map'")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ModelConfigError(f"bad model config: {exc}") from exc

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"model config is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ModelConfigError("model config JSON must be an object")
        return cls.from_dict(data)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ModelConfigError(message)


_INT_FIELDS = (
    "n_radial", "channels", "lmax", "n_blocks", "mixing_layers", "n_focus", "focus_dim",
    "radial_so2_rank", "n_atten_head", "ffn_neurons", "ffn_blocks",
)  # fmt: skip
_INT_TUPLE_FIELDS = ("radial_mlp", "fitting_neurons", "env_exponents")
_REAL_FIELDS = ("rcut", "version", "eps")


def _is_int(value: object) -> bool:
    # bool is an int subclass; a JSON ``true`` where a width belongs is a mistake, not a 1.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_field_types(cfg: ModelConfig) -> None:
    """Reject wrongly typed fields before any arithmetic on them can raise a bare TypeError
    (or silently truncate ``64.5`` channels to 64)."""
    type_map: object = cfg.type_map
    _require(
        isinstance(type_map, list | tuple) and all(isinstance(s, str) for s in type_map),
        f"type_map must be a list of element symbols, got {type_map!r}",
    )
    for name in _INT_FIELDS:
        value = getattr(cfg, name)
        _require(_is_int(value), f"{name} must be an integer, got {value!r}")
    for name in _INT_TUPLE_FIELDS:
        value = getattr(cfg, name)
        _require(
            isinstance(value, list | tuple) and all(_is_int(w) for w in value),
            f"{name} must be a list of integers, got {value!r}",
        )
    for name in _REAL_FIELDS:
        value = getattr(cfg, name)
        _require(_is_real(value), f"{name} must be a number, got {value!r}")
    for name in ("basis", "radial_so2_mode", "ffn"):
        value = getattr(cfg, name)
        _require(isinstance(value, str), f"{name} must be a string, got {value!r}")
    _require(
        isinstance(cfg.use_env_seed, bool),
        f"use_env_seed must be true or false, got {cfg.use_env_seed!r}",
    )
    _require(isinstance(cfg.extra, dict), f"extra must be an object, got {cfg.extra!r}")


def _validate(cfg: ModelConfig) -> None:
    from ase.data import atomic_numbers

    _require(len(cfg.type_map) >= 1, "type_map must list at least one element")
    _require(len(set(cfg.type_map)) == len(cfg.type_map), "type_map has duplicate elements")
    for sym in cfg.type_map:
        _require(sym in atomic_numbers and sym != "X", f"type_map: unknown element symbol {sym!r}")
    _require(math.isfinite(cfg.rcut) and cfg.rcut > 0, f"rcut must be > 0, got {cfg.rcut}")
    _require(cfg.n_radial >= 1, f"n_radial must be >= 1, got {cfg.n_radial}")
    _require(
        cfg.basis in ("bessel", "gaussian"), f"basis must be bessel|gaussian, got {cfg.basis!r}"
    )
    _require(cfg.basis != "gaussian" or cfg.n_radial >= 2, "gaussian basis needs n_radial >= 2")
    _require(all(w >= 0 for w in cfg.radial_mlp), "radial_mlp widths must be >= 0")
    _require(cfg.channels >= 2, f"channels must be >= 2, got {cfg.channels}")
    _require(1 <= cfg.lmax <= 6, f"lmax must be in 1..6, got {cfg.lmax}")
    _require(cfg.n_blocks >= 1, f"n_blocks must be >= 1, got {cfg.n_blocks}")
    _require(cfg.mixing_layers >= 1, f"mixing_layers must be >= 1, got {cfg.mixing_layers}")
    _require(cfg.n_focus >= 1, f"n_focus must be >= 1, got {cfg.n_focus}")
    _require(cfg.focus_dim >= 0, f"focus_dim must be >= 0, got {cfg.focus_dim}")
    _require(
        cfg.radial_so2_mode in ("none", "degree_channel"),
        f"radial_so2_mode must be none|degree_channel, got {cfg.radial_so2_mode!r}",
    )
    if cfg.radial_so2_mode == "degree_channel":
        _require(
            1 <= cfg.radial_so2_rank <= 4,
            f"radial_so2_rank must be in 1..4 for degree_channel, got {cfg.radial_so2_rank}",
        )
    _require(cfg.n_atten_head >= 0, f"n_atten_head must be >= 0, got {cfg.n_atten_head}")
    if cfg.n_atten_head > 0:
        _require(
            cfg.focus_width % cfg.n_atten_head == 0,
            f"n_atten_head ({cfg.n_atten_head}) must divide the focus width ({cfg.focus_width})",
        )
    _require(cfg.ffn in ("plain", "s2"), f"ffn must be plain|s2, got {cfg.ffn!r}")
    _require(cfg.ffn_neurons >= 0, "ffn_neurons must be >= 0")
    _require(cfg.ffn_blocks >= 1, f"ffn_blocks must be >= 1, got {cfg.ffn_blocks}")
    _require(len(cfg.fitting_neurons) >= 1, "fitting_neurons needs at least one hidden layer")
    _require(all(w >= 0 for w in cfg.fitting_neurons), "fitting_neurons must be >= 0")
    _require(cfg.version in (1.0, 1.1), f"version must be 1.0 or 1.1, got {cfg.version}")
    _require(len(cfg.env_exponents) == 2, "env_exponents must be [rbf_p, edge_p]")
    _require(all(p >= 1 for p in cfg.env_exponents), "env_exponents must be >= 1")
    _require(math.isfinite(cfg.eps) and cfg.eps > 0, f"eps must be finite and > 0, got {cfg.eps}")


_PRESETS: dict[str, dict[str, Any]] = {
    # model-dpa4.md §11 "tiny-fused": the CI model (plain GLU FFN).
    "tiny": dict(
        rcut=6.0, n_radial=8, channels=32, lmax=2, n_blocks=2, mixing_layers=2,
        radial_so2_mode="degree_channel", radial_so2_rank=1, n_focus=4, focus_dim=32,
        n_atten_head=1, ffn="plain", ffn_blocks=1,
    ),
    "small": dict(
        rcut=6.0, n_radial=16, channels=64, lmax=2, n_blocks=2, mixing_layers=2,
        radial_so2_mode="degree_channel", radial_so2_rank=1, n_focus=2, focus_dim=64,
        n_atten_head=2, ffn="s2",
    ),
    "medium": dict(
        rcut=6.0, n_radial=16, channels=128, lmax=3, n_blocks=3, mixing_layers=4,
        radial_so2_mode="degree_channel", radial_so2_rank=2, n_focus=2, focus_dim=64,
        n_atten_head=4, ffn="s2",
    ),
    "large": dict(
        rcut=6.0, n_radial=16, channels=128, lmax=4, n_blocks=4, mixing_layers=4,
        radial_so2_mode="degree_channel", radial_so2_rank=2, n_focus=2, focus_dim=128,
        n_atten_head=4, ffn="s2",
    ),
}  # fmt: skip

PRESET_NAMES: tuple[str, ...] = tuple(_PRESETS)


def preset(name: str, type_map: tuple[str, ...] | list[str], **overrides: Any) -> ModelConfig:
    """A named architecture (``tiny``, ``small``, ``medium``, ``large``) for these elements."""
    if name not in _PRESETS:
        raise ModelConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESET_NAMES)}")
    return ModelConfig(type_map=tuple(type_map), **{**_PRESETS[name], **overrides})
