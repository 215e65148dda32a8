"""GPU benchmark of the DPA4 model: energy + forces (+ stress) per step on water boxes.

For each config (``small``, ``medium`` and DeePMD's bar config) and size (192, 1.5k, 12k, 98k
atoms by default) it times the fused path, the reference path and ``torch.compile`` of the
reference, and reports ms/step, atom-steps/s, peak memory (MiB and MiB/atom), the share of a step
spent in graph build, in the SO(2) value-path ops and in the rest, and the fused-vs-reference
max |ΔF|. Each case runs under every ``--memory`` mode (``fast``: all per-edge activations kept;
``lean``: edge chunks recomputed in the backward; ``auto``: lean only when needed). Larger sizes
of a (config, path, memory) series are skipped after its first out-of-memory, and
``--find-max`` then doubles the size from the last that fitted until one does not, reporting the
largest that fits. Results go to ``benchmarks/results/model_<date>.json``.

    python benchmarks/model.py                       # everything
    python benchmarks/model.py --configs bar --paths fused --memory fast lean --find-max
    python benchmarks/model.py --configs bar --sizes 192 12288 --paths fused reference
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from service.graph.structures import StructureArrays, Structures  # noqa: E402
from service.model.config import ModelConfig, preset  # noqa: E402
from service.model.potential import MEMORY_MODES, Potential  # noqa: E402
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


def water_box(n_atoms: int) -> Structures:
    numbers, pos, cell = water_frame()
    reps = max(1, round((n_atoms / len(numbers)) ** (1 / 3)))
    shifts = np.stack(np.meshgrid(*[np.arange(reps)] * 3, indexing="ij"), -1).reshape(-1, 3)
    all_pos = (pos[None] + (shifts @ cell)[:, None]).reshape(-1, 3)
    arrays = StructureArrays(
        numbers=np.tile(numbers, len(shifts)),
        positions=all_pos,
        cell=cell * reps,
        pbc=(True, True, True),
    )
    return Structures.from_arrays([arrays])


def _timed(fn: Any, repeats: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000.0 / repeats


def _value_path_share(
    pot: Potential, structures: Structures, props: tuple[str, ...]
) -> dict[str, float]:
    """Fractions of one step's CUDA time in graph build and in so2kernels ops (profiler)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from service.graph.neighbors import build_graph

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        with record_function("graph_build"):
            build_graph(structures, pot.config.rcut)
        pot.predict(structures, props)
        torch.cuda.synchronize()
    total = graph = value = 0.0
    for evt in prof.key_averages():
        cuda = float(getattr(evt, "device_time_total", getattr(evt, "cuda_time_total", 0.0)))
        name = evt.key
        if name == "graph_build":
            graph = cuda
        elif (
            "so2kernels" in name
            or "rotate_mix" in name
            or "mixing_stack" in name
            or "aggregate" in name
            or "segment_" in name
        ):
            value += float(getattr(evt, "self_device_time_total", cuda))
        if evt.key.startswith(("void", "triton", "_")) or "kernel" in name.lower():
            total += float(getattr(evt, "self_device_time_total", 0.0))
    total = max(total, 1e-9)
    return {
        "graph_build": graph / total,
        "value_path": value / total,
        "rest": max(0.0, 1 - (graph + value) / total),
    }


def run_case(
    cfg_name: str, n_atoms: int, path: str, props: tuple[str, ...], repeats: int, memory: str
) -> dict[str, Any]:
    cfg = CONFIGS[cfg_name]()
    model = randomized_model(cfg)
    pot = Potential(
        model, device="cuda", path="fused" if path == "fused" else "reference", memory=memory
    )
    structures = water_box(n_atoms).to(pot.device)
    if path == "compiled":
        pot.model = torch.compile(pot.model, dynamic=True)  # type: ignore[assignment]
    row: dict[str, Any] = {
        "config": cfg_name,
        "n_atoms": int(structures.n_atoms),
        "path": path,
        "memory": memory,
        "properties": list(props),
    }
    try:
        t0 = time.perf_counter()
        pot.predict(structures, props)  # warm-up (compile, autotune)
        torch.cuda.synchronize()
        row["first_call_s"] = time.perf_counter() - t0
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms = _timed(lambda: pot.predict(structures, props), repeats)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        row.update(
            ms_per_step=ms,
            atom_steps_per_s=structures.n_atoms / ms * 1000.0,
            peak_mib=peak,
            mib_per_atom=peak / structures.n_atoms,
        )
        if path != "compiled":
            row["time_shares"] = _value_path_share(pot, structures, props)
    except torch.cuda.OutOfMemoryError:
        row["error"] = "out of memory"
    finally:
        torch.cuda.empty_cache()
    return row


def run_series(
    cfg_name: str, path: str, memory: str, sizes: list[int], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """One (config, path, memory) series over increasing sizes; stops at the first OOM. With
    ``--find-max`` it keeps doubling past the last size until a run does not fit."""
    props = ("energy", "forces", "stress") if args.stress else ("energy", "forces")
    rows: list[dict[str, Any]] = []
    largest = 0
    for n in sorted(sizes):
        row = run_case(cfg_name, n, path, props, args.repeats, memory)
        print(json.dumps(row), flush=True)
        rows.append(row)
        if "error" in row:
            break
        largest = row["n_atoms"]
    else:
        n = 2 * max(sizes)
        while args.find_max and n <= args.max_atoms:
            row = run_case(cfg_name, n, path, props, 2, memory)
            print(json.dumps(row), flush=True)
            rows.append(row)
            if "error" in row:
                break
            largest = row["n_atoms"]
            n *= 2
    rows.append(
        {"config": cfg_name, "path": path, "memory": memory, "largest_fitting_atoms": largest}
    )
    return rows


def agreement(cfg_name: str, n_atoms: int) -> dict[str, Any]:
    """Fused vs reference max |ΔF| and |ΔE| on the same model and box."""
    model = randomized_model(CONFIGS[cfg_name]())
    structures = water_box(n_atoms)
    out = {}
    for path in ("fused", "reference"):
        pot = Potential(model, device="cuda", path=path)
        out[path] = pot.predict(structures.to(pot.device), ("energy", "forces"))
    d_f = float((out["fused"].forces - out["reference"].forces).abs().max())
    d_e = float((out["fused"].energy - out["reference"].energy).abs().max())
    return {
        "config": cfg_name,
        "n_atoms": int(structures.n_atoms),
        "max_abs_dF": d_f,
        "max_abs_dE": d_e,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--configs", nargs="+", default=["small", "medium", "bar"], choices=list(CONFIGS)
    )
    parser.add_argument("--sizes", nargs="+", type=int, default=[192, 1536, 12288, 98304])
    parser.add_argument("--paths", nargs="+", default=["fused", "reference", "compiled"])
    parser.add_argument("--memory", nargs="+", default=["fast", "lean"], choices=list(MEMORY_MODES))
    parser.add_argument("--find-max", action="store_true", help="double sizes until OOM")
    parser.add_argument("--max-atoms", type=int, default=1_600_000)
    parser.add_argument("--stress", action="store_true", help="also compute the stress")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--agreement-sizes", nargs="+", type=int, default=[192, 1536, 12288])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/model.py needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows = []
    for cfg_name in args.configs:
        for path in args.paths:
            for memory in args.memory:
                rows += run_series(cfg_name, path, memory, args.sizes, args)
    checks = [agreement(c, n) for c in args.configs for n in args.agreement_sizes]
    for c in checks:
        print(json.dumps(c), flush=True)
    import triton

    doc = {
        "benchmark": "model",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": dt.datetime.now(dt.UTC).isoformat(),
        "command": " ".join(sys.argv),
        "rows": rows,
        "agreement": checks,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S")
    path = args.out / f"model_{stamp}.json"
    path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
