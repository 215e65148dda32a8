"""Service benchmark (GPU; the lead runs it): HTTP overhead and throughput vs in-process.

    python benchmarks/service.py [--model FILE] [--device cuda] [--quick]
    python benchmarks/service.py --device cpu --fake-model [--sizes 192 768] [--repeats 200]

1. Per-request overhead: one periodic water box of 192, 1,536 and 12,288 atoms, energy +
   forces + stress, through the ASE calculators: ``SO2LocalCalculator`` (in process) against
   ``SO2Calculator`` (HTTP, JSON and msgpack); medians, overhead = HTTP − in-process.
   Target: ≤ 1 ms at ≤ 1k atoms.
2. Throughput with 192-atom structures: 1, 8 and 64 concurrent HTTP clients (spread over
   several client processes so that Python on the client side is not the bottleneck) vs the
   in-process potential serially (one structure per pass) and batched (64 per pass), with
   the ratios. Target: 64 clients ≥ 80 % of in-process batched.

Server-side phases come with every case: the medians of each answer's
``provenance.timings`` (read, decode, queue, compute, handoff, total) plus the mean response
encoding time and, for the throughput points, the mean requests and atoms per device pass,
pass time and queue wait, all from ``/metrics`` differences around the case. What the round
trip leaves beyond the server's own time (``client_and_transport_ms``) is the client
(encoding, decoding, ASE bookkeeping) and loopback HTTP.

The default run takes about 3 minutes on an H200 with the current model step; ``--quick``
(fewer repeats, shorter throughput windows) about half that.

The server runs in its own process (``so2serve serve``), started after the in-process phase
has released the GPU memory. Without ``--model`` the shipped default model is used, or, if
there is none yet, a random model of DeePMD's bar configuration (benchmarks/model.py).
Raw numbers go to ``benchmarks/results/service-<date>.json``.

``--fake-model`` (CPU micro-benchmark, no GPU needed): the server evaluates with a do-nothing
model (zeros of the right shapes), so the round trip is pure service overhead. It reports, per
size and wire format, the round trip against the in-process path (validate → predict → host
arrays), the server's phases as above, and each CPU stage timed alone in this process (client
encode / decode, server parse + validation, response encode, engine admission → worker →
result). Written to ``--out`` when given.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import json
import multiprocessing
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from ase import Atoms
from ase.calculators.calculator import Calculator, all_changes

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clients.http import (  # noqa: E402
    SO2Calculator,
    decode_response,
    encode_request,
    encode_structure,
    result_arrays,
)
from clients.local import SO2LocalCalculator  # noqa: E402
from service.engine import Evaluator  # noqa: E402
from service.graph.structures import Structures  # noqa: E402
from service.model.potential import Potential, default_model_path, load_potential  # noqa: E402
from tests.service.fakes import FakeExecution, FakePrediction  # noqa: E402

SIZES = (192, 1536, 12288)
CLIENTS = (1, 8, 64)
PROPERTIES = ("energy", "forces", "stress")  # what the calculators ask for a periodic box
LARGE = 5000  # atoms from which a size gets only LARGE_REPEATS timed calls
LARGE_REPEATS = 3
JSON, MSGPACK = "application/json", "application/msgpack"


def _bench_model_module() -> Any:
    spec = importlib.util.spec_from_file_location("bench_model", ROOT / "benchmarks" / "model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def water_atoms(n_atoms: int, seed: int = 0) -> Atoms:
    """A water box tiled from the 192-atom frame, jittered so that frames differ."""
    numbers, positions, cell = _bench_model_module().water_frame()
    reps = max(1, round((n_atoms / len(numbers)) ** (1 / 3)))
    atoms: Atoms = Atoms(numbers=numbers, positions=positions, cell=cell, pbc=True) * ((reps,) * 3)
    atoms.positions += np.random.default_rng(seed).normal(scale=0.01, size=atoms.positions.shape)
    return atoms


def model_file(requested: str | None, workdir: Path) -> Path:
    if requested is not None:
        return Path(requested)
    if default_model_path().is_file():
        return default_model_path()
    from service.model.io import save_model

    bench = _bench_model_module()
    from tests.model.randomized import randomized_model

    path = workdir / "bar-random.safetensors"
    save_model(randomized_model(bench.bar_config()), path)
    return path


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def repeats_for(n_atoms: int, repeats: int) -> int:
    return repeats if n_atoms < LARGE else min(repeats, LARGE_REPEATS)


def calculator_step(calculator: Calculator, atoms: Atoms) -> Callable[[], object]:
    """One ASE evaluation as MD asks for it (cache bypassed: every call is computed)."""

    def step() -> object:
        calculator.calculate(atoms, PROPERTIES, all_changes)  # type: ignore[no-untyped-call]
        return calculator.results

    return step


def in_process_step(potential: Evaluator, atoms: list[Atoms]) -> Callable[[], object]:
    """A batched pass the way SO2LocalCalculator does one: validate, predict, host copies."""

    def step() -> object:
        prediction = potential.predict(Structures.from_atoms(atoms), PROPERTIES)
        assert prediction.forces is not None
        return prediction.forces.cpu().numpy()

    return step


def in_process_phase(
    potential: Potential, sizes: list[int], batch: int, repeats: int
) -> dict[str, Any]:
    rows: dict[str, Any] = {"single_ms": {}, "validate_ms": {}}
    calculator = SO2LocalCalculator(potential)
    for n in sizes:
        atoms = water_atoms(n)
        reps = repeats_for(len(atoms), repeats)
        rows["single_ms"][str(len(atoms))] = median_ms(calculator_step(calculator, atoms), reps)
        # The part of a call that both sides pay on the host (HTTP: in the decode phase).
        rows["validate_ms"][str(len(atoms))] = median_ms(
            lambda atoms=atoms: Structures.from_atoms([atoms]), reps
        )
    frames = [water_atoms(192, seed=k) for k in range(batch)]
    serial = median_ms(in_process_step(potential, frames[:1]), repeats)
    batched = median_ms(in_process_step(potential, frames), max(3, repeats // 4))
    rows["serial_192"] = {"pass_ms": serial, "atom_steps_per_s": 192 / (serial * 1e-3)}
    rows[f"batched_{batch}x192"] = {
        "pass_ms": batched,
        "atom_steps_per_s": batch * 192 / (batched * 1e-3),
    }
    return rows


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(model: Path, device: str, port: int) -> subprocess.Popen[bytes]:
    inherited = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), inherited]))}
    command = [
        sys.executable,
        "-m",
        "service.cli",
        "serve",
        "--model",
        str(model),
        "--device",
        device,
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    server = subprocess.Popen(command, env=env)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError("the server exited during startup")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    server.kill()
    raise RuntimeError("the server was not ready within 10 minutes")


_SERVER_TOTALS = (
    "so2serve_encode_seconds",
    "so2serve_batch_requests",
    "so2serve_batch_atoms",
    "so2serve_pass_seconds",
    "so2serve_queue_wait_seconds",
)


def server_totals(url: str) -> dict[str, float]:
    """``_sum`` and ``_count`` of the server's unlabelled histograms in ``_SERVER_TOTALS``."""
    wanted = {f"{name}{suffix}" for name in _SERVER_TOTALS for suffix in ("_sum", "_count")}
    totals = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            totals[name] = float(value)
    return totals


def mean_of(before: dict[str, float], after: dict[str, float], name: str) -> float | None:
    count = after[f"{name}_count"] - before[f"{name}_count"]
    return (after[f"{name}_sum"] - before[f"{name}_sum"]) / count if count else None


def http_round_trip(url: str, atoms: Atoms, wire: str, repeats: int) -> dict[str, Any]:
    """Median SO2Calculator call, the server's median phases and its mean answer encoding."""
    timings: list[dict[str, float]] = []
    with SO2Calculator(url, timeout=600, wire=wire) as calculator:  # type: ignore[arg-type]
        compute = calculator_step(calculator, atoms)

        def step() -> object:
            results = compute()
            assert calculator.provenance is not None
            timings.append(calculator.provenance["timings"])
            return results

        before = server_totals(url)
        total = median_ms(step, repeats)
        after = server_totals(url)
    server = {k: statistics.median(t[k] for t in timings) for k in timings[0]}
    encode = mean_of(before, after, "so2serve_encode_seconds")
    server["encode_ms"] = (encode or 0.0) * 1e3
    return {
        "round_trip_ms": total,
        "server_ms": server,
        "client_and_transport_ms": total - server["total_ms"] - server["encode_ms"],
    }


def http_overhead_phase(url: str, sizes: list[int], repeats: int) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for n in sizes:
        atoms = water_atoms(n)
        for wire in ("json", "msgpack"):
            reps = repeats_for(len(atoms), repeats)
            rows[f"{len(atoms)}/{wire}"] = http_round_trip(url, atoms, wire, reps)
    return rows


async def _client_loop(
    url: str, bodies: list[bytes], clients: int, duration: float
) -> tuple[list[float], float]:
    """Latencies of every request and the wall time until the last one came back."""
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    headers = {"Content-Type": MSGPACK, "Accept": MSGPACK}
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        begin = time.perf_counter()
        stop = begin + duration

        async def one(k: int) -> None:
            while time.perf_counter() < stop:
                start = time.perf_counter()
                response = await http.post(
                    "/evaluate", content=bodies[k % len(bodies)], headers=headers
                )
                response.raise_for_status()
                latencies.append(time.perf_counter() - start)
                k += 1

        await asyncio.gather(*(one(k) for k in range(clients)))
    return latencies, time.perf_counter() - begin


def _client_process(args: tuple[str, int, float]) -> tuple[list[float], float]:
    url, clients, duration = args
    bodies = [
        encode_request([encode_structure(water_atoms(192, seed=k), True)], PROPERTIES, True)
        for k in range(8)
    ]
    return asyncio.run(_client_loop(url, bodies, clients, duration))


CLIENT_PROCESSES = 8


def throughput_phase(url: str, client_counts: list[int], duration: float) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    # One pool for all client counts: starting a process imports torch (seconds each).
    with multiprocessing.get_context("spawn").Pool(CLIENT_PROCESSES) as pool:
        for clients in client_counts:
            processes = min(clients, CLIENT_PROCESSES)
            shares = [clients // processes + (k < clients % processes) for k in range(processes)]
            before = server_totals(url)
            results = pool.map(_client_process, [(url, s, duration) for s in shares], chunksize=1)
            after = server_totals(url)
            rows[str(clients)] = throughput_row(results) | {"server": server_row(before, after)}
    return rows


def server_row(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """What the server did during one throughput point (means over its passes/requests)."""

    def ms(name: str) -> float | None:
        mean = mean_of(before, after, name)
        return None if mean is None else mean * 1e3

    return {
        "passes": after["so2serve_pass_seconds_count"] - before["so2serve_pass_seconds_count"],
        "requests_per_pass": mean_of(before, after, "so2serve_batch_requests"),
        "atoms_per_pass": mean_of(before, after, "so2serve_batch_atoms"),
        "pass_ms": ms("so2serve_pass_seconds"),
        "queue_wait_ms": ms("so2serve_queue_wait_seconds"),
        "encode_ms": ms("so2serve_encode_seconds"),
    }


def throughput_row(results: list[tuple[list[float], float]]) -> dict[str, Any]:
    latencies = [x for r, _ in results for x in r]
    elapsed = max(t for _, t in results)
    return {
        "requests": len(latencies),
        "seconds": elapsed,
        "atom_steps_per_s": len(latencies) * 192 / elapsed,
        "latency_p50_ms": float(np.percentile(latencies, 50) * 1e3),
        "latency_p99_ms": float(np.percentile(latencies, 99) * 1e3),
    }


# CPU micro-benchmark with a do-nothing model (--fake-model)


class NullEvaluator:
    """The ``Evaluator`` surface answering zeros: what is left is the service's own cost."""

    execution = FakeExecution(path="null")

    def info(self) -> dict[str, Any]:
        return {"name": "null", "sha256": "0" * 64, "elements": ["H", "O"], "rcut": 6.0}

    def predict(self, structures: Structures, properties: Collection[str]) -> FakePrediction:
        b, n = structures.n_structures, structures.n_atoms
        zeros = torch.zeros
        return FakePrediction(
            energy=zeros(b, dtype=torch.float64),
            energies=zeros(n, dtype=torch.float64) if "energies" in properties else None,
            forces=zeros(n, 3, dtype=torch.float64) if "forces" in properties else None,
            virial=zeros(b, 3, 3, dtype=torch.float64),
            stress=zeros(b, 6, dtype=torch.float64) if "stress" in properties else None,
        )


def _serve_null(port: int) -> None:
    import uvicorn

    from service.api.app import create_app, uvicorn_options
    from service.api.settings import ServiceSettings

    settings = ServiceSettings(port=port, log_level="warning")
    app = create_app(settings, evaluator=NullEvaluator())
    uvicorn.run(app, **uvicorn_options(settings))  # as `so2serve serve` runs it


def start_null_server(port: int) -> multiprocessing.process.BaseProcess:
    server = multiprocessing.get_context("spawn").Process(target=_serve_null, args=(port,))
    server.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            time.sleep(0.1)
    server.kill()
    raise RuntimeError("the fake-model server was not ready within 60 s")


def engine_handoff_ms(repeats: int) -> float:
    """Median admission → worker thread → result delivery of one 192-atom request, no HTTP."""
    from service.engine import BatchLimits, Engine, ServiceMetrics, Worker

    metrics = ServiceMetrics()
    structures = Structures.from_atoms([water_atoms(192)])

    async def run() -> float:
        engine = Engine(
            Worker(NullEvaluator(), metrics), BatchLimits(), metrics, rcut=6.0, elements=[1, 8]
        )
        await engine.start()
        times = []
        for k in range(repeats + 3):
            start = time.perf_counter()
            await engine.evaluate(structures, PROPERTIES)
            if k >= 3:
                times.append(time.perf_counter() - start)
        await engine.stop()
        return statistics.median(times) * 1e3

    return asyncio.run(run())


def stage_breakdown(atoms: Atoms, binary: bool, repeats: int) -> dict[str, float]:
    """Medians (ms) of the CPU stages of one request, each run alone in this process."""
    from service.api.wire import WireFormat, encode, parse_evaluate, structure_results
    from service.engine import EvaluationResult, EvaluationTimings

    fmt = WireFormat.MSGPACK if binary else WireFormat.JSON
    body = encode_request([encode_structure(atoms, binary)], PROPERTIES, binary)
    n = len(atoms)
    result = EvaluationResult(
        energy=np.zeros(1),
        forces=np.zeros((n, 3)),
        energies=None,
        virial=None,
        stress=np.zeros((1, 6)),
        atom_ptr=np.array([0, n]),
        timings=EvaluationTimings(0.0, 0.0, 1),
    )

    def respond() -> bytes:
        rows = structure_results(result, PROPERTIES, np.array([True]))
        return encode({"results": rows, "provenance": {"request_id": "x" * 32}}, fmt)

    answer = respond()
    return {
        "client_encode_ms": median_ms(
            lambda: encode_request([encode_structure(atoms, binary)], PROPERTIES, binary), repeats
        ),
        "server_parse_validate_ms": median_ms(lambda: parse_evaluate(body, fmt), repeats),
        "server_encode_ms": median_ms(respond, repeats),
        "client_decode_ms": median_ms(
            lambda: result_arrays(decode_response(answer, fmt.value)["results"][0]), repeats
        ),
    }


def fake_model_main(args: argparse.Namespace) -> None:
    sizes = args.sizes if args.sizes != list(SIZES) else [192, 1536]
    evaluator = NullEvaluator()
    handoff = engine_handoff_ms(args.repeats)
    port = free_port()
    server = start_null_server(port)
    rows: dict[str, Any] = {}
    url = f"http://127.0.0.1:{port}"
    local = SO2LocalCalculator(evaluator)
    try:
        for n in sizes:
            atoms = water_atoms(n)
            in_process = median_ms(calculator_step(local, atoms), args.repeats)
            for wire in ("json", "msgpack"):
                http = http_round_trip(url, atoms, wire, args.repeats)
                stages = stage_breakdown(atoms, wire == "msgpack", args.repeats)
                round_trip = http["round_trip_ms"]
                rows[f"{len(atoms)}/{wire}"] = {
                    "round_trip_ms": round_trip,
                    "in_process_ms": in_process,
                    "overhead_ms": round_trip - in_process,
                    "server_ms": http["server_ms"],
                    "client_and_transport_ms": http["client_and_transport_ms"],
                    "stages_ms": stages,  # each stage alone in this process
                    "engine_handoff_ms": handoff,
                }
    finally:
        server.terminate()
        server.join(30)
    result = {
        "benchmark": "service-overhead-cpu-fake-model",
        "date": datetime.now(UTC).isoformat(),
        "command": " ".join(sys.argv),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "results": rows,
    }
    print(json.dumps(result, indent=2))
    print(f"{'case':>14} {'round trip':>11} {'in-process':>11} {'overhead':>9}  (ms, medians)")
    for key, row in rows.items():
        print(
            f"{key:>14} {row['round_trip_ms']:11.3f} {row['in_process_ms']:11.3f} "
            f"{row['overhead_ms']:9.3f}"
        )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")


def main() -> None:
    # A plain SIGTERM (e.g. `timeout`) must still run the `finally` that stops the server.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model file (default: shipped, else random bar config)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per client count")
    parser.add_argument(
        "--quick", action="store_true", help="8 repeats and 4 s per client count (GPU smoke run)"
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--clients", type=int, nargs="+", default=list(CLIENTS))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--fake-model", action="store_true", help="CPU overhead breakdown with a do-nothing model"
    )
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.duration = min(args.repeats, 8), min(args.duration, 4.0)
    if args.fake_model:
        fake_model_main(args)
        return
    device = torch.device(args.device)
    workdir = Path(tempfile.mkdtemp(prefix="so2bench-"))
    model = model_file(args.model, workdir)

    potential = load_potential(model, device=args.device)
    batch = max(args.clients)
    in_process = in_process_phase(potential, args.sizes, batch, args.repeats)
    execution = vars(potential.execution)
    del potential
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    port = free_port()
    server = start_server(model, args.device, port)
    try:
        url = f"http://127.0.0.1:{port}"
        overhead = http_overhead_phase(url, args.sizes, args.repeats)
        throughput = throughput_phase(url, args.clients, args.duration)
    finally:
        server.terminate()
        server.wait(60)

    for key, row in overhead.items():
        size = key.split("/")[0]
        row["overhead_ms"] = row["round_trip_ms"] - in_process["single_ms"][size]
        # Device pass on the server vs the in-process call without its host validation.
        row["server_compute_minus_in_process_predict_ms"] = row["server_ms"]["compute_ms"] - (
            in_process["single_ms"][size] - in_process["validate_ms"][size]
        )
    batched = in_process[f"batched_{batch}x192"]["atom_steps_per_s"]
    serial = in_process["serial_192"]["atom_steps_per_s"]
    for row in throughput.values():
        row["vs_in_process_batched"] = row["atom_steps_per_s"] / batched
        row["vs_in_process_serial"] = row["atom_steps_per_s"] / serial
    result = {
        "benchmark": "service",
        "date": datetime.now(UTC).isoformat(),
        "command": " ".join(sys.argv),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": _version("triton"),
        "python": sys.version.split()[0],
        "http_stack": {name: _version(name) for name in ("uvicorn", "uvloop", "httptools")},
        "model": str(model),
        "execution": execution,
        "in_process": in_process,
        "http_overhead": overhead,
        "http_throughput_192": throughput,
        f"http{batch}_vs_in_process_batched": throughput[str(batch)]["atom_steps_per_s"] / batched,
    }
    out = (
        args.out or ROOT / "benchmarks" / "results" / f"service-{datetime.now():%Y%m%d-%H%M%S}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    print_summary(overhead, throughput)
    print(f"wrote {out}")


def print_summary(overhead: dict[str, Any], throughput: dict[str, Any]) -> None:
    print(f"{'case':>14} {'HTTP':>10} {'overhead':>9}  (ms, medians; target ≤ 1 ms at ≤ 1k atoms)")
    for key, row in overhead.items():
        print(f"{key:>14} {row['round_trip_ms']:10.3f} {row['overhead_ms']:9.3f}")
    print(f"{'clients':>8} {'atom-steps/s':>13} {'/batched':>9} {'/serial':>8} {'p50 ms':>8}")
    for clients, row in throughput.items():
        print(
            f"{clients:>8} {row['atom_steps_per_s']:13.0f} {row['vs_in_process_batched']:9.2f} "
            f"{row['vs_in_process_serial']:8.2f} {row['latency_p50_ms']:8.1f}"
        )


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "absent"


if __name__ == "__main__":
    main()
