"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch


@pytest.fixture
def poisoned_alloc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every float buffer allocated through ``torch.empty``, ``torch.empty_like`` or
    ``Tensor.new_empty`` starts as NaN, so an output element a kernel fails to write cannot pass
    a comparison."""
    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(math.nan) if t.is_floating_point() else t

    def poisoned_new_empty(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return poison(new_empty(self, *args, **kwargs))

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))
    monkeypatch.setattr(torch.Tensor, "new_empty", poisoned_new_empty)
    yield
