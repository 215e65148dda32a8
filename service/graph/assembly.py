"""Forces, virials and stress from the gradient of the energy with respect to the edge vectors.

With ``g_e = ∂E/∂r_e`` and ``r_e = x_src + S·cell − x_dst``: ``F_dst += g_e``, ``F_src −= g_e``,
``W = −Σ_e g_e ⊗ r_e`` (row = force component), per-atom virial half of each edge term to each
endpoint; ``stress = −sym(W)/V`` in ASE Voigt order (model-dpa4.md §5). Periodic images need
nothing extra because ``S·cell`` is a constant inside ``r_e``. All sums are CSR segment sums in
float64 (:mod:`service.graph.segments`): deterministic, no atomics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from service.graph.neighbors import Graph
from service.graph.segments import csr_segment_sum

VOIGT_ROWS = (0, 1, 2, 1, 0, 0)
VOIGT_COLS = (0, 1, 2, 2, 2, 1)
"""ASE Voigt order (xx, yy, zz, yz, xz, xy)."""


@dataclass
class ForcesVirial:
    """forces (N, 3), virial (B, 3, 3) and atom_virial (N, 3, 3) (None if not requested),
    all float64, eV/Å and eV."""

    forces: Tensor
    virial: Tensor
    atom_virial: Tensor | None


def assemble_forces_virial(
    graph: Graph, edge_grad: Tensor, edge_vec: Tensor, *, atom_virial: bool = True
) -> ForcesVirial:
    """Forces and virials from ``edge_grad`` = ∂E/∂r (E, 3) and the edge vectors (E, 3)."""
    g = edge_grad.to(torch.float64)
    r = edge_vec.to(torch.float64)
    order = graph.src_order
    forces = csr_segment_sum(g, graph.dst_rowptr) - csr_segment_sum(
        g.index_select(0, order), graph.src_rowptr
    )
    edge_virial = -(g.unsqueeze(2) * r.unsqueeze(1))  # (E, 3, 3)
    virial = csr_segment_sum(edge_virial, graph.edge_ptr)
    per_atom = None
    if atom_virial:
        per_atom = 0.5 * (
            csr_segment_sum(edge_virial, graph.dst_rowptr)
            + csr_segment_sum(edge_virial.index_select(0, order), graph.src_rowptr)
        )
    return ForcesVirial(forces=forces, virial=virial, atom_virial=per_atom)


def stress_from_virial(virial: Tensor, cells: Tensor, pbc: Tensor) -> Tensor:
    """(B, 6) ``−sym(W)/V`` in Voigt order (xx, yy, zz, yz, xz, xy), eV/Å³; NaN for structures
    that are not periodic along all three axes (no volume)."""
    sym = 0.5 * (virial + virial.transpose(-1, -2))
    volume = torch.linalg.det(cells.to(virial.dtype)).abs()
    periodic = pbc.all(dim=-1)
    safe_volume = torch.where(periodic, volume, torch.ones_like(volume))
    stress = -sym[:, list(VOIGT_ROWS), list(VOIGT_COLS)] / safe_volume.unsqueeze(-1)
    return torch.where(periodic.unsqueeze(-1), stress, torch.full_like(stress, float("nan")))
