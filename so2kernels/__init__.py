"""Fused Triton ops of the SO(2) value path, each with an eager reference of identical semantics.

Importing this package registers the ``torch.ops.so2kernels`` namespace:

* ``so2_rotate_mix``: gather + rotate to the edge frame + radial degree mixing;
* ``so2_mixing_stack``: the gated SO(2) mixing stack with focus competition (α);
* ``so2_attention_aggregate``: rotate back + attention/scatter weights + dst CSR reduction;
* ``segment_sum``: CSR segment sum (edges → nodes), fp32 or fp64, no atomics;
* ``segment_broadcast``: its adjoint (nodes → edges);
* ``segment_outer_sum``: per-edge outer products ``a[e, k]·b[e, row_map[k]]`` summed into
  their destination nodes (dst CSR), without materialising the (E, K, C) messages;
* ``gated_act``: the stack's gated SiLU activation, standalone.

The ops run Triton on CUDA (and on CPU under ``TRITON_INTERPRET=1``) and their references
elsewhere; see :mod:`so2kernels._dispatch`.
"""

from so2kernels.aggregate import attention_aggregate, attention_aggregate_reference
from so2kernels.gated_act import gated_act, gated_act_reference
from so2kernels.mixing_stack import mixing_stack_reference, so2_mixing_stack
from so2kernels.mixing_stack_fast import measure_stack_error
from so2kernels.mixing_stack_kernels import StackPrecision
from so2kernels.outer_sum import segment_outer_sum, segment_outer_sum_reference
from so2kernels.rotate_mix import rotate_mix, rotate_mix_reference
from so2kernels.segment import (
    segment_broadcast,
    segment_broadcast_reference,
    segment_sum,
    segment_sum_reference,
)

__all__ = [
    "StackPrecision",
    "attention_aggregate",
    "attention_aggregate_reference",
    "gated_act",
    "gated_act_reference",
    "measure_stack_error",
    "mixing_stack_reference",
    "rotate_mix",
    "rotate_mix_reference",
    "segment_broadcast",
    "segment_broadcast_reference",
    "segment_outer_sum",
    "segment_outer_sum_reference",
    "segment_sum",
    "segment_sum_reference",
    "so2_mixing_stack",
]
