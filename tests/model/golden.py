"""Edge caches built from DeePMD's golden edge-level tensors (triclinic cell), independent of
service.graph, so model stages can be checked against DeePMD's own geometry."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from tests.conftest import shared_path


def golden_file(name: str) -> Path:
    return shared_path("reference", "golden", name)


@dataclass
class ArrayGraph:
    src: Tensor
    dst: Tensor
    src_order: Tensor
    src_rowptr: Tensor
    dst_rowptr: Tensor


@dataclass
class ArrayCache:
    vec: Tensor
    length: Tensor
    env: Tensor
    env_rbf: Tensor
    wigner: Tensor
    inv_sqrt_deg: Tensor
    graph: ArrayGraph


def _rowptr(index: Tensor, n: int) -> Tensor:
    return torch.cat(
        [torch.zeros(1, dtype=torch.int64), torch.bincount(index, minlength=n).cumsum(0)]
    )


def _envelope(x: np.ndarray, p: int) -> np.ndarray:
    u = np.clip(1.0 - x, 0.0, 1.0)
    return u**4 * sum(math.comb(k + 3, 3) * x**k for k in range(p))


def triclinic_cache(rcut: float = 6.0) -> tuple[ArrayCache, np.ndarray]:
    """``(cache, kept)``: real edges sorted by dst; ``kept[i]`` is the golden edge id of edge i."""
    common = np.load(golden_file("tiny_fused_common_intermediates.npz"))
    mask = common["tricl_edge_mask"]
    real = np.nonzero(mask)[0]
    index = common["tricl_edge_index"][:, real]
    order = np.argsort(index[1], kind="stable")
    kept = real[order]
    src = torch.from_numpy(index[0, order].copy())
    dst = torch.from_numpy(index[1, order].copy())
    vec = torch.from_numpy(common["tricl_edge_vec"][kept]).float()
    length = torch.sqrt((vec * vec).sum(-1) + 1e-14)
    env_rbf = torch.from_numpy(_envelope(length.double().numpy() / rcut, 7)).float()
    n = 3
    graph = ArrayGraph(src, dst, torch.argsort(src, stable=True), _rowptr(src, n), _rowptr(dst, n))
    cache = ArrayCache(
        vec=vec,
        length=length,
        env=torch.from_numpy(common["tricl_edge_env"][kept]),
        env_rbf=env_rbf,
        wigner=torch.from_numpy(common["tricl_D_full"][kept]).contiguous(),
        inv_sqrt_deg=torch.from_numpy(common["tricl_inv_sqrt_deg"]),
        graph=graph,
    )
    return cache, kept
