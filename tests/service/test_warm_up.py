"""The server's warm-up pass covers what the first requests would otherwise compile.

On the CPU: the warm-up evaluates a periodic cell smaller than the cutoff and a structure without
a cell, for every property. On the GPU (``gpu`` marker): in a fresh interpreter, after
``Worker.warm_up``, requests of other sizes and kinds (a molecule, a liquid-like box, a batch,
odd atom counts, a box past graph replay's limit) miss no Triton kernel cache: no request pays a
compilation, in either precision tier. And the kernels a warm-up records, compiled up front on a
fresh Triton cache (``so2kernels.precompile``), leave the warm-up's own passes nothing to
compile (nor the in-process calculator's first step); a recorded kernel that fails to compile
is compiled again at its launch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from service.engine import ServiceMetrics, Worker
from service.engine.kernel_sets import kernel_set_fingerprint, preload_recorded_kernels
from service.graph.structures import Structures
from tests.service.fakes import REPO, FakeExecution, PairPotential


@dataclass
class RecordingPotential(PairPotential):
    seen: list[tuple[bool, frozenset[str]]] = field(default_factory=list)

    def predict(self, structures: Structures, properties: Collection[str]) -> object:
        periodic = bool(structures.pbc.any())
        self.seen.append((periodic, frozenset(properties)))
        return super().predict(structures, properties)


def test_warm_up_covers_periodic_images_and_cell_less_structures() -> None:
    potential = RecordingPotential(rcut=6.0, elements=("H", "O"))
    Worker(potential, ServiceMetrics()).warm_up([1, 8])
    assert [periodic for periodic, _ in potential.seen] == [True, False]
    for _, properties in potential.seen:
        assert {"energy", "forces", "stress", "energies"} <= properties


def test_kernel_set_fingerprint_follows_architecture_and_execution_only() -> None:
    info = {
        "name": "water", "sha256": "ab", "elements": ["H", "O"], "rcut": 6.0,
        "config": {"lmax": 2, "focus_dim": 128}, "n_parameters": 10,
        "execution": {"path": "fused", "precision": "fp32", "device": "cuda:0",
                      "memory": "fast", "cuda_graphs": True},
    }  # fmt: skip
    key = kernel_set_fingerprint(info)
    retrained = {**info, "name": "other", "sha256": "cd", "n_parameters": 11}
    second_gpu = {**info, "execution": {**info["execution"], "device": "cuda:1"}}
    assert kernel_set_fingerprint(retrained) == kernel_set_fingerprint(second_gpu) == key
    fast = {**info, "execution": {**info["execution"], "precision": "fp16x3"}}
    wider = {**info, "config": {"lmax": 3, "focus_dim": 128}}
    assert len({key, kernel_set_fingerprint(fast), kernel_set_fingerprint(wider)}) == 3


def test_nothing_is_preloaded_off_cuda() -> None:
    assert preload_recorded_kernels(PairPotential(rcut=6.0, elements=("H", "O"))) is None


def _run_fresh(script: str, *args: str, triton_cache: Path | None = None) -> Any:
    """Run ``script`` in a fresh interpreter (with its own ``TRITON_CACHE_DIR`` if given) and
    return the JSON of its last stdout line."""
    env = dict(os.environ)
    if triton_cache is not None:
        env["TRITON_CACHE_DIR"] = str(triton_cache)
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


_FIRST_REQUESTS = r"""
import json, sys
import numpy as np
from triton import knobs
from service.engine import ServiceMetrics, Worker
from service.engine.evaluator import model_elements
from service.graph.structures import StructureArrays, Structures
from service.model.potential import load_potentials

(potential,) = load_potentials(None, devices="cuda:0", precision=sys.argv[1])
worker = Worker(potential, ServiceMetrics())
worker.warm_up(model_elements(potential.info()))
misses = []
knobs.runtime.jit_cache_hook = lambda *a, **kw: misses.append(str(kw.get("repr"))[:300]) and False

def lattice(shape, periodic, seed, drop=0):
    # Water-like density (0.1 atoms/Å³), jittered so no two structures are alike.
    grid = np.stack(np.meshgrid(*(np.arange(n) for n in shape), indexing="ij"), -1)
    pos = 2.15 * grid.reshape(-1, 3).astype(float)
    pos += np.random.default_rng(seed).normal(scale=0.05, size=pos.shape)
    pos = pos[: len(pos) - drop]
    numbers = [8 if k % 3 == 0 else 1 for k in range(len(pos))]
    cell = 2.15 * np.diag(shape).astype(float) if periodic else None
    return StructureArrays(numbers=numbers, positions=pos, cell=cell, pbc=None)

requests = {
    "molecule of 21 atoms": [lattice((3, 7, 1), False, 1)],
    "box of 192 atoms": [lattice((4, 6, 8), True, 2)],
    "batch of 5 boxes": [lattice((4, 4, 4), True, 3 + k) for k in range(5)],
    "box of 1,535 atoms": [lattice((12, 12, 11), True, 9, drop=49)],
    "box of 4,913 atoms (no replay)": [lattice((17, 17, 17), True, 10)],
}
report = {}
for name, items in requests.items():
    out = worker.run([Structures.from_arrays(items)], frozenset(("energy", "forces", "stress")))
    assert not out.failures, out.failures
    report[name] = list(misses)
    misses.clear()
print(json.dumps(report))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "fp16x3"])
def test_first_requests_after_warm_up_compile_nothing(precision: str) -> None:
    if torch.cuda.device_count() == 0:  # pragma: no cover - skipped by the marker
        pytest.skip("needs CUDA")
    report = _run_fresh(_FIRST_REQUESTS, precision)
    compiled = {name: kernels for name, kernels in report.items() if kernels}
    assert not compiled, json.dumps(compiled, indent=1)


_RECORD = r"""
import json, sys
from pathlib import Path
from so2kernels import precompile
from service.engine import ServiceMetrics, Worker
from service.engine.evaluator import model_elements
from service.engine.kernel_sets import kernel_set_fingerprint
from service.model.potential import load_potentials

precompile.TABLES_DIR = Path(sys.argv[1])
(potential,) = load_potentials(None, devices="cuda:0", precision=sys.argv[2])
fingerprint = kernel_set_fingerprint(potential.info())
with precompile.record_compiles() as recorded:
    Worker(potential, ServiceMetrics()).warm_up(model_elements(potential.info()), preload=False)
import torch
name = torch.cuda.get_device_name(0)
specs = list(recorded)

def sized(value):
    return isinstance(value, int) and not isinstance(value, bool) and value > 1

# One record corrupted: its key is a real launch's, but the constants it compiles with are not.
k = next(k for k, s in enumerate(specs) if any(map(sized, json.loads(s.spec)["constant_vals"])))
broken = json.loads(specs[k].spec)
broken["constant_vals"] = ["bogus" if sized(v) else v for v in broken["constant_vals"]]
specs[k] = precompile.KernelSpec(specs[k].kernel, json.dumps(broken))
precompile.save_kernel_set(name, fingerprint, specs)
print(json.dumps({"recorded": len(specs), "broken": specs[k].kernel}))
"""

_PRELOAD = r"""
import json, sys
from pathlib import Path
from triton import knobs
from so2kernels import precompile
from service.engine import ServiceMetrics, Worker
from service.engine.evaluator import model_elements
from service.engine.kernel_sets import kernel_set_fingerprint
from service.model.potential import load_potentials
import torch

precompile.TABLES_DIR = Path(sys.argv[1])
(potential,) = load_potentials(None, devices="cuda:0", precision=sys.argv[2])
specs = precompile.load_kernel_set(torch.cuda.get_device_name(0),
                                   kernel_set_fingerprint(potential.info()))
report = precompile.preload_kernels(specs)
misses = []
knobs.runtime.jit_cache_hook = lambda *a, **kw: misses.append(kw["fn"].name) and False
Worker(potential, ServiceMetrics()).warm_up(model_elements(potential.info()), preload=False)
print(json.dumps({"specs": len(specs), "compiled": report.compiled,
                  "failed": list(report.failed), "seconds": report.seconds, "misses": misses}))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "fp16x3"])
def test_recorded_kernels_compile_before_the_warm_up_needs_them(
    precision: str, tmp_path: Path
) -> None:
    if torch.cuda.device_count() == 0:  # pragma: no cover - skipped by the marker
        pytest.skip("needs CUDA")

    recorded = _run_fresh(_RECORD, str(tmp_path), precision, triton_cache=tmp_path / "cache-0")
    assert recorded["recorded"] >= 10
    preloaded = _run_fresh(_PRELOAD, str(tmp_path), precision, triton_cache=tmp_path / "cache-1")
    assert preloaded["specs"] == recorded["recorded"]
    assert preloaded["failed"] == [recorded["broken"]]
    assert preloaded["compiled"] == recorded["recorded"] - 1
    # Only the kernel whose record was broken compiles in the passes, at its launch.
    assert [name.split(".")[-1] for name in preloaded["misses"]] == [
        recorded["broken"].split(":")[-1]
    ]


_LOCAL_CALCULATOR = r"""
import json
import numpy as np
from ase import Atoms
from triton import knobs
from clients import SO2LocalCalculator

calc = SO2LocalCalculator(None, device="cuda:0")
misses = []
knobs.runtime.jit_cache_hook = lambda *a, **kw: misses.append(kw["fn"].name) and False
grid = np.stack(np.meshgrid(*(np.arange(3),) * 3, indexing="ij"), -1).reshape(-1, 3)
atoms = Atoms(numbers=[8, 1, 1] * 9, positions=2.2 * grid + 0.03 * np.arange(27)[:, None],
              cell=6.6 * np.eye(3), pbc=True)
atoms.calc = calc
atoms.get_forces()
print(json.dumps({"misses": misses}))
"""


@pytest.mark.gpu
def test_local_calculator_compiles_its_kernels_before_the_first_step(tmp_path: Path) -> None:
    """On an empty Triton cache the in-process calculator's constructor compiles the shipped
    model's recorded kernel set; its first calculation then compiles nothing."""
    if torch.cuda.device_count() == 0:  # pragma: no cover - skipped by the marker
        pytest.skip("needs CUDA")
    report = _run_fresh(_LOCAL_CALCULATOR, triton_cache=tmp_path / "triton-cache")
    assert report == {"misses": []}


def test_a_failing_preload_leaves_the_kernels_to_their_launch(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Preloading is an optimisation: whatever goes wrong in it, the warm-up goes on."""
    from service.engine import kernel_sets
    from so2kernels.precompile import KernelSpec

    def broken(*_: Any, **__: Any) -> None:
        raise RuntimeError("a Triton without the preload machinery")

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H200")
    monkeypatch.setattr(
        kernel_sets, "load_kernel_set", lambda *_: [KernelSpec("so2kernels:k", "{}")]
    )
    monkeypatch.setattr(kernel_sets, "preload_kernels", broken)
    on_gpu = PairPotential(rcut=6.0, elements=("H", "O"), execution=FakeExecution(device="cuda:0"))
    with caplog.at_level("WARNING", logger="so2serve.kernels"):
        assert kernel_sets.preload_recorded_kernels(on_gpu) is None
    assert "could not preload the recorded kernels" in caplog.text


def test_warm_up_preloads_unless_told_not_to(monkeypatch: pytest.MonkeyPatch) -> None:
    from service.engine import worker as worker_module

    calls: list[object] = []
    monkeypatch.setattr(worker_module, "preload_recorded_kernels", calls.append)
    potential = PairPotential(rcut=6.0, elements=("H", "O"))
    worker = Worker(potential, ServiceMetrics())
    worker.warm_up([1, 8], preload=False)
    assert calls == []
    worker.warm_up([1, 8])
    assert calls == [potential]


def test_the_local_calculator_preloads_the_models_it_loads_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from clients import local

    calls: list[object] = []
    monkeypatch.setattr(local, "preload_recorded_kernels", calls.append)
    local.SO2LocalCalculator(PairPotential(rcut=6.0, elements=("H", "O")))
    assert calls == []  # a potential the caller loaded is the caller's business
    calc = local.SO2LocalCalculator(None, device="cpu")
    assert calls == [calc.potential]


@pytest.mark.parametrize("precision", ["fp32", "fp16x3"])
def test_the_shipped_kernel_sets_match_the_shipped_model(precision: str) -> None:
    """The recorded sets are found by the fingerprint a server computes for the shipped model
    on a GPU: a change of the model's config (or of the fingerprint) must come with a new
    record (``benchmarks/cold_start.py --scenarios record``)."""
    from service.model.potential import load_potential
    from so2kernels.precompile import kernel_set_path

    info = load_potential(None, device="cpu", path="reference").info()
    on_gpu = {"path": "fused", "precision": precision, "device": "cuda:0", "memory": "auto",
              "cuda_graphs": True}  # fmt: skip
    recorded = json.loads(kernel_set_path("NVIDIA H200").read_text())["3.6.0"]
    assert kernel_set_fingerprint({**info, "execution": on_gpu}) in recorded


_SHIPPED = r"""
import json, sys
from triton import knobs
from service.engine import ServiceMetrics, Worker
from service.engine.evaluator import model_elements
from service.engine.kernel_sets import preload_recorded_kernels
from service.model.potential import load_potentials

(potential,) = load_potentials(None, devices="cuda:0", precision=sys.argv[1])
report = preload_recorded_kernels(potential)
misses = []
knobs.runtime.jit_cache_hook = lambda *a, **kw: misses.append(kw["fn"].name) and False
Worker(potential, ServiceMetrics()).warm_up(model_elements(potential.info()), preload=False)
print(json.dumps({"compiled": report and report.compiled, "failed": report and report.failed,
                  "misses": misses}))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "fp16x3"])
def test_the_shipped_kernel_sets_cover_the_warm_up(precision: str, tmp_path: Path) -> None:
    """On this GPU, a fresh Triton cache and the shipped model: every recorded kernel compiles,
    and the warm-up's passes then compile nothing (a set gone stale after a launcher change,
    e.g. new tiles, fails here). Only meaningful where a set is recorded for this GPU."""
    if torch.cuda.device_count() == 0:  # pragma: no cover - skipped by the marker
        pytest.skip("needs CUDA")
    result = _run_fresh(_SHIPPED, precision, triton_cache=tmp_path / "triton-cache")
    if result["compiled"] is None:
        pytest.skip(f"no kernel set recorded for {torch.cuda.get_device_name()}")
    assert result["failed"] == []
    assert result["compiled"] >= 10
    assert result["misses"] == []
