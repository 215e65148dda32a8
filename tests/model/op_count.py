"""Count the aten operators of one energy+forces step, by phase and by model module.

Every op that reaches the dispatcher's Python mode is one kernel launch on the device (composite
ops such as ``linear`` are already decomposed there), so the counts are what the launch-bound
step costs. Forward ops are attributed to the innermost ``nn.Module`` running them; backward ops
to the ``so2serve::<phase>`` range they run in.

    python -m tests.model.op_count --config bar --atoms 192 --path reference
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

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


class OpCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts dispatched aten ops under the current ``(phase, module)`` label."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.label = "other"
        self.counts: collections.Counter[str] = collections.Counter()
        self.by_name: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.__name__.split(".")[0]
        if name not in _VIEW_OPS:
            self.counts[self.label] += 1
            self.by_name[f"{self.label} {name}"] += 1
        return func(*args, **(kwargs or {}))


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

    phases = ("build_graph", "edge_vectors", "build_edge_cache", "assemble_forces_virial")
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


def count_step_ops(potential: Potential, structures: Structures) -> OpCounter:
    """Counts of one ``predict(energy, forces)``: forward per module, backward and the rest."""
    counter = OpCounter()
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


def _summarise(counter: OpCounter, top: int) -> None:
    total = sum(counter.counts.values())
    fwd = sum(v for k, v in counter.counts.items() if k.startswith("forward"))
    bwd = sum(v for k, v in counter.counts.items() if k.startswith("backward"))
    print(f"total {total}  model forward {fwd}  backward {bwd}  other {total - fwd - bwd}")
    for label, n in counter.counts.most_common():
        print(f"{n:6d}  {label}")
    print("-- top ops")
    for label, n in counter.by_name.most_common(top):
        print(f"{n:6d}  {label}")


def main() -> None:
    from benchmarks.model import CONFIGS, water_box
    from tests.model.randomized import randomized_model

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="bar", choices=sorted(CONFIGS))
    parser.add_argument("--atoms", type=int, default=192)
    parser.add_argument("--path", default="reference", choices=("reference", "fused"))
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    potential = Potential(
        randomized_model(CONFIGS[args.config]()), device="cpu", path=args.path, memory="fast"
    )
    structures = water_box(args.atoms)
    potential.predict(structures, ("energy", "forces"))  # warm caches (packed weights, tables)
    _summarise(count_step_ops(potential, structures), args.top)


if __name__ == "__main__":
    main()
