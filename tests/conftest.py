"""Test setup: Triton kernels run in the CPU interpreter unless a GPU is present.

``TRITON_INTERPRET`` must be set before ``so2kernels`` is imported (it is read when the kernels
are defined), hence this happens before any project import.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SHARED = Path(__file__).resolve().parents[2] / "shared"
"""../shared beside the checkout (read-only data, golden numbers)."""

GPU_DATA = Path(__file__).resolve().parents[1] / ".gpu_data"
"""A git-ignored copy of ../shared for GPU runs, where ../shared does not travel."""


def shared_path(*parts: str) -> Path:
    """A path into ../shared, or into its carried .gpu_data copy; skips the test if absent."""
    for root in (SHARED, GPU_DATA):
        p = root.joinpath(*parts)
        if p.exists():
            return p
    pytest.skip(f"shared material not found: {'/'.join(parts)}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seeded_global_rng() -> None:
    """Every test starts from the same global torch RNG state, so a draw from the global
    generator (a random cotangent, a random probe) does not depend on which tests ran before:
    tolerances are judged on reproducible inputs."""
    torch.manual_seed(20261130)
