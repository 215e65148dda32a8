"""Typed errors of the model package; the service maps them to HTTP 4xx/5xx responses."""

from __future__ import annotations


class ModelConfigError(ValueError):
    """A model configuration is invalid or unsupported; the message names the field."""


class ModelFileError(ValueError):
    """A model file is missing, corrupted, of an unknown format version or inconsistent."""


class UnsupportedCheckpointError(ValueError):
    """A DeePMD checkpoint uses an option outside our supported subset; the message names it."""
