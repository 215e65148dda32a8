"""Constant buffers that keep their exact float64 values through dtype casts.

``nn.Module.to(dtype)`` casts each buffer from the dtype it holds: a constant computed in float64
but held in float32 (the model's default) comes back from ``.to(torch.float64)`` with float32's
rounding, so the fp64 validation path would run on fp32-rounded quadratures and weights (a
rotated structure's forces then differ by ~3e-8 eV/Å instead of ~1e-13). A module that derives
from :class:`ExactConstants` registers such constants once, in float64, and every cast rebuilds
them from those values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Self

from torch import Tensor, nn


class ExactConstants(nn.Module):
    """Mixin: non-persistent buffers rebuilt from a float64 master on every ``_apply`` (``to``,
    ``float``, ``double``, ``cuda``, ...), each in the dtype and on the device the cast chose."""

    def __init__(self) -> None:
        super().__init__()
        self._exact_constants: dict[str, Tensor] = {}

    def register_constant(self, name: str, value: Tensor) -> None:
        """Buffer ``name`` held in float32 until the module is cast; ``value`` is its exact
        (float64, CPU) master."""
        master = value.detach().double().cpu()
        self._exact_constants[name] = master
        self.register_buffer(name, master.float(), persistent=False)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Self:
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        for name, master in self._exact_constants.items():
            cast = self._buffers[name]
            assert cast is not None
            self._buffers[name] = master.to(cast.device, cast.dtype)
        return self
