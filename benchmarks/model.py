"""GPU benchmark of the DPA4 model: energy + forces (+ stress) per step on water boxes.

Cases are ``config:size,size,...`` (configs ``small``, ``medium`` and DeePMD's ``bar``); the
default covers bar at 192/1536/12288 atoms and small/medium at 192/12288. Each case runs the fused
path (exact fp32, and ``fused-fp16x3``: the opt-in fast mixing-stack GEMM tier), and the reference
path (``compiled``, ``torch.compile`` of the reference, runs for the ``--compile-configs`` up to
``--compile-max-atoms``) under every ``--memory`` mode and reports
ms/step, atom-steps/s, peak memory (MiB and MiB/atom) and the split of one step's CUDA time:
phases (``so2serve::graph / edge_cache / model / backward / assembly`` profiler ranges of
``Potential.predict``) and kernels (so2kernels Triton kernels vs everything else). ``--profile``
also stores the top-30 CUDA kernels and CPU ops of that step and the number of kernel launches.
A (config, path, memory) series stops at its first out-of-memory; ``--find-max`` doubles past the
last size until one does not fit.

Agreement (always, unless ``--no-agreement``), for the exact fused tier (``fused_fp32``) and the
fast one (``fused_fp16x3``) side by side:
(i) the shipped default water model (forces ~1 eV/Å): each fused tier vs reference fp32 max |ΔF|
    on water boxes (``--agreement-sizes``), target ≤ 1e-5 eV/Å; also vs reference fp64 at the
    sizes of ``--fp64-sizes`` (fp64 at 12k atoms would not fit);
(ii) the random bar model (forces up to ~250 eV/Å, E ≈ 4.6e4 eV, where fp32 noise alone is
    ~1e-3 eV/Å): each fused tier and reference fp32 vs reference fp64 (and the fused tiers vs
    reference fp32), absolute and relative to max |F| (``--fp64-sizes``), so the fused errors can
    be read against fp32 noise.

Results go to ``benchmarks/results/model_<date>.json``, rewritten after every row (a run cut by a
time limit keeps what finished).

    python benchmarks/model.py --profile             # the default suite, ~5-8 min on an H200
    python benchmarks/model.py --cases bar:192,12288 --paths fused --memory fast lean --find-max
    python benchmarks/model.py --cases bar:192,1536,12288 --paths fused fused-fp16x3 --profile
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from service.graph.structures import StructureArrays, Structures  # noqa: E402
from service.model.captured import CAPTURE_MAX_ATOMS, RECORD_AFTER  # noqa: E402
from service.model.config import ModelConfig, preset  # noqa: E402
from service.model.potential import (  # noqa: E402
    MEMORY_MODES,
    Potential,
    Prediction,
    load_potential,
)
from tests.model.randomized import randomized_model  # noqa: E402

WATER_DIRS = (
    ROOT / ".gpu_data" / "water" / "data_0",
    ROOT / ".gpu_data" / "data" / "water" / "data_0",
    ROOT.parent / "shared" / "data" / "water" / "data_0",
)


def bar_config() -> ModelConfig:
    """DeePMD's DPA4 bar: C 128, L 2, 2 blocks, 3 mixing layers, 1×128 focus, rank 1, 1 head, S2."""
    return ModelConfig(
        type_map=("O", "H"), channels=128, lmax=2, n_blocks=2, mixing_layers=3, n_focus=1,
        focus_dim=128, radial_so2_mode="degree_channel", radial_so2_rank=1, n_atten_head=1,
        ffn="s2", n_radial=16, rcut=6.0,
    )  # fmt: skip


BENCH_PATHS = {
    "fused": ("fused", "fp32"),
    "fused-fp16x3": ("fused", "fp16x3"),
    "reference": ("reference", "fp32"),
    "compiled": ("reference", "fp32"),
}
"""Benchmark path name → (Potential path, precision); ``<name>-eager`` runs without CUDA graphs."""


def parse_bench_path(name: str) -> tuple[str, str, bool]:
    """``"fused-fp16x3-eager"`` → ``("fused", "fp16x3", True)`` (path, precision, eager)."""
    base = name.removesuffix("-eager")
    path, precision = BENCH_PATHS[base]
    return path, precision, base != name


CONFIGS = {
    "small": lambda: preset("small", ["O", "H"]),
    "medium": lambda: preset("medium", ["O", "H"]),
    "bar": bar_config,
}


def water_frame() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(numbers (192,), positions (192, 3), cell (3, 3))`` of water frame 0 (or a stand-in)."""
    for root in WATER_DIRS:
        if (root / "set.000" / "coord.npy").is_file():
            types = np.loadtxt(root / "type.raw", dtype=np.int64)
            type_map = (
                (root / "type_map.raw").read_text().split()
                if (root / "type_map.raw").is_file()
                else ["O", "H"]
            )
            numbers = np.array([{"O": 8, "H": 1}[type_map[t]] for t in types])
            pos = np.load(root / "set.000" / "coord.npy")[0].reshape(-1, 3)
            cell = np.load(root / "set.000" / "box.npy")[0].reshape(3, 3)
            return numbers, pos, cell
    rng = np.random.default_rng(0)
    side = (64 * 29.9) ** (1 / 3)  # 64 molecules at water density (≈29.9 Å³ per molecule)
    o = rng.uniform(0, side, (64, 3))
    h = o[:, None, :] + rng.normal(0, 0.6, (64, 2, 3))
    pos = np.concatenate([o, h.reshape(-1, 3)])
    return np.array([8] * 64 + [1] * 128), pos, np.eye(3) * side


def box_repeats(n_copies: int) -> tuple[int, int, int]:
    """The most cubic ``(a, b, c)`` with ``a·b·c = n_copies`` (8×8×6 for 384 copies)."""
    best = (n_copies, 1, 1)
    for a in range(1, n_copies + 1):
        for b in range(1, a + 1):
            c, rest = divmod(n_copies, a * b)
            if rest == 0 and c <= b and a - c < best[0] - best[2]:
                best = (a, b, c)
    return best


def water_box(n_atoms: int) -> Structures:
    """The 192-atom water frame repeated to ``round(n_atoms / 192)`` copies, as cubic as the
    count allows (73,728 atoms = 8×8×6 frames)."""
    numbers, pos, cell = water_frame()
    reps = np.array(box_repeats(max(1, round(n_atoms / len(numbers)))))
    grid = np.meshgrid(*[np.arange(r) for r in reps], indexing="ij")
    shifts = np.stack(grid, -1).reshape(-1, 3)
    all_pos = (pos[None] + (shifts @ cell)[:, None]).reshape(-1, 3)
    arrays = StructureArrays(
        numbers=np.tile(numbers, len(shifts)),
        positions=all_pos,
        cell=cell * reps[:, None],
        pbc=(True, True, True),
    )
    return Structures.from_arrays([arrays])


def _timed(fn: Any, repeats: int) -> tuple[float, float]:
    """(median, mean) wall ms of one step. Each step returns host arrays, so it ends synchronised;
    the median keeps a stray host hiccup (GC, page fault) out of the latency of small steps."""
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1000.0)
    return float(statistics.median(samples)), float(statistics.fmean(samples))


SMALL_STEP_REPEATS = 40
"""Steps timed below 2,000 atoms (at least): their latency is a few ms, so a median needs more."""


PHASES = ("graph", "edge_cache", "model", "backward", "assembly")
"""The ``so2serve::<phase>`` profiler ranges of Potential.predict."""
SEARCH_KERNELS = ("_direct_pairs_kernel", "_pad_graph_kernel")
"""The neighbour search's own kernels. A replayed step runs them inside its CUDA graph, where no
profiler range encloses them (its ``graph`` range holds only the input copy): the graph phase
is the larger of the range's time and theirs."""
TOP_N = 30


def so2kernels_kernel_names() -> frozenset[str]:
    """Names of every Triton kernel defined in so2kernels (the value path's device work)."""
    import importlib
    import pkgutil

    import so2kernels

    names: set[str] = set()
    for info in pkgutil.iter_modules(so2kernels.__path__):
        module = importlib.import_module(f"so2kernels.{info.name}")
        names.update(
            name for name, obj in vars(module).items() if type(obj).__name__ == "JITFunction"
        )
    return frozenset(names)


def _device_us(evt: Any, self_only: bool) -> float:
    key = "self_device_time_total" if self_only else "device_time_total"
    legacy = "self_cuda_time_total" if self_only else "cuda_time_total"
    return float(getattr(evt, key, getattr(evt, legacy, 0.0)))


def _top(rows: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    return sorted(rows, key=lambda r: -float(r[key]))[:TOP_N]


def profile_step(
    pot: Potential, structures: Structures, props: tuple[str, ...], detail: bool
) -> dict[str, Any]:
    """One profiled step: phase times (ms of CUDA time inside each ``so2serve::`` range), the
    kernel-time split (so2kernels vs rest), kernel launches, and with ``detail`` the top-30 CUDA
    kernels and CPU ops by total time."""
    from torch.autograd import DeviceType  # type: ignore[attr-defined]
    from torch.profiler import ProfilerActivity, profile

    value_kernels = so2kernels_kernel_names()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        pot.predict(structures, props)
        torch.cuda.synchronize()
    kernels: list[dict[str, Any]] = []
    cpu_ops: list[dict[str, Any]] = []
    phases = dict.fromkeys(PHASES, 0.0)
    for evt in prof.key_averages():
        if evt.key.startswith("so2serve::"):
            phase = evt.key.split("::", 1)[1]
            if phase in phases:
                phases[phase] = max(phases[phase], _device_us(evt, False) / 1e3)
            continue
        if evt.device_type == DeviceType.CUDA:
            kernels.append(
                {"name": evt.key[:200], "count": evt.count, "ms": _device_us(evt, True) / 1e3}
            )
        elif evt.count > 0:
            cpu_ops.append(
                {
                    "name": evt.key[:200],
                    "count": evt.count,
                    "cpu_ms": evt.cpu_time_total / 1e3,
                    "self_cpu_ms": evt.self_cpu_time_total / 1e3,
                    "cuda_ms": _device_us(evt, False) / 1e3,
                }
            )
    total = sum(k["ms"] for k in kernels)
    value = sum(k["ms"] for k in kernels if any(v in k["name"] for v in value_kernels))
    search = sum(k["ms"] for k in kernels if any(v in k["name"] for v in SEARCH_KERNELS))
    phases["graph"] = max(phases["graph"], search)
    out: dict[str, Any] = {
        "kernel_ms": total,
        "kernel_launches": sum(k["count"] for k in kernels),
        "phase_ms": phases,
        "value_path_share": value / max(total, 1e-9),
        "graph_build_share": phases["graph"] / max(total, 1e-9),
    }
    if detail:
        out["top_kernels"] = _top(kernels, "ms")
        out["top_cpu_ops"] = _top(cpu_ops, "cpu_ms")
    return out


def make_potential(cfg_name: str, path: str, memory: str) -> Potential:
    """A random-weight potential of ``cfg_name`` on the bench path; ``compiled`` wraps the
    reference model in ``torch.compile(dynamic=True)``."""
    value_path, precision, eager = parse_bench_path(path)
    pot = Potential(
        randomized_model(CONFIGS[cfg_name]()), device="cuda", path=value_path,
        precision=precision, memory=memory, capture=False if eager or path == "compiled" else None,
    )  # fmt: skip
    if path == "compiled":
        pot.model = torch.compile(pot.model, dynamic=True)  # type: ignore[assignment]
    return pot


def run_case(
    cfg_name: str, n_atoms: int, path: str, props: tuple[str, ...], args: argparse.Namespace,
    memory: str, pot: Potential | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One size. ``pot`` (kept by the caller across sizes) spares a compiled series from
    compiling again for every size; otherwise a fresh potential is made and released."""
    owned = pot is None
    if pot is None:
        pot = make_potential(cfg_name, path, memory)
    precision = parse_bench_path(path)[1]
    structures = water_box(n_atoms)  # on the host, as a request arrives
    row: dict[str, Any] = {
        "config": cfg_name,
        "n_atoms": int(structures.n_atoms),
        "path": path,
        "precision": precision,
        "cuda_graphs": pot._captured is not None and n_atoms < CAPTURE_MAX_ATOMS,
        "memory": memory,
        "properties": list(props),
    }
    # A compiled model's backward for a new shape is compiled lazily, inside the autograd engine's
    # device thread on CUDA, where it aborted the process (benchmarks/compile_probe.py): the
    # compiled series runs its backward on the calling thread.
    with torch.autograd.set_multithreading_enabled(path != "compiled"):
        try:
            t0 = time.perf_counter()
            pot.predict(structures, props)  # warm-up (compile, autotune)
            torch.cuda.synchronize()
            row["first_call_s"] = time.perf_counter() - t0
            if row["cuda_graphs"]:  # small shapes: recorded as a CUDA graph on a later hit
                for _ in range(RECORD_AFTER):
                    pot.predict(structures, props)
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            repeats = args.repeats if n_atoms >= 2000 else max(args.repeats, SMALL_STEP_REPEATS)
            ms, mean_ms = _timed(lambda: pot.predict(structures, props), repeats)
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            row.update(
                ms_per_step=ms,
                mean_ms_per_step=mean_ms,
                atom_steps_per_s=structures.n_atoms / ms * 1000.0,
                peak_mib=peak,
                mib_per_atom=peak / structures.n_atoms,
            )
            if path != "compiled" and n_atoms <= args.profile_max_atoms:
                row["profile"] = profile_step(pot, structures, props, args.profile)
        except torch.cuda.OutOfMemoryError:
            row["error"] = "out of memory"
        finally:
            if owned:
                pot.model = (
                    pot.model.cpu()
                )  # free the weights and cached packs before the next case
            torch.cuda.empty_cache()
    return row


def run_series(
    cfg_name: str, path: str, memory: str, sizes: list[int], args: argparse.Namespace,
    emit: Any,
) -> None:  # fmt: skip
    """One (config, path, memory) series over increasing sizes; stops at the first OOM. With
    ``--find-max`` it keeps doubling past the last size until a run does not fit."""
    props = ("energy", "forces", "stress") if args.stress else ("energy", "forces")
    # One compiled model for the whole series: its first row's first_call_s is the compile.
    shared = make_potential(cfg_name, path, memory) if path == "compiled" else None
    largest = 0
    for n in sorted(sizes):
        row = run_case(cfg_name, n, path, props, args, memory, shared)
        emit("rows", row)
        if "error" in row:
            break
        largest = row["n_atoms"]
    else:
        n = 2 * max(sizes)
        while args.find_max and n <= args.max_atoms:
            row = run_case(cfg_name, n, path, props, args, memory, shared)
            emit("rows", row)
            if "error" in row:
                break
            largest = row["n_atoms"]
            n *= 2
    emit(
        "rows",
        {"config": cfg_name, "path": path, "memory": memory, "largest_fitting_atoms": largest},
    )
    if shared is not None:
        shared.model = shared.model.cpu()
        torch._dynamo.reset()  # drop the compiled graphs with the model they guard
        torch.cuda.empty_cache()


AGREEMENT_RUNS = {
    "fused_fp32": ("fused", "fp32"),
    "fused_fp16x3": ("fused", "fp16x3"),
    "reference_fp32": ("reference", "fp32"),
    "fp64": ("reference", "fp64"),
}
"""Runs of the agreement section: name → (Potential path, precision)."""
COMPARED = (
    ("fused_fp32", "reference_fp32"),
    ("fused_fp16x3", "reference_fp32"),
    ("fused_fp32", "fp64"),
    ("fused_fp16x3", "fp64"),
    ("reference_fp32", "fp64"),
)


def _max_abs(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    assert a is not None and b is not None
    return float((a - b).abs().max())


def agreement_predictions(
    make: Callable[[str, str], Potential], structures: Structures, runs: list[str]
) -> dict[str, Prediction]:
    """Energy and forces of ``structures`` for each named run of ``AGREEMENT_RUNS``; one
    potential on the device at a time."""
    out = {}
    for name in runs:
        pot = make(*AGREEMENT_RUNS[name])
        out[name] = pot.predict(structures.to(pot.device), ("energy", "forces"))
        del pot
        torch.cuda.empty_cache()
    return out


def deviations(out: dict[str, Prediction], scale_f: float, scale_e: float) -> dict[str, Any]:
    """``"<run>_vs_<baseline>"`` → max |ΔF|, max |ΔE| and both relative to the given scales, for
    every pair of ``COMPARED`` whose runs are present."""
    rows: dict[str, Any] = {}
    for name, baseline in COMPARED:
        if name in out and baseline in out:
            d_f = _max_abs(out[name].forces, out[baseline].forces)
            d_e = _max_abs(out[name].energy, out[baseline].energy)
            rows[f"{name}_vs_{baseline}"] = {
                "max_abs_dF": d_f,
                "rel_dF": d_f / scale_f,
                "max_abs_dE": d_e,
                "rel_dE": d_e / scale_e,
            }
    return rows


def default_model_agreement(n_atoms: int, with_fp64: bool) -> dict[str, Any]:
    """Shipped default water model: both fused tiers vs reference fp32 (and fp64 if asked)."""
    structures = water_box(n_atoms)
    runs = [name for name in AGREEMENT_RUNS if with_fp64 or name != "fp64"]

    def make(path: str, precision: str) -> Potential:
        return load_potential(None, device="cuda", path=path, precision=precision)

    out = agreement_predictions(make, structures, runs)
    forces = out["reference_fp32"].forces
    assert forces is not None
    scale_f = float(forces.abs().max())
    return {
        "model": "default",
        "n_atoms": int(structures.n_atoms),
        "max_abs_F": scale_f,
        "max_abs_E": float(out["reference_fp32"].energy.abs().max()),
        "max_abs_dF_fused_vs_reference": _max_abs(out["fused_fp32"].forces, forces),
        "max_abs_dE_fused_vs_reference": _max_abs(
            out["fused_fp32"].energy, out["reference_fp32"].energy
        ),
        "target_max_abs_dF": 1e-5,
        **deviations(out, scale_f, float(out["reference_fp32"].energy.abs().max())),
    }


def fp64_agreement(cfg_name: str, n_atoms: int) -> dict[str, Any]:
    """Random model: both fused tiers and reference fp32 against reference fp64."""
    model = randomized_model(CONFIGS[cfg_name]())
    structures = water_box(n_atoms)

    def make(path: str, precision: str) -> Potential:
        return Potential(model, device="cuda", path=path, precision=precision)

    out = agreement_predictions(make, structures, list(AGREEMENT_RUNS))
    exact_f = out["fp64"].forces
    assert exact_f is not None
    scale_f = float(exact_f.abs().max())
    scale_e = float(out["fp64"].energy.abs().max())
    return {
        "model": f"random {cfg_name}",
        "n_atoms": int(structures.n_atoms),
        "max_abs_F": scale_f,
        "max_abs_E": scale_e,
        **deviations(out, scale_f, scale_e),
    }


def parse_cases(cases: list[str]) -> list[tuple[str, list[int]]]:
    """``["bar:192,1536", "small:192"]`` → ``[("bar", [192, 1536]), ("small", [192])]``."""
    parsed = []
    for case in cases:
        name, _, sizes = case.partition(":")
        if name not in CONFIGS or not sizes:
            raise SystemExit(
                f"bad case {case!r}: use config:size,size with config in {list(CONFIGS)}"
            )
        parsed.append((name, [int(n) for n in sizes.split(",")]))
    return parsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cases", nargs="+", default=["bar:192,1536,12288", "small:192,12288", "medium:192,12288"]
    )
    parser.add_argument(
        "--paths", nargs="+",
        default=["fused", "fused-eager", "fused-fp16x3", "reference", "compiled"],
        choices=["fused", "fused-eager", "fused-fp16x3", "fused-fp16x3-eager", "reference",
                 "reference-eager", "compiled"],
        help="'-eager' variants run without CUDA-graph replay of small steps; 'fused-fp16x3' is "
        "the fused path with the fast mixing-stack tier",
    )  # fmt: skip
    parser.add_argument("--compile-configs", nargs="*", default=["bar"])
    parser.add_argument("--compile-max-atoms", type=int, default=1536)
    parser.add_argument("--memory", nargs="+", default=["fast"], choices=list(MEMORY_MODES))
    parser.add_argument("--profile", action="store_true", help="store top-30 kernels / CPU ops")
    parser.add_argument(
        "--profile-max-atoms", type=int, default=16384,
        help="profile one step (phase and kernel split) only up to this size: beyond it an "
        "extra multi-second step would cost more device time than it tells",
    )  # fmt: skip
    parser.add_argument("--find-max", action="store_true", help="double sizes until OOM")
    parser.add_argument("--max-atoms", type=int, default=1_600_000)
    parser.add_argument("--stress", action="store_true", help="also compute the stress")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-agreement", action="store_true")
    parser.add_argument("--agreement-sizes", nargs="+", type=int, default=[192, 1536, 12288])
    parser.add_argument("--fp64-configs", nargs="*", default=["bar"])
    parser.add_argument("--fp64-sizes", nargs="+", type=int, default=[192, 1536])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/model.py needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    # A compiled reference past Dynamo's recompile limit must fail, not time eager code.
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    torch.backends.cudnn.allow_tf32 = False
    import triton

    doc: dict[str, Any] = {
        "benchmark": "model",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": dt.datetime.now(dt.UTC).isoformat(),
        "command": " ".join(sys.argv),
        "rows": [],
        "agreement": [],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S")
    out_path = args.out / f"model_{stamp}.json"

    def emit(section: str, row: dict[str, Any]) -> None:
        print(json.dumps({k: v for k, v in row.items() if not k.startswith("top_")}), flush=True)
        doc[section].append(row)
        out_path.write_text(json.dumps(doc, indent=1))

    for cfg_name, sizes in parse_cases(args.cases):
        for path in args.paths:
            if path == "compiled":
                if cfg_name not in args.compile_configs:
                    continue
                sizes_here = [n for n in sizes if n <= args.compile_max_atoms]
            else:
                sizes_here = sizes
            for memory in args.memory:
                if sizes_here:
                    run_series(cfg_name, path, memory, sizes_here, args, emit)
    if not args.no_agreement:
        for n in args.agreement_sizes:
            emit("agreement", default_model_agreement(n, with_fp64=n in args.fp64_sizes))
        for cfg_name in args.fp64_configs:
            for n in args.fp64_sizes:
                emit("agreement", fp64_agreement(cfg_name, n))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
