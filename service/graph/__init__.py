"""Per-request graph: validated structures → neighbour graph → edge cache → force assembly.

Modules here import from ``so2kernels`` inside the functions that use it: importing that
package registers every Triton kernel, and the graph layer should not pay for that just to be
imported.
"""

from service.graph.assembly import ForcesVirial, assemble_forces_virial, stress_from_virial
from service.graph.edge_cache import EdgeCache, build_edge_cache
from service.graph.errors import InvalidStructureError
from service.graph.neighbors import Graph, build_graph, edge_vectors
from service.graph.radial import c3_envelope
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
    "build_edge_cache",
    "build_graph",
    "c3_envelope",
    "edge_quaternion",
    "edge_vectors",
    "quaternion_to_rotation",
    "stress_from_virial",
    "symbols_to_numbers",
    "wigner_d",
]
