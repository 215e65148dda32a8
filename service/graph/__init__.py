"""Per-request graph: validated structures → neighbour graph → edge cache → force assembly."""

from service.graph.assembly import ForcesVirial, assemble_forces_virial, stress_from_virial
from service.graph.edge_cache import EdgeCache, build_edge_cache
from service.graph.errors import InvalidStructureError
from service.graph.neighbors import Graph, build_graph, edge_vectors
from service.graph.radial import (
    bessel_basis,
    c3_envelope,
    gaussian_basis,
    initial_bessel_frequencies,
)
from service.graph.structures import StructureArrays, Structures, symbols_to_numbers
from service.graph.wigner import edge_quaternion, quaternion_to_rotation, wigner_d

__all__ = [
    "EdgeCache",
    "ForcesVirial",
    "Graph",
    "InvalidStructureError",
    "StructureArrays",
    "Structures",
    "assemble_forces_virial",
    "bessel_basis",
    "build_edge_cache",
    "build_graph",
    "c3_envelope",
    "edge_quaternion",
    "edge_vectors",
    "gaussian_basis",
    "initial_bessel_frequencies",
    "quaternion_to_rotation",
    "stress_from_virial",
    "symbols_to_numbers",
    "wigner_d",
]
