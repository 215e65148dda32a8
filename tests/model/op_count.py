"""Count the aten operators of one energy+forces step, by phase and by model module.

Every op that reaches the dispatcher's Python mode is about one kernel launch on the device
(composite ops such as ``linear`` are already decomposed there; a few ops launch two on CUDA,
e.g. ``select_backward`` = fill + copy), so the counts are what the launch-bound step costs.
Forward ops are attributed to the innermost ``nn.Module`` running them; backward ops to the
module or phase whose autograd node they run for. The CLI also estimates the bytes each op of
the model's glue moves at a larger size (``--scale-atoms``/``--scale-edges``: outputs written
plus inputs read, tensors scaled by their edge or node axis), to rank glue by memory traffic.

    python -m tests.model.op_count --config bar --atoms 192 --path fused
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import service.model.potential as potential_module
from service.graph.structures import Structures
from service.model.potential import Potential

# Shape/metadata ops that launch nothing on the device.
_VIEW_OPS = frozenset(
    {
        "view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t", "slice",
        "select", "unsqueeze", "squeeze", "as_strided", "alias", "detach", "split",
        "split_with_sizes", "unbind", "chunk", "narrow", "diagonal", "unflatten", "flatten",
        "_reshape_alias", "lift_fresh",
    }
)  # fmt: skip


PHASE_LABELS = (
    "build_graph", "place_and_build_graph", "place_and_build_graph_carrying", "edge_vectors",
    "build_edge_cache", "assemble_forces_virial",
)  # fmt: skip
"""Labels of the step's non-model phases (graph, edge cache, force assembly)."""

# Factories read no tensor data (only the metadata of their ``self`` argument).
_FACTORY_PREFIXES = ("new_", "empty", "zeros", "ones", "full", "scalar_tensor")


@dataclass(frozen=True)
class SizeScale:
    """Maps a tensor of the counted step to its byte size in a larger system: tensors with an
    edge axis (leading, or second as in focus-major ``(F, E, ROW)``) scale by the edge ratio,
    tensors with a node axis by the atom ratio, everything else (weights) stays."""

    n_edges: int
    n_nodes: int
    edge_ratio: float = 1.0
    node_ratio: float = 1.0

    def bytes(self, t: Any) -> float:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return 0.0
        size = float(t.numel() * t.element_size())
        if t.shape[0] == self.n_edges or (t.dim() > 1 and t.shape[1] == self.n_edges):
            return size * self.edge_ratio
        if t.shape[0] in (self.n_nodes, self.n_nodes + 1):
            return size * self.node_ratio
        return size


@dataclass(frozen=True)
class OpRecord:
    """One counted op: its label, aten name and the bytes it writes and reads (scaled)."""

    label: str
    name: str
    written: float
    read: float


class OpCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts dispatched aten ops under the current ``(phase, module)`` label; with a
    :class:`SizeScale` it also records each op's (scaled) bytes written and read."""

    def __init__(self, scale: SizeScale | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.label = "other"
        self.scale = scale
        self.counts: collections.Counter[str] = collections.Counter()
        self.by_name: collections.Counter[str] = collections.Counter()
        self.records: list[OpRecord] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if name not in _VIEW_OPS:
            self.counts[self.label] += 1
            self.by_name[f"{self.label} {name}"] += 1
            if self.scale is not None:
                self.records.append(self._record(name, args, kwargs, out))
        return out

    def _record(self, name: str, args: Any, kwargs: Any, out: Any) -> OpRecord:
        assert self.scale is not None
        outputs = out if isinstance(out, tuple | list) else (out,)
        written = sum(self.scale.bytes(t) for t in outputs)
        read = 0.0
        if not name.startswith(_FACTORY_PREFIXES):
            read = sum(self.scale.bytes(t) for t in tree_leaves((args, kwargs)))
        return OpRecord(self.label, name, written, read)


class BackwardLabeller(TorchFunctionMode):
    """Tags each autograd node created under a label so its backward ops count there too."""

    def __init__(self, counter: OpCounter) -> None:
        super().__init__()
        self.counter = counter
        self.tagged: set[int] = set()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        label = "backward " + self.counter.label.removeprefix("forward ")
        for t in out if isinstance(out, tuple | list) else (out,):
            node = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
            if node is not None and id(node) not in self.tagged:
                node.register_prehook(self._enter(label))
                self.tagged.add(id(node))
        return out

    def _enter(self, label: str) -> Any:
        def hook(_grads: Any) -> None:
            self.counter.label = label

        return hook


def _labelled_functions() -> list[tuple[Any, str]]:
    """``(namespace, name)`` of the functions whose ops get their own label: the non-model
    phases of ``predict`` and the so2kernels value-path references (one op each when fused)."""
    from importlib import import_module

    from service.model.layers import so2conv

    # Import by name: the package re-exports functions named like these submodules.
    rotate_mix = import_module("so2kernels.rotate_mix")
    mixing_stack = import_module("so2kernels.mixing_stack")

    # The graph phase is whichever builder the potential calls (a host one or the device one).
    phases = [n for n in PHASE_LABELS if hasattr(potential_module, n)]
    return [
        *((potential_module, n) for n in phases),
        (rotate_mix, "rotate_mix_reference"),
        (mixing_stack, "mixing_stack_reference"),
        (so2conv, "attention_aggregate_reference"),
    ]


@contextmanager
def _phase_labels(counter: OpCounter) -> Iterator[None]:
    """Label ops of :func:`_labelled_functions` by wrapping them in their namespaces."""
    targets = _labelled_functions()
    originals = [getattr(space, name) for space, name in targets]

    def labelled(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            previous, counter.label = counter.label, f"forward {name}"
            try:
                return fn(*args, **kwargs)
            finally:
                counter.label = previous

        return call

    for (space, name), fn in zip(targets, originals, strict=True):
        setattr(space, name, labelled(name, fn))
    try:
        yield
    finally:
        for (space, name), fn in zip(targets, originals, strict=True):
            setattr(space, name, fn)


@contextmanager
def _module_labels(model: nn.Module, counter: OpCounter) -> Iterator[None]:
    """Label forward ops with the innermost module's qualified name (a stack of hooks)."""
    stack: list[str] = []
    handles = []
    for qual, module in model.named_modules():
        name = qual or "model"

        def pre(_m: nn.Module, _a: Any, name: str = name) -> None:
            stack.append(counter.label)
            counter.label = f"forward {name}"

        def post(_m: nn.Module, _a: Any, _o: Any) -> None:
            counter.label = stack.pop()

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def count_step_ops(
    potential: Potential, structures: Structures, scale: SizeScale | None = None
) -> OpCounter:
    """Counts of one ``predict(energy, forces)``: forward per module, backward and the rest
    (and each op's bytes, scaled by ``scale``)."""
    counter = OpCounter(scale)
    original_grad = torch.autograd.grad

    def labelled_grad(*args: Any, **kwargs: Any) -> Any:
        previous, counter.label = counter.label, "backward"
        try:
            return original_grad(*args, **kwargs)
        finally:
            counter.label = previous

    torch.autograd.grad = labelled_grad
    try:
        with (
            _phase_labels(counter),
            _module_labels(potential.model, counter),
            BackwardLabeller(counter),
            counter,
        ):
            potential.predict(structures, ("energy", "forces"))
    finally:
        torch.autograd.grad = original_grad
    return counter


KERNEL_OPS = ("so2_", "segment_")
"""Name prefixes of the so2kernels ops (the value path), counted apart from the model's glue."""


def is_model_label(label: str, direction: str | None = None) -> bool:
    """Whether ``label`` is a model module's (``direction``: "forward"/"backward"/either): not a
    non-model phase, and for the backward attributed to a module (unattributed backward nodes
    belong to the edge cache)."""
    kind, _, where = label.partition(" ")
    if direction is not None and kind != direction:
        return False
    return kind in ("forward", "backward") and bool(where) and not where.startswith(PHASE_LABELS)


def model_ops(counter: OpCounter, direction: str) -> int:
    """Ops of the model's own modules in one direction (the non-model phases excluded)."""
    return sum(n for label, n in counter.counts.items() if is_model_label(label, direction))


def _summarise(counter: OpCounter, top: int) -> None:
    total = sum(counter.counts.values())
    fwd, bwd = model_ops(counter, "forward"), model_ops(counter, "backward")
    print(f"total {total}  model forward {fwd}  model backward {bwd}  rest {total - fwd - bwd}")
    glue = [
        r for r in counter.records if is_model_label(r.label) and not r.name.startswith(KERNEL_OPS)
    ]
    if glue:
        ops: collections.Counter[str] = collections.Counter(r.name for r in glue)
        gigabytes: dict[str, float] = collections.defaultdict(float)
        for r in glue:
            gigabytes[r.name] += (r.written + r.read) / 1e9
        total_gb = sum(gigabytes.values())
        print(f"-- model glue (so2kernels ops excluded): {len(glue)} ops, {total_gb:.1f} GB moved")
        for name, n in ops.most_common():
            print(f"{n:6d}  {gigabytes[name]:8.2f} GB  {name}")
    print("-- by label")
    for label, n in counter.counts.most_common():
        print(f"{n:6d}  {label}")
    print("-- top ops")
    for label, n in counter.by_name.most_common(top):
        print(f"{n:6d}  {label}")


def main() -> None:
    from benchmarks.model import CONFIGS, water_box
    from service.graph.neighbors import build_graph
    from tests.model.randomized import randomized_model

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="bar", choices=sorted(CONFIGS))
    parser.add_argument("--atoms", type=int, default=192)
    parser.add_argument("--path", default="reference", choices=("reference", "fused"))
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--scale-atoms", type=int, default=12_288, help="bytes estimated at")
    parser.add_argument("--scale-edges", type=float, default=1.05e6, help="edges there")
    args = parser.parse_args()
    potential = Potential(
        randomized_model(CONFIGS[args.config]()), device="cpu", path=args.path, memory="fast"
    )
    structures = water_box(args.atoms)
    potential.predict(structures, ("energy", "forces"))  # warm caches (packed weights, tables)
    graph = build_graph(structures, potential.config.rcut)
    scale = SizeScale(
        graph.n_edges, graph.n_atoms, args.scale_edges / graph.n_edges,
        args.scale_atoms / graph.n_atoms,
    )  # fmt: skip
    _summarise(count_step_ops(potential, structures, scale), args.top)


if __name__ == "__main__":
    main()
