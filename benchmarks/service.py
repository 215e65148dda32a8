"""Service benchmark (GPU; the lead runs it): HTTP overhead and throughput vs in-process.

    python benchmarks/service.py [--model FILE] [--device cuda] [--quick] [--profile-server]
                                 [--phases in_process engine profile http throughput]
    python benchmarks/service.py --device cpu --fake-model [--sizes 192 768] [--repeats 200]

The results file is rewritten after every phase (with ``phase_seconds``), so a run cut short
keeps the phases it finished; ``--phases`` runs a subset (the ratios need ``in_process``).
``--profile-server`` adds the ``profile`` phase: ``PROFILE_PASSES`` passes of sequential
192-atom requests recorded by ``service.engine.profiling.PassProfiler`` behind the engine in
this process (``engine_in_process.profile``) and in the server (``server_profile``, via
``SO2SERVE_PROFILE_*``), side by side: wall, worker CPU vs blocked, event-loop and other
threads' CPU, garbage collections, top worker ops, CUDA kernel time, interpreter and thread
settings. ``--server-env NAME=VALUE`` sets environment variables of the server alone (thread
counts, ``SO2SERVE_*`` settings) to test a suspect.

1. Per-request overhead: one periodic water box of 192, 1,536 and 12,288 atoms, energy +
   forces + stress, through the ASE calculators: ``SO2LocalCalculator`` (in process) against
   ``SO2Calculator`` (HTTP, JSON and msgpack); medians, overhead = HTTP − in-process.
   Target: ≤ 1 ms at ≤ 1k atoms. The same potential is also timed behind the engine in this
   process (``Engine.evaluate`` as a lone keyed client: admission, the pass inline as a lone
   HTTP client's, host results, no HTTP), which
   splits the overhead into the engine's share (engine − calculator) and HTTP's (round trip
   − engine), and the worker's compute time into the same step with and without a server.
   Those medians come from phases minutes apart, and the step drifts by ±0.3–0.5 ms on the
   H200 between them; ``http_overhead_paired`` (below ``LARGE`` atoms) alternates the two
   calculators call by call on the same structure (the in-process model loaded beside the
   server, the same file, device, path and precision) and reports the median of the per-pair
   differences with its quartiles, in which that drift cancels.
2. Throughput with 192-atom structures: 1, 8 and 64 concurrent HTTP clients (sequential, each
   on its own keep-alive connection in a thread, spread over several client processes so that
   Python on the client side is not the bottleneck) vs the
   in-process potential serially (one structure per pass) and batched (64 per pass), with
   the ratios. Target: 64 clients ≥ 80 % of in-process batched. Each point's clients start
   together; the rate is that of the steady window of ``--duration`` seconds after a
   ``RAMP_S`` ramp (the first passes: a lone request, then everyone else), which is reported
   apart (``ramp``), and the server's counters cover that window alone (``busy_share``: pass
   time over wall time; ``pass_gap_ms``: the device idle between a pass and a next one whose
   work was already queued). The same client counts are run against the engine in this
   process (sequential coroutines, each validating its structure as the server does): what
   batching reaches without HTTP.

Server-side phases come with every case: the medians of each answer's
``provenance.timings`` (read, decode, admit, queue, compute, handoff, total) plus the mean response
encoding time and, for the throughput points, the mean requests and atoms per device pass,
pass time and queue wait, all from ``/metrics`` differences around the case; ``inline_share``
is the share of answers whose pass ran on the server's event loop (a lone client, see
``service.engine.batcher``), ``client_cpu_ms`` the calculator's CPU time per call. The
calculator polls for its answer near the time it is due (``spin_lead_ms``, its default);
``<n>/msgpack-sleep`` is the same case with a calculator that sleeps until the answer
arrives, alternated with ``<n>/msgpack``. What the round trip leaves beyond the server's own
time (``client_and_transport_ms``) is the client (encoding, decoding, ASE bookkeeping) and
loopback HTTP. ``http_echo`` gives that floor: the same request bytes to a bare app served
like the service, answered at once and after a wait in a device-like thread or busy on the
event loop, with a sleeping or polling client (``wake_ms``: what waking up costs after a
pass-long sleep). ``engine_in_process.interleaved_192`` alternates engine requests (in the
worker thread, and inline as a lone keyed client) with the same ``predict`` called directly,
so that the engine's own compute cost and the validation in flow are measured without the
device's drift between phases.

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
result). Then the batching of 192-atom clients against a model that sleeps like a device
pass (``SleepEvaluator``: a fixed cost plus a per-atom cost, GIL released), with gathering
off (``--batch-window-ms 0``) and on, and against a launch-bound one (``LaunchEvaluator``:
an eager pass's ~1,500 launches feeding a simulated device, which idles whenever the worker
thread waits for the GIL): requests per pass and throughput against the same model's
batched pass. Written to ``--out`` when given.

``--batch-window-ms`` and ``--switch-interval-ms`` are passed to the server (its longest wait
for returning clients, its interpreter's thread switch interval), to compare settings.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
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
from concurrent.futures import ThreadPoolExecutor
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

from clients._connection import KeepAliveConnection  # noqa: E402
from clients.http import (  # noqa: E402
    DEFAULT_SPIN_LEAD_MS,
    SO2Calculator,
    decode_response,
    encode_request,
    encode_structure,
    result_arrays,
)
from clients.local import SO2LocalCalculator  # noqa: E402
from service.engine import Evaluator  # noqa: E402
from service.engine.batcher import INLINE_QUIET_S  # noqa: E402
from service.engine.profiling import PassProfiler, ProfileRequest  # noqa: E402
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
        calculator.calculate(atoms, PROPERTIES, all_changes)
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
            functools.partial(Structures.from_atoms, [atoms]), reps
        )
    frames = [water_atoms(192, seed=k) for k in range(batch)]
    serial = median_ms(in_process_step(potential, frames[:1]), repeats)
    rows["serial_192"] = {"pass_ms": serial, "atom_steps_per_s": 192 / (serial * 1e-3)}
    # Half the crowd too: the pass two alternating cohorts would each get.
    for n in sorted({max(1, batch // 2), batch}):
        batched = median_ms(in_process_step(potential, frames[:n]), max(3, repeats // 4))
        rows[f"batched_{n}x192"] = {
            "pass_ms": batched,
            "atom_steps_per_s": n * 192 / (batched * 1e-3),
        }
    return rows


def make_engine(evaluator: Evaluator, metrics: Any, profiler: Any = None) -> Any:
    """An engine around ``evaluator`` with the server's default limits."""
    from ase.data import atomic_numbers

    from service.api.app import batch_limits
    from service.api.settings import ServiceSettings
    from service.engine import Engine, Worker

    info = evaluator.info()
    return Engine(
        [Worker(evaluator, metrics)],
        batch_limits(ServiceSettings(), evaluator.execution.device),
        metrics,
        rcut=float(info["rcut"]),
        elements=[atomic_numbers[e] for e in info["elements"]],
        profiler=profiler,
    )


LONE_CLIENT = "bench"
"""The key of the engine phase's sequential client: a keyed client that is alone has its
passes run on the event loop (inline), as a lone HTTP client's are; anonymous requests run
in the worker thread."""


async def _engine_requests(engine: Any, atoms: Atoms, repeats: int) -> dict[str, float]:
    """Medians (ms) of ``repeats`` sequential requests of a lone keyed client: validation +
    ``Engine.evaluate`` in all, and the engine's phases as a server reports them."""
    rows: list[dict[str, float]] = []
    for k in range(repeats + 2):
        # The loop turns between requests, as it does between an HTTP client's (they come
        # through its poll); the engine runs a pass inline only once it has.
        await asyncio.sleep(0)
        start = time.perf_counter()
        structures = Structures.from_atoms([atoms])
        validated = time.perf_counter()
        result = await engine.evaluate(structures, PROPERTIES, client=LONE_CLIENT)
        resumed = time.perf_counter()
        if k >= 2:  # the first two: warm-up, as for every other timing here
            t = result.timings
            rows.append(
                {
                    "total_ms": (resumed - start) * 1e3,
                    "validate_ms": (validated - start) * 1e3,
                    "admit_ms": (t.admitted_at - validated) * 1e3,
                    "queue_ms": t.queue_s * 1e3,
                    "compute_ms": t.compute_s * 1e3,
                    "handoff_ms": (resumed - t.finished_at) * 1e3,
                }
            )
    return {name: statistics.median(r[name] for r in rows) for name in rows[0]}


async def _interleaved_with_direct(
    engine: Any, evaluator: Evaluator, atoms: Atoms, repeats: int
) -> dict[str, float]:
    """Engine requests, in the worker thread and inline, alternating with the same predict
    called directly on this thread.

    Every side validates the same structure right after a pass (``validate`` in flow: caches
    cold as a server finds them, unlike the hot loop of ``in_process.validate_ms``) and makes
    the same host copies (``to_host``), so ``paired_compute_minus_direct_ms`` (worker thread:
    an anonymous request) and ``paired_inline_compute_minus_direct_ms`` (a lone keyed client:
    the pass on the loop thread), medians of per-step differences, are what running the step
    in the engine costs either way; phase-to-phase drift of the device (a millisecond on the
    H200 between phases) cancels. ``*_total_ms``: validation to result in hand.
    """
    from service.engine.worker import to_host

    names = ("energy", "forces", "energies", "virial", "stress")
    rows: list[dict[str, float]] = []
    for k in range(repeats + 2):
        start = time.perf_counter()
        structures = Structures.from_atoms([atoms])
        validated = time.perf_counter()
        prediction = evaluator.predict(structures, PROPERTIES)
        to_host({name: getattr(prediction, name) for name in names})
        predicted = time.perf_counter()
        row = {
            "direct_validate_ms": (validated - start) * 1e3,
            "direct_predict_ms": (predicted - validated) * 1e3,
            "direct_total_ms": (predicted - start) * 1e3,
        }
        for label, client in (("engine", None), ("inline", LONE_CLIENT)):
            engine_start = time.perf_counter()
            structures = Structures.from_atoms([atoms])
            engine_validated = time.perf_counter()
            result = await engine.evaluate(structures, PROPERTIES, client=client)
            done = time.perf_counter()
            compute_ms = result.timings.compute_s * 1e3
            row |= {
                f"{label}_ran_inline": float(result.timings.inline),  # its median: 1 or 0
                f"{label}_validate_ms": (engine_validated - engine_start) * 1e3,
                f"{label}_compute_ms": compute_ms,
                f"{label}_total_ms": (done - engine_start) * 1e3,
            }
        row["paired_compute_minus_direct_ms"] = row["engine_compute_ms"] - row["direct_predict_ms"]
        row["paired_inline_compute_minus_direct_ms"] = (
            row["inline_compute_ms"] - row["direct_predict_ms"]
        )
        if k >= 2:
            rows.append(row)
    return {name: statistics.median(r[name] for r in rows) for name in rows[0]}


async def _engine_clients(engine: Any, clients: int, duration: float) -> tuple[int, float]:
    """Requests answered to ``clients`` sequential in-process clients (each validating its
    192-atom structure, as the server decodes it) within ``duration``, and the wall time."""
    frames = [water_atoms(192, seed=k) for k in range(8)]
    done = 0
    begin = time.perf_counter()
    stop = begin + duration

    async def one(k: int) -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await asyncio.sleep(0)  # as between an HTTP client's requests (_engine_requests)
            structures = Structures.from_atoms([frames[k % len(frames)]])
            await engine.evaluate(structures, PROPERTIES, client=k)
            done += 1

    await asyncio.gather(*(one(k) for k in range(clients)))
    return done, time.perf_counter() - begin


def engine_phase(
    evaluator: Evaluator,
    sizes: list[int],
    repeats: int,
    client_counts: list[int],
    duration: float,
    profile: ProfileRequest | None = None,
) -> dict[str, Any]:
    """The evaluator behind an ``Engine`` in this process, with the interpreter tuned as the
    server tunes it: per-size request phases, and the throughput of concurrent in-process
    clients with the engine's batching (no HTTP). With ``profile``, first the profiled passes
    of sequential 192-atom requests (``profile_requests``), as the server records them."""
    from service.api.app import tuned_interpreter
    from service.api.settings import ServiceSettings
    from service.engine import ServiceMetrics

    async def run() -> dict[str, Any]:
        metrics = ServiceMetrics()
        profiler = None if profile is None else PassProfiler(profile)
        engine = make_engine(evaluator, metrics, profiler)
        await engine.start()
        rows: dict[str, Any] = {"requests_ms": {}, "throughput_192": {}}
        try:
            if profiler is not None:
                atoms = water_atoms(192)
                await _engine_requests(engine, atoms, profile_requests(profiler.request))
                rows["profile"] = profiler.summary()
            for n in sizes:
                atoms = water_atoms(n)
                reps = repeats_for(len(atoms), repeats)
                rows["requests_ms"][str(len(atoms))] = await _engine_requests(engine, atoms, reps)
            if sizes:
                rows["interleaved_192"] = await _interleaved_with_direct(
                    engine, evaluator, water_atoms(192), repeats
                )
            for clients in client_counts:
                before = registry_totals(metrics.registry)
                done, elapsed = await _engine_clients(engine, clients, duration)
                after = registry_totals(metrics.registry)
                rows["throughput_192"][str(clients)] = {
                    "requests": done,
                    "seconds": elapsed,
                    "atom_steps_per_s": done * 192 / elapsed,
                    "server": server_row(before, after),
                }
        finally:
            await engine.stop()
        return rows

    with tuned_interpreter(ServiceSettings().switch_interval_ms * 1e-3):
        return asyncio.run(run())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(
    model: Path,
    device: str,
    port: int,
    window_ms: float | None,
    switch_ms: float | None,
    profile: ProfileRequest | None = None,
    extra_env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    inherited = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), inherited]))}
    env |= extra_env or {}
    if switch_ms is not None:  # a setting without a flag: its environment variable
        env["SO2SERVE_SWITCH_INTERVAL_MS"] = str(switch_ms)
    if profile is not None:
        env |= {
            "SO2SERVE_PROFILE_PASSES": str(profile.passes),
            "SO2SERVE_PROFILE_SKIP_PASSES": str(profile.skip),
            "SO2SERVE_PROFILE_DIR": str(profile.out_dir),
        }
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
    if window_ms is not None:
        command += ["--batch-window-ms", str(window_ms)]
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
    "so2serve_gather_wait_seconds",
    "so2serve_pass_gap_seconds",
)
INLINE_PASSES = "so2serve_inline_passes_total"
_WANTED_TOTALS = {f"{name}{suffix}" for name in _SERVER_TOTALS for suffix in ("_sum", "_count")} | {
    INLINE_PASSES
}


def server_totals(url: str) -> dict[str, float]:
    """``_sum`` and ``_count`` of the server's unlabelled histograms in ``_SERVER_TOTALS``,
    its count of inline passes, and ``wall_s`` (``time.monotonic()`` when read)."""
    totals = {"wall_s": time.monotonic()}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name in _WANTED_TOTALS:
            totals[name] = float(value)
    return totals


def registry_totals(registry: Any) -> dict[str, float]:
    """``server_totals`` of an engine in this process."""
    totals = {name: registry.get_sample_value(name) or 0.0 for name in _WANTED_TOTALS}
    return totals | {"wall_s": time.monotonic()}


def mean_of(before: dict[str, float], after: dict[str, float], name: str) -> float | None:
    count = after[f"{name}_count"] - before[f"{name}_count"]
    return (after[f"{name}_sum"] - before[f"{name}_sum"]) / count if count else None


def http_round_trip(
    url: str, atoms: Atoms, wire: str, repeats: int, spin_lead_ms: float = DEFAULT_SPIN_LEAD_MS
) -> dict[str, Any]:
    """Median SO2Calculator call, the server's median phases, its mean answer encoding, the
    share of answers whose pass ran inline (on the server's event loop), and the client's CPU
    time per call (``spin_lead_ms``: the calculator's poll before the answer is due)."""
    timings: list[dict[str, float]] = []
    inline: list[bool] = []
    with SO2Calculator(
        url,
        timeout=600,
        wire=wire,  # type: ignore[arg-type]
        spin_lead_ms=spin_lead_ms,
    ) as calculator:
        compute = calculator_step(calculator, atoms)
        # The previous case's connection counts as a client that may come back until
        # INLINE_QUIET_S after its last answer; until then a lone client is not run inline.
        time.sleep(1.5 * INLINE_QUIET_S)

        def step() -> object:
            results = compute()
            assert calculator.provenance is not None
            timings.append(calculator.provenance["timings"])
            inline.append(bool(calculator.provenance.get("inline")))
            return results

        before = server_totals(url)
        cpu_before = time.process_time()
        total = median_ms(step, repeats)
        client_cpu_ms = (time.process_time() - cpu_before) / len(timings) * 1e3
        after = server_totals(url)
    timed = timings[-repeats:]  # as the round trip's median: without the warm-up calls
    server = {k: statistics.median(t[k] for t in timed) for k in timed[0]}
    encode = mean_of(before, after, "so2serve_encode_seconds")
    server["encode_ms"] = (encode or 0.0) * 1e3
    return {
        "round_trip_ms": total,
        "server_ms": server,
        "client_and_transport_ms": total - server["total_ms"] - server["encode_ms"],
        "inline_share": sum(inline[-repeats:]) / repeats,
        "client_cpu_ms": client_cpu_ms,
    }


def http_overhead_phase(url: str, sizes: list[int], repeats: int) -> dict[str, Any]:
    """Per size: JSON and msgpack with the calculator's defaults, and (below ``LARGE``
    atoms) msgpack with a calculator that sleeps until its answer arrives
    (``msgpack-sleep``, ``spin_lead_ms=0``), interleaved with the default msgpack one."""
    rows: dict[str, Any] = {}
    for n in sizes:
        atoms = water_atoms(n)
        reps = repeats_for(len(atoms), repeats)
        rows[f"{len(atoms)}/json"] = http_round_trip(url, atoms, "json", reps)
        if len(atoms) >= LARGE:
            rows[f"{len(atoms)}/msgpack"] = http_round_trip(url, atoms, "msgpack", reps)
            continue
        # Halves alternating with the sleeping client: the host drifts between cases.
        halves: dict[str, list[dict[str, Any]]] = {"msgpack": [], "msgpack-sleep": []}
        for _ in range(2):
            for key, lead in (("msgpack", DEFAULT_SPIN_LEAD_MS), ("msgpack-sleep", 0.0)):
                halves[key].append(
                    http_round_trip(url, atoms, "msgpack", max(5, reps // 2), spin_lead_ms=lead)
                )
        for key, parts in halves.items():
            rows[f"{len(atoms)}/{key}"] = _mean_rows(parts)
    return rows


PAIRS_PER_REPEAT = 3
"""Timed pairs per size of the paired overhead, per ``--repeats``: the IQR of the per-pair
differences wants more samples than a median does."""
PAIR_WARMUP = 5
"""Untimed pairs first: the in-process potential records its CUDA graph on its third call."""
PAIR_SHIFT_A = 1e-5
"""Rigid shift (Å) of the structure per pair: new positions every call, the same neighbour
graph up to rounding (and so the same CUDA-graph bucket) on both sides."""


def paired_overhead(
    url: str, local: SO2LocalCalculator, atoms: Atoms, pairs: int
) -> dict[str, Any]:
    """``pairs`` alternations of one in-process call and one HTTP call (msgpack, the
    calculator's defaults) on the same positions; which side goes first alternates too.

    ``overhead_ms`` is the median of the per-pair differences (HTTP − in-process), with its
    quartiles: the device's drift between phases (±0.3–0.5 ms on the H200) cancels, unlike in
    ``http_overhead`` where the two medians come from phases minutes apart. Both sides share
    the device but never run at once; each call follows one of the other process, so a GPU
    context switch, if it costs anything, is paid by both.
    """
    base = atoms.positions.copy()
    calls: dict[str, list[float]] = {"http": [], "local": []}
    timings: list[dict[str, float]] = []
    inline: list[bool] = []
    with SO2Calculator(url, timeout=600) as remote:
        server_execution = remote.info()["execution"]
        local_execution = {
            key: getattr(local.potential.execution, key) for key in ("path", "precision", "device")
        }
        if any(server_execution[key] != value for key, value in local_execution.items()):
            raise RuntimeError(
                f"in-process execution {local_execution} differs from the server's "
                f"{server_execution}: the pairs would compare different steps"
            )
        steps = {"http": calculator_step(remote, atoms), "local": calculator_step(local, atoms)}
        time.sleep(1.5 * INLINE_QUIET_S)  # see http_round_trip
        for k in range(PAIR_WARMUP + pairs):
            atoms.positions = base + PAIR_SHIFT_A * k
            for side in ("local", "http") if k % 2 == 0 else ("http", "local"):
                start = time.perf_counter()
                steps[side]()
                elapsed_ms = (time.perf_counter() - start) * 1e3
                if k >= PAIR_WARMUP:
                    calls[side].append(elapsed_ms)
            if k >= PAIR_WARMUP:
                assert remote.provenance is not None
                timings.append(remote.provenance["timings"])
                inline.append(bool(remote.provenance.get("inline")))
    atoms.positions = base
    differences = [h - c for h, c in zip(calls["http"], calls["local"], strict=True)]
    q1, q3 = (float(q) for q in np.percentile(differences, [25, 75]))
    round_trip, in_process = statistics.median(calls["http"]), statistics.median(calls["local"])
    return {
        "pairs": pairs,
        "overhead_ms": statistics.median(differences),
        "overhead_q1_ms": q1,
        "overhead_q3_ms": q3,
        "overhead_iqr_ms": q3 - q1,
        "round_trip_ms": round_trip,
        "in_process_ms": in_process,
        "difference_of_medians_ms": round_trip - in_process,
        "inline_share": sum(inline) / pairs,
        "server_ms": {name: statistics.median(t[name] for t in timings) for name in timings[0]},
        "execution": local_execution,
    }


def paired_overhead_phase(
    url: str, local: SO2LocalCalculator, sizes: list[int], repeats: int
) -> dict[str, Any]:
    """``paired_overhead`` per size below ``LARGE`` atoms, each printed as it is done."""
    rows: dict[str, Any] = {}
    for n in sizes:
        atoms = water_atoms(n)
        if len(atoms) >= LARGE:
            continue
        rows[str(len(atoms))] = paired_overhead(url, local, atoms, PAIRS_PER_REPEAT * repeats)
        print(paired_line(str(len(atoms)), rows[str(len(atoms))]), flush=True)
    return rows


def paired_line(size: str, row: dict[str, Any]) -> str:
    """One size's paired overhead as printed during the phase and in the summary."""
    return (
        f"paired overhead, {size} atoms: {row['overhead_ms']:.3f} ms "
        f"(IQR {row['overhead_q1_ms']:.3f}–{row['overhead_q3_ms']:.3f}, {row['pairs']} pairs); "
        f"HTTP {row['round_trip_ms']:.3f}, in-process {row['in_process_ms']:.3f}, "
        f"inline share {row['inline_share']:.2f}"
    )


def _mean_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The mean of equally shaped result rows (numbers and dicts of numbers)."""
    out: dict[str, Any] = {}
    for key, value in rows[0].items():
        if isinstance(value, dict):
            out[key] = {k: statistics.fmean(r[key][k] for r in rows) for k in value}
        else:
            out[key] = statistics.fmean(r[key] for r in rows)
    return out


ECHO_PAYLOAD_BYTES = 5_100
"""About the msgpack answer to a 192-atom energy + forces + stress request."""


def _serve_echo(port: int) -> None:
    """A bare ASGI app served as ``so2serve serve`` serves (uvicorn options, event loop,
    protocol): it reads the body, optionally holds the request in a device-like thread for
    ``X-Delay-Ms`` (``DeviceThread``, the engine's hop there and back) or, with ``X-Inline``,
    busy on the event loop itself for that long (a pass run inline, its thread never asleep),
    and answers a fixed payload, with the time really held in ``X-Slept-Ms``."""
    import uvicorn

    from service.api import app as service_app
    from service.api.settings import ServiceSettings
    from service.engine.worker import DeviceThread

    payload = bytes(ECHO_PAYLOAD_BYTES)
    device: list[DeviceThread] = []

    def sleep_ms(delay_s: float) -> float:
        start = time.perf_counter()
        time.sleep(delay_s)
        return (time.perf_counter() - start) * 1e3

    def busy_ms(delay_s: float) -> float:
        start = time.perf_counter()
        while time.perf_counter() - start < delay_s:
            pass
        return (time.perf_counter() - start) * 1e3

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
        headers_in = dict(scope["headers"])
        delay_ms = float(headers_in.get(b"x-delay-ms", b"0"))
        slept_ms = 0.0
        if delay_ms > 0 and b"x-inline" in headers_in:
            slept_ms = busy_ms(delay_ms * 1e-3)
        elif delay_ms > 0:
            if not device:
                device.append(DeviceThread("echo-device"))
            slept_ms = await device[0].run(functools.partial(sleep_ms, delay_ms * 1e-3))
        headers = [
            (b"content-type", b"application/msgpack"),
            (b"content-length", str(len(payload)).encode()),
            (b"x-slept-ms", repr(slept_ms).encode()),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": payload})

    settings = ServiceSettings(port=port, log_level="warning")
    uvicorn.run(app, **{**service_app.uvicorn_options(settings), "lifespan": "off"})


def echo_phase(delays_ms: list[float], repeats: int) -> dict[str, Any]:
    """The HTTP floor, and what a long wait adds to it: round trips of a 192-atom request
    body to the bare app of ``_serve_echo`` over the calculator's connection, answered at
    once and after a wait of each delay (the time held subtracted): ``delay_*`` in a
    device-like thread (the worker path), ``inline_*`` busy on the event loop (a lone
    client's inline pass), ``inline_*_spin`` the same with the client polling for its answer
    from the calculator's default lead before it is due. Cases alternate in rounds (the host
    drifts).

    ``wake_ms`` (a case's round trip − the immediate one) is what waking up costs after
    that long asleep: the client in its socket read, the server's loop in its poll, the
    thread handoffs; on a machine whose idle cores drop into deep sleep states it grows
    with the delay, and a real request pays it on every step. ``client_cpu_ms``: the
    client's CPU time per request of each case (what spinning costs).
    """
    port = free_port()
    server = multiprocessing.get_context("spawn").Process(target=_serve_echo, args=(port,))
    server.start()
    url = f"http://127.0.0.1:{port}"
    body = encode_request([encode_structure(water_atoms(192), True)], PROPERTIES, True)
    accept = {"Accept": "application/msgpack"}
    sleeper = KeepAliveConnection(url, 60.0, accept)
    spinner = KeepAliveConnection(url, 60.0, accept, spin_lead_s=DEFAULT_SPIN_LEAD_MS * 1e-3)
    cases: list[tuple[str, KeepAliveConnection, dict[str, str]]] = [("delay_0_ms", sleeper, {})]
    for delay in delays_ms:
        held = {"X-Delay-Ms": repr(delay)}
        cases += [
            (f"delay_{delay:g}_ms", sleeper, held),
            (f"inline_{delay:g}_ms", sleeper, held | {"X-Inline": "1"}),
            (f"inline_{delay:g}_ms_spin", spinner, held | {"X-Inline": "1"}),
        ]
    times: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    cpu_ms: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    rounds = 4
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                sleeper.request("GET", "/")
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        for _ in range(rounds):
            for name, connection, extra in cases:
                headers = {"Content-Type": "application/msgpack", **extra}
                per_round = max(5, repeats // rounds)
                cpu_before = time.process_time()
                for k in range(per_round + 5):
                    start = time.perf_counter()
                    reply = connection.request("POST", "/evaluate", body, headers)
                    elapsed_ms = (time.perf_counter() - start) * 1e3
                    if k >= 5:  # the first ones: warm-up (and the spinner's prediction)
                        times[name].append(elapsed_ms - float(reply.header("x-slept-ms") or 0.0))
                cpu_ms[name].append((time.process_time() - cpu_before) / (per_round + 5) * 1e3)
        sleeper.close()
        spinner.close()
    finally:
        server.terminate()
        server.join(30)
    rows: dict[str, Any] = {name: statistics.median(values) for name, values in times.items()}
    floor = rows["delay_0_ms"]
    rows["wake_ms"] = {key: value - floor for key, value in rows.items() if key != "delay_0_ms"}
    rows["client_cpu_ms"] = {name: statistics.median(values) for name, values in cpu_ms.items()}
    return rows


def _sequential_client(
    url: str, bodies: list[bytes], first: int, begin: float, stop: float
) -> list[tuple[float, float]]:
    """One MD-like client on its own keep-alive connection (the one ``SO2Calculator`` uses):
    from ``begin`` (``time.monotonic()``, the same clock in every process), the next request
    as soon as the answer is in, until ``stop``; (answer time, latency) of each request."""
    connection = KeepAliveConnection(url, 120.0, {"Accept": MSGPACK})
    headers = {"Content-Type": MSGPACK}
    answers: list[tuple[float, float]] = []
    k = first
    time.sleep(max(0.0, begin - time.monotonic()))
    try:
        while time.monotonic() < stop:
            start = time.monotonic()
            reply = connection.request("POST", "/evaluate", bodies[k % len(bodies)], headers)
            if reply.status != 200:
                raise RuntimeError(f"/evaluate answered {reply.status}: {reply.content[:200]!r}")
            done = time.monotonic()
            answers.append((done, done - start))
            k += 1
    finally:
        connection.close()
    return answers


def _client_process(args: tuple[str, int, float, float]) -> list[tuple[float, float]]:
    """``clients`` sequential clients in threads of this process (each waits in its socket
    with the GIL released, and its Python per request is ~0.05 ms), all starting at ``begin``
    and sending until ``stop``: (answer time, latency) of every request."""
    url, clients, begin, stop = args
    bodies = [
        encode_request([encode_structure(water_atoms(192, seed=k), True)], PROPERTIES, True)
        for k in range(8)
    ]
    with ThreadPoolExecutor(clients) as pool:
        runs = list(
            pool.map(lambda k: _sequential_client(url, bodies, k, begin, stop), range(clients))
        )
    return [x for run in runs for x in run]


CLIENT_PROCESSES = 8

RAMP_S = 1.5
"""Seconds of each throughput point before its measured window: the clients start together
and the server settles into its steady rhythm (a crowd's first passes are a lone request,
then everyone else); reported apart as ``ramp``."""

START_DELAY_S = 1.0
"""The clients of a point start this long after it is handed to the client processes (each
has to receive its task and build its request bodies first)."""


def throughput_phase(
    url: str, client_counts: list[int], duration: float, processes: int = CLIENT_PROCESSES
) -> dict[str, Any]:
    """Per client count: the steady rate over ``duration`` seconds after a ``RAMP_S`` ramp,
    with the server's counters over that same window."""
    rows: dict[str, Any] = {}
    # One pool for all client counts: starting a process imports torch (seconds each).
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        pool.map(time.sleep, [0.0] * processes, chunksize=1)  # every process has started
        for clients in client_counts:
            used = min(clients, processes)
            shares = [clients // used + (k < clients % used) for k in range(used)]
            begin = time.monotonic() + START_DELAY_S
            window = (begin + RAMP_S, begin + RAMP_S + duration)
            tasks = [(url, share, begin, window[1]) for share in shares]
            running = pool.map_async(_client_process, tasks, chunksize=1)
            time.sleep(max(0.0, window[0] - time.monotonic()))
            before = server_totals(url)
            time.sleep(max(0.0, window[1] - time.monotonic()))
            after = server_totals(url)
            answers = [x for part in running.get() for x in part]
            rows[str(clients)] = throughput_row(answers, begin, window) | {
                "server": server_row(before, after)
            }
    return rows


def server_row(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """What the server did during one throughput point (means over its passes/requests).
    ``pass_gap_ms``: the device idle between a pass and the next when that one's work was
    already queued (``so2serve_pass_gap_seconds``); ``busy_share``: pass time over the
    window's wall time."""

    def ms(name: str) -> float | None:
        mean = mean_of(before, after, name)
        return None if mean is None else mean * 1e3

    gathered = "so2serve_gather_wait_seconds"
    gap = "so2serve_pass_gap_seconds"
    wall = after["wall_s"] - before["wall_s"]
    busy = after["so2serve_pass_seconds_sum"] - before["so2serve_pass_seconds_sum"]
    return {
        "passes": after["so2serve_pass_seconds_count"] - before["so2serve_pass_seconds_count"],
        "inline_passes": after.get(INLINE_PASSES, 0.0) - before.get(INLINE_PASSES, 0.0),
        "requests_per_pass": mean_of(before, after, "so2serve_batch_requests"),
        "atoms_per_pass": mean_of(before, after, "so2serve_batch_atoms"),
        "pass_ms": ms("so2serve_pass_seconds"),
        "busy_share": busy / wall if wall > 0 else None,
        "pass_gaps": after.get(f"{gap}_count", 0.0) - before.get(f"{gap}_count", 0.0),
        "pass_gap_ms": ms(gap),
        "queue_wait_ms": ms("so2serve_queue_wait_seconds"),
        "encode_ms": ms("so2serve_encode_seconds"),
        "gathers": after[f"{gathered}_count"] - before[f"{gathered}_count"],
        "gather_wait_ms": ms(gathered),
    }


def throughput_row(
    answers: list[tuple[float, float]], begin: float, window: tuple[float, float]
) -> dict[str, Any]:
    """The steady rate (answers within ``window``) and the ramp's (``begin`` → window)."""
    steady = [latency for done, latency in answers if window[0] <= done < window[1]]
    ramp = sum(1 for done, _ in answers if done < window[0])
    seconds = window[1] - window[0]
    return {
        "requests": len(steady),
        "seconds": seconds,
        "atom_steps_per_s": len(steady) * 192 / seconds,
        "latency_p50_ms": float(np.percentile(steady, 50) * 1e3) if steady else None,
        "latency_p99_ms": float(np.percentile(steady, 99) * 1e3) if steady else None,
        "ramp": {
            "seconds": window[0] - begin,
            "requests": ramp,
            "atom_steps_per_s": ramp * 192 / (window[0] - begin),
        },
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


def _python_work(steps: int) -> None:
    """Pure-Python busy work that holds the GIL (the stand-in for an eager pass's launches)."""
    for _ in range(steps):
        pass


def python_steps_per_s() -> float:
    """How many ``_python_work`` steps this interpreter runs per second, alone."""
    steps = 2_000_000
    start = time.perf_counter()
    _python_work(steps)
    return steps / (time.perf_counter() - start)


class SleepEvaluator(NullEvaluator):
    """A do-nothing model that takes as long as a device pass of ``fixed_s + per_atom_s·N``.

    ``host_share`` of that time is Python work holding the GIL (calibrated once, so that it
    takes longer when the thread has to wait for the GIL), in ``host_chunk_s`` slices between
    waits that release it, like an eager pass's launches between device synchronisations; the
    rest is spent waiting (``time.sleep``), like a thread waiting for its GPU.
    """

    def __init__(
        self, fixed_s: float, per_atom_s: float, host_share: float, host_chunk_s: float = 0.001
    ) -> None:
        self.fixed_s = fixed_s
        self.per_atom_s = per_atom_s
        self.host_share = host_share
        self.host_chunk_s = host_chunk_s
        self.chunk_steps = round(python_steps_per_s() * host_chunk_s) if host_share > 0 else 0

    def pass_s(self, n_atoms: int) -> float:
        return self.fixed_s + self.per_atom_s * n_atoms

    def predict(self, structures: Structures, properties: Collection[str]) -> FakePrediction:
        total = self.pass_s(structures.n_atoms)
        chunks = max(1, round(total * self.host_share / self.host_chunk_s))
        wait = total * (1.0 - self.host_share) / chunks
        for _ in range(chunks):
            _python_work(self.chunk_steps)
            time.sleep(wait)  # a device synchronisation: releases the GIL
        return super().predict(structures, properties)


H200_PASS = {"fixed_s": 0.010, "per_atom_s": 18e-6}
"""Pass times of the default model on the H200 (13 ms for 192 atoms, 230 ms for 64×192, from
BENCHMARKS.md): ``SleepEvaluator`` parameters of a CPU stand-in for batching studies."""


class LaunchEvaluator(NullEvaluator):
    """A stand-in whose pass is launch-bound like an eager GPU pass: ``launches`` host
    launches, each ``launch_host_s`` of torch calls on a tiny CPU tensor (each call releases
    and retakes the GIL, as torch ops and Triton launches do), feed a simulated device that
    runs them in order, each taking an equal share of the pass's device time, and the host
    waits for the device ``syncs`` times per pass (the device idles whenever the launches
    fall behind it, e.g. while the worker waits for the GIL). Passes of at most
    ``eager_above`` atoms replay a recorded graph: ``replay_launches`` launches.
    """

    refuses_coincident_atoms = True  # as ``Potential``: decoding skips that search

    def __init__(
        self,
        fixed_s: float,
        per_atom_s: float,
        *,
        eager_above: int = 4096,
        launches: int = 1500,
        replay_launches: int = 20,
        launch_host_s: float = 15e-6,
        syncs: int = 10,
    ) -> None:
        self.fixed_s = fixed_s
        self.per_atom_s = per_atom_s
        self.eager_above = eager_above
        self.launches = launches
        self.replay_launches = replay_launches
        self.syncs = syncs
        self._scratch = torch.zeros(8)
        calls = 20_000
        start = time.perf_counter()
        for _ in range(calls):
            self._scratch.add_(1.0)
        per_call = (time.perf_counter() - start) / calls
        self.calls_per_launch = max(1, round(launch_host_s / per_call))

    def pass_s(self, n_atoms: int) -> float:
        """Device time of a pass of ``n_atoms`` (its wall time when nothing delays it)."""
        return self.fixed_s + self.per_atom_s * n_atoms

    def predict(self, structures: Structures, properties: Collection[str]) -> FakePrediction:
        n = structures.n_atoms
        launches = self.launches if n > self.eager_above else self.replay_launches
        device_each = self.pass_s(n) / launches
        sync_every = max(1, launches // self.syncs)
        device_free_at = time.perf_counter()
        for k in range(launches):
            for _ in range(self.calls_per_launch):
                self._scratch.add_(1.0)
            device_free_at = max(device_free_at, time.perf_counter()) + device_each
            if (k + 1) % sync_every == 0 or k == launches - 1:
                time.sleep(max(0.0, device_free_at - time.perf_counter()))
        return super().predict(structures, properties)


H200_LAUNCHES = {"fixed_s": 0.0067, "per_atom_s": 14.4e-6}
"""``LaunchEvaluator`` pass times of the default model on the H200: 95.2 ms for 32×192 atoms
and 183.8 ms for 64×192 in process (``service-20261130-064451.json``)."""


def stand_in(kind: str) -> SleepEvaluator | LaunchEvaluator:
    """An H200 stand-in: ``"waits"`` / ``"gil30"`` the sleeping one holding the GIL for 0 % /
    30 % of each pass, ``"launches"`` the launch-bound one."""
    if kind == "launches":
        return LaunchEvaluator(H200_LAUNCHES["fixed_s"], H200_LAUNCHES["per_atom_s"])
    return SleepEvaluator(**H200_PASS, host_share={"waits": 0.0, "gil30": 0.3}[kind])


def _serve_fake(
    port: int,
    kind: str | None,
    window_ms: float | None,
    switch_ms: float | None,
    profile: ProfileRequest | None,
) -> None:
    import uvicorn

    from service.api import app as service_app
    from service.api.settings import ServiceSettings

    given: dict[str, Any] = {} if window_ms is None else {"batch_window_ms": window_ms}
    if switch_ms is not None:
        given["switch_interval_ms"] = switch_ms
    if profile is not None:
        given |= {
            "profile_passes": profile.passes,
            "profile_skip_passes": profile.skip,
            "profile_dir": profile.out_dir,
        }
    settings = ServiceSettings(port=port, log_level="warning", **given)
    evaluator = NullEvaluator() if kind is None else stand_in(kind)
    app = service_app.create_app(settings, evaluator=evaluator)
    uvicorn.run(app, **service_app.uvicorn_options(settings))  # as `so2serve serve` runs it


def start_fake_server(
    port: int,
    *,
    kind: str | None = None,
    window_ms: float | None = None,
    switch_ms: float | None = None,
    profile: ProfileRequest | None = None,
) -> multiprocessing.process.BaseProcess:
    """A server in its own process: the null model, or ``stand_in(kind)``."""
    server = multiprocessing.get_context("spawn").Process(
        target=_serve_fake, args=(port, kind, window_ms, switch_ms, profile)
    )
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


BATCHING_CASES = (
    # label, window (None: the server's default), switch interval (None: the server's),
    # stand-in (``stand_in``)
    ("continuous", 0.0, None, "waits"),
    ("gathering, default bound", None, None, "waits"),
    ("gathering ≤ 50 ms", 50.0, None, "waits"),
    ("continuous, GIL 30 %", 0.0, None, "gil30"),
    ("continuous, GIL 30 %, 0.5 ms switch", 0.0, 0.5, "gil30"),
    ("gathering, default bound, GIL 30 %", None, None, "gil30"),
    ("launch-bound", None, None, "launches"),
    ("launch-bound, 0.5 ms switch", None, 0.5, "launches"),
)


def batching_study(client_counts: list[int], duration: float, processes: int) -> dict[str, Any]:
    """HTTP clients of 192-atom structures against the H200 stand-in (``BATCHING_CASES``):
    gathering off and on, passes that only wait (GIL free), passes that hold the GIL for
    30 % of their time and launch-bound passes (``LaunchEvaluator``), the server's switch
    interval against a ten times shorter one. Rates against each stand-in's own batched pass
    (``vs_model_batched``)."""
    batch_atoms = max(client_counts) * 192
    rows: dict[str, Any] = {}
    batched_rates: dict[str, float] = {}
    for label, window, switch, kind in BATCHING_CASES:
        batched = batch_atoms / stand_in(kind).pass_s(batch_atoms)
        batched_rates[label] = batched
        port = free_port()
        server = start_fake_server(port, kind=kind, window_ms=window, switch_ms=switch)
        try:
            url = f"http://127.0.0.1:{port}"
            points = throughput_phase(url, client_counts, duration, processes)
        finally:
            server.terminate()
            server.join(30)
        for row in points.values():
            row["vs_model_batched"] = row["atom_steps_per_s"] / batched
        rows[label] = points
    return {"model_batched_atom_steps_per_s": batched_rates, "points": rows}


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
        # What a server of the real model decodes (its neighbour list checks coincident atoms).
        "server_parse_validate_model_ms": median_ms(
            lambda: parse_evaluate(body, fmt, check_coincident=False), repeats
        ),
        "server_encode_ms": median_ms(respond, repeats),
        "client_decode_ms": median_ms(
            lambda: result_arrays(decode_response(answer, fmt.value)["results"][0]), repeats
        ),
    }


def fake_model_main(args: argparse.Namespace, phases: set[str]) -> None:
    """The ``--fake-model`` run: phases ``engine`` (null model behind the engine in this
    process), ``http`` (round trips, paired overhead, stages), ``throughput`` (batching
    study), ``profile`` (passes profiled in the server and behind the engine, as on the GPU)."""
    sizes = args.sizes if args.sizes != list(SIZES) else [192, 1536]
    evaluator = NullEvaluator()
    workdir = Path(tempfile.mkdtemp(prefix="so2bench-fake-"))
    results = ResultsFile(
        args.out,
        {
            "benchmark": "service-overhead-cpu-fake-model",
            "date": datetime.now(UTC).isoformat(),
            "command": " ".join(sys.argv),
            "phases": [p for p in PHASES if p in phases],
            "torch": torch.__version__,
            "cpu_count": os.cpu_count(),
        },
    )
    profile = "profile" in phases
    if "engine" in phases or profile:
        request = ProfileRequest(PROFILE_PASSES, PROFILE_SKIP, workdir / "profile", "engine")
        engine = engine_phase(
            evaluator,
            sizes if "engine" in phases else [],
            args.repeats,
            [],
            0.0,
            request if profile else None,
        )
        results.put("engine_in_process", engine)
    if phases & {"http", "profile"}:
        server_request = ProfileRequest(PROFILE_PASSES, PROFILE_SKIP, workdir / "profile", "server")
        port = free_port()
        server = start_fake_server(port, profile=server_request if profile else None)
        url = f"http://127.0.0.1:{port}"
        try:
            if profile:
                results.put("server_profile", server_profile_phase(url, server_request))
            if "http" in phases:
                results.put("results", fake_round_trips(url, evaluator, sizes, args.repeats))
                paired = paired_overhead_phase(
                    url, SO2LocalCalculator(evaluator), sizes, args.repeats
                )
                results.put("http_overhead_paired", paired)
                results.put("http_echo", echo_phase(ECHO_DELAYS_MS, args.repeats))
        finally:
            server.terminate()
            server.join(30)
    if "throughput" in phases:
        batching = batching_study(args.clients, args.duration, args.client_processes)
        results.put("batching_192", batching)
    print_fake_summary(results.doc)
    print_summary(results.doc)


FAKE_CASES = (
    ("json", "json", DEFAULT_SPIN_LEAD_MS),
    ("msgpack", "msgpack", DEFAULT_SPIN_LEAD_MS),
    ("msgpack-sleep", "msgpack", 0.0),
)
"""Round-trip cases of the fake-model run: name, wire format, the calculator's spin lead."""


def fake_round_trips(
    url: str, evaluator: NullEvaluator, sizes: list[int], repeats: int
) -> dict[str, Any]:
    """Per size and wire format: round trip vs in-process, server phases, CPU stages alone."""
    local = SO2LocalCalculator(evaluator)
    rows: dict[str, Any] = {}
    for n in sizes:
        atoms = water_atoms(n)
        in_process = median_ms(calculator_step(local, atoms), repeats)
        for name, wire, lead in FAKE_CASES:
            http = http_round_trip(url, atoms, wire, repeats, spin_lead_ms=lead)
            round_trip = http["round_trip_ms"]
            rows[f"{len(atoms)}/{name}"] = {
                "round_trip_ms": round_trip,
                "in_process_ms": in_process,
                "overhead_ms": round_trip - in_process,
                "server_ms": http["server_ms"],
                "client_and_transport_ms": http["client_and_transport_ms"],
                "client_cpu_ms": http["client_cpu_ms"],
                "inline_share": http["inline_share"],
                # Each stage alone in this process.
                "stages_ms": stage_breakdown(atoms, wire == "msgpack", repeats),
            }
    return rows


def print_fake_summary(doc: dict[str, Any]) -> None:
    rows = doc.get("results", {})
    if rows:
        print(f"{'case':>14} {'round trip':>11} {'in-process':>11} {'overhead':>9}  (ms, medians)")
    for key, row in rows.items():
        print(
            f"{key:>14} {row['round_trip_ms']:11.3f} {row['in_process_ms']:11.3f} "
            f"{row['overhead_ms']:9.3f}"
        )
    for n, row in doc.get("engine_in_process", {}).get("requests_ms", {}).items():
        print(f"engine, {n} atoms: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()))
    batching = doc.get("batching_192")
    if batching:
        print(f"{'clients':>8} {'/batched':>9} {'req/pass':>9} {'pass ms':>8}  (H200-like model)")
        for label, points in batching["points"].items():
            for clients, row in points.items():
                print(
                    f"{clients:>8} {row['vs_model_batched']:9.2f} "
                    f"{row['server']['requests_per_pass'] or 0:9.1f} "
                    f"{row['server']['pass_ms'] or 0:8.1f}  {label}"
                )


PHASES = ("in_process", "engine", "profile", "http", "throughput")
"""GPU run phases in their order; ``profile`` (``--profile-server``) profiles passes of the
engine in this process (within ``engine``) and of the server (before the ``http`` phase)."""

ECHO_DELAYS_MS = [1.0, 9.0]
"""Device-thread waits of the echo phase: a short one, and a 192-atom pass on the H200."""

PROFILE_PASSES, PROFILE_SKIP = 10, 6
"""Profiled passes of sequential 192-atom requests, after this many unprofiled ones (the
server's first 192-atom requests record its CUDA graph)."""


def profile_requests(request: ProfileRequest) -> int:
    """Sequential requests that make ``request.skip + request.passes`` passes."""
    return request.skip + request.passes


def server_profile_phase(url: str, request: ProfileRequest, timeout_s: float = 60.0) -> Any:
    """Sequential 192-atom msgpack requests until the server has written its pass profile;
    the profile, with the median phases of those requests."""
    atoms = water_atoms(192)
    row = http_round_trip(url, atoms, "msgpack", profile_requests(request))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        written = sorted(request.out_dir.glob(f"profile-{request.label}-*.json"))
        if written:
            return {"requests": row, **json.loads(written[-1].read_text())}
        time.sleep(0.2)
    return {"requests": row, "error": f"no profile in {request.out_dir} after {timeout_s} s"}


class ResultsFile:
    """The results document, rewritten after every phase (a run cut short keeps what ran)."""

    def __init__(self, path: Path | None, header: dict[str, Any]) -> None:
        self.path = path
        self.doc = header
        self._last = time.monotonic()

    def put(self, key: str, value: Any) -> None:
        """Add one phase's results (and the seconds since the previous one) and save."""
        now = time.monotonic()
        self.doc.setdefault("phase_seconds", {})[key] = round(now - self._last, 1)
        self._last = now
        self.doc[key] = value
        derive_comparisons(self.doc)
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".part")
        partial.write_text(json.dumps(self.doc, indent=2))
        partial.replace(self.path)
        print(f"[{key}] written to {self.path}", flush=True)


def derive_comparisons(doc: dict[str, Any]) -> None:
    """Overhead splits and throughput ratios from whichever phases are in ``doc``."""
    in_process = doc.get("in_process")
    engine = doc.get("engine_in_process", {})
    for key, row in doc.get("http_overhead", {}).items():
        size = key.split("/")[0]
        if in_process is not None:
            local = in_process["single_ms"][size]
            row["overhead_ms"] = row["round_trip_ms"] - local
            # Device pass on the server vs the in-process call without its host validation.
            row["server_compute_minus_in_process_predict_ms"] = row["server_ms"]["compute_ms"] - (
                local - in_process["validate_ms"][size]
            )
        through_engine = engine.get("requests_ms", {}).get(size)
        if through_engine is not None:
            # The overhead split: the engine's share (no HTTP) and what HTTP adds on top.
            if in_process is not None:
                row["engine_minus_in_process_ms"] = through_engine["total_ms"] - local
            row["http_minus_engine_ms"] = row["round_trip_ms"] - through_engine["total_ms"]
            # The same worker step with and without a server around it.
            row["server_compute_minus_engine_compute_ms"] = (
                row["server_ms"]["compute_ms"] - through_engine["compute_ms"]
            )
    if in_process is None:
        return
    batched_key = max(
        (k for k in in_process if k.startswith("batched_")), key=lambda k: int(k[8:].split("x")[0])
    )
    batched = in_process[batched_key]["atom_steps_per_s"]
    serial = in_process["serial_192"]["atom_steps_per_s"]
    for rows in (doc.get("http_throughput_192", {}), engine.get("throughput_192", {})):
        for row in rows.values():
            row["vs_in_process_batched"] = row["atom_steps_per_s"] / batched
            row["vs_in_process_serial"] = row["atom_steps_per_s"] / serial
    http = doc.get("http_throughput_192", {})
    if http:
        most = max(http, key=int)
        doc[f"http{most}_vs_in_process_batched"] = http[most]["vs_in_process_batched"]


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
        "--phases",
        nargs="+",
        choices=PHASES,
        default=None,
        help="run only these phases (default: all but profile; ratios need in_process)",
    )
    parser.add_argument(
        "--profile-server",
        action="store_true",
        help=f"add the profile phase: {PROFILE_PASSES} passes of sequential 192-atom requests "
        "profiled (torch.profiler, thread CPU times, GC) in the server and behind the engine "
        "in this process",
    )
    parser.add_argument(
        "--batch-window-ms",
        type=float,
        default=None,
        help="the server's longest wait for returning clients (default: its own)",
    )
    parser.add_argument(
        "--switch-interval-ms",
        type=float,
        default=None,
        help="the server's interpreter switch interval (default: its own; CPython's is 5)",
    )
    parser.add_argument(
        "--server-env",
        nargs="+",
        default=[],
        metavar="NAME=VALUE",
        help="environment of the server process only (e.g. OMP_NUM_THREADS=4, "
        "SO2SERVE_SWITCH_INTERVAL_MS=1), recorded in the results",
    )
    parser.add_argument(
        "--fake-model", action="store_true", help="CPU overhead breakdown with a do-nothing model"
    )
    parser.add_argument(
        "--client-processes",
        type=int,
        default=CLIENT_PROCESSES,
        help="processes the throughput clients are spread over",
    )
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.duration = min(args.repeats, 8), min(args.duration, 4.0)
    phases = set(args.phases or [p for p in PHASES if p != "profile"])
    server_env = dict(item.split("=", 1) for item in args.server_env)
    if args.profile_server:
        phases.add("profile")
    if args.fake_model:
        fake_model_main(args, phases)
        return
    device = torch.device(args.device)
    workdir = Path(tempfile.mkdtemp(prefix="so2bench-"))
    model = model_file(args.model, workdir)
    stamp = f"{datetime.now():%Y%m%d-%H%M%S}"
    results = ResultsFile(
        args.out or ROOT / "benchmarks" / "results" / f"service-{stamp}.json",
        {
            "benchmark": "service",
            "date": datetime.now(UTC).isoformat(),
            "command": " ".join(sys.argv),
            "phases": [p for p in PHASES if p in phases],
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "triton": _version("triton"),
            "python": sys.version.split()[0],
            "http_stack": {name: _version(name) for name in ("uvicorn", "uvloop", "httptools")},
            "model": str(model),
            "server_batch_window_ms": args.batch_window_ms,
            "server_switch_interval_ms": args.switch_interval_ms,
            "server_env": server_env,
        },
    )

    def profile_request(label: str) -> ProfileRequest | None:
        if "profile" not in phases:
            return None
        return ProfileRequest(PROFILE_PASSES, PROFILE_SKIP, workdir / "profile", label)

    if phases & {"in_process", "engine"} or (
        "profile" in phases and not phases & {"http", "throughput"}
    ):
        potential = load_potential(model, device=args.device)
        results.put("execution", vars(potential.execution))
        if "in_process" in phases:
            batch = max(args.clients)
            results.put("in_process", in_process_phase(potential, args.sizes, batch, args.repeats))
        if "engine" in phases or "profile" in phases:
            engine_sizes = args.sizes if "engine" in phases else []
            # --quick leaves out the engine's in-process crowds: their client coroutines share
            # this interpreter with the worker, so they measure the benchmark, not the engine.
            engine_clients = args.clients if "engine" in phases and not args.quick else []
            engine = engine_phase(
                potential,
                engine_sizes,
                args.repeats,
                engine_clients,
                args.duration,
                profile_request("engine"),
            )
            results.put("engine_in_process", engine)
        del potential
        release_device_memory(device)

    server_phases = phases & {"profile", "http", "throughput"}
    if server_phases:
        port = free_port()
        profile = profile_request("server")
        server = start_server(
            model,
            args.device,
            port,
            args.batch_window_ms,
            args.switch_interval_ms,
            profile,
            server_env,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            if profile is not None:
                results.put("server_profile", server_profile_phase(url, profile))
            if "http" in phases:
                results.put("http_overhead", http_overhead_phase(url, args.sizes, args.repeats))
                # The in-process side of the pairs: the model loaded as the server loads it.
                local = SO2LocalCalculator(load_potential(model, device=args.device))
                paired = paired_overhead_phase(url, local, args.sizes, args.repeats)
                results.put("http_overhead_paired", paired)
                del local
                release_device_memory(device)
                results.put("http_echo", echo_phase(ECHO_DELAYS_MS, args.repeats))
            if "throughput" in phases:
                throughput = throughput_phase(
                    url, args.clients, args.duration, args.client_processes
                )
                results.put("http_throughput_192", throughput)
        finally:
            server.terminate()
            server.wait(60)
    print_summary(results.doc)
    print(f"wrote {results.path}")


def release_device_memory(device: torch.device) -> None:
    """Return the cached blocks of potentials no longer referenced (for the server's sake)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def print_summary(doc: dict[str, Any]) -> None:
    overhead = doc.get("http_overhead", {})
    if overhead:
        print("overhead (ms, medians; target ≤ 1 ms at ≤ 1k atoms) = engine share + HTTP share")
        print(
            f"{'case':>14} {'HTTP':>10} {'overhead':>9} {'engine':>8} {'HTTP':>8} {'Δcompute':>9}"
        )
        for key, row in overhead.items():
            cells = [
                row.get(name, float("nan"))
                for name in (
                    "overhead_ms",
                    "engine_minus_in_process_ms",
                    "http_minus_engine_ms",
                    "server_compute_minus_engine_compute_ms",
                )
            ]
            print(
                f"{key:>14} {row['round_trip_ms']:10.3f} "
                + " ".join(f"{c:{w}.3f}" for c, w in zip(cells, (9, 8, 8, 9), strict=True))
            )
            phases = {
                **row["server_ms"],
                "client+transport": row["client_and_transport_ms"],
                "client CPU": row.get("client_cpu_ms", float("nan")),
                "inline share": row.get("inline_share", float("nan")),
            }
            print(
                " " * 16 + ", ".join(f"{k.removesuffix('_ms')} {v:.3f}" for k, v in phases.items())
            )
    for size, row in doc.get("http_overhead_paired", {}).items():
        print(paired_line(size, row))
    echo = doc.get("http_echo")
    if echo:
        wake = ", ".join(f"{k} {v:.3f}" for k, v in echo["wake_ms"].items())
        print(f"bare HTTP echo: {echo['delay_0_ms']:.3f} ms; added after a wait: {wake}")
        cpu = ", ".join(f"{k} {v:.3f}" for k, v in echo.get("client_cpu_ms", {}).items())
        print(f"echo client CPU per request (ms): {cpu}")
    interleaved = doc.get("engine_in_process", {}).get("interleaved_192")
    if interleaved:
        print(
            "engine vs direct predict, interleaved, 192 atoms (ms, medians): "
            + ", ".join(f"{k.removesuffix('_ms')} {v:.3f}" for k, v in interleaved.items())
        )
    throughput = doc.get("http_throughput_192", {})
    engine_throughput = doc.get("engine_in_process", {}).get("throughput_192", {})
    if throughput or engine_throughput:
        print(f"{'clients':>8} {'atom-steps/s':>13} {'/batched':>9} {'/serial':>8} {'req/pass':>9}")
    for name, rows in (("HTTP", throughput), ("engine", engine_throughput)):
        for clients, row in rows.items():
            print(
                f"{clients:>8} {row['atom_steps_per_s']:13.0f} "
                f"{row.get('vs_in_process_batched', float('nan')):9.2f} "
                f"{row.get('vs_in_process_serial', float('nan')):8.2f} "
                f"{row['server']['requests_per_pass'] or 0:9.1f}  {name}"
            )
    profiles = [
        ("server", doc.get("server_profile", {})),
        ("engine", doc.get("engine_in_process", {}).get("profile", {})),
    ]
    for label, profile in profiles:
        medians = profile.get("medians")
        if medians:
            print(f"profile {label}: " + ", ".join(f"{k} {v:.2f}" for k, v in medians.items()))


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "absent"


if __name__ == "__main__":
    main()
