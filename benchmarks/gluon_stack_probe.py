"""Experiment (issue #2): warp-specialised Gluon fp16x3 block GEMMs vs the Triton kernel.

Warp-specialised Gluon versions of the mixing stack's forward block GEMM, against the Triton
descriptor kernel they are meant to replace. None of them is faster (H200, torch 2.11, Triton
3.6, bar case; ``results/gluon_stack_probe_20261130T111110Z.json``, one call timing all four
side by side), so nothing of this ships in ``so2kernels``:

- gated |m|=1: Triton 4.72 ms; v1 5.45 (0.87×), v2 5.85 (0.81×), v3 5.44 (0.87×)
- gated m=0: Triton 3.00 ms; v1 3.04 (0.99×), v2 3.12 (0.96×), v3 3.11 (0.97×)
- final |m|=1: Triton 4.20 ms; v1 4.09 (1.03×), v2 4.16 (1.01×), v3 3.98 (1.05×)
- final m=0: Triton 2.57 ms; v1 2.65 (0.97×), v2 2.57 (1.00×), v3 2.75 (0.93×)

(Errors vs float64 identical to the Triton kernel's in every variant, outputs equal or within
8e-8; v3 also checked at odd sizes.) Neither keeping products in flight (v2) nor halving the
weight traffic per edge (v3) moved the gated |m|=1 GEMM, whose epilogue (store z, load u and
σ, store the activation) is the heaviest.

Three variants of one kernel (``block_fwd_gluon_kernel``, picked by ``GLUON_V1/V2/V3``):

* v1 (``gluon``): first run alone (``results/gluon_stack_probe_20261130T105457Z.json``):
  |m|=1 gated 5.28 vs 4.57 ms, m=0 gated 2.97 vs 2.92, final |m|=1 4.08 vs 4.00, final m=0
  2.52 vs 2.45 ms. Each K step is retired (``wait(0)``) before the next A box is split,
  because wgmma reads its register operand asynchronously.
* v2 (``gluon_v2``): v1 with A through shared memory. The consumer splits the fp32 A box into
  fp16 head/tail planes in a double-buffered staging area (NVMMA layout), so every wgmma reads
  both operands from shared memory and one step's three products stay in flight
  (``wait(3)``) while the next box is split; a ring slot is released one step later.
* v3 (``gluon_v3``): v2's product, cooperative instead of ping-pong: both consumers take the
  same 128-edge tile (64 rows each) from one 6-stage ring and one producer, so each B box
  (fp16 head + tail: as many bytes as fp32) serves 128 edges instead of 64. Rationale (not
  measured): at 64 × 128 tiles the L2→SM traffic of the gated |m|=1 block is ~25.8 GB (B 2/3
  of it), 5.6 TB/s at the Triton kernel's 4.57 ms, i.e. L2 bandwidth rather than the tensor
  pipe may be the limit; 128-edge tiles cut it to ~17.2 GB. The price: both consumers run
  their epilogues at the same time (the producer keeps prefetching).

Common contract: that of :func:`so2kernels.mixing_stack_kernels.block_fwd_desc_kernel`: the
layer input ``u (F, E, ROW)`` through a TMA descriptor over its ``(F·E, ROW)`` rows, the block
weights through descriptors over the fp16 head and ``2^11``-scaled tail planes ``(NL·F·W,
W)``; ``z_all (NG, F, E, ROW)``, ``sig (F, E, LG)``, ``alpha (E, F)`` and ``out`` ((F, E,
ROW), or (E, F, ROW) for the final layer) as fp32 pointers with int64 element offsets.
Schedule: one CTA per SM, persistent over the Triton kernel's flat tile order (focus, edge
tile, column tile fastest); one-warp TMA producers (fp32 A box, fp16 B head and tail boxes per
32-wide K step) feed shared-memory rings through ``ready``/``empty`` mbarriers; each consumer
warpgroup keeps two fp32 accumulators (``Ah·Bh`` and ``Ah·Bl + Al·Bh``) over 64 edges × 128
columns and runs the layer's epilogue straight from the accumulator layout. Registers: 168 at
launch, 240 per consumer after ``setmaxnreg``, 24 per producer. Offline sm_90 (``--offline``;
Triton 3.6.0 and 3.7.1 alike unless noted): shared memory v1 196,920 B, v2 229,736 B, v3
229,688 B (limit 232,448); spills only in the gated |m|=1 epilogue (the K loops are clean):
bar case v1 56 B, v2 96 B (3.6: 100), v3 148 B (3.6: 68); lmax 3 / Cf 64 and lmax 2 / Cf 96
v1 160 B, v2 176 B (3.6: 180), v3 208 B (3.6: 176); none elsewhere.

Not done: the epilogue still reads and writes global memory from the accumulator layout (32-byte
segments); staging it through shared memory with TMA stores needs 32 KiB per consumer that
v2/v3 spend on the A staging and the ring.

The probe: for each forward block GEMM (gated layer: m=0 and |m|=1; final layer: both, with
alpha), on the same operands, it times the Triton kernel and the Gluon variants at the bar case
(E = 1,051,392, lmax 2, Cf 128, F 1), compares each with a float64 evaluation on sampled edges
(normwise error over the block's columns, the last partial edge tile always included) and with
the Triton kernel, then repeats the comparison (untimed, ``--odd-kernels``, default v3) at odd
sizes: E not a multiple of the tile, F = 2, lmax 1 and 3, Cf 64. One JSON line per row;
``results/gluon_stack_probe_<UTC>.json`` is rewritten after each row. A watchdog ends the
process if a kernel hangs (a barrier deadlock would hold the GPU)::

    PYTHONPATH=$PWD python3 benchmarks/gluon_stack_probe.py [--skip-bar] [--skip-odd]
        [--kernels gluon gluon_v2 gluon_v3] [--odd-kernels gluon_v3]
    PYTHONPATH=$PWD python3 benchmarks/gluon_stack_probe.py --offline   # sm_90 compile, no GPU
"""

# Gluon kernels take untyped arguments and @gluon.jit is an untyped decorator.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
from __future__ import annotations

import argparse
import faulthandler
import functools
import json
import math
import os
import re
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from benchmarks.common import time_ms, write_results
from so2kernels._dispatch import UnsupportedInputError
from so2kernels._layout import block_widths, row_width
from so2kernels.mixing_stack_fast import normwise_rel_error
from so2kernels.mixing_stack_kernels import (
    StackPrecision,
    _split_fp16x3,
    block_fwd_desc_kernel,
    desc_block_k,
    persistent_grid,
    row_descriptor,
    split_fp16x3,
    tile_config,
    weight_descriptors,
)


class GluonTile:
    """Launch shape of :func:`block_fwd_gluon_kernel`: ``block_m`` edges × ``block_n`` columns
    per tile (one consumer's in ping-pong, both consumers' when cooperative), ``block_k``-wide K
    steps, ``stages`` ring slots per ring."""

    def __init__(self, block_m: int, block_n: int, block_k: int, stages: int) -> None:
        self.block_m, self.block_n, self.block_k, self.stages = block_m, block_n, block_k, stages

    def k_step(self, width: int) -> int:
        """K step over a ``width``-wide block: the tile's when it divides the width (a step past
        the width would read the next weight matrix's rows), else 32 (every width is a multiple
        of 32)."""
        return self.block_k if width % self.block_k == 0 else 32


@dataclass(frozen=True)
class GluonKernel:
    """One variant of :func:`block_fwd_gluon_kernel`: its name in the probe's rows, its tile,
    where the split A operand lives, and how the two consumer warpgroups share the work."""

    name: str
    tile: GluonTile
    smem_a: bool  # fp16 A planes staged in shared memory (v2, v3), else wgmma register operands
    cooperative: bool  # both consumers on one tile, one ring (v3), else ping-pong over tiles


# 64 edges × 128 columns per consumer in all variants: two fp32 accumulators are 128 registers
# a thread, which leaves room in a 240-register consumer for the epilogue. 32-wide K steps keep
# the fp32 A box at one 128-byte swizzle row. v1: 4 stages per consumer ring, 2 rings: 192 KiB
# of shared memory; v2 adds 32 KiB of fp16 A staging. v3's tile is 128 edges (64 per consumer)
# so each B box feeds both: 6 stages of one ring (192 KiB) plus the 32 KiB staging.
GLUON_V1 = GluonKernel("gluon", GluonTile(64, 128, 32, 4), smem_a=False, cooperative=False)
GLUON_V2 = GluonKernel("gluon_v2", GluonTile(64, 128, 32, 4), smem_a=True, cooperative=False)
GLUON_V3 = GluonKernel("gluon_v3", GluonTile(128, 128, 32, 6), smem_a=True, cooperative=True)
GLUON_KERNELS = (GLUON_V1, GLUON_V2, GLUON_V3)

_CONSUMER_REGS = gl.constexpr(240)
_PRODUCER_REGS = gl.constexpr(24)
MAX_REGISTERS = 168
"""Per-thread register cap of the launch: 12 warps (two consumer warpgroups and the producers'
warpgroup) at 168 registers fill the 64K register file; the producers then hand theirs to the
consumers (24 → 240)."""
SHARED_MEMORY_LIMIT = 232_448
"""Shared memory one CTA may use on sm_90 (227 KiB)."""


_A_STAGING = gl.constexpr(2)
# v2 stages the split A box in shared memory: step s writes buffer s % 2 while step s - 1's
# products may still read the other one.

# Triton 3.7 names the CTA (here: partition) barrier gl.barrier, Triton 3.6 gl.thread_barrier.
_partition_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


def hopper_available() -> bool:
    """Whether this process sees a Hopper (sm_90) GPU, the only target of the Gluon kernel."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


# Gluon: tile coordinates, split/merge, partitions


@gluon.jit
def _tile_origin(tile, n_edge, N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Focus, first edge and first output column of flat tile ``tile`` (column tiles fastest)."""
    col_tiles: gl.constexpr = (N - 1) // BLOCK_N + 1
    per_focus = gl.cdiv(n_edge, BLOCK_M) * col_tiles
    focus = tile // per_focus
    local = tile - focus * per_focus
    return focus, (local // col_tiles) * BLOCK_M, (local % col_tiles) * BLOCK_N


@gluon.jit
def _producer(
    descs, smem, sizes, first_tile, tile_stride, ring: gl.constexpr, COL0: gl.constexpr,
    WIDTH: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """One warp: TMA loads of every K step of ring ``ring``'s tiles into its stages."""
    u_desc, w_desc, w_lo_desc = descs
    a_bufs, b_bufs, b_lo_bufs, ready, empty = smem
    n_edge, n_focus, layer = sizes
    BLOCK_M: gl.constexpr = u_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = u_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[1]
    K_STEPS: gl.constexpr = WIDTH // BLOCK_K
    STEP_BYTES: gl.constexpr = u_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes
    n_tiles = n_focus * gl.cdiv(n_edge, BLOCK_M) * ((WIDTH - 1) // BLOCK_N + 1)
    step = 0
    for tile in range(first_tile, n_tiles, tile_stride):
        focus, first, n0 = _tile_origin(tile, n_edge, WIDTH, BLOCK_M, BLOCK_N)
        a_row = focus * n_edge + first
        b_row = (layer * n_focus + focus) * WIDTH
        for k in range(K_STEPS):
            slot = ring * STAGES + step % STAGES
            # A slot starts free: the first wait on `empty` is for the phase before phase 0.
            mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, STEP_BYTES)
            tma.async_copy_global_to_shared(
                u_desc, [a_row, COL0 + k * BLOCK_K], bar, a_bufs.index(slot)
            )
            tma.async_copy_global_to_shared(
                w_desc, [b_row + k * BLOCK_K, n0], bar, b_bufs.index(slot)
            )
            tma.async_copy_global_to_shared(
                w_lo_desc, [b_row + k * BLOCK_K, n0], bar, b_lo_bufs.index(slot)
            )
            step += 1


@gluon.jit
def _tile_product(
    a_bufs, b_bufs, b_lo_bufs, ready, empty, step, ring: gl.constexpr, acc_layout: gl.constexpr,
    K_STEPS: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """Compensated product of one tile from the ring, starting at ring step ``step``; returns the
    merged fp32 result (acc layout).

    Each step's wgmmas are retired before the next step's A box is split: wgmma reads its
    register operand asynchronously, and the compiler may place the next split in the same
    registers (in flight, that is undefined behaviour). The tensor pipe's short gap per step is
    filled by the other consumer warpgroup's products."""
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[2]
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    hi = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
    lo = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
    for _k in range(K_STEPS):
        slot = ring * STAGES + step % STAGES
        mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
        a_hi, a_lo = _split_fp16x3(a_bufs.index(slot).load(a_layout))
        b_hi = b_bufs.index(slot)
        hi = warpgroup_mma(a_hi, b_hi, hi, is_async=True)
        lo = warpgroup_mma(a_hi, b_lo_bufs.index(slot), lo, is_async=True)
        lo = warpgroup_mma(a_lo, b_hi, lo, is_async=True)
        hi, lo, a_hi, a_lo = warpgroup_mma_wait(num_outstanding=0, deps=(hi, lo, a_hi, a_lo))
        mbarrier.arrive(empty.index(slot), count=1)
        step += 1
    return (hi + lo * (1.0 / 2048.0)) * 16.0


@gluon.jit
def _tile_product_smem_a(
    a_bufs, b_bufs, b_lo_bufs, ready, empty, staging, step, ring: gl.constexpr,
    group: gl.constexpr, ROW0: gl.constexpr, acc_layout: gl.constexpr, K_STEPS: gl.constexpr,
    STAGES: gl.constexpr,
):  # fmt: skip
    """v2/v3 of :func:`_tile_product`: the split A box goes to shared memory, so every wgmma
    reads both operands from shared memory and one step's products stay in flight while the
    next box is split; returns the merged fp32 result (acc layout).

    ``staging`` holds the fp16 head and tail planes ``(2·BUFS, ROWS, BLOCK_K)``; consumer
    ``group`` owns buffers ``group·BUFS …`` and takes rows ``ROW0 … ROW0 + ROWS`` of each A box
    of ring ``ring``. A ring slot is released (one arrive per consumer that reads it) once the
    step that read its B boxes has retired, one step later."""
    a_hi_stage, a_lo_stage = staging
    BOX_M: gl.constexpr = a_bufs.type.shape[1]
    ROWS: gl.constexpr = a_hi_stage.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[2]
    BUFS: gl.constexpr = _A_STAGING
    # 16-byte pieces, one 128-byte fp32 box row per 8 threads: conflict-free on the swizzled box.
    ROW_THREADS: gl.constexpr = BLOCK_K // 4
    split_layout: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 4], threads_per_warp=[32 // ROW_THREADS, ROW_THREADS],
        warps_per_cta=[4, 1], order=[1, 0],
    )  # fmt: skip
    hi = gl.zeros([ROWS, BLOCK_N], gl.float32, acc_layout)
    lo = gl.zeros([ROWS, BLOCK_N], gl.float32, acc_layout)
    for k in range(K_STEPS):
        slot = ring * STAGES + step % STAGES
        buf = group * BUFS + step % BUFS
        mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
        box = a_bufs.index(slot) if ROWS == BOX_M else a_bufs.index(slot).slice(ROW0, ROWS)
        a_hi, a_lo = _split_fp16x3(box.load(split_layout))
        # This buffer was last read by step - 2's products; every warp has retired those (its
        # wait in step - 1) only once all of them are past this barrier.
        _partition_barrier()
        a_hi_stage.index(buf).store(a_hi)
        a_lo_stage.index(buf).store(a_lo)
        # The generic-proxy stores of all four warps must be visible to the async proxy (wgmma).
        fence_async_shared()
        _partition_barrier()
        b_hi = b_bufs.index(slot)
        hi = warpgroup_mma(a_hi_stage.index(buf), b_hi, hi, is_async=True)
        lo = warpgroup_mma(a_hi_stage.index(buf), b_lo_bufs.index(slot), lo, is_async=True)
        lo = warpgroup_mma(a_lo_stage.index(buf), b_hi, lo, is_async=True)
        # Each async wgmma is one group: leaving 3 outstanding retires step - 1.
        hi, lo = warpgroup_mma_wait(num_outstanding=3, deps=(hi, lo))
        if k > 0:
            mbarrier.arrive(empty.index(ring * STAGES + (step - 1) % STAGES), count=1)
        step += 1
    hi, lo = warpgroup_mma_wait(num_outstanding=0, deps=(hi, lo))
    mbarrier.arrive(empty.index(ring * STAGES + (step - 1) % STAGES), count=1)
    return (hi + lo * (1.0 / 2048.0)) * 16.0


@gluon.jit
def _epilogue(
    acc, focus, first, n0, n_edge, n_focus, layer, u_ptr, z_ptr, sig_ptr, alpha_ptr, out_ptr,
    acc_layout: gl.constexpr, L: gl.constexpr, FD: gl.constexpr, M1_BLOCK: gl.constexpr,
    FINAL: gl.constexpr, APPLY_ALPHA: gl.constexpr,
):  # fmt: skip
    """The layer's epilogue on one tile, straight from the accumulator layout (each thread holds
    pairs of adjacent columns, so every warp store fills whole 32-byte sectors)."""
    GWD: gl.constexpr = L * FD
    ROW: gl.constexpr = FD + 3 * GWD
    M0: gl.constexpr = FD + GWD
    WIDTH: gl.constexpr = 2 * GWD if M1_BLOCK else M0
    COL0: gl.constexpr = M0 if M1_BLOCK else 0
    BLOCK_M: gl.constexpr = acc.type.shape[0]
    BLOCK_N: gl.constexpr = acc.type.shape[1]
    rows = first + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
    cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
    rows64 = rows.to(gl.int64)
    focus64 = focus.to(gl.int64)
    row_ok = rows < n_edge
    mask = row_ok[:, None] & (cols < WIDTH)[None, :]
    act_rows = (focus64 * n_edge + rows64) * ROW + COL0
    u_at = act_rows[:, None] + cols[None, :]
    if FINAL:
        result = gl.load(u_ptr + u_at, mask=mask, other=0.0) + acc
        if APPLY_ALPHA:
            a = gl.load(alpha_ptr + rows64 * n_focus + focus64, mask=row_ok, other=0.0)
            result = result * a[:, None]
        out_rows = (rows64 * n_focus + focus64) * ROW + COL0
        gl.store(out_ptr + out_rows[:, None] + cols[None, :], result, mask=mask)
    else:
        z_rows = ((layer * n_focus + focus64) * n_edge + rows64) * ROW + COL0
        gl.store(z_ptr + z_rows[:, None] + cols[None, :], acc, mask=mask)
        if M1_BLOCK:
            sig_rows = (focus64 * n_edge + rows64) * GWD
            gate = gl.load(
                sig_ptr + sig_rows[:, None] + (cols % GWD)[None, :], mask=mask, other=0.0
            )
            value = acc * gate + gl.load(u_ptr + u_at, mask=mask, other=0.0)
            gl.store(out_ptr + u_at, value, mask=mask)
        else:
            # Scalar rows get SiLU here; the gate kernel fills the l>=1 m=0 rows.
            scalar = mask & (cols < FD)[None, :]
            silu = acc / (1.0 + gl.exp(-acc))
            gl.store(
                out_ptr + u_at, gl.load(u_ptr + u_at, mask=scalar, other=0.0) + silu, mask=scalar
            )


@gluon.jit
def _consumer(
    smem, pointers, sizes, first_tile, tile_stride, ring: gl.constexpr, L: gl.constexpr,
    FD: gl.constexpr, M1_BLOCK: gl.constexpr, FINAL: gl.constexpr, APPLY_ALPHA: gl.constexpr,
    STAGES: gl.constexpr, staging, group: gl.constexpr, SMEM_A: gl.constexpr,
    COOP: gl.constexpr,
):  # fmt: skip
    """One warpgroup (consumer ``group``): products and epilogue of the tiles of ring ``ring``
    from ``first_tile`` on. Ping-pong (v1, v2): every other tile of the CTA, whole. ``COOP``
    (v3): every tile of the CTA, rows ``group·BLOCK_M/2 …`` of it, the B boxes shared with the
    other consumer. ``SMEM_A`` selects the product with A staged in shared memory
    (``staging``; unused by v1)."""
    a_bufs, b_bufs, b_lo_bufs, ready, empty = smem
    u_ptr, z_ptr, sig_ptr, alpha_ptr, out_ptr = pointers
    n_edge, n_focus, layer = sizes
    M0: gl.constexpr = FD + L * FD
    WIDTH: gl.constexpr = 2 * L * FD if M1_BLOCK else M0
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[2]
    K_STEPS: gl.constexpr = WIDTH // BLOCK_K
    ROWS: gl.constexpr = BLOCK_M // 2 if COOP else BLOCK_M
    ROW0: gl.constexpr = group * ROWS if COOP else 0
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    n_tiles = n_focus * gl.cdiv(n_edge, BLOCK_M) * ((WIDTH - 1) // BLOCK_N + 1)
    step = 0
    for tile in range(first_tile, n_tiles, tile_stride):
        focus, first, n0 = _tile_origin(tile, n_edge, WIDTH, BLOCK_M, BLOCK_N)
        first += ROW0
        if SMEM_A:
            acc = _tile_product_smem_a(
                a_bufs, b_bufs, b_lo_bufs, ready, empty, staging, step, ring, group, ROW0,
                acc_layout, K_STEPS, STAGES,
            )  # fmt: skip
        else:
            acc = _tile_product(
                a_bufs, b_bufs, b_lo_bufs, ready, empty, step, ring, acc_layout, K_STEPS, STAGES
            )
        step += K_STEPS
        _epilogue(
            acc, focus, first, n0, n_edge, n_focus, layer, u_ptr, z_ptr, sig_ptr, alpha_ptr,
            out_ptr, acc_layout, L, FD, M1_BLOCK, FINAL, APPLY_ALPHA,
        )  # fmt: skip


@gluon.jit
def block_fwd_gluon_kernel(
    u_desc,  # fp32 (F·E, ROW) over the layer input, box (BLOCK_M, BLOCK_K)
    w_desc,  # fp16 (NL·F·W, W) over the weight heads, box (BLOCK_K, BLOCK_N)
    w_lo_desc,  # the same over the weight tails
    u_ptr,  # (F, E, ROW) layer input (the residual)
    z_ptr,  # (NG, F, E, ROW) pre-activation stack (gated layers)
    sig_ptr,  # (F, E, GWD) gates of this layer (gated layers, |m|=1 block)
    alpha_ptr,  # (E, F) competition weight (FINAL with APPLY_ALPHA)
    out_ptr,  # (F, E, ROW) next activation; (E, F, ROW) edge-major when FINAL
    n_edge,
    n_focus,
    layer,
    L: gl.constexpr,
    FD: gl.constexpr,
    M1_BLOCK: gl.constexpr,
    FINAL: gl.constexpr,
    APPLY_ALPHA: gl.constexpr,
    STAGES: gl.constexpr,
    SMEM_A: gl.constexpr,
    COOP: gl.constexpr,
):
    """Fast-tier block GEMM of one layer with its epilogue (semantics of
    :func:`so2kernels.mixing_stack_kernels.block_fwd_kernel`), warp-specialised: this
    warpgroup and one worker warpgroup consume alternate tiles, two one-warp workers load them.
    ``SMEM_A`` False is v1 (A split into wgmma register operands), True v2 (A split into
    shared-memory planes). ``COOP`` (v3, with ``SMEM_A``): both consumer warpgroups work on
    the same ``BLOCK_M``-edge tile (half the rows each) from one ring and one producer, so each
    B box loaded serves twice the edges."""
    M0: gl.constexpr = FD + L * FD
    WIDTH: gl.constexpr = 2 * L * FD if M1_BLOCK else M0
    COL0: gl.constexpr = M0 if M1_BLOCK else 0
    # v1's register-operand product takes whole boxes: it has no cooperative form.
    gl.static_assert(SMEM_A or not COOP, "the cooperative schedule needs SMEM_A")
    RINGS: gl.constexpr = 1 if COOP else 2
    BLOCK_M: gl.constexpr = u_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = u_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[1]
    SLOTS: gl.constexpr = RINGS * STAGES
    a_bufs = gl.allocate_shared_memory(u_desc.dtype, [SLOTS, BLOCK_M, BLOCK_K], u_desc.layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [SLOTS, BLOCK_K, BLOCK_N], w_desc.layout)
    b_lo_bufs = gl.allocate_shared_memory(w_desc.dtype, [SLOTS, BLOCK_K, BLOCK_N], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(SLOTS):
        mbarrier.init(ready.index(i), count=1)
        # Cooperative slots are read by both consumers: each releases it.
        mbarrier.init(empty.index(i), count=2 if COOP else 1)
    if SMEM_A:
        a16_layout: gl.constexpr = gl.NVMMASharedLayout(
            swizzle_byte_width=2 * BLOCK_K, element_bitwidth=16, rank=2
        )
        ROWS: gl.constexpr = BLOCK_M // 2 if COOP else BLOCK_M
        a16_shape: gl.constexpr = [2 * _A_STAGING, ROWS, BLOCK_K]
        staging = (
            gl.allocate_shared_memory(gl.float16, a16_shape, a16_layout),
            gl.allocate_shared_memory(gl.float16, a16_shape, a16_layout),
        )
    else:
        # Unused by v1; warp_specialize takes values only, so any shared buffers stand in.
        staging = (b_bufs, b_lo_bufs)

    pid = gl.program_id(0)
    n_programs = gl.num_programs(0)
    smem = (a_bufs, b_bufs, b_lo_bufs, ready, empty)
    pointers = (u_ptr, z_ptr, sig_ptr, alpha_ptr, out_ptr)
    sizes = (n_edge, n_focus, layer)
    descs = (u_desc, w_desc, w_lo_desc)
    if COOP:
        gl.warp_specialize(
            [
                (_consumer, (smem, pointers, sizes, pid, n_programs, 0, L, FD, M1_BLOCK, FINAL,
                             APPLY_ALPHA, STAGES, staging, 0, SMEM_A, COOP)),
                (_consumer, (smem, pointers, sizes, pid, n_programs, 0, L, FD, M1_BLOCK, FINAL,
                             APPLY_ALPHA, STAGES, staging, 1, SMEM_A, COOP)),
                (_producer, (descs, smem, sizes, pid, n_programs, 0, COL0, WIDTH, STAGES)),
            ],
            [4, 1],
            [_CONSUMER_REGS, _PRODUCER_REGS],
        )  # fmt: skip
    else:
        stride = RINGS * n_programs
        other = pid + n_programs  # the second consumer's first tile
        gl.warp_specialize(
            [
                (_consumer, (smem, pointers, sizes, pid, stride, 0, L, FD, M1_BLOCK, FINAL,
                             APPLY_ALPHA, STAGES, staging, 0, SMEM_A, COOP)),
                (_consumer, (smem, pointers, sizes, other, stride, 1, L, FD, M1_BLOCK, FINAL,
                             APPLY_ALPHA, STAGES, staging, 1, SMEM_A, COOP)),
                (_producer, (descs, smem, sizes, pid, stride, 0, COL0, WIDTH, STAGES)),
                (_producer, (descs, smem, sizes, other, stride, 1, COL0, WIDTH, STAGES)),
            ],
            [4, 1, 1],
            [_CONSUMER_REGS, _PRODUCER_REGS, _PRODUCER_REGS],
        )  # fmt: skip


# Launcher of the Gluon kernel


def _nvmma(block: list[int], dtype: gl.dtype) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for(block, dtype)


def _aligned(t: Tensor) -> Tensor:
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _row_descriptor(rows: Tensor, block_m: int, block_k: int) -> TensorDescriptor:
    flat = _aligned(rows).view(-1, rows.shape[-1])
    if flat.shape[0] >= 2**31:
        raise UnsupportedInputError(
            f"so2kernels: {flat.shape[0]} activation rows exceed the int32 coordinates of a "
            "tensor descriptor"
        )
    block = [block_m, block_k]
    return TensorDescriptor(
        flat, list(flat.shape), list(flat.stride()), block, _nvmma(block, gl.float32)
    )


def _weight_descriptor(w: Tensor, block_k: int, block_n: int) -> TensorDescriptor:
    flat = _aligned(w).view(-1, w.shape[-1])
    block = [block_k, block_n]
    return TensorDescriptor(
        flat, list(flat.shape), list(flat.stride()), block, _nvmma(block, gl.float16)
    )


def block_fwd_gluon(
    src: Tensor,
    weights: tuple[Tensor, Tensor],
    z_all: Tensor,
    sig: Tensor,
    alpha: Tensor,
    out: Tensor,
    layer: int,
    lmax: int,
    focus_dim: int,
    *,
    m1_block: bool,
    final: bool,
    apply_alpha: bool,
    kernel: GluonKernel = GLUON_V1,
) -> None:
    """Launch :func:`block_fwd_gluon_kernel` for ``layer``'s m=0 (or |m|=1 when ``m1_block``)
    block: ``src (F, E, ROW)`` fp32, ``weights`` the fp16 (head, tail) planes ``(NL, F, W, W)``,
    the remaining tensors as in the Triton launcher; ``kernel`` picks the variant."""
    tile = kernel.tile
    n_focus, n_edge, _row = src.shape
    width = weights[0].shape[-1]
    block_k = tile.k_step(width)
    col_tiles = -(-width // tile.block_n)
    n_tiles = n_focus * -(-n_edge // tile.block_m) * col_tiles
    sms = torch.cuda.get_device_properties(src.device).multi_processor_count
    grid = (max(1, min(sms, n_tiles)),)
    block_fwd_gluon_kernel[grid](
        _row_descriptor(src, tile.block_m, block_k),
        _weight_descriptor(weights[0], block_k, tile.block_n),
        _weight_descriptor(weights[1], block_k, tile.block_n),
        src, z_all, sig, alpha, out, n_edge, n_focus, layer,
        L=lmax, FD=focus_dim, M1_BLOCK=m1_block, FINAL=final, APPLY_ALPHA=apply_alpha,
        STAGES=tile.stages, SMEM_A=kernel.smem_a, COOP=kernel.cooperative, num_warps=4,
        maxnreg=MAX_REGISTERS,
    )  # fmt: skip


# Offline sm_90 compile (no GPU): shared memory and ptxas's register/spill report per variant

OFFLINE_REGIMES = ((2, 128), (1, 64), (3, 64), (2, 96))
OFFLINE_FLAGS = (
    (True, False, False),
    (False, False, False),
    (True, True, True),
    (False, True, True),
)
"""(M1_BLOCK, FINAL, APPLY_ALPHA) of the four forward block GEMMs."""


def compile_offline(
    lmax: int, focus_dim: int, flags: tuple[bool, bool, bool], kernel: GluonKernel
) -> dict[str, object]:
    """Compile one variant for sm_90 with the local Triton (run without TRITON_INTERPRET)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    m1_block, final, apply_alpha = flags
    tile = kernel.tile
    width = 2 * lmax * focus_dim if m1_block else (lmax + 1) * focus_dim
    block_k = tile.k_step(width)
    u_block, w_block = [tile.block_m, block_k], [block_k, tile.block_n]
    u_layout = gl.NVMMASharedLayout.get_default_for(u_block, gl.float32)
    w_layout = gl.NVMMASharedLayout.get_default_for(w_block, gl.float16)
    w_type = f"tensordesc<fp16[{block_k},{tile.block_n}],{w_layout!r}>"
    consts = {
        "L": lmax, "FD": focus_dim, "M1_BLOCK": m1_block, "FINAL": final,
        "APPLY_ALPHA": apply_alpha, "STAGES": tile.stages, "SMEM_A": kernel.smem_a,
        "COOP": kernel.cooperative,
    }  # fmt: skip
    signature = {
        "u_desc": f"tensordesc<fp32[{tile.block_m},{block_k}],{u_layout!r}>",
        "w_desc": w_type,
        "w_lo_desc": w_type,
        **dict.fromkeys(("u_ptr", "z_ptr", "sig_ptr", "alpha_ptr", "out_ptr"), "*fp32"),
        **dict.fromkeys(("n_edge", "n_focus", "layer"), "i32"),
        **dict.fromkeys(consts, "constexpr"),
    }
    source = GluonASTSource(fn=block_fwd_gluon_kernel, signature=signature, constexprs=consts)
    options = {"num_warps": 4, "maxnreg": MAX_REGISTERS}
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        report = subprocess.run(
            [str(ptxas), "-v", "--gpu-name=sm_90a", str(ptx), "-o", os.devnull],
            capture_output=True, text=True, check=True,
        ).stderr  # fmt: skip
    spills = re.search(r"(\d+) bytes spill stores", report)
    reallocations = re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", compiled.asm["ptx"])
    registers = re.search(r"Used (\d+) registers", report)
    return {
        "kernel": kernel.name, "triton": triton.__version__,
        "lmax": lmax, "focus_dim": focus_dim, "m1_block": m1_block, "final": final,
        "shared_bytes": compiled.metadata.shared,
        "shared_fits_sm90": compiled.metadata.shared <= SHARED_MEMORY_LIMIT,
        "launch_registers": int(registers.group(1)) if registers else None,
        "spill_store_bytes": int(spills.group(1)) if spills else None,
        "setmaxnreg": sorted({int(n) for n in reallocations}),
    }  # fmt: skip


# The probe

BAR_EDGES = 1_051_392
HANG_LIMIT_S = 45  # one kernel's compile, first launch and timing; a hang ends the process
SAMPLED_EDGES = 4096


@dataclass(frozen=True)
class Shape:
    lmax: int
    focus_dim: int
    n_focus: int
    n_edge: int


@dataclass(frozen=True)
class Variant:
    """One block GEMM: which block, and the gated or final layer's epilogue."""

    name: str
    m1_block: bool
    final: bool


VARIANTS = (
    Variant("gated_m1", True, False),
    Variant("gated_m0", False, False),
    Variant("final_m1_alpha", True, True),
    Variant("final_m0_alpha", False, True),
)
N_LAYERS = 3  # layers 0, 1 gated; layer 2 final


@dataclass
class Operands:
    u: Tensor  # (F, E, ROW)
    w_heads: tuple[Tensor, Tensor]  # fp16 planes (NL, F, M0, M0), (NL, F, M1, M1)
    w_tails: tuple[Tensor, Tensor]
    w32: tuple[Tensor, Tensor]  # the fp32 weights
    sig: Tensor  # (F, E, LG)
    alpha: Tensor  # (E, F)


def make_operands(shape: Shape, seed: int) -> Operands:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    m0, m1, gate = block_widths(shape.lmax, shape.focus_dim)
    f, e = shape.n_focus, shape.n_edge

    def randn(*size: int) -> Tensor:
        return torch.randn(*size, device="cuda", generator=gen)

    u = randn(f, e, m0 + m1)
    w0 = randn(N_LAYERS, f, m0, m0) / math.sqrt(m0)
    w1 = randn(N_LAYERS, f, m1, m1) / math.sqrt(m1)
    planes0, planes1 = split_fp16x3(w0), split_fp16x3(w1)
    sig = torch.sigmoid(randn(f, e, gate))
    alpha = 0.98 * torch.softmax(randn(e, f), dim=1) + 0.02 / f
    return Operands(u, (planes0[0], planes1[0]), (planes0[1], planes1[1]), (w0, w1), sig, alpha)


@dataclass
class Outputs:
    z_all: Tensor  # (NG, F, E, ROW)
    out: Tensor  # (F, E, ROW), or (E, F, ROW) for the final layer


def fresh_outputs(shape: Shape, final: bool) -> Outputs:
    f, e = shape.n_focus, shape.n_edge
    row = row_width(shape.lmax, shape.focus_dim)
    z_all = torch.full((N_LAYERS - 1, f, e, row), float("nan"), device="cuda")
    out = torch.full((e, f, row) if final else (f, e, row), float("nan"), device="cuda")
    return Outputs(z_all, out)


def layer_of(variant: Variant) -> int:
    return N_LAYERS - 1 if variant.final else 1


def launch_triton(shape: Shape, ops: Operands, variant: Variant, outs: Outputs) -> None:
    """The shipped fast-tier launch of one block (as in so2kernels.mixing_stack)."""
    m0, m1, _gate = block_widths(shape.lmax, shape.focus_dim)
    width = m1 if variant.m1_block else m0
    index = 1 if variant.m1_block else 0
    tile = tile_config("fwd", shape.focus_dim, shape.lmax, StackPrecision.FAST, ops.u.device)
    block_k = desc_block_k(width, tile)
    n_tiles = (
        triton.cdiv(shape.n_edge, tile.block_m) * triton.cdiv(width, tile.block_n) * shape.n_focus
    )
    block_fwd_desc_kernel[persistent_grid(n_tiles, tile, ops.u.device)](
        row_descriptor(ops.u, tile.block_m, block_k),
        *weight_descriptors((ops.w_heads[index], ops.w_tails[index]), block_k, tile.block_n),
        ops.u, outs.z_all, ops.sig, ops.alpha, outs.out, shape.n_edge, shape.n_focus,
        layer_of(variant), L=shape.lmax, FD=shape.focus_dim, M1_BLOCK=variant.m1_block,
        FINAL=variant.final, APPLY_ALPHA=variant.final, BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n, BLOCK_K=block_k, num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )  # fmt: skip


def launch_gluon(
    kernel: GluonKernel, shape: Shape, ops: Operands, variant: Variant, outs: Outputs
) -> None:
    index = 1 if variant.m1_block else 0
    block_fwd_gluon(
        ops.u, (ops.w_heads[index], ops.w_tails[index]), outs.z_all, ops.sig, ops.alpha,
        outs.out, layer_of(variant), shape.lmax, shape.focus_dim, m1_block=variant.m1_block,
        final=variant.final, apply_alpha=variant.final, kernel=kernel,
    )  # fmt: skip


def reference_block(
    shape: Shape, ops: Operands, variant: Variant, edges: Tensor
) -> tuple[Tensor | None, Tensor, Tensor]:
    """float64 (z, out, out column mask) of the block on ``edges``: z ``(F, S, W)`` (None for
    the final layer), out ``(F, S, W)`` (focus-major for the final layer too)."""
    m0, _m1, gate = block_widths(shape.lmax, shape.focus_dim)
    col0 = m0 if variant.m1_block else 0
    index = 1 if variant.m1_block else 0
    w = ops.w32[index][layer_of(variant)].double()  # (F, W, W)
    width = w.shape[-1]
    u_blk = ops.u[:, edges, col0 : col0 + width].double()
    z = torch.bmm(u_blk, w)
    written = torch.ones(width, dtype=torch.bool, device=z.device)
    if variant.final:
        alpha = ops.alpha[edges].double().t()[:, :, None]
        return None, (u_blk + z) * alpha, written
    if variant.m1_block:
        gates = ops.sig[:, edges].double().repeat(1, 1, width // gate)
        return z, u_blk + z * gates, written
    written = torch.arange(width, device=z.device) < shape.focus_dim
    return z, u_blk + z * torch.sigmoid(z), written


def block_views(
    shape: Shape, variant: Variant, outs: Outputs, edges: Tensor
) -> tuple[Tensor | None, Tensor]:
    """The kernel's z and out on the block's columns at ``edges``, focus-major ``(F, S, W)``."""
    m0, m1, _gate = block_widths(shape.lmax, shape.focus_dim)
    col0, width = (m0, m1) if variant.m1_block else (0, m0)
    cols = slice(col0, col0 + width)
    if variant.final:
        return None, outs.out[edges, :, cols].transpose(0, 1)
    return outs.z_all[layer_of(variant)][:, edges, cols], outs.out[:, edges, cols]


def compare(
    shape: Shape, ops: Operands, variant: Variant, results: dict[str, Outputs], edges: Tensor
) -> dict[str, float]:
    z_ref, out_ref, written = reference_block(shape, ops, variant, edges)
    errors: dict[str, float] = {}
    views = {name: block_views(shape, variant, outs, edges) for name, outs in results.items()}
    for name, (z, out) in views.items():
        errors[f"{name}_out_err"] = normwise_rel_error(out[..., written], out_ref[..., written])
        if z is not None and z_ref is not None:
            errors[f"{name}_z_err"] = normwise_rel_error(z, z_ref)
        errors[f"{name}_nan"] = float(not bool(torch.isfinite(out[..., written]).all()))
    out_t = views["triton"][1][..., written]
    scale = out_t.abs().max().item()
    for name, (_z, out) in views.items():
        if name != "triton":
            diff = (out[..., written] - out_t).abs().max().item()
            errors[f"{name}_vs_triton_out"] = diff / scale if scale else 0.0
    return errors


Launcher = Callable[[Shape, Operands, Variant, Outputs], None]
LAUNCHERS: dict[str, Launcher] = {
    "triton": launch_triton,
    **{kernel.name: functools.partial(launch_gluon, kernel) for kernel in GLUON_KERNELS},
}


def run_row(
    shape: Shape, variant: Variant, timed: bool, seed: int, names: list[str]
) -> dict[str, object]:
    """Launch the Triton kernel and the named Gluon variants on the same operands (timed at
    the bar case) and compare each with float64 and with the Triton kernel. A variant that
    raises is recorded as ``<name>_error`` and left out of the comparison."""
    ops = make_operands(shape, seed)
    results: dict[str, Outputs] = {}
    row: dict[str, object] = {"variant": variant.name, **shape.__dict__}
    for name in ["triton", *names]:
        launch = LAUNCHERS[name]
        faulthandler.dump_traceback_later(HANG_LIMIT_S, exit=True)
        try:
            outs = fresh_outputs(shape, variant.final)
            launch(shape, ops, variant, outs)
            torch.cuda.synchronize()
            if timed:
                call = functools.partial(launch, shape, ops, variant, outs)
                elapsed = time_ms(call, 5, 30)
                row[f"{name}_ms"] = elapsed
                if name != "triton":
                    row[f"{name}_speedup"] = float(row["triton_ms"]) / elapsed  # type: ignore[arg-type]
        except Exception as exc:  # a failing kernel is a result, not the end of the row
            if name == "triton":
                raise
            row[f"{name}_error"] = repr(exc)[:2000]
        else:
            results[name] = outs
        finally:
            faulthandler.cancel_dump_traceback_later()
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    n_sample = min(SAMPLED_EDGES, shape.n_edge)
    edges = torch.randperm(shape.n_edge, device="cuda", generator=gen)[:n_sample]
    # The last (partial) edge tile is where masking mistakes show: always check it.
    edges = torch.cat(
        (edges, torch.arange(max(0, shape.n_edge - 130), shape.n_edge, device="cuda"))
    )
    row.update(compare(shape, ops, variant, results, edges))
    return row


ODD_CASES = (
    (Shape(2, 128, 1, 1000), VARIANTS),
    (Shape(1, 64, 2, 777), (VARIANTS[0], VARIANTS[3])),
    (Shape(3, 64, 1, 515), (VARIANTS[1], VARIANTS[2])),
    (Shape(1, 128, 2, 131), (VARIANTS[0], VARIANTS[1])),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-bar", action="store_true")
    parser.add_argument("--skip-odd", action="store_true")
    parser.add_argument("--offline", action="store_true", help="compile for sm_90 only (no GPU)")
    gluon_names = [kernel.name for kernel in GLUON_KERNELS]
    parser.add_argument(
        "--kernels", nargs="+", choices=gluon_names, default=gluon_names,
        help="Gluon variants timed at the bar case",
    )  # fmt: skip
    parser.add_argument(
        "--odd-kernels", nargs="*", choices=gluon_names, default=["gluon_v3"],
        help="Gluon variants checked at the odd sizes (v1's were checked by the first run; v2 "
        "has v1's epilogue and masking, v3 new row offsets)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if args.offline:
        for lmax, focus_dim in OFFLINE_REGIMES:
            for flags in OFFLINE_FLAGS:
                for kernel in GLUON_KERNELS:
                    row = compile_offline(lmax, focus_dim, flags, kernel)
                    print(json.dumps(row), flush=True)
        return
    if not hopper_available():
        raise SystemExit("gluon_stack_probe: needs a Hopper (sm_90) GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    rows: list[dict[str, object]] = []
    path: Path | None = None
    plan: list[tuple[Shape, Variant, bool, list[str]]] = []
    if not args.skip_bar:
        plan += [(Shape(2, 128, 1, BAR_EDGES), v, True, args.kernels) for v in VARIANTS]
    if not args.skip_odd:
        plan += [
            (shape, v, False, args.odd_kernels) for shape, variants in ODD_CASES for v in variants
        ]
    for i, (shape, variant, timed, names) in enumerate(plan):
        try:
            row = run_row(shape, variant, timed, i, names)
        except Exception as exc:  # a failing row is a result, not the end
            faulthandler.cancel_dump_traceback_later()
            row = {"variant": variant.name, **shape.__dict__, "error": repr(exc)[:2000]}
        print(json.dumps(row), flush=True)
        rows.append(row)
        path = write_results(args.out, "gluon_stack_probe", rows, path)


if __name__ == "__main__":
    main()
