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
    """Forces and virials from ``edge_grad`` = ∂E/∂r (E, 3) and the edge vectors (E, 3).

    Every reduction is parallel over atoms: the structure virial sums the per-centre virials
    (atoms are structure-major), instead of one long per-structure walk over all its edges.
    """
    g = edge_grad.to(torch.float64)
    r = edge_vec.to(torch.float64)
    forces = csr_segment_sum(g, graph.dst_rowptr) - csr_segment_sum(
        g, graph.src_rowptr, graph.src_order
    )
    # Imported here: so2kernels' package import pulls in every Triton kernel.
    from so2kernels._layout import device_constant

    # 0 − g⊗r: the negation rides on the product's launch (exactly: a sign flip).
    zero = device_constant((0.0,), g.device, torch.float64)
    edge_virial = torch.addcmul(zero, g.unsqueeze(2), r.unsqueeze(1), value=-1.0)  # (E, 3, 3)
    centre_virial = csr_segment_sum(edge_virial, graph.dst_rowptr)  # (N, 3, 3)
    virial = csr_segment_sum(centre_virial, atom_rowptr(graph))
    per_atom = None
    if atom_virial:
        source_virial = csr_segment_sum(edge_virial, graph.src_rowptr, graph.src_order)
        per_atom = 0.5 * (centre_virial + source_virial)
    return ForcesVirial(forces=forces, virial=virial, atom_virial=per_atom)


def atom_rowptr(graph: Graph) -> Tensor:
    """(B+1,) int64 atom offsets of the structures, from the sorted ``atom_batch`` on the device
    (a search, no host read)."""
    bounds = torch.arange(graph.n_structures + 1, device=graph.device, dtype=torch.int64)
    return torch.searchsorted(graph.atom_batch, bounds)


def stress_from_virial(virial: Tensor, cells: Tensor, pbc: Tensor) -> Tensor:
    """(B, 6) ``−sym(W)/V`` in Voigt order (xx, yy, zz, yz, xz, xy), eV/Å³; NaN for structures
    that are not periodic along all three axes (no volume)."""
    sym = 0.5 * (virial + virial.transpose(-1, -2))
    # Triple product rather than linalg.det: a batched LU may read its pivots/info on the host.
    a, b, c = cells.to(virial.dtype).unbind(-2)
    volume = torch.linalg.vecdot(a, torch.linalg.cross(b, c)).abs()
    periodic = pbc.all(dim=-1)
    safe_volume = torch.where(periodic, volume, torch.ones_like(volume))
    # Voigt entries as slices of the flattened symmetric matrix (no index tensor to upload):
    # flat 0, 4, 8 are xx, yy, zz; flat 5, 2, 1 are yz, xz, xy.
    flat = sym.flatten(-2)
    voigt = torch.cat((flat[:, 0::4], flat[:, 5:6], flat[:, 2:3], flat[:, 1:2]), dim=-1)
    stress = -voigt / safe_volume.unsqueeze(-1)
    return torch.where(periodic.unsqueeze(-1), stress, torch.full_like(stress, float("nan")))
