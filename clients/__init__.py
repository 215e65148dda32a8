"""ASE calculators for the SO(2) potential: over HTTP and in-process (imported lazily, so
``from clients import SO2Calculator`` does not import torch or the model)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from clients.http import SO2Calculator
    from clients.local import SO2LocalCalculator

__all__ = ["SO2Calculator", "SO2LocalCalculator"]


def __getattr__(name: str) -> Any:
    if name == "SO2Calculator":
        from clients.http import SO2Calculator

        return SO2Calculator
    if name == "SO2LocalCalculator":
        from clients.local import SO2LocalCalculator

        return SO2LocalCalculator
    raise AttributeError(f"module 'clients' has no attribute {name!r}")
