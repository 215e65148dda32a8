"""Experiment (issue #2): the fast tier's correction products accumulated in fp16.

The fp16x3 block GEMMs keep two fp32 accumulators per tile: the head product ``A_hi·B_hi`` and
the corrections ``A_hi·B_lo + A_lo·B_hi``. The fifth session's profile found them
latency-bound because the two accumulators (plus the epilogue) fill the register file: 242-255
registers, two CTAs per SM at best, the tensor pipe 41-49 % busy. The corrections are worth
2^-11 of the result, so ~11 bits of their own precision are enough. Accumulated by the tensor
cores in fp16 (``out_dtype=tl.float16``) they take half the registers: 32 fewer per thread at
a 64x128 tile with four warps.

``--variant shipped`` runs the stack as shipped; ``--variant f16corr`` replaces the
descriptor-fed tile product (``_desc_matmul``, every fast-tier block GEMM) before anything
compiles. Each variant then runs ``kernels_mixing_stack.py --cases bar --no-compile --only
fused_fast --profile``, which times it and measures its error against float64 at the bar case
and writes ``results/kernels_mixing_stack_<stamp>.json``. Run the variants in alternation, each
in its own process (``gpu.sh f16corr``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import kernels_mixing_stack
from so2kernels import mixing_stack_kernels
from so2kernels.mixing_stack_kernels import _merge_fp16x3, _split_fp16x3


@triton.jit
def desc_matmul_f16_corrections(
    a_desc, a_row, a_next, a_col, b_desc, b_lo_desc, b_row, n0,
    K: tl.constexpr, A_PLANES: tl.constexpr, EDGE_MAJOR: tl.constexpr, K_STEP: tl.constexpr,
    E_TILE: tl.constexpr, C_TILE: tl.constexpr,
):  # fmt: skip
    """``_desc_matmul`` with the corrections' accumulator in fp16 (same operands, same merge)."""
    hi_sum = tl.full((E_TILE, C_TILE), 0.0, tl.float32)
    lo_sum = tl.full((E_TILE, C_TILE), 0.0, tl.float16)
    for k_start in range(0, K, K_STEP):
        if A_PLANES:
            a_hi = a_desc.load([a_row, a_col + k_start])
            a_lo = a_desc.load([a_row + a_next, a_col + k_start])
        elif EDGE_MAJOR:
            a_hi, a_lo = _split_fp16x3(
                a_desc.load([a_row, a_next, a_col + k_start]).reshape(E_TILE, K_STEP)
            )
        else:
            a_hi, a_lo = _split_fp16x3(a_desc.load([a_row, a_col + k_start]))
        b_hi = b_desc.load([b_row + k_start, n0])
        b_lo = b_lo_desc.load([b_row + k_start, n0])
        hi_sum = tl.dot(a_hi, b_hi, hi_sum)
        lo_sum = tl.dot(a_hi, b_lo, lo_sum, out_dtype=tl.float16)
        lo_sum = tl.dot(a_lo, b_hi, lo_sum, out_dtype=tl.float16)
    return _merge_fp16x3(hi_sum, lo_sum.to(tl.float32))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--variant", choices=("shipped", "f16corr"), required=True)
    args = parser.parse_args()
    if args.variant == "f16corr":
        # Kernels resolve the helpers they call from their module's globals at compile time.
        mixing_stack_kernels._desc_matmul = desc_matmul_f16_corrections
    # The results' "command" then names the variant.
    sys.argv = [f"{sys.argv[0]} --variant {args.variant} ->", "--cases", "bar", "--no-compile",
                "--only", "fused_fast", "--profile"]  # fmt: skip
    print(f"variant {args.variant}", flush=True)
    kernels_mixing_stack.main()


if __name__ == "__main__":
    main()
