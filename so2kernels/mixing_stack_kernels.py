"""Triton kernels shared by ``so2_mixing_stack`` and ``gated_act``, and their launch tiles.

Layout contract (see :mod:`so2kernels.mixing_stack` and :mod:`so2kernels.gated_act`):
activations are laid out focus first as ``(F, E, ROW)``, stacked per-layer tensors
``(NL, F, E, ROW)``, block weights ``(NL, F, K, K)`` in (in, out) storage, gate projections
``(NL, F, Cf, LG)``, sigmoid gates and gate-logit gradients ``(F, E, LG)``, alpha ``(E, F)``;
the stack result is laid out edge first as ``(E, F, ROW)``. Every kernel reads a layer through
an integer ``layer`` into the stacked tensors (no per-layer views reach Triton). Element offsets
are int64.

Every kernel is a tiled GEMM ``acc = A @ B`` over one block of the row (the m=0 block, the |m|=1
block, the gate projection or its transpose) with a fused epilogue. Program grid:
``(cdiv(E, BLOCK_M) · cdiv(N, BLOCK_N), F)``; output-column tiles vary fastest so the programs
that share an edge tile of A run together and hit it in L2 (the persistent kernels walk the
same order).

Precision tiers (``FAST`` constexpr):

* exact (``FAST=False``): fp32 ``tl.dot(..., input_precision="ieee")``, no TF32.
* fast (``FAST=True``, "fp16x3", after Ootomo & Yokota): both operands are split into fp16 heads
  and tails, ``A·B ≈ Ah·Bh + (Ah·Bl + Al·Bh)``, on tensor cores with fp32 accumulation; the head
  product and the tail corrections keep separate accumulators merged once per tile. Tails are
  stored scaled by ``2^11`` (so they do not underflow fp16) and activations are scaled by
  ``2^-4`` before the split (so large residual-stream values do not overflow the fp16 head); both
  scales are powers of two and undone exactly. Weight splits are made by :func:`split_fp16x3`
  once per weight version (cached by :func:`weight_operands`); activation splits happen in
  registers, once per output-column tile, except for the backward's pre-activation cotangent:
  the gate kernels that produce it store it split (fp16 head and tail planes, the bytes of one
  fp32 copy) and the residual GEMMs load those planes as their A operand, bit-identical to
  splitting in registers.

The fast tier's block GEMMs (:func:`block_fwd_desc_kernel`, :func:`block_bwd_desc_kernel`) run
persistent grids and load every GEMM operand through host-built tensor descriptors (no
per-thread address tensors: 190-250 registers instead of 255 with spills on sm_90); the gate
kernels and the exact tier keep pointer loads and one program per tile.
"""

# Triton kernels take untyped pointer/constexpr arguments and @triton.jit is an untyped decorator.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from pathlib import Path

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary
from triton.tools.tensor_descriptor import TensorDescriptor

from so2kernels._dispatch import UnsupportedInputError
from so2kernels.tiles import TABLES_DIR, device_slug

__all__ = [
    "ACT_PRESCALE",
    "TAIL_SCALE",
    "StackPrecision",
    "TileConfig",
    "desc_block_k",
    "edge_major_descriptor",
    "persistent_grid",
    "row_descriptor",
    "split_fp16x3",
    "stack_overlay_path",
    "stack_table_path",
    "tile_config",
    "triton_release",
    "weight_descriptors",
    "weight_operands",
]

ACT_PRESCALE = 2.0**-4
"""Activation prescale of the fast tier (keeps fp16 heads of large activations finite)."""
TAIL_SCALE = 2.0**11
"""Tail scale of the fast tier (keeps fp16 tails of small values out of the subnormal range)."""


class StackPrecision(StrEnum):
    """GEMM precision of the mixing stack, chosen per call and never substituted silently."""

    EXACT = "ieee"
    """fp32 FMA dots with IEEE rounding (no TF32): the default, bitwise-stable tier."""
    FAST = "fp16x3"
    """Error-compensated fp16 tensor-core GEMMs (~2^-22 relative step per GEMM)."""

    @classmethod
    def parse(cls, value: str | StackPrecision) -> StackPrecision:
        """Map an op argument to the enum; an unknown name raises ``ValueError``."""
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(repr(p.value) for p in cls)
            raise ValueError(
                f"so2kernels: unknown stack precision {value!r}; use one of {choices}"
            ) from None

    def require_exact_double_backward(self) -> None:
        """Refuse a differentiable (``create_graph``) backward of a fast-tier stack: the closed
        forms it composes are exact fp32, so it would not be the tier the caller chose."""
        if self is not StackPrecision.EXACT:
            raise UnsupportedInputError(
                f"so2kernels.so2_mixing_stack: precision {self.value!r} has no double backward "
                "(create_graph=True); run the stack with precision='ieee' to differentiate its "
                "backward"
            )

    def require_triton(self, op: str, device: torch.device) -> None:
        """Refuse a fast-tier call that would run off the Triton path (no silent exact result)."""
        if self is not StackPrecision.EXACT:
            raise UnsupportedInputError(
                f"so2kernels.{op}: precision {self.value!r} needs the Triton path "
                f"(CUDA tensors, or TRITON_INTERPRET=1); got device {device}"
            )


# Launch tiles


@dataclass(frozen=True)
class TileConfig:
    """One launch shape: ``BLOCK_M`` edges × ``BLOCK_N`` output columns, ``BLOCK_K`` per K step."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def grid(self, n_edge: int, width: int, n_focus: int) -> tuple[int, int]:
        """Grid of a tiled launch: (edge tiles × column tiles of ``width``, focus streams)."""
        return triton.cdiv(n_edge, self.block_m) * triton.cdiv(width, self.block_n), n_focus

    def launch_meta(self) -> dict[str, int]:
        """The tile as the kernels' constexprs and launch options."""
        return {
            "BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "BLOCK_K": self.block_k,
            "num_warps": self.num_warps, "num_stages": self.num_stages,
        }  # fmt: skip


# Conservative defaults. Exact fp32: 64×64×32 FMA tiles keep registers in check on every Cf.
# Fast: 128-edge tiles feed the tensor cores. Under the interpreter, fewer and larger programs are
# cheaper (cost grows with program count, barely with tile size).
_DEFAULT_EXACT = TileConfig(64, 64, 32, 4, 2)
_DEFAULT_FAST = TileConfig(128, 64, 32, 8, 3)
_INTERPRETER = TileConfig(32, 64, 32, 1, 1)


def stack_table_path(device_name: str) -> Path:
    """The swept table of a GPU: ``tables/mixing_stack_<slug>.json`` (written by the benchmark
    sweep; the slug is the rotate-mix table's)."""
    return TABLES_DIR / f"mixing_stack_{device_slug(device_name)}.json"


def triton_release() -> str:
    """``major.minor`` of the running Triton: the release a table overlay was swept under."""
    return ".".join(triton.__version__.split(".")[:2])


def stack_overlay_path(device_name: str, release: str) -> Path:
    """Entries swept under Triton ``release`` where it schedules a kernel family differently
    from the release the GPU's base table was swept under:
    ``tables/mixing_stack_<slug>.triton-<release>.json``. They override the base entries."""
    return TABLES_DIR / f"mixing_stack_{device_slug(device_name)}.triton-{release}.json"


def _table_entries(path: Path) -> dict[str, list[int]]:
    if not path.is_file():
        return {}
    entries: dict[str, list[int]] = json.loads(path.read_text())["configs"]
    return entries


@cache
def _load_table(device_name: str) -> dict[str, list[int]]:
    """The GPU's entries for the running Triton: the base table with the release's overlay on
    top, or only the file ``SO2_STACK_TABLE`` names (the sweep's scratch table)."""
    forced = os.environ.get("SO2_STACK_TABLE")
    if forced:
        return _table_entries(Path(forced))
    return {
        **_table_entries(stack_table_path(device_name)),
        **_table_entries(stack_overlay_path(device_name, triton_release())),
    }


def table_key(kind: str, focus_dim: int, lmax: int, precision: StackPrecision) -> str:
    """Key of one table entry, e.g. ``"fwd|cf128|l2|ieee"``.

    Kinds: ``fwd`` (forward block GEMMs), ``gate`` (the forward's gate kernel and the
    backward's scalar-row kernel), ``gbwd`` (the backward's gate-row kernel; the ``gate`` entry
    stands in where it has none), ``bwd`` (residual GEMMs of the gated layers' backward); fast
    tier only: ``fbwd`` (the final layer's residual GEMMs, which split their fp32 operand in
    registers).
    """
    return f"{kind}|cf{focus_dim}|l{lmax}|{precision.value}"


_STAND_IN_KIND = {"gbwd": "gate"}
"""Kinds whose table entry may be missing: the kind whose entry stands in (older tables)."""


def tile_config(
    kind: str, focus_dim: int, lmax: int, precision: StackPrecision, device: torch.device
) -> TileConfig:
    """Launch tile for a kernel family on ``device``: swept table entry, else the fallback."""
    if device.type != "cuda":
        return _INTERPRETER
    table = _load_table(torch.cuda.get_device_name(device))
    entry = table.get(table_key(kind, focus_dim, lmax, precision))
    if entry is None and kind in _STAND_IN_KIND:
        entry = table.get(table_key(_STAND_IN_KIND[kind], focus_dim, lmax, precision))
    if entry is not None:
        return TileConfig(*entry)
    return fallback_tile(precision)


def fallback_tile(precision: StackPrecision) -> TileConfig:
    """The conservative GPU tile used when the swept table has no entry."""
    return _DEFAULT_FAST if precision is StackPrecision.FAST else _DEFAULT_EXACT


def split_fp16x3(w: Tensor) -> tuple[Tensor, Tensor]:
    """fp16 head and ``TAIL_SCALE``-scaled fp16 tail of an fp32 weight: ``w ≈ hi + lo/2^11``."""
    hi = w.to(torch.float16)
    lo = ((w - hi.to(torch.float32)) * TAIL_SCALE).to(torch.float16)
    return hi, lo


# Weight operands, cached per weight tensor.
#
# Frozen inference weights would otherwise rebuild their kernel operands every step (fp16x3
# planes: five launches per weight; transposed copies: one each): tens of launches in a small
# step. Keyed weakly on the tensor's identity (an entry dies with its tensor; a later tensor at
# a recycled address never matches) and stamped with its version counter and storage metadata,
# so an in-place update (optimiser step, load_state_dict) or a ``.data`` swap rebuilds it.
# Weights that require grad are never cached: an in-place write through ``.data`` (EMA swaps,
# hand-written updates) bumps no version counter and would serve stale planes. Under CUDA-graph
# capture a hit is read by address like any weight (the capturer re-records when weights
# change); a miss is built inside the graph and not stored, so no cached tensor lives in a
# graph's private pool. Cached operands never share storage with their weight (no key cycle).

_Stamp = tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]
_OperandKey = tuple[StackPrecision, bool]  # (tier, transposed)
_Entries = dict[_OperandKey, tuple[_Stamp, tuple[Tensor, Tensor]]]
_operand_cache: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""weight tensor → {(tier, transposed): (stamp, (head, tail))}."""


def _stamp(w: Tensor) -> _Stamp:
    return (w._version, w.data_ptr(), tuple(w.shape), tuple(w.stride()), w.dtype, w.device)


def _cacheable(w: Tensor) -> bool:
    """Plain frozen eager tensors only: trainable weights may change unseen (above), fakes and
    functional wrappers have no identity, inference tensors no version counter to check."""
    plain = type(w) is Tensor or type(w) is torch.nn.Parameter
    return plain and not (w.requires_grad or w.is_inference() or torch.compiler.is_compiling())


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _build_operands(
    w: Tensor, precision: StackPrecision, transposed: bool
) -> tuple[Tensor, Tensor]:
    dense = (w.transpose(-2, -1) if transposed else w).clone(memory_format=torch.contiguous_format)
    if precision is not StackPrecision.FAST:
        return dense, dense
    if not (_capturing(w.device) or torch.compiler.is_compiling()):  # a host read
        _check_head_range(w)
    return split_fp16x3(dense)


def weight_operands(
    w: Tensor, precision: StackPrecision, *, transposed: bool = False
) -> tuple[Tensor, Tensor]:
    """The (head, tail) pair a kernel reads for weight ``w (..., K, N)`` (or its transpose over
    the last two axes): fp16x3 planes for the fast tier, the contiguous fp32 weight twice for
    the exact tier. Cached per weight tensor while it is unchanged (see above)."""
    if not transposed and precision is StackPrecision.EXACT and w.is_contiguous():
        return w, w
    if not _cacheable(w):
        return _build_operands(w, precision, transposed)
    entries: _Entries | None = _operand_cache.get(w)  # type: ignore[no-untyped-call]
    key, stamp = (precision, transposed), _stamp(w)
    hit = entries.get(key) if entries is not None else None
    if hit is not None and hit[0] == stamp:
        return hit[1]
    if _capturing(w.device):  # planes built now live in the graph's pool: never cached
        return _build_operands(w, precision, transposed)
    if entries is None:
        entries = {}
        _operand_cache[w] = entries
    # Normal tensors under no_grad even when first asked for in inference mode or under
    # autograd: the planes are kernel operands only, never part of a graph.
    with torch.inference_mode(False), torch.no_grad():
        operands = _build_operands(w, precision, transposed)
    entries[key] = (stamp, operands)
    return operands


_FP16_MAX = 65504.0
"""Largest finite fp16: a weight beyond it has an infinite head and a NaN tail."""


def _check_head_range(w: Tensor) -> None:
    """Refuse fast-tier weights whose fp16 head would overflow (or that are not finite): their
    products would be NaN, not an fp32-accurate result. One host read per build outside capture."""
    peak = float(w.detach().abs().max()) if w.numel() else 0.0
    if not peak < _FP16_MAX:
        raise UnsupportedInputError(
            f"so2kernels.so2_mixing_stack: precision 'fp16x3' needs finite weights below "
            f"{_FP16_MAX:g} in magnitude (the fp16 head's range); got max |w| = {peak:g}. "
            "Use precision='ieee'"
        )


# Tensor descriptors and persistent grids of the fast tier's block GEMMs
#
# The fast tier's block GEMMs feed their operands to the tensor cores through the tensor-memory
# accelerator (no per-thread address tensors) and run persistent grids (a program walks tiles
# with a stride of the grid size); descriptors are built on the host for each launch.

_DESC_K_FALLBACK = 32
"""K step when the tile's does not divide a block width (every width of the regime is a
multiple of 32)."""


def desc_block_k(width: int, tile: TileConfig) -> int:
    """K step of a descriptor-fed product over a ``width``-wide block: the tile's when it divides
    the width (a step past the width would read the next weight matrix's rows), else 32."""
    return tile.block_k if width % tile.block_k == 0 else _DESC_K_FALLBACK


def _aligned(t: Tensor) -> Tensor:
    """``t``, or a copy of it where a view starts off the 16-byte alignment descriptors need
    (a view at an odd storage offset; fresh allocations are always aligned)."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _check_rows(n_rows: int) -> None:
    if n_rows >= 2**31:
        raise UnsupportedInputError(
            f"so2kernels: {n_rows} activation rows exceed the int32 coordinates of a tensor "
            "descriptor"
        )


def row_descriptor(rows: Tensor, block_m: int, block_k: int) -> TensorDescriptor:
    """Contiguous rows ``(..., ROW)`` (the fp32 activation ``(F, E, ROW)`` or the fp16 planes
    ``(2, F, E, ROW)``) as one ``(rows, ROW)`` descriptor with ``(block_m, block_k)`` boxes."""
    flat = _aligned(rows).view(-1, rows.shape[-1])
    _check_rows(flat.shape[0])
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [block_m, block_k])


def edge_major_descriptor(x: Tensor, block_m: int, block_k: int) -> TensorDescriptor:
    """The fp32 output cotangent, ``(E, F, ROW)`` with edges outermost, as a 3-d descriptor
    with ``(block_m, 1, block_k)`` boxes (one focus per box)."""
    _check_rows(x.shape[0])
    x = _aligned(x.contiguous())
    n_edges, n_focus, row = x.shape
    # A contiguous tensor may carry any stride on a size-1 axis (an F = 1 cotangent made by a
    # permute); a descriptor's strides must be 16-byte multiples, which the canonical ones are.
    return TensorDescriptor(
        x, [n_edges, n_focus, row], [n_focus * row, row, 1], [block_m, 1, block_k]
    )


def weight_descriptors(
    operands: tuple[Tensor, Tensor], block_k: int, block_n: int
) -> tuple[TensorDescriptor, TensorDescriptor]:
    """Descriptors over the fp16 (head, tail) weight stacks ``(NL, F, W, W)``, each seen as
    ``(NL·F·W, W)`` with ``(block_k, block_n)`` boxes."""

    def describe(w: Tensor) -> TensorDescriptor:
        flat = _aligned(w).view(-1, w.shape[-1])
        return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [block_k, block_n])

    return describe(operands[0]), describe(operands[1])


_REGISTER_FILE = 65536
"""32-bit registers per multiprocessor (sm_80 and sm_90)."""
_MAX_THREAD_REGISTERS = 255


def persistent_grid(n_tiles: int, tile: TileConfig, device: torch.device) -> tuple[int]:
    """Programs of a persistent launch: as many as fit on the device at once. The fast tier's
    block GEMMs use (nearly) every register a thread may have (two fp32 accumulators per tile),
    so the register file sets the programs per multiprocessor. Under the interpreter two
    programs, so that the strided tile loop is still walked."""
    if device.type != "cuda":
        return (min(n_tiles, 2),)
    per_sm = max(1, _REGISTER_FILE // (_MAX_THREAD_REGISTERS * 32 * tile.num_warps))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return (max(1, min(n_tiles, sms * per_sm)),)


PER_CALL_ARGS = ("n_edge", "layer")
"""Kernel arguments that change from call to call (the edge count, the layer of the stack). Triton
would otherwise compile a variant per value class (1, a multiple of 16, other): a server's first
requests of a new size, and each layer of a pass, would each compile the same kernel again. They
only bound masks and offset whole rows, so nothing is lost by not specialising on them."""


# Triton: the shared tile product


# The host's scales as kernel constants: splits made on either side must merge the same way.
_ACT_PRESCALE = tl.constexpr(ACT_PRESCALE)
_TAIL_SCALE = tl.constexpr(TAIL_SCALE)


@triton.jit
def _split_fp16x3(x):
    """fp16 head and ``TAIL_SCALE``-scaled fp16 tail of ``ACT_PRESCALE·x`` (fp32 ``x``)."""
    scaled = x * _ACT_PRESCALE
    head = scaled.to(tl.float16)
    tail = ((scaled - head.to(tl.float32)) * _TAIL_SCALE).to(tl.float16)
    return head, tail


@triton.jit
def _merge_fp16x3(head_sum, tail_sum):
    """Undo the tail scale and the activation prescale of a compensated product."""
    return (head_sum + tail_sum * (1.0 / _TAIL_SCALE)) * (1.0 / _ACT_PRESCALE)


@triton.jit
def _tile_matmul(
    a_rows,  # (E_TILE,) pointers to A[m, 0]; A columns are contiguous
    row_mask,
    b_ptr,  # B[0, 0] (fp32, or the fp16 head when FAST); B rows are LDB apart
    b_lo_ptr,  # fp16 tail of B when FAST (scaled by TAIL_SCALE); unused otherwise
    offs_n,
    n_mask,
    K: tl.constexpr,
    LDB: tl.constexpr,
    FAST: tl.constexpr,
    K_STEP: tl.constexpr,
    E_TILE: tl.constexpr,
    C_TILE: tl.constexpr,
):
    """fp32 product of the row tile ``A[:, :K]`` with the column tile ``B[:K, offs_n]``."""
    hi_sum = tl.full((E_TILE, C_TILE), 0.0, tl.float32)
    lo_sum = tl.full((E_TILE, C_TILE), 0.0, tl.float32)
    for k_start in range(0, K, K_STEP):
        kk = k_start + tl.arange(0, K_STEP)
        k_ok = kk < K
        a_ok = row_mask[:, None] & k_ok[None, :]
        a = tl.load(a_rows[:, None] + kk[None, :], mask=a_ok, other=0.0)
        b_idx = offs_n[None, :] + LDB * kk.to(tl.int64)[:, None]
        b_ok = n_mask[None, :] & k_ok[:, None]
        b = tl.load(b_ptr + b_idx, mask=b_ok, other=0.0)
        if FAST:
            a_hi, a_lo = _split_fp16x3(a)
            b_lo = tl.load(b_lo_ptr + b_idx, mask=b_ok, other=0.0)
            hi_sum = tl.dot(a_hi, b, hi_sum)
            lo_sum = tl.dot(a_hi, b_lo, lo_sum)
            lo_sum = tl.dot(a_lo, b, lo_sum)
        else:
            hi_sum = tl.dot(a, b, hi_sum, input_precision="ieee")
    if FAST:
        hi_sum = _merge_fp16x3(hi_sum, lo_sum)
    return hi_sum


@triton.jit
def _desc_matmul(
    a_desc,  # A rows: fp16 planes or fp32 rows (2-d), or the edge-major fp32 rows (3-d)
    a_row,  # first A row of the tile (head plane), or first edge (EDGE_MAJOR); int32
    a_next,  # rows from the head plane to the tail plane (A_PLANES), or the focus (EDGE_MAJOR)
    a_col,  # first A column of the block
    b_desc,  # fp16 (NL·F·W, W) descriptor over the B heads, block (K_STEP, C_TILE)
    b_lo_desc,  # the same over the B tails
    b_row,  # first row of this (layer, focus) matrix
    n0,  # first output column of the tile
    K: tl.constexpr,
    A_PLANES: tl.constexpr,
    EDGE_MAJOR: tl.constexpr,
    K_STEP: tl.constexpr,
    E_TILE: tl.constexpr,
    C_TILE: tl.constexpr,
):
    """Fast-tier product of :func:`_tile_matmul` with every operand loaded through a tensor
    descriptor. ``A_PLANES``: A stored as head/tail planes (the tiles go to the tensor cores as
    loaded); otherwise fp32 A split in registers. ``K_STEP`` must divide ``K``: a B row past
    ``K`` belongs to the next matrix. Rows of A past a focus's edges are another focus's (or
    plane's, or the zero fill): each output row depends on its own A row only, and those rows
    are masked at the store; B columns past ``W`` are zero-filled.
    """
    hi_sum = tl.full((E_TILE, C_TILE), 0.0, tl.float32)
    lo_sum = tl.full((E_TILE, C_TILE), 0.0, tl.float32)
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
        lo_sum = tl.dot(a_hi, b_lo, lo_sum)
        lo_sum = tl.dot(a_lo, b_hi, lo_sum)
    return _merge_fp16x3(hi_sum, lo_sum)


@triton.jit
def _store_split(head_ptrs, tail, value, mask):
    """Store fp32 ``value`` as its fp16 head at ``head_ptrs`` and its tail ``tail`` further."""
    head, low = _split_fp16x3(value)
    tl.store(head_ptrs, head, mask=mask)
    tl.store(head_ptrs + tail, low, mask=mask)


@triton.jit
def _tile_coords(n_edge, N: tl.constexpr, E_TILE: tl.constexpr, C_TILE: tl.constexpr):
    """Edge rows (int64) and output columns of this program, with their masks."""
    col_tiles: tl.constexpr = (N - 1) // C_TILE + 1
    tile = tl.program_id(axis=0)
    tile_n = tile % col_tiles
    rows = (tile // col_tiles).to(tl.int64) * E_TILE + tl.arange(0, E_TILE)
    cols = tile_n * C_TILE + tl.arange(0, C_TILE)
    return rows, rows < n_edge, cols, cols < N, tile_n


@triton.jit
def _flat_tile(tile, n_edge, N: tl.constexpr, E_TILE: tl.constexpr, C_TILE: tl.constexpr):
    """Coordinates of flat tile ``tile`` of a persistent launch (focus, then edge tiles,
    output-column tiles fastest, as the grid of :func:`_tile_coords`): focus (int64), first edge
    (int32, a descriptor coordinate), edge rows (int64), output columns, their masks and the
    column-tile index."""
    col_tiles: tl.constexpr = (N - 1) // C_TILE + 1
    per_focus = tl.cdiv(n_edge, E_TILE) * col_tiles
    focus = tile // per_focus
    local = tile - focus * per_focus
    tile_n = local % col_tiles
    first = (local // col_tiles) * E_TILE
    rows = first.to(tl.int64) + tl.arange(0, E_TILE)
    cols = tile_n * C_TILE + tl.arange(0, C_TILE)
    return focus.to(tl.int64), first, rows, rows < n_edge, cols, cols < N, tile_n


@triton.jit
def _n_flat_tiles(n_edge, n_focus, N: tl.constexpr, E_TILE: tl.constexpr, C_TILE: tl.constexpr):
    return n_focus * tl.cdiv(n_edge, E_TILE) * ((N - 1) // C_TILE + 1)


@triton.jit
def _focus_coords():
    """This program's focus index (int64) and the focus count, both from grid axis 1."""
    focus = tl.program_id(axis=1)
    return focus.to(tl.int64), tl.num_programs(axis=1)


# Triton: forward


@triton.jit
def _block_fwd_epilogue(
    acc, rows, row_mask, cols, col_mask, focus, n_focus, n_edge, layer, u_ptr, z_ptr, sig_ptr,
    alpha_ptr, out_ptr, L: tl.constexpr, FD: tl.constexpr, M1_BLOCK: tl.constexpr,
    FINAL: tl.constexpr, APPLY_ALPHA: tl.constexpr,
):  # fmt: skip
    """Finish the block product ``acc`` of :func:`block_fwd_kernel` on its tile."""
    GWD: tl.constexpr = L * FD
    ROW: tl.constexpr = FD + 3 * GWD
    M0: tl.constexpr = FD + GWD
    COL0: tl.constexpr = M0 if M1_BLOCK else 0
    mask = row_mask[:, None] & col_mask[None, :]
    u_rows = u_ptr + (focus * n_edge + rows) * ROW + COL0
    if FINAL:
        u_tile = tl.load(u_rows[:, None] + cols[None, :], mask=mask, other=0.0)
        result = u_tile + acc
        if APPLY_ALPHA:
            a = tl.load(alpha_ptr + rows * n_focus + focus, mask=row_mask, other=0.0)
            result = result * a[:, None]
        out_rows = out_ptr + (rows * n_focus + focus) * ROW + COL0
        tl.store(out_rows[:, None] + cols[None, :], result, mask=mask)
    else:
        z_rows = z_ptr + ((layer * n_focus + focus) * n_edge + rows) * ROW + COL0
        tl.store(z_rows[:, None] + cols[None, :], acc, mask=mask)
        out_rows = out_ptr + (focus * n_edge + rows) * ROW + COL0
        if M1_BLOCK:
            u_tile = tl.load(u_rows[:, None] + cols[None, :], mask=mask, other=0.0)
            gate_cols = cols % GWD
            sig_rows = sig_ptr + (focus * n_edge + rows) * GWD
            gate = tl.load(sig_rows[:, None] + gate_cols[None, :], mask=mask, other=0.0)
            tl.store(out_rows[:, None] + cols[None, :], u_tile + acc * gate, mask=mask)
        else:
            # Scalar rows need no gate: SiLU lands here (the residual is read for them alone);
            # the gate kernel fills the l>=1 m=0 rows.
            scalar_mask = mask & (cols < FD)[None, :]
            u_tile = tl.load(u_rows[:, None] + cols[None, :], mask=scalar_mask, other=0.0)
            silu = acc * tl.sigmoid(acc)
            tl.store(out_rows[:, None] + cols[None, :], u_tile + silu, mask=scalar_mask)


@triton.jit(do_not_specialize=PER_CALL_ARGS)
def block_fwd_kernel(
    u_ptr,  # (F, E, ROW) layer input
    w_ptr,  # (NL, F, W, W) block weights
    z_ptr,  # (NG, F, E, ROW) pre-activation stack (gated layers)
    sig_ptr,  # (F, E, GWD) gates of this layer (gated layers, |m|=1 block)
    alpha_ptr,  # (E, F) competition weight (FINAL with APPLY_ALPHA)
    out_ptr,  # (F, E, ROW) next activation; (E, F, ROW) edge-major when FINAL
    n_edge,
    layer,
    L: tl.constexpr,
    FD: tl.constexpr,
    M1_BLOCK: tl.constexpr,
    FINAL: tl.constexpr,
    APPLY_ALPHA: tl.constexpr,
    BLOCK_M: tl.constexpr,  # edges per tile
    BLOCK_N: tl.constexpr,  # output columns per tile
    BLOCK_K: tl.constexpr,  # reduction step
):
    """One exact-tier block GEMM of a layer, ``z = u[:, blk] @ W[layer, f]``, with the layer's
    epilogue (the fast tier's is :func:`block_fwd_desc_kernel`).

    Gated layer: store ``z``; the m=0 block also finishes the SiLU scalar rows and the |m|=1 block
    applies the gates, ``out = u + z·σ``. Final identity layer (``FINAL``): ``(u + z)·alpha``
    stored edge-major.
    """
    GWD: tl.constexpr = L * FD
    ROW: tl.constexpr = FD + 3 * GWD
    M0: tl.constexpr = FD + GWD
    WIDTH: tl.constexpr = 2 * GWD if M1_BLOCK else M0
    COL0: tl.constexpr = M0 if M1_BLOCK else 0
    focus, n_focus = _focus_coords()
    rows, row_mask, cols, col_mask, _pid_n = _tile_coords(n_edge, WIDTH, BLOCK_M, BLOCK_N)

    u_rows = u_ptr + (focus * n_edge + rows) * ROW + COL0
    w_off = (layer * n_focus + focus) * WIDTH * WIDTH
    acc = _tile_matmul(
        u_rows, row_mask, w_ptr + w_off, w_ptr, cols, col_mask,
        WIDTH, WIDTH, False, BLOCK_K, BLOCK_M, BLOCK_N,
    )  # fmt: skip
    _block_fwd_epilogue(
        acc, rows, row_mask, cols, col_mask, focus, n_focus, n_edge, layer, u_ptr, z_ptr, sig_ptr,
        alpha_ptr, out_ptr, L, FD, M1_BLOCK, FINAL, APPLY_ALPHA,
    )  # fmt: skip


@triton.jit(do_not_specialize=PER_CALL_ARGS)
def block_fwd_desc_kernel(
    u_desc,  # fp32 (F·E, ROW) descriptor over the layer input, block (BLOCK_M, BLOCK_K)
    w_desc,  # fp16 (NL·F·W, W) descriptor over the weight heads, block (BLOCK_K, BLOCK_N)
    w_lo_desc,  # the same over the weight tails
    u_ptr,  # (F, E, ROW) layer input (the residual)
    z_ptr,  # (NG, F, E, ROW) pre-activation stack (gated layers)
    sig_ptr,  # (F, E, GWD) gates of this layer (gated layers, |m|=1 block)
    alpha_ptr,  # (E, F) competition weight (FINAL with APPLY_ALPHA)
    out_ptr,  # (F, E, ROW) next activation; (E, F, ROW) edge-major when FINAL
    n_edge,
    n_focus,
    layer,
    L: tl.constexpr,
    FD: tl.constexpr,
    M1_BLOCK: tl.constexpr,
    FINAL: tl.constexpr,
    APPLY_ALPHA: tl.constexpr,
    BLOCK_M: tl.constexpr,  # edges per tile
    BLOCK_N: tl.constexpr,  # output columns per tile
    BLOCK_K: tl.constexpr,  # reduction step
):
    """Fast-tier :func:`block_fwd_kernel` on a persistent grid, operands fed by descriptors
    (:func:`_desc_matmul`); the programs stride over the flat tiles of :func:`_flat_tile`."""
    M0: tl.constexpr = FD + L * FD  # scalar rows, then the m=0 rows of l >= 1
    WIDTH: tl.constexpr = 2 * L * FD if M1_BLOCK else M0
    COL0: tl.constexpr = M0 if M1_BLOCK else 0
    n_tiles = _n_flat_tiles(n_edge, n_focus, WIDTH, BLOCK_M, BLOCK_N)
    for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        focus, first, rows, row_mask, cols, col_mask, pid_n = _flat_tile(
            tile, n_edge, WIDTH, BLOCK_M, BLOCK_N
        )
        focus32 = focus.to(tl.int32)
        acc = _desc_matmul(
            u_desc, focus32 * n_edge + first, 0, COL0, w_desc, w_lo_desc,
            (layer * n_focus + focus32) * WIDTH, pid_n * BLOCK_N, WIDTH, False, False, BLOCK_K,
            BLOCK_M, BLOCK_N,
        )  # fmt: skip
        # One epilogue over the whole tile, the final layer's too. Split into column halves (fewer
        # registers live), the final tile miscompiled under Triton 3.7.1 at 64x128x32 with 3 or 4
        # stages: NaN and wrong values in x_local wherever alpha applied; 3.6.0 and the whole tile
        # were right, and the whole tile as fast (H200, benchmarks/stack_nonfinite_probe.py).
        _block_fwd_epilogue(
            acc, rows, row_mask, cols, col_mask, focus, n_focus, n_edge, layer, u_ptr, z_ptr,
            sig_ptr, alpha_ptr, out_ptr, L, FD, M1_BLOCK, FINAL, APPLY_ALPHA,
        )  # fmt: skip


@triton.jit(do_not_specialize=PER_CALL_ARGS)
def gate_fwd_kernel(
    z_ptr,  # (NG, F, E, ROW) pre-activations; layer ``layer`` is read
    gw_ptr,  # (NG, F, FD, GWD) gate projections (fp16 head when FAST)
    gw_lo_ptr,
    res_ptr,  # (F, E, ROW) residual added to the activation (HAS_RES)
    sig_ptr,  # (F, E, GWD) gates out (STORE_SIG)
    out_ptr,  # (F, E, ROW)
    n_edge,
    layer,
    L: tl.constexpr,
    FD: tl.constexpr,
    HAS_RES: tl.constexpr,
    ALL_ROWS: tl.constexpr,
    STORE_SIG: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    FAST: tl.constexpr,
):
    """Gates ``σ = sigmoid(z_scalar @ gw)`` and the gated rows ``res + z·σ``.

    The stack (``ALL_ROWS=False``) finishes the l>=1 m=0 rows and leaves σ for the |m|=1 GEMM
    epilogue; the standalone activation (``ALL_ROWS=True``) also writes the |m|=1 rows and the
    SiLU scalar rows (from the programs of the first column tile).
    """
    GWD: tl.constexpr = L * FD
    ROW: tl.constexpr = FD + 3 * GWD
    FP: tl.constexpr = triton.next_power_of_2(FD)
    focus, n_focus = _focus_coords()
    rows, row_mask, cols, col_mask, pid_n = _tile_coords(n_edge, GWD, BLOCK_M, BLOCK_N)

    z_rows = z_ptr + ((layer * n_focus + focus) * n_edge + rows) * ROW
    g_off = (layer * n_focus + focus) * FD * GWD
    logit = _tile_matmul(
        z_rows, row_mask, gw_ptr + g_off, gw_lo_ptr + g_off, cols, col_mask,
        FD, GWD, FAST, BLOCK_K, BLOCK_M, BLOCK_N,
    )  # fmt: skip
    gate = tl.sigmoid(logit)
    mask = row_mask[:, None] & col_mask[None, :]
    act_rows = (focus * n_edge + rows) * ROW
    if STORE_SIG:
        sig_rows = sig_ptr + (focus * n_edge + rows) * GWD
        tl.store(sig_rows[:, None] + cols[None, :], gate, mask=mask)
    n_gated_rows: tl.constexpr = 3 if ALL_ROWS else 1
    for r in tl.static_range(n_gated_rows):
        shift = FD + GWD * r
        z_tile = tl.load(z_rows[:, None] + (cols + shift)[None, :], mask=mask, other=0.0)
        value = z_tile * gate
        at = act_rows[:, None] + (cols + shift)[None, :]
        if HAS_RES:
            value += tl.load(res_ptr + at, mask=mask, other=0.0)
        tl.store(out_ptr + at, value, mask=mask)
    if ALL_ROWS:  # noqa: SIM102  (constexpr branch around a runtime one)
        if pid_n == 0:
            sc = tl.arange(0, FP)
            s_mask = row_mask[:, None] & (sc < FD)[None, :]
            s = tl.load(z_rows[:, None] + sc[None, :], mask=s_mask, other=0.0)
            silu = s * tl.sigmoid(s)
            if HAS_RES:
                silu += tl.load(res_ptr + act_rows[:, None] + sc[None, :], mask=s_mask, other=0.0)
            tl.store(out_ptr + act_rows[:, None] + sc[None, :], silu, mask=s_mask)


# Triton: backward


@triton.jit
def _store_cotangent(ptrs, tail, value, mask, SPLIT: tl.constexpr):
    """fp32 store, or (``SPLIT``) the head/tail planes of :func:`_store_split`."""
    if SPLIT:
        _store_split(ptrs, tail, value, mask)
    else:
        tl.store(ptrs, value, mask=mask)


@triton.jit
def _gate_rows_bwd(
    z_ptr, gw_ptr, gw_lo_ptr, g_ptr, gzup_ptr, gz_ptr, q_ptr, unext_ptr, uprev_ptr, n_edge,
    layer, L: tl.constexpr, FD: tl.constexpr, HAS_GZ_UP: tl.constexpr, SPLIT_GZ: tl.constexpr,
    RECOVER: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    """Body of :func:`gate_bwd_kernel` and :func:`gate_bwd_split_kernel` (operands there)."""
    GWD: tl.constexpr = L * FD
    ROW: tl.constexpr = FD + 3 * GWD
    focus, n_focus = _focus_coords()
    rows, row_mask, cols, col_mask, _pid_n = _tile_coords(n_edge, GWD, BLOCK_M, BLOCK_N)

    z_at = ((layer * n_focus + focus) * n_edge + rows) * ROW
    g_off = (layer * n_focus + focus) * FD * GWD
    logit = _tile_matmul(
        z_ptr + z_at, row_mask, gw_ptr + g_off, gw_lo_ptr + g_off, cols, col_mask,
        FD, GWD, FAST, BLOCK_K, BLOCK_M, BLOCK_N,
    )  # fmt: skip
    gate = tl.sigmoid(logit)
    mask = row_mask[:, None] & col_mask[None, :]
    act_rows = (focus * n_edge + rows) * ROW
    tail = n_focus.to(tl.int64) * n_edge * ROW
    dot_gz = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for r in tl.static_range(3):
        shift = FD + GWD * r
        at = act_rows[:, None] + (cols + shift)[None, :]
        z_tile = tl.load(z_ptr + z_at[:, None] + (cols + shift)[None, :], mask=mask, other=0.0)
        g_tile = tl.load(g_ptr + at, mask=mask, other=0.0)
        dot_gz += g_tile * z_tile
        grad = g_tile * gate
        if HAS_GZ_UP:
            grad += tl.load(
                gzup_ptr + z_at[:, None] + (cols + shift)[None, :], mask=mask, other=0.0
            )
        _store_cotangent(gz_ptr + at, tail, grad, mask, SPLIT_GZ)
        if RECOVER:
            u_tile = tl.load(unext_ptr + at, mask=mask, other=0.0)
            tl.store(uprev_ptr + at, u_tile - z_tile * gate, mask=mask)
    q_rows = q_ptr + (focus * n_edge + rows) * GWD
    tl.store(q_rows[:, None] + cols[None, :], dot_gz * gate * (1.0 - gate), mask=mask)


@triton.jit(do_not_specialize=PER_CALL_ARGS)
def gate_bwd_kernel(
    z_ptr,  # (NG, F, E, ROW) pre-activations; layer ``layer`` is read
    gw_ptr,  # (NG, F, FD, GWD) (fp16 head when FAST)
    gw_lo_ptr,
    g_ptr,  # (F, E, ROW) cotangent of the activation output
    gz_ptr,  # (F, E, ROW) out: cotangent of z, gated rows
    q_ptr,  # (F, E, GWD) out: cotangent of the gate logits
    unext_ptr,  # (F, E, ROW) layer output (RECOVER)
    uprev_ptr,  # (F, E, ROW) out: recovered layer input, gated rows (RECOVER)
    n_edge,
    layer,
    L: tl.constexpr,
    FD: tl.constexpr,
    RECOVER: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    FAST: tl.constexpr,
):
    """Gated-row backward: recompute σ, ``gz_r = g_r·σ``, ``q = Σ_r g_r z_r · σ(1-σ)``.

    With ``RECOVER`` it also walks the residual back, ``u_prev = u_next - z·σ`` on the gated rows.
    """
    _gate_rows_bwd(
        z_ptr, gw_ptr, gw_lo_ptr, g_ptr, z_ptr, gz_ptr, q_ptr, unext_ptr, uprev_ptr, n_edge,
        layer, L, FD, False, False, RECOVER, BLOCK_K, BLOCK_N, BLOCK_M, FAST,
    )  # fmt: skip


@triton.jit(do_not_specialize=PER_CALL_ARGS)
def gate_bwd_split_kernel(
    z_ptr,  # (NG, F, E, ROW) pre-activations; layer ``layer`` is read
    gw_ptr,  # (NG, F, FD, GWD) fp16 head
    gw_lo_ptr,  # fp16 tail
    g_ptr,  # (F, E, ROW) cotangent of the activation output
    gzup_ptr,  # (NG, F, E, ROW) cotangent arriving on z_all itself (HAS_GZ_UP)
    gzs_ptr,  # (2, F, E, ROW) fp16 out: cotangent of z, head plane then tail plane; gated rows
    q_ptr,  # (F, E, GWD) out: cotangent of the gate logits
    unext_ptr,  # (F, E, ROW) layer output (RECOVER)
    uprev_ptr,  # (F, E, ROW) out: recovered layer input, gated rows (RECOVER)
    n_edge,
    layer,
    L: tl.constexpr,
    FD: tl.constexpr,
    HAS_GZ_UP: tl.constexpr,
    RECOVER: tl.constexpr,
    BLOCK_M: tl.constexpr,  # edges per tile
    BLOCK_N: tl.constexpr,  # output columns per tile
    BLOCK_K: tl.constexpr,  # reduction step
):
    """Fast-tier :func:`gate_bwd_kernel`: adds the z_all cotangent, stores ``gz`` split."""
    _gate_rows_bwd(
        z_ptr, gw_ptr, gw_lo_ptr, g_ptr, gzup_ptr, gzs_ptr, q_ptr, unext_ptr, uprev_ptr, n_edge,
        layer, L, FD, HAS_GZ_UP, True, RECOVER, BLOCK_K, BLOCK_N, BLOCK_M, True,
    )  # fmt: skip


@triton.jit
def _scalar_rows_bwd(
    q_ptr, gwt_ptr, gwt_lo_ptr, z_ptr, g_ptr, gzup_ptr, gz_ptr, unext_ptr, uprev_ptr, n_edge,
    layer, L: tl.constexpr, FD: tl.constexpr, HAS_GZ_UP: tl.constexpr, SPLIT_GZ: tl.constexpr,
    RECOVER: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    """Body of :func:`scalar_bwd_kernel` and :func:`scalar_bwd_split_kernel`."""
    GWD: tl.constexpr = L * FD
    ROW: tl.constexpr = FD + 3 * GWD
    focus, n_focus = _focus_coords()
    rows, row_mask, cols, col_mask, _pid_n = _tile_coords(n_edge, FD, BLOCK_M, BLOCK_N)

    q_rows = q_ptr + (focus * n_edge + rows) * GWD
    g_off = (layer * n_focus + focus) * GWD * FD
    acc = _tile_matmul(
        q_rows, row_mask, gwt_ptr + g_off, gwt_lo_ptr + g_off, cols, col_mask,
        GWD, FD, FAST, BLOCK_K, BLOCK_M, BLOCK_N,
    )  # fmt: skip
    mask = row_mask[:, None] & col_mask[None, :]
    z_at = ((layer * n_focus + focus) * n_edge + rows)[:, None] * ROW + cols[None, :]
    act_at = ((focus * n_edge + rows) * ROW)[:, None] + cols[None, :]
    s = tl.load(z_ptr + z_at, mask=mask, other=0.0)
    g_tile = tl.load(g_ptr + act_at, mask=mask, other=0.0)
    phi = tl.sigmoid(s)
    grad = g_tile * phi * (1.0 + s * (1.0 - phi)) + acc
    if HAS_GZ_UP:
        grad += tl.load(gzup_ptr + z_at, mask=mask, other=0.0)
    _store_cotangent(gz_ptr + act_at, n_focus.to(tl.int64) * n_edge * ROW, grad, mask, SPLIT_GZ)
    if RECOVER:
        u_tile = tl.load(unext_ptr + act_at, mask=mask, other=0.0)
        tl.store(uprev_ptr + act_at, u_tile - s * phi, mask=mask)


@triton.jit(do_not_specialize=PER_CALL_ARGS)
def scalar_bwd_kernel(
    q_ptr,  # (F, E, GWD) gate-logit cotangent
    gwt_ptr,  # (NG, F, GWD, FD) transposed gate projections (fp16 head when FAST)
    gwt_lo_ptr,
    z_ptr,  # (NG, F, E, ROW) pre-activations
    g_ptr,  # (F, E, ROW) cotangent of the activation output
    gz_ptr,  # (F, E, ROW) out: cotangent of z, scalar rows
    unext_ptr,  # (F, E, ROW) layer output (RECOVER)
    uprev_ptr,  # (F, E, ROW) out: recovered layer input, scalar rows (RECOVER)
    n_edge,
    layer,
    L: tl.constexpr,
    FD: tl.constexpr,
    RECOVER: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    FAST: tl.constexpr,
):
    """Scalar-row backward ``gz_s = g_s·silu'(s) + q @ gwᵀ``; ``u_prev = u_next - silu(s)``."""
    _scalar_rows_bwd(
        q_ptr, gwt_ptr, gwt_lo_ptr, z_ptr, g_ptr, z_ptr, gz_ptr, unext_ptr, uprev_ptr, n_edge,
        layer, L, FD, False, False, RECOVER, BLOCK_K, BLOCK_N, BLOCK_M, FAST,
    )  # fmt: skip


@triton.jit(do_not_specialize=PER_CALL_ARGS)
def scalar_bwd_split_kernel(
    q_ptr,  # (F, E, GWD) gate-logit cotangent
    gwt_ptr,  # (NG, F, GWD, FD) transposed gate projections, fp16 head
    gwt_lo_ptr,  # fp16 tail
    z_ptr,  # (NG, F, E, ROW) pre-activations
    g_ptr,  # (F, E, ROW) cotangent of the activation output
    gzup_ptr,  # (NG, F, E, ROW) cotangent arriving on z_all itself (HAS_GZ_UP)
    gzs_ptr,  # (2, F, E, ROW) fp16 out: split cotangent of z, scalar rows
    unext_ptr,  # (F, E, ROW) layer output (RECOVER)
    uprev_ptr,  # (F, E, ROW) out: recovered layer input, scalar rows (RECOVER)
    n_edge,
    layer,
    L: tl.constexpr,
    FD: tl.constexpr,
    HAS_GZ_UP: tl.constexpr,
    RECOVER: tl.constexpr,
    BLOCK_M: tl.constexpr,  # edges per tile
    BLOCK_N: tl.constexpr,  # output columns per tile
    BLOCK_K: tl.constexpr,  # reduction step
):
    """Fast-tier :func:`scalar_bwd_kernel`: adds the z_all cotangent, stores ``gz`` split."""
    _scalar_rows_bwd(
        q_ptr, gwt_ptr, gwt_lo_ptr, z_ptr, g_ptr, gzup_ptr, gzs_ptr, unext_ptr, uprev_ptr, n_edge,
        layer, L, FD, HAS_GZ_UP, True, RECOVER, BLOCK_K, BLOCK_N, BLOCK_M, True,
    )  # fmt: skip


@triton.jit
def _column_halves(tile, E_TILE: tl.constexpr, C_TILE: tl.constexpr):
    """Left and right ``(E_TILE, C_TILE // 2)`` column halves of an ``(E_TILE, C_TILE)`` tile."""
    pairs = tl.permute(tl.reshape(tile, (E_TILE, 2, C_TILE // 2)), (0, 2, 1))
    return tl.split(pairs)


@triton.jit
def _block_bwd_epilogue(
    acc, rows, row_mask, cols, a_rows, act_rows, res_ptr, alpha_ptr, u_ptr, out_ptr, focus,
    n_focus, WIDTH: tl.constexpr, FINAL: tl.constexpr, APPLY_ALPHA: tl.constexpr,
    ALPHA_PARTIALS: tl.constexpr,
):  # fmt: skip
    """Finish the residual product ``acc`` on the columns ``cols`` (see :func:`block_bwd_kernel`);
    returns ``Σ_cols u·(grad + grad Wᵀ)`` per edge row with ``ALPHA_PARTIALS``, else zeros."""
    mask = row_mask[:, None] & (cols < WIDTH)[None, :]
    grad_alpha = tl.zeros_like(rows).to(tl.float32)
    if FINAL:
        grad = tl.load(a_rows[:, None] + cols[None, :], mask=mask, other=0.0)
        result = grad + acc
        if APPLY_ALPHA:
            if ALPHA_PARTIALS:
                # Σ_c grad·out = Σ_c u·(grad + grad Wᵀ) (the transpose moved onto the cotangent):
                # no division by alpha, so an edge with alpha = 0 still gets its gradient.
                u_tile = tl.load(u_ptr + act_rows[:, None] + cols[None, :], mask=mask, other=0.0)
                grad_alpha = tl.sum(u_tile * result, axis=1)
            a = tl.load(alpha_ptr + rows * n_focus + focus, mask=row_mask, other=0.0)
            result = result * a[:, None]
    else:
        result = tl.load(res_ptr + act_rows[:, None] + cols[None, :], mask=mask, other=0.0) + acc
    tl.store(out_ptr + act_rows[:, None] + cols[None, :], result, mask=mask)
    return grad_alpha


@triton.jit
def _block_bwd_finish(
    acc, rows, row_mask, cols, pid_n, a_rows, focus, n_focus, res_ptr, alpha_ptr, u_ptr,
    part_ptr, out_ptr, n_edge, L: tl.constexpr, FD: tl.constexpr, M1_BLOCK: tl.constexpr,
    FINAL: tl.constexpr, APPLY_ALPHA: tl.constexpr, ALPHA_PARTIALS: tl.constexpr,
    HALVES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Epilogue of a residual backward tile (see :func:`block_bwd_kernel`): store ``g_in`` and,
    with ``ALPHA_PARTIALS``, this tile's share of the alpha gradient ``Σ grad·out``. ``HALVES``
    runs it on one column half at a time."""
    GWD: tl.constexpr = L * FD
    ROW: tl.constexpr = FD + 3 * GWD
    M0: tl.constexpr = FD + GWD
    WIDTH: tl.constexpr = 2 * GWD if M1_BLOCK else M0
    COL0: tl.constexpr = M0 if M1_BLOCK else 0
    NT0: tl.constexpr = (M0 - 1) // BLOCK_N + 1
    N_SLOTS: tl.constexpr = NT0 + (2 * GWD - 1) // BLOCK_N + 1
    act_rows = (focus * n_edge + rows) * ROW + COL0
    if HALVES:
        # Holding grad, u and the product of a whole tile at once spills (sm_90, 64x128 tile:
        # 255 registers); one column half at a time does not (233) and ran 7 % faster at the
        # bar case. The other epilogues gained nothing from halves (H200, 2026-11-30).
        left, right = _column_halves(acc, BLOCK_M, BLOCK_N)
        left_cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N // 2)
        grad_alpha = _block_bwd_epilogue(
            left, rows, row_mask, left_cols, a_rows, act_rows, res_ptr, alpha_ptr, u_ptr,
            out_ptr, focus, n_focus, WIDTH, FINAL, APPLY_ALPHA, ALPHA_PARTIALS,
        )  # fmt: skip
        grad_alpha += _block_bwd_epilogue(
            right, rows, row_mask, left_cols + BLOCK_N // 2, a_rows, act_rows, res_ptr,
            alpha_ptr, u_ptr, out_ptr, focus, n_focus, WIDTH, FINAL, APPLY_ALPHA, ALPHA_PARTIALS,
        )  # fmt: skip
    else:
        grad_alpha = _block_bwd_epilogue(
            acc, rows, row_mask, cols, a_rows, act_rows, res_ptr, alpha_ptr, u_ptr, out_ptr,
            focus, n_focus, WIDTH, FINAL, APPLY_ALPHA, ALPHA_PARTIALS,
        )  # fmt: skip
    if ALPHA_PARTIALS:
        slot = pid_n + (NT0 if M1_BLOCK else 0)
        tl.store(part_ptr + (rows * n_focus + focus) * N_SLOTS + slot, grad_alpha, mask=row_mask)


@triton.jit(do_not_specialize=PER_CALL_ARGS)
def block_bwd_kernel(
    a_ptr,  # (F, E, ROW) pre-activation cotangent; (E, F, ROW) output cotangent when FINAL
    wt_ptr,  # (NL, F, W, W) transposed block weights
    res_ptr,  # (F, E, ROW) cotangent of the layer output (not read when FINAL)
    alpha_ptr,  # (E, F)
    u_ptr,  # (F, E, ROW) the final layer's input u_final (ALPHA_PARTIALS)
    part_ptr,  # (E, F, NT) out: per column tile, Σ u·(grad + grad Wᵀ) over its columns
    out_ptr,  # (F, E, ROW) out: cotangent of the layer input
    n_edge,
    layer,
    L: tl.constexpr,
    FD: tl.constexpr,
    M1_BLOCK: tl.constexpr,
    FINAL: tl.constexpr,
    APPLY_ALPHA: tl.constexpr,
    ALPHA_PARTIALS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # edges per tile
    BLOCK_N: tl.constexpr,  # output columns per tile
    BLOCK_K: tl.constexpr,  # reduction step
):
    """Exact-tier residual backward of one block: ``g_in = g_out + gz @ Wᵀ`` (the fast tier's is
    :func:`block_bwd_desc_kernel`).

    For the final identity layer (``FINAL``) ``gz = g_out = alpha·grad`` is read edge-major and
    alpha is applied after the product: ``g_in = alpha·(grad + grad @ Wᵀ)``. ``ALPHA_PARTIALS``
    leaves this tile's share of the alpha gradient in its slot, as :func:`block_bwd_desc_kernel`.
    """
    GWD: tl.constexpr = L * FD
    ROW: tl.constexpr = FD + 3 * GWD
    M0: tl.constexpr = FD + GWD
    WIDTH: tl.constexpr = 2 * GWD if M1_BLOCK else M0
    COL0: tl.constexpr = M0 if M1_BLOCK else 0
    focus, n_focus = _focus_coords()
    rows, row_mask, cols, col_mask, pid_n = _tile_coords(n_edge, WIDTH, BLOCK_M, BLOCK_N)

    edge_rows = (rows * n_focus + focus) * ROW + COL0
    act_rows = (focus * n_edge + rows) * ROW + COL0
    a_rows = a_ptr + (edge_rows if FINAL else act_rows)
    w_off = (layer * n_focus + focus) * WIDTH * WIDTH
    acc = _tile_matmul(
        a_rows, row_mask, wt_ptr + w_off, wt_ptr, cols, col_mask,
        WIDTH, WIDTH, False, BLOCK_K, BLOCK_M, BLOCK_N,
    )  # fmt: skip
    _block_bwd_finish(
        acc, rows, row_mask, cols, pid_n, a_rows, focus, n_focus, res_ptr, alpha_ptr, u_ptr,
        part_ptr, out_ptr, n_edge, L, FD, M1_BLOCK, FINAL, APPLY_ALPHA, ALPHA_PARTIALS, False,
        BLOCK_N, BLOCK_M,
    )  # fmt: skip


@triton.jit(do_not_specialize=PER_CALL_ARGS)
def block_bwd_desc_kernel(
    a_desc,  # FINAL: fp32 (E, F, ROW) descriptor over the output cotangent, block
    # (BLOCK_M, 1, BLOCK_K); else fp16 (2·F·E, ROW) over the split cotangent planes
    wt_desc,  # fp16 (NL·F·W, W) over the transposed weight heads, block (BLOCK_K, BLOCK_N)
    wt_lo_desc,  # the same over the tails
    a_ptr,  # (E, F, ROW) the output cotangent (FINAL)
    res_ptr,  # (F, E, ROW) cotangent of the layer output (not read when FINAL)
    alpha_ptr,  # (E, F)
    u_ptr,  # (F, E, ROW) the final layer's input u_final (ALPHA_PARTIALS)
    part_ptr,  # (E, F, NT) out: per column tile, Σ u·(grad + grad Wᵀ) over its columns
    out_ptr,  # (F, E, ROW) out: cotangent of the layer input
    n_edge,
    n_focus,
    layer,
    L: tl.constexpr,
    FD: tl.constexpr,
    M1_BLOCK: tl.constexpr,
    FINAL: tl.constexpr,
    APPLY_ALPHA: tl.constexpr,
    ALPHA_PARTIALS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # edges per tile
    BLOCK_N: tl.constexpr,  # output columns per tile
    BLOCK_K: tl.constexpr,  # reduction step
):
    """Fast-tier residual backward of one block on a persistent grid (tiles as
    :func:`_flat_tile`), operands fed by descriptors (:func:`_desc_matmul`).

    ``g_in = g_out + gz @ Wᵀ``, with ``gz`` read as the head/tail planes of :func:`_store_split`
    that the gate backward kernels leave. For the final identity layer (``FINAL``) ``gz = g_out
    = alpha·grad`` is read edge-major (split in registers), alpha is applied after the product,
    ``g_in = alpha·(grad + grad @ Wᵀ)``, and the epilogue runs on one column half at a time;
    ``ALPHA_PARTIALS`` also leaves this tile's share of the alpha gradient ``Σ_c grad·out =
    Σ_c u·(grad + grad Wᵀ)``: the m=0 block fills slots ``[0, NT0)``, the |m|=1 block the next
    ``NT1``, and the caller sums the slots.
    """
    GWD: tl.constexpr = L * FD
    ROW: tl.constexpr = FD + 3 * GWD
    M0: tl.constexpr = FD + GWD
    WIDTH: tl.constexpr = 2 * GWD if M1_BLOCK else M0
    COL0: tl.constexpr = M0 if M1_BLOCK else 0
    n_tiles = _n_flat_tiles(n_edge, n_focus, WIDTH, BLOCK_M, BLOCK_N)
    for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        focus, first, rows, row_mask, cols, _col_mask, pid_n = _flat_tile(
            tile, n_edge, WIDTH, BLOCK_M, BLOCK_N
        )
        focus32 = focus.to(tl.int32)
        if FINAL:
            a_row, a_next = first, focus32
        else:
            a_row, a_next = focus32 * n_edge + first, n_focus * n_edge
        acc = _desc_matmul(
            a_desc, a_row, a_next, COL0, wt_desc, wt_lo_desc, (layer * n_focus + focus32) * WIDTH,
            pid_n * BLOCK_N, WIDTH, not FINAL, FINAL, BLOCK_K, BLOCK_M, BLOCK_N,
        )  # fmt: skip
        a_rows = a_ptr + (rows * n_focus + focus) * ROW + COL0
        _block_bwd_finish(
            acc, rows, row_mask, cols, pid_n, a_rows, focus, n_focus, res_ptr, alpha_ptr, u_ptr,
            part_ptr, out_ptr, n_edge, L, FD, M1_BLOCK, FINAL, APPLY_ALPHA, ALPHA_PARTIALS,
            FINAL, BLOCK_N, BLOCK_M,
        )  # fmt: skip
