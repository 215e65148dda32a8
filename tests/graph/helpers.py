"""Shared fixtures for the graph tests: random structures and a brute-force neighbour list."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable

import numpy as np
import torch
from numpy.typing import NDArray

from service.graph.structures import StructureArrays


def random_cell(rng: np.random.Generator, size: float, skew: float = 0.3) -> NDArray[np.float64]:
    """A random triclinic cell (rows) of roughly ``size`` Å, positively oriented."""
    cell = np.diag(rng.uniform(0.8, 1.2, 3) * size) + rng.uniform(-skew, skew, (3, 3)) * size
    if np.linalg.det(cell) < 0:
        cell[2] *= -1
    return cell


def random_structure(
    rng: np.random.Generator,
    n_atoms: int,
    cell: NDArray[np.float64] | None,
    pbc: tuple[bool, bool, bool],
    *,
    spread: float = 6.0,
    min_sep: float = 0.3,
) -> StructureArrays:
    """Random positions (inside the cell, or in a box of ``spread`` Å), a little outside along
    open axes, kept ``min_sep`` apart so no pair sits near the coincidence threshold."""
    points: list[NDArray[np.float64]] = []
    while len(points) < n_atoms:
        if cell is None:
            x = rng.uniform(-0.5, 0.5, 3) * spread
        else:
            frac = rng.uniform(-0.2, 1.2, 3)
            x = frac @ cell
        if all(np.linalg.norm(x - p) > min_sep for p in points):
            points.append(x)
    numbers = rng.integers(1, 10, n_atoms)
    return StructureArrays(numbers=numbers, positions=np.array(points), cell=cell, pbc=pbc)


def brute_force_pairs(
    positions: NDArray[np.float64],
    cell: NDArray[np.float64] | None,
    pbc: tuple[bool, bool, bool] | NDArray[np.bool_],
    rcut: float,
) -> set[tuple[int, int, int, int, int]]:
    """Every (dst, src, S0, S1, S2) with 0 < |x_src + S·cell − x_dst| ≤ rcut, by enumerating all
    images within reach of the cutoff (O(N²·images))."""
    pbc = np.asarray(pbc, dtype=bool)
    cell = np.zeros((3, 3)) if cell is None else np.asarray(cell)
    reach = [0, 0, 0]
    if pbc.any():
        inv = np.linalg.inv(np.where(pbc[:, None], cell, np.eye(3)))
        heights = 1.0 / np.linalg.norm(inv, axis=0)
        reach = [int(np.ceil(rcut / h)) + 1 if p else 0 for h, p in zip(heights, pbc, strict=True)]
    out = set()
    ranges = [range(-k, k + 1) for k in reach]
    for s0, s1, s2 in itertools.product(*ranges):
        d = positions[None, :, :] + np.array((s0, s1, s2)) @ cell - positions[:, None, :]
        dist = np.linalg.norm(d, axis=-1)
        ok = (dist <= rcut) & (dist > 0)
        for i, j in zip(*np.nonzero(ok), strict=True):
            out.add((int(i), int(j), s0, s1, s2))
    return out


def cuda_syncs(call: Callable[[], object]) -> list[str]:
    """The synchronising CUDA operations ``call()`` makes, as torch's sync debug mode reports
    them (its one-time "... is a prototype feature ..." notice is not one)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [
        str(w.message)
        for w in caught
        if "called a synchronizing" in str(w.message) and "prototype" not in str(w.message)
    ]
