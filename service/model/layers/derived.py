"""Weights derived from parameters (folded, row-expanded, packed), built once per weights version.

Inference steps with frozen weights would otherwise rebuild the same small tensors every step:
each rebuild is a few kernel launches that a launch-bound step (and its CUDA graph) pays again.
:func:`derived_weights` caches them on the owning module, keyed on the ``(address, version,
device, dtype)`` of the tensors they are built from and on those tensors themselves (weakly: a
new parameter may land at a freed one's address with the same version), so an optimiser step,
``load_state_dict`` (also with ``assign=True``) or a device move rebuilds them on the next
call; a write through ``.data`` moves no version counter and is not seen (write in place:
``copy_``). ``live=True`` (training, ``create_graph``) builds them under autograd instead, so
weight gradients flow through the derivation.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch import Tensor, nn

T = TypeVar("T")

_CACHE_ATTRIBUTE = "_derived_weights_cache"

Key = tuple[tuple[int, int, torch.device, torch.dtype], ...]


def _version_key(sources: Sequence[Tensor]) -> Key:
    return tuple((t.data_ptr(), t._version, t.device, t.dtype) for t in sources)


class _Entry:
    """A derived value, the key it was built under and weak references to its sources."""

    def __init__(self, key: Key | None, sources: Sequence[Tensor], value: object) -> None:
        self.key = key
        self.sources = [weakref.ref(t) for t in sources]
        self.value = value

    def serves(self, key: Key, sources: Sequence[Tensor]) -> bool:
        return self.key == key and all(
            ref() is t for ref, t in zip(self.sources, sources, strict=True)
        )

    def __getstate__(self) -> dict[str, object]:
        # A copy (deepcopy, pickle) belongs to other tensors: it serves nothing, and weak
        # references do not pickle.
        return {"key": None, "sources": [], "value": None}


def derived_weights(
    owner: nn.Module, name: str, sources: Sequence[Tensor], build: Callable[[], T], *, live: bool
) -> T:
    """``build()`` (a tensor or a tuple of tensors derived from ``sources``), cached on ``owner``
    under ``name`` while ``sources`` are unchanged; rebuilt under autograd when ``live`` or
    while torch.compile traces (see :func:`eager_frozen`)."""
    if not eager_frozen(live):
        return build()
    # A plain attribute (not a buffer): the cache is neither saved nor moved with the module.
    cache: dict[str, _Entry] = owner.__dict__.setdefault(_CACHE_ATTRIBUTE, {})
    key = _version_key(sources)
    entry = cache.get(name)
    if entry is None or not entry.serves(key, sources):
        # Normal (non-inference) tensors even when first built under inference mode, so a later
        # autograd step may save them for its backward.
        with torch.inference_mode(False), torch.no_grad():
            entry = _Entry(key, sources, build())
        cache[name] = entry
    value: T = entry.value  # type: ignore[assignment]
    return value


def eager_frozen(live: bool) -> bool:
    """Whether frozen-weight shortcuts apply: weights not ``live`` and no torch.compile trace
    running (a compiled graph derives the weights itself; the cache's address/version keys and
    the closed-form autograd functions would only break its graph)."""
    return not live and not torch.compiler.is_compiling()
