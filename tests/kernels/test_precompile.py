"""Recorded kernel sets (``so2kernels.precompile``): recording, the per-GPU files, resolving.

Compiling a recorded set needs a CUDA driver: that half is tested on the GPU
(``tests/service/test_warm_up.py``), where a server's warm-up preloads its kernels. Whether the
shipped sets still name this code's kernels is tested here.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from triton import knobs
from triton.runtime.jit import JITFunction

from so2kernels import precompile
from so2kernels.precompile import (
    KernelSpec,
    kernel_set_path,
    load_kernel_set,
    preload_kernels,
    record_compiles,
    save_kernel_set,
    source_hash,
)
from so2kernels.tiles import TABLES_DIR
from tests.offline_compile import REPO, run_without_interpreter

DEVICE = "NVIDIA H200"


@pytest.fixture
def tables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(precompile, "TABLES_DIR", tmp_path)
    return tmp_path


def _spec(name: str, key: str = "k") -> KernelSpec:
    return KernelSpec(f"tests.kernels.test_precompile:{name}", json.dumps({"key": key}))


def _kernel_body(x_ptr: Any) -> None:  # a function to wrap in a JITFunction by hand
    pass


_jit_kernel = JITFunction(_kernel_body)


def test_kernel_sets_round_trip_per_triton_version_and_fingerprint(tables: Path) -> None:
    first, second = [_spec("a", "1"), _spec("b", "2")], [_spec("c", "3")]
    path = save_kernel_set(DEVICE, "model-a", first, triton_version="3.6.0")
    save_kernel_set(DEVICE, "model-b", second, triton_version="3.6.0")
    save_kernel_set(DEVICE, "model-a", second, triton_version="3.7.1")
    assert path == kernel_set_path(DEVICE) == tables / "nvidia_h200.kernels.json"
    assert load_kernel_set(DEVICE, "model-a", triton_version="3.6.0") == first
    assert load_kernel_set(DEVICE, "model-b", triton_version="3.6.0") == second
    assert load_kernel_set(DEVICE, "model-a", triton_version="3.7.1") == second
    # Another Triton's records, another model, another GPU: nothing to preload.
    assert load_kernel_set(DEVICE, "model-a", triton_version="3.5.0") == []
    assert load_kernel_set(DEVICE, "model-c", triton_version="3.6.0") == []
    assert load_kernel_set("NVIDIA A100-SXM4-80GB", "model-a", triton_version="3.6.0") == []
    # A new record of a fingerprint replaces the old one.
    save_kernel_set(DEVICE, "model-a", second, triton_version="3.6.0")
    assert load_kernel_set(DEVICE, "model-a", triton_version="3.6.0") == second


def test_an_unreadable_kernel_set_is_ignored_with_a_warning(
    tables: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kernel_set_path(DEVICE).write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="so2kernels.precompile"):
        assert load_kernel_set(DEVICE, "model-a") == []
    assert "ignoring the kernel set" in caplog.text
    kernel_set_path(DEVICE).write_text(json.dumps({"3.6.0": {"model-a": [{"spec": "{}"}]}}))
    assert load_kernel_set(DEVICE, "model-a", triton_version="3.6.0") == []


def test_specs_resolve_only_to_jit_functions() -> None:
    with pytest.raises(LookupError, match="no kernel"):
        KernelSpec("so2kernels.no_such_module:kernel", "{}").resolve()
    with pytest.raises(LookupError, match="no kernel"):
        KernelSpec("so2kernels.precompile:no_such_kernel", "{}").resolve()
    with pytest.raises(LookupError, match="not a kernel of so2kernels, service"):
        KernelSpec("os:system", "{}").resolve()
    with pytest.raises(LookupError, match="not a Triton JIT function"):
        KernelSpec("so2kernels.precompile:load_kernel_set", "{}").resolve()
    assert _spec("x", key="abc").cache_key == "abc"


def test_recording_collects_each_variant_once_and_keeps_an_installed_hook() -> None:
    jit = JITFunction(_kernel_body)
    earlier: list[str] = []
    previous = knobs.runtime.jit_post_compile_hook

    def installed(*_: Any, **kwargs: Any) -> None:
        earlier.append(kwargs["compile"]["specialization_data"])

    def compiled(data: str) -> None:
        hook = knobs.runtime.jit_post_compile_hook
        assert hook is not None
        hook(key="k", fn=SimpleNamespace(jit_function=jit),
             compile={"key": "k", "specialization_data": data})  # fmt: skip

    knobs.runtime.jit_post_compile_hook = installed
    try:
        with record_compiles() as recorded:
            compiled('{"key": "one"}')
            compiled('{"key": "two"}')
            compiled('{"key": "one"}')  # the same variant again (a second device, a reload)
        assert knobs.runtime.jit_post_compile_hook is installed
    finally:
        knobs.runtime.jit_post_compile_hook = previous
    name, source = f"{_kernel_body.__module__}:_kernel_body", source_hash(jit)
    assert recorded == [
        KernelSpec(name, '{"key": "one"}', source),
        KernelSpec(name, '{"key": "two"}', source),
    ]
    assert len(earlier) == 3


def test_recording_ignores_hook_calls_without_a_specialisation() -> None:
    with record_compiles() as recorded:
        hook = knobs.runtime.jit_post_compile_hook
        assert hook is not None
        hook(key="k", fn=SimpleNamespace(name="not a JIT function"), compile={})
        hook(key="k", fn=SimpleNamespace(jit_function=JITFunction(_kernel_body)), compile={})
    assert recorded == []


def test_a_record_of_a_kernel_changed_since_does_not_resolve(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(precompile, "KERNEL_PACKAGES", (__name__.partition(".")[0],))
    name = f"{__name__}:_jit_kernel"
    assert KernelSpec(name, "{}").resolve() is _jit_kernel  # recorded without a source hash
    assert KernelSpec(name, "{}", source_hash(_jit_kernel)).resolve() is _jit_kernel
    with pytest.raises(LookupError, match="changed since it was recorded"):
        KernelSpec(name, "{}", "0" * 64).resolve()


class _FakeKernel:
    """The surface of a JIT function that preloading touches: per-device caches, preload."""

    def __init__(self, failing: set[str]) -> None:
        self.device_caches: defaultdict[int, tuple[dict[str, object], None]] = defaultdict(
            lambda: ({}, None)
        )
        self.failing = failing

    def preload(self, data: str) -> None:
        key = json.loads(data)["key"]
        if key in self.failing:
            raise RuntimeError(f"{key} does not compile")
        self.device_caches[1][0][key] = f"kernel {key}"  # as Triton's does, on success only


def test_preloading_compiles_what_is_missing_and_reports_what_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kernel = _FakeKernel(failing={"broken"})
    kernel.device_caches[1][0]["loaded"] = "kernel loaded"

    def resolve(spec: KernelSpec) -> _FakeKernel:
        if spec.kernel.endswith("gone"):
            raise LookupError(f"no kernel {spec.kernel}")
        return kernel

    monkeypatch.setattr(KernelSpec, "resolve", resolve)
    monkeypatch.setattr(torch.cuda, "device", lambda *_: contextlib.nullcontext())
    specs = [_spec("a", "new"), _spec("b", "loaded"), _spec("c", "broken"), _spec("gone", "x")]
    report = preload_kernels(specs, device=1, workers=2)
    assert report.compiled == 2  # "new" now, "loaded" already there
    assert sorted(report.failed) == sorted([specs[2].kernel, specs[3].kernel])
    assert kernel.device_caches[1][0] == {"loaded": "kernel loaded", "new": "kernel new"}
    assert report.seconds >= 0.0


# The shipped sets against this code. A kernel-set record names its kernel by source_hash, which
# also covers the JIT functions it calls and its line number: editing a kernel, or any line above
# it, leaves the record unused (that kernel compiles at its launch again, and the GPU test of the
# warm-up fails). The hash is the code's alone (no Triton version, no process history), so CI
# checks the records of every Triton version against the code it runs.

_HASHES = """
import json
from so2kernels.precompile import KernelSpec, source_hash
names = json.loads({names!r})
print(json.dumps({{n: source_hash(KernelSpec(n, "{{}}").resolve()) for n in names}}))
"""


def shipped_records() -> dict[str, dict[str, str]]:
    """``{"<triton version> <module:qualname>": hash}`` of every shipped kernel-set record."""
    records: dict[str, str] = {}
    for path in TABLES_DIR.glob("*.kernels.json"):
        for version, sets in json.loads(path.read_text()).items():
            for entries in sets.values():
                records.update({f"{version} {e['kernel']}": e["source"] for e in entries})
    return records


def current_kernel_hashes(names: list[str]) -> dict[str, str]:
    """``source_hash`` of each named kernel in this code (computed outside the interpreter,
    which has no JIT functions)."""
    script = _HASHES.format(names=json.dumps(names))
    hashes: dict[str, str] = json.loads(run_without_interpreter(script).strip().splitlines()[-1])
    return hashes


def test_the_shipped_kernel_sets_name_this_code() -> None:
    recorded = shipped_records()
    assert recorded, f"no kernel sets shipped in {TABLES_DIR.relative_to(REPO)}"
    hashes = current_kernel_hashes(sorted({key.split()[1] for key in recorded}))
    moved = sorted(key for key, source in recorded.items() if hashes[key.split()[1]] != source)
    assert not moved, (
        f"changed since the shipped kernel sets were recorded: {moved}. Keep the kernel's source "
        "and line, or re-record the sets on the GPU (benchmarks/cold_start.py --scenarios record)"
    )
