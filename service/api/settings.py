"""Service settings: defaults, ``SO2SERVE_*`` environment variables, then CLI flags.

Precedence (highest first): keyword arguments (the CLI passes only the flags given),
environment variables (``SO2SERVE_MAX_ATOMS=50000``, ``SO2SERVE_API_KEY=...``), defaults.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

_DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:\d+|cuda:all|cuda:\d+(,cuda:\d+)+)$")


def is_loopback(host: str) -> bool:
    """True for addresses that only this machine can reach."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname: assume it resolves to something reachable


class ServiceSettings(BaseSettings):
    """Everything ``so2serve serve`` can be told."""

    # No inf/nan: an infinite body limit or batching window would break every request.
    model_config = SettingsConfigDict(
        env_prefix="SO2SERVE_", extra="forbid", frozen=True, allow_inf_nan=False
    )

    model: Path | None = Field(
        default=None, description="model file; None = the shipped default model"
    )
    device: str = Field(
        default="auto",
        description="auto | cpu | cuda | cuda:N | cuda:all | cuda:N,cuda:M,... (several GPUs: "
        "one model copy and worker thread per GPU, sharing one queue)",
    )
    execution: Literal["auto", "fused", "reference"] = Field(
        default="auto", description="fused Triton path or eager reference; auto picks fused on CUDA"
    )
    precision: Literal["fp32", "fp64", "fp16x3"] = Field(
        default="fp32",
        description="fp32 (exact), fp64 (reference path) or fp16x3 (opt-in fast mixing-stack "
        "GEMMs; fused path only)",
    )
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    api_key: SecretStr | None = Field(
        default=None, description="required in X-API-Key or 'Authorization: Bearer' when set"
    )
    insecure: bool = Field(
        default=False, description="allow a non-loopback host without an API key"
    )
    max_atoms: int = Field(default=100_000, gt=0, description="per structure; above → 413")
    max_request_atoms: int = Field(
        default=2_000_000, gt=0, description="all structures of one request; above → 413"
    )
    max_batch_atoms: int = Field(default=16_384, gt=0, description="atom budget of one device pass")
    max_batch_edges: int = Field(
        default=2_000_000,
        gt=0,
        description="estimated-edge budget of one device pass; unless set, a model on the CPU "
        "takes at most what half the host's memory available at start holds",
    )
    batch_window_ms: float = Field(
        default=5.0,
        ge=0,
        description="longest wait for returning clients before a pass (0: never wait)",
    )
    inline_max_atoms: int = Field(
        default=2048,
        ge=0,
        description="largest pass run on the event loop when its request is alone (no thread "
        "hop; the loop is busy meanwhile); 0: every pass in the worker thread. Unless set, a "
        "model on the CPU runs every pass in the worker thread",
    )
    switch_interval_ms: float = Field(
        default=5.0,
        gt=0,
        description="CPython's thread switch interval while serving (see tuned_interpreter)",
    )
    max_queue: int = Field(
        default=1024, gt=0, description="queued requests; above → 503 Retry-After"
    )
    max_body_mb: float = Field(
        default=256.0,
        gt=0,
        description="largest request body (a compact JSON body of max_request_atoms atoms is "
        "~140 MB; parsing JSON holds the GIL and takes ~20× the body in memory)",
    )
    body_timeout_s: float = Field(
        default=60.0, gt=0, description="time allowed to receive a request body; above → 408"
    )
    profile_passes: int = Field(
        default=0,
        ge=0,
        description="record this many device passes with torch.profiler (0: off; diagnostics)",
    )
    profile_skip_passes: int = Field(
        default=10, ge=0, description="passes after warm-up before the profiled ones"
    )
    profile_dir: Path = Field(
        default=Path("so2serve-profile"), description="where the pass profile JSON is written"
    )
    warm_up: bool = Field(default=True, description="run one pass before reporting ready")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if not _DEVICE.match(value):
            raise ValueError(
                "device must be auto, cpu, cuda, cuda:N, cuda:all or a list cuda:N,cuda:M,..., "
                f"got {value!r}"
            )
        return value

    @field_validator("api_key")
    @classmethod
    def _non_empty_key(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value():
            raise ValueError("the API key must not be empty")
        return value

    @model_validator(mode="after")
    def _no_unknown_environment_variables(self) -> ServiceSettings:
        # pydantic-settings reads the variables it knows and ignores the rest: a misspelt one
        # (SO2SERVE_INLINE_MAX_ATOM) would leave its setting at the default without a word.
        known = {f"SO2SERVE_{name.upper()}" for name in type(self).model_fields}
        unknown = sorted(
            name for name in os.environ if name.upper().startswith("SO2SERVE_")
            and name.upper() not in known
        )  # fmt: skip
        if unknown:
            guess = difflib.get_close_matches(unknown[0].upper(), sorted(known), n=1)
            hint = f" (did you mean {guess[0]}?)" if guess else ""
            raise ValueError(
                f"unknown environment variable {unknown[0]}{hint}: no setting has that name "
                "(the settings: docs/service.md)"
            )
        return self

    @model_validator(mode="after")
    def _refuse_open_exposure(self) -> ServiceSettings:
        if not is_loopback(self.host) and self.api_key is None and not self.insecure:
            raise ValueError(
                f"refusing to listen on {self.host} without an API key: anyone who can reach "
                "it could use the GPU. Set --api-key (or SO2SERVE_API_KEY), or pass --insecure"
            )
        return self

    @model_validator(mode="after")
    def _profile_one_device(self) -> ServiceSettings:
        several = "," in self.device or self.device == "cuda:all"
        if self.profile_passes > 0 and several:
            raise ValueError(
                "pass profiling records one device: with SO2SERVE_PROFILE_PASSES, "
                "use --device cuda:N"
            )
        return self

    @model_validator(mode="after")
    def _fast_tier_needs_fused(self) -> ServiceSettings:
        if self.precision == "fp16x3" and self.execution == "reference":
            raise ValueError(
                "precision fp16x3 runs in the fused kernels only: use --path fused or auto "
                "(on CUDA), or precision fp32"
            )
        return self

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 2**20)
