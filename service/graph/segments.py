"""Deterministic CSR segment sums in float64 (no atomics): the reductions of edge values onto atoms
and of atom values onto structures.

``out[i] = Σ_{k in [rowptr[i], rowptr[i+1])} values[order[k]]`` (``order`` omitted: the rows are
already grouped, e.g. edges sorted by ``dst``). One program per segment adds its rows in a fixed
order (the CSR kernel of :mod:`so2kernels.segment`, float64 accumulation; its eager reference on
plain CPU), so results are bit-reproducible run to run, nothing is read back to the host (the
step stays capturable in a CUDA graph), and the sum is differentiable to any order (its adjoint
is the matching broadcast).
"""

from __future__ import annotations

import torch
from torch import Tensor


def csr_segment_sum(values: Tensor, rowptr: Tensor, order: Tensor | None = None) -> Tensor:
    """(S, ...) float64 sums of (E, ...) ``values`` over the S segments of ``rowptr`` (S+1,),
    reading row ``order[k]`` at CSR position k (``order`` (E,) int64, None for the identity)."""
    # Imported here: see the package docstring (service/graph/__init__.py).
    from so2kernels.segment import segment_sum

    return segment_sum(values.to(torch.float64), order, rowptr)
