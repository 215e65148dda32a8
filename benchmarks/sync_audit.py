"""Audit one energy+force step for host synchronisations and host→device uploads.

The step is the device part of ``Potential.predict`` (what a CUDA graph records): edge vectors →
``build_edge_cache`` → ``DPA4Model`` (fused and reference paths) → per-structure energy
``index_add`` → ``autograd.grad`` → ``assemble_forces_virial``. The graph is built first and the
step runs a few times to warm up (Triton compilation, cached device constants, packed weights);
then one more step runs under two detectors:

* CUDA only: ``torch.cuda.set_sync_debug_mode("warn")``; every synchronising CUDA call warns, and
  the warning hook records the Python stack.
* Any device: a dispatch mode that records the ops which force a host round trip on CUDA:
  tensors made from host data (``torch.tensor``, ``from_numpy``, Python-list indices: each an
  upload), scalar reads (``.item()``, ``int()``, ``bool()``), and data-dependent output shapes
  (``nonzero``, ``masked_select``, ``unique``, ``bincount``, ``repeat_interleave`` without
  ``output_size``). On CPU this finds the same sites without a GPU (ops issued by the Triton
  interpreter itself are ignored).

Every event is printed with its stack filtered to this repository's files; the exit code is 1 if
any event occurred. The lead runs it on the GPU:

    python benchmarks/sync_audit.py                 # default model + bar config, 192 atoms, CUDA
    TRITON_INTERPRET=1 python benchmarks/sync_audit.py --device cpu --configs default
"""

from __future__ import annotations

import argparse
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from service.graph.assembly import assemble_forces_virial  # noqa: E402
from service.graph.edge_cache import build_edge_cache  # noqa: E402
from service.graph.neighbors import Graph, build_graph, edge_vectors  # noqa: E402
from service.graph.structures import Structures  # noqa: E402
from service.model.dpa4 import DPA4Model  # noqa: E402

HOST_ROUND_TRIP_OPS = frozenset(
    {
        "aten::lift_fresh",
        "aten::_local_scalar_dense",
        "aten::nonzero",
        "aten::masked_select",
        "aten::_unique2",
        "aten::unique_dim",
        "aten::unique_consecutive",
        "aten::bincount",
        "aten::_assert_async",
    }
)
"""Ops that read device data on the host, or upload host data, on a CUDA tensor."""


@dataclass
class AuditEvent:
    """One sync or upload: what happened and the repository frames that led to it."""

    kind: str
    stack: list[str]


@dataclass
class AuditLog:
    events: list[AuditEvent] = field(default_factory=list)

    def record(self, kind: str) -> None:
        frames = _repo_frames()
        if frames is not None:
            self.events.append(AuditEvent(kind, frames))


def _frame_owner(filename: str) -> str:
    """``repo`` (our code), ``library`` (Triton, NumPy, ...) or ``skip`` (torch, the standard
    library, this script): who issued an op is the innermost frame that is not ``skip``."""
    parts = Path(filename).parts
    if "site-packages" in parts:
        return "skip" if "torch" in parts else "library"
    if filename == __file__ or not filename.startswith(str(ROOT)):
        return "skip"
    return "repo"


def _repo_frames() -> list[str] | None:
    """The stack's repository frames (outermost first), or None when the op was issued by a
    library (e.g. the Triton interpreter copying arguments), which a CUDA step never runs."""
    stack = traceback.extract_stack()
    owners = [_frame_owner(f.filename) for f in stack]
    issuer = next((o for o in reversed(owners) if o != "skip"), None)
    if issuer != "repo":
        return None
    return [
        f"{Path(f.filename).relative_to(ROOT)}:{f.lineno} {f.name}: {f.line}"
        for f, owner in zip(stack, owners, strict=True)
        if owner == "repo"
    ]


def _is_round_trip(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    name = func._schema.name
    if name in HOST_ROUND_TRIP_OPS:
        return True
    if name == "aten::repeat_interleave" and func._overloadname == "Tensor":
        return kwargs.get("output_size", args[1] if len(args) > 1 else None) is None
    if name in ("aten::index", "aten::index_put", "aten::index_put_"):
        # Boolean-mask indexing has a data-dependent shape (a nonzero underneath).
        indices = args[1] if len(args) > 1 else []
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)
    return False


class _RoundTripMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, log: AuditLog):
        super().__init__()  # type: ignore[no-untyped-call]
        self.log = log

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if _is_round_trip(func, args, kwargs):
            self.log.record(func._schema.name)
        return func(*args, **kwargs)


@contextmanager
def audited(device: torch.device) -> Iterator[AuditLog]:
    """Record every host round trip issued inside the block (see the module docstring)."""
    log = AuditLog()
    previous_hook = warnings.showwarning

    def hook(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
        # set_sync_debug_mode's own one-time notice ("... is a prototype feature ...") is not a
        # synchronisation; the per-call warnings say "called a synchronizing CUDA operation".
        if "synchroniz" in str(message) and "prototype feature" not in str(message):
            log.record(f"cuda sync: {str(message).splitlines()[0]}")
        else:
            previous_hook(message, category, *args, **kwargs)

    warnings.showwarning = hook
    cuda = device.type == "cuda"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = hook
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.set_sync_debug_mode("warn")
            with _RoundTripMode(log):
                yield log
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = previous_hook


def energy_force_step(
    model: DPA4Model, graph: Graph, structures: Structures, types: torch.Tensor, *, fused: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(energy (B,), forces (N, 3), virial (B, 3, 3))``: the device part of one evaluation."""
    cfg = model.config
    dtype = next(model.parameters()).dtype
    with torch.enable_grad():
        edge_vec = edge_vectors(graph, structures.positions, structures.cells)
        edge_vec = edge_vec.detach().requires_grad_(True)
        cache = build_edge_cache(
            graph, edge_vec, rcut=cfg.rcut, lmax=cfg.lmax, env_exponents=cfg.env_exponents,
            deg_floor=cfg.degree_norm_floor, eps=cfg.eps, dtype=dtype,
        )  # fmt: skip
        atom_energy = model(types, cache, fused=fused, live_weights=False)
        energy = atom_energy.new_zeros(graph.n_structures).index_add(
            0, graph.atom_batch, atom_energy
        )
        (edge_grad,) = torch.autograd.grad(energy.sum(), edge_vec)
    assembled = assemble_forces_virial(
        graph, edge_grad.double(), edge_vec.detach().double(), atom_virial=False
    )
    return energy.detach(), assembled.forces, assembled.virial


def audit_step(
    model: DPA4Model,
    structures: Structures,
    types: torch.Tensor,
    device: torch.device,
    *,
    fused: bool,
    warmup: int = 2,
) -> AuditLog:
    """Build the graph, warm the step up ``warmup`` times, audit one more step."""
    structures = structures.to(device)
    graph = build_graph(structures, model.config.rcut)
    types = types.to(device)
    run: Callable[[], Any] = lambda: energy_force_step(  # noqa: E731
        model, graph, structures, types, fused=fused
    )
    for _ in range(warmup):
        run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    with audited(device) as log:
        run()
    return log


def _models(names: list[str], device: torch.device) -> Iterator[tuple[str, DPA4Model, Any]]:
    from benchmarks.model import CONFIGS
    from service.model.potential import load_potential
    from tests.model.randomized import randomized_model

    for name in names:
        if name == "default":
            potential = load_potential(None, device=device, capture=False)
            yield name, potential.model, potential
        else:
            yield name, randomized_model(CONFIGS[name]()).to(device).eval(), None


def _water(n_atoms: int) -> Structures:
    """The benchmark water box; below one frame (192 atoms, e.g. for the CPU interpreter) the
    first ``n_atoms`` atoms of the frame in its own cell."""
    from benchmarks.model import water_box, water_frame
    from service.graph.structures import StructureArrays

    if n_atoms >= 192:
        return water_box(n_atoms)
    numbers, positions, cell = water_frame()
    arrays = StructureArrays(
        numbers=numbers[:n_atoms], positions=positions[:n_atoms], cell=cell, pbc=(True,) * 3
    )
    return Structures.from_arrays([arrays])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--configs", nargs="+", default=["default", "bar"])
    parser.add_argument("--paths", nargs="+", default=["fused", "reference"])
    parser.add_argument("--atoms", type=int, default=192)
    args = parser.parse_args()
    from service.model.potential import Potential

    device = torch.device(args.device)
    structures = _water(args.atoms)
    total = 0
    for name, model, potential in _models(args.configs, device):
        pot = potential or Potential(model, device=device, path="reference", capture=False)
        types = pot.atom_types(structures)
        for path in args.paths:
            log = audit_step(model, structures, types, device, fused=path == "fused")
            print(f"== {name} / {path}: {len(log.events)} host round trips")
            for event in log.events:
                print(f"  [{event.kind}]")
                for frame in event.stack[-6:]:
                    print(f"      {frame}")
            total += len(log.events)
    print(f"TOTAL {total} host round trips after warm-up")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
