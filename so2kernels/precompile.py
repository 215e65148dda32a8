"""Compile a known set of Triton kernels before their first launch, several at a time.

A fresh process compiles each Triton kernel at its first launch, one after the other on the
launching thread: a server's warm-up spends ~30 s there on an empty Triton cache (H200 host).
When the kernels a workload launches are known (recorded once on the same GPU model with the
same Triton version) they can be compiled up front on a few threads instead. About half of a
compile (LLVM, ptxas) runs outside the GIL, which makes that ~2x faster. Each compiled kernel
lands in its JIT function's in-process cache (and Triton's disk cache) under the key its launch
computes, so the launch finds it.

A record of a kernel whose source changed since is skipped, and one that fails to compile is
dropped: those kernels compile at their first launch as before. The source hash
(:func:`source_hash`) also covers the JIT functions a kernel calls and its line number, so an
edit above a kernel counts as a change. A record that still compiles but that no launch asks
for any more (its launcher changed, e.g. new tiles) only costs compile time: re-record after
such changes (``benchmarks/cold_start.py --scenarios record``). A gpu test checks that the
shipped sets cover the server's warm-up; a CPU test, that they name the current code's kernels.

Kernel sets live in ``so2kernels/tables/<gpu-slug>.kernels.json``, keyed by Triton version
(the recorded specialisations are in that version's format) and by a workload fingerprint
chosen by the caller::

    {"3.6.0": {"<fingerprint>": [{"kernel": "module:qualname", "spec": "<Triton's JSON>",
                                  "source": "<source_hash of the function>"}, ...]}}
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.runtime.jit import JITFunction

from so2kernels.tiles import TABLES_DIR, device_slug

__all__ = [
    "KernelSpec",
    "PreloadReport",
    "kernel_set_path",
    "load_kernel_set",
    "preload_kernels",
    "record_compiles",
    "save_kernel_set",
    "source_hash",
]

log = logging.getLogger("so2kernels.precompile")

KERNEL_PACKAGES = ("so2kernels", "service")
"""Top-level packages whose Triton kernels a kernel set may name."""


@cache
def source_hash(kernel: JITFunction[Any]) -> str:
    """sha256 of a kernel's source and first line, those of every JIT function it calls (through
    any depth), and the ``tl.constexpr`` globals they read.

    Not Triton's ``cache_key``: that one depends on what the process hashed before (a callee
    already hashed for another kernel lends its globals to the callers hashed after it; Triton
    3.6 and 3.7), so the same code got different keys on the GPU box and in CI.
    """
    sources: dict[str, str] = {}
    constants: dict[str, str] = {}
    pending = [kernel]
    while pending:
        fn = pending.pop()
        name = f"{fn.fn.__module__}:{fn.fn.__qualname__}"
        if name in sources:
            continue
        sources[name] = f"{fn.starting_line_number}\n{fn.src}"
        for ref, value in _global_references(fn):
            if isinstance(value, JITFunction):
                pending.append(value)
            elif isinstance(value, tl.constexpr):
                constants[f"{name}:{ref}"] = repr(value.value)
    text = json.dumps([sorted(sources.items()), sorted(constants.items())])
    return hashlib.sha256(text.encode()).hexdigest()


def _global_references(fn: JITFunction[Any]) -> Iterator[tuple[str, Any]]:
    """``(name, value)`` of each global a JIT function's body names, plain (``helper``) or as a
    module attribute (``ops.helper``)."""
    namespace = fn.fn.__globals__
    for node in ast.walk(ast.parse(fn.src)):
        if isinstance(node, ast.Name) and node.id in namespace:
            yield node.id, namespace[node.id]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            module = namespace.get(node.value.id)
            if isinstance(module, ModuleType) and hasattr(module, node.attr):
                yield f"{node.value.id}.{node.attr}", getattr(module, node.attr)


@dataclass(frozen=True)
class KernelSpec:
    """One compiled variant of a kernel: ``kernel`` is ``"module:qualname"`` of its
    ``@triton.jit`` function, ``spec`` Triton's serialised specialisation (JSON text), and
    ``source`` the function's :func:`source_hash` when it was recorded (empty: unknown), so that
    a record of a kernel changed since is not compiled for nothing."""

    kernel: str
    spec: str
    source: str = ""

    def resolve(self) -> JITFunction[Any]:
        """The JIT function itself; ``LookupError`` if the name no longer leads to one, or
        leads outside this project's packages (a record never imports anything else)."""
        module_name, _, qualname = self.kernel.partition(":")
        if module_name.partition(".")[0] not in KERNEL_PACKAGES:
            raise LookupError(f"{self.kernel} is not a kernel of {', '.join(KERNEL_PACKAGES)}")
        try:
            target: Any = importlib.import_module(module_name)
            for part in qualname.split("."):
                target = getattr(target, part)
        except (ImportError, AttributeError) as exc:
            raise LookupError(f"no kernel {self.kernel}") from exc
        if not isinstance(target, JITFunction):
            raise LookupError(f"{self.kernel} is not a Triton JIT function")
        if self.source and self.source != source_hash(target):
            raise LookupError(f"{self.kernel} changed since it was recorded")
        return target

    @cached_property
    def cache_key(self) -> str:
        """The in-process cache key the launch computes (recorded with the specialisation)."""
        return str(json.loads(self.spec)["key"])


@dataclass(frozen=True)
class PreloadReport:
    """What :func:`preload_kernels` did: kernels compiled (or loaded from Triton's disk cache),
    the names of those that failed (left to compile at their first launch), and the wall time."""

    compiled: int
    failed: tuple[str, ...]
    seconds: float


# Recording


@contextmanager
def record_compiles() -> Iterator[list[KernelSpec]]:
    """Collect every kernel variant this process compiles or loads inside the block, in order,
    without duplicates. Triton has one post-compile hook: an installed one keeps being called."""
    recorded: list[KernelSpec] = []
    seen: set[KernelSpec] = set()
    previous = knobs.runtime.jit_post_compile_hook

    def on_compile(*args: Any, **kwargs: Any) -> Any:
        jit = getattr(kwargs.get("fn"), "jit_function", None)
        data = (kwargs.get("compile") or {}).get("specialization_data")
        if isinstance(jit, JITFunction) and isinstance(data, str):
            name = f"{jit.fn.__module__}:{jit.fn.__qualname__}"
            spec = KernelSpec(name, data, source_hash(jit))
            if spec not in seen:
                seen.add(spec)
                recorded.append(spec)
        return None if previous is None else previous(*args, **kwargs)

    knobs.runtime.jit_post_compile_hook = on_compile
    try:
        yield recorded
    finally:
        knobs.runtime.jit_post_compile_hook = previous


# Preloading


def _default_workers() -> int:
    # About half of a compile holds the GIL (Triton's front end and MLIR passes), so past a few
    # threads more add memory, not speed (H200 host, 8 threads: 2.1x one at a time).
    return max(1, min(8, len(os.sched_getaffinity(0))))


def preload_kernels(
    specs: Sequence[KernelSpec], *, device: int | None = None, workers: int | None = None
) -> PreloadReport:
    """Compile ``specs`` for CUDA device ``device`` (default: the current one) on ``workers``
    threads (default: the CPUs this process may use, at most 8) and return when all are done.
    A variant already in the kernel's cache is left alone. Never raises for a spec: one that
    cannot be resolved or compiled is reported in ``failed`` and left to its first launch.

    Each thread runs Triton's own synchronous preload, which puts a kernel in the cache only
    once it has compiled: a launch elsewhere never meets a half-done or failed one."""
    start = time.perf_counter()
    index = torch.cuda.current_device() if device is None else device
    failed: list[str] = []
    present = 0
    jobs: list[tuple[KernelSpec, JITFunction[Any]]] = []
    for spec in specs:
        try:
            fn = spec.resolve()
            # The per-device cache is created on first use: here, not by several threads.
            cache = fn.device_caches[index][0]
        except Exception as exc:  # a stale or foreign record: its launch compiles it
            log.debug("not preloading %s: %s", spec.kernel, exc)
            failed.append(spec.kernel)
            continue
        if spec.cache_key in cache:
            present += 1
        else:
            jobs.append((spec, fn))

    def compile_one(job: tuple[KernelSpec, JITFunction[Any]]) -> bool:
        spec, fn = job
        try:
            with torch.cuda.device(index):
                fn.preload(spec.spec)
        except Exception as exc:
            log.debug("preloading %s failed: %s", spec.kernel, exc)
            return False
        return True

    with ThreadPoolExecutor(workers or _default_workers(), "triton-preload") as pool:
        done = list(pool.map(compile_one, jobs))
    failed += [spec.kernel for (spec, _), ok in zip(jobs, done, strict=True) if not ok]
    return PreloadReport(present + sum(done), tuple(failed), time.perf_counter() - start)


# Kernel-set files


def kernel_set_path(device_name: str) -> Path:
    """``so2kernels/tables/<gpu-slug>.kernels.json`` for a CUDA device name."""
    return TABLES_DIR / f"{device_slug(device_name)}.kernels.json"


def _read(path: Path) -> dict[str, dict[str, list[dict[str, str]]]]:
    if not path.is_file():
        return {}
    data: dict[str, dict[str, list[dict[str, str]]]] = json.loads(path.read_text())
    return data


def load_kernel_set(
    device_name: str, fingerprint: str, *, triton_version: str = triton.__version__
) -> list[KernelSpec]:
    """The kernels recorded for ``fingerprint`` on this GPU model with this Triton version;
    empty when none were (or the file is unreadable: preloading is an optimisation)."""
    try:
        entries = _read(kernel_set_path(device_name)).get(triton_version, {}).get(fingerprint, [])
        return [KernelSpec(e["kernel"], e["spec"], e.get("source", "")) for e in entries]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("ignoring the kernel set for %s: %s", device_name, exc)
        return []


def save_kernel_set(
    device_name: str,
    fingerprint: str,
    specs: Sequence[KernelSpec],
    *,
    triton_version: str = triton.__version__,
) -> Path:
    """Store ``specs`` for ``fingerprint`` (replacing an earlier record of it); returns the file."""
    path = kernel_set_path(device_name)
    data = _read(path)
    data.setdefault(triton_version, {})[fingerprint] = [
        {"kernel": s.kernel, "spec": s.spec, "source": s.source} for s in specs
    ]
    staged = path.with_suffix(".tmp")
    staged.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    staged.replace(path)  # readers never see half a file
    return path
