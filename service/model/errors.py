"""Typed errors of the model package; the service maps them to HTTP 4xx/5xx responses."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


class ModelConfigError(ValueError):
    """A model configuration is invalid or unsupported; the message names the field."""


class ModelFileError(ValueError):
    """A model file is missing, corrupted, of an unknown format version or inconsistent."""


class UnsupportedCheckpointError(ValueError):
    """A DeePMD checkpoint uses an option outside our supported subset; the message names it."""


class HostMemoryError(MemoryError):
    """A CPU step would need more memory than the host (or its container) has available: refused
    before it allocates, since past that point Linux's out-of-memory killer ends the process
    instead of failing the allocation."""


class NonFiniteResultError(RuntimeError):
    """The model returned NaN or inf (broken weights, or a structure far outside anything it
    was trained on); never passed on as a result."""


def non_finite_fields(values: Mapping[str, np.ndarray | None]) -> list[str]:
    """Names of the host arrays in ``values`` (``None``: not computed) holding NaN or inf.
    Stress is left out: its rows are NaN by definition for structures without a 3-D cell."""
    return [
        name
        for name, value in values.items()
        if value is not None and name != "stress" and not np.isfinite(value).all()
    ]
