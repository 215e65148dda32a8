"""Launch tiles for the rotate-mix kernels: shape-keyed tables per GPU, with conservative fallbacks.

Tables live in ``so2kernels/tables/<gpu-slug>.json`` (``NVIDIA H200`` → ``nvidia_h200.json``) and
are written by ``benchmarks/sweep_tiles.py``. Layout::

    {"device": "NVIDIA H200", "torch": "...", "triton": "...", "date": "...", "command": "...",
     "rotate_mix_fwd": {"cw128_l2_r1": {"block_e": 2, "num_warps": 4}, ...},
     "rotate_mix_bwd": {"cw128_l2_r1": {"variant": "edge", "block_e": 4, "num_warps": 4}, ...}}

``variant`` picks the backward's schedule (the forward has one, edge-parallel, and ignores it):

* ``"csr"`` (the fallback): programs take fixed-length chunks of the source CSR order (``chunk``
  edges, chosen from E when the entry leaves it 0) and walk the node segments inside, ``block_e``
  edges per step, node gradient in registers; segments cut by a chunk boundary are finished by a
  small per-node pass that sums the cut parts in a fixed order. Parallelism follows E, not N.
* ``"node"``: one program per node walks the node's whole source segment ``block_e`` edges at a
  time and reduces the node gradient in registers (no per-edge intermediate; N programs);
* ``"edge"``: one program per ``block_e`` consecutive edges writes a per-edge node gradient that
  a CSR ``segment_sum`` then reduces (more traffic, far more parallelism, coalesced edge reads).

``block_e`` is the number of edges one program handles at a time: in the forward and the edge
variant, edges per program; in the csr and node variants, the edge-block step through one node's
segment. The per-edge channel reductions (Wigner and kernel gradients) stay inside one warp only
when a warp spans all channels of an edge, i.e. with ``num_warps = 1``; with more warps Triton
lays warps along the channel axis and every reduction goes through shared memory and a barrier.
Every candidate is validated against the float64 reference before it is timed. A backward entry
is written only when a measured configuration beat the fallback. A missing key means the
fallback; an entry without ``variant`` is a node entry (written before variants existed). Extra
fields (``ms``, ``fallback_ms``, ``<variant>_ms``) record the measurement.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Literal

import torch
import triton

from so2kernels._layout import n_coeff

Direction = Literal["fwd", "bwd"]
Variant = Literal["csr", "node", "edge"]
VARIANTS: tuple[Variant, ...] = ("csr", "node", "edge")

TABLES_DIR = Path(__file__).resolve().parent / "tables"


@dataclass(frozen=True)
class LaunchTiles:
    """One launch configuration: edges per program step, warps per program, backward schedule
    and, for the csr schedule, edges per program (0: chosen from E by :func:`csr_chunk`)."""

    block_e: int
    num_warps: int
    variant: Variant = "node"
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.block_e < 1 or self.block_e & (self.block_e - 1):
            raise ValueError(f"block_e must be a power of two >= 1, got {self.block_e}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps}")
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.chunk < 0:
            raise ValueError(f"chunk must be >= 0 (0: chosen from E), got {self.chunk}")


INTERPRETER_TILES = LaunchTiles(block_e=8, num_warps=4, variant="csr")
"""Under TRITON_INTERPRET the cost is programs × ops, so the CPU path takes wide edge blocks."""

CSR_TARGET_PROGRAMS = 16384
"""The csr schedule's automatic chunk aims at about this many programs: several waves of
one-warp programs on a 132-SM GPU at large E, and still ~1000 programs at E ≈ 17k."""
CSR_CHUNK_BOUNDS = (16, 256)
"""Automatic chunk range: below 16 edges the cut-segment parts (one (D, C) block each) cost
about as much traffic as the edges themselves; above 256 the last wave runs nearly empty."""


def csr_chunk(n_edge: int, tiles: LaunchTiles) -> int:
    """Edges per program of the csr schedule: ``tiles.chunk`` when set, else the power of two
    that gives about CSR_TARGET_PROGRAMS programs, within CSR_CHUNK_BOUNDS and at least one
    edge block."""
    if tiles.chunk > 0:
        return tiles.chunk
    wanted = int(triton.next_power_of_2(max(1, triton.cdiv(n_edge, CSR_TARGET_PROGRAMS))))
    low, high = CSR_CHUNK_BOUNDS
    return max(min(wanted, high), low, tiles.block_e)


def table_key(c_wide: int, lmax: int, rank: int) -> str:
    """Shape regime key of a table entry."""
    return f"cw{c_wide}_l{lmax}_r{rank}"


def device_slug(device_name: str) -> str:
    """File stem of a GPU's table: lower-case, non-alphanumerics folded to ``_``."""
    return re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_")


@cache
def load_table(slug: str) -> dict[str, Any]:
    """The table for a device slug, or ``{}`` when none ships."""
    path = TABLES_DIR / f"{slug}.json"
    if not path.is_file():
        return {}
    table: dict[str, Any] = json.loads(path.read_text())
    return table


def fallback_tiles(direction: Direction, c_wide: int, lmax: int) -> LaunchTiles:
    """One edge per step; forward with 4 warps (8 past 256 lanes), backward on the csr schedule
    with warps growing with its per-program working set (lanes × packed rows), which kept ptxas
    (sm_90) under 255 registers without spills up to lmax 3."""
    lanes = triton.next_power_of_2(c_wide)
    if direction == "fwd":
        return LaunchTiles(block_e=1, num_warps=4 if lanes <= 256 else 8)
    work = lanes * n_coeff(lmax)
    warps = 1 if work <= 128 * 16 else 4 if work <= 256 * 16 else 8
    return LaunchTiles(block_e=1, num_warps=warps, variant="csr")


def rotate_mix_tiles(
    direction: Direction, c_wide: int, lmax: int, rank: int, device: torch.device
) -> LaunchTiles:
    """Tiles for one rotate-mix launch: the device's table entry, else the fallback."""
    if device.type != "cuda":
        return INTERPRETER_TILES
    slug = device_slug(torch.cuda.get_device_name(device))
    entry = load_table(slug).get(f"rotate_mix_{direction}", {}).get(table_key(c_wide, lmax, rank))
    if entry is None:
        return fallback_tiles(direction, c_wide, lmax)
    return LaunchTiles(
        block_e=int(entry["block_e"]),
        num_warps=int(entry["num_warps"]),
        variant=entry.get("variant", "node"),
        chunk=int(entry.get("chunk", 0)),
    )
