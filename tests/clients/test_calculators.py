"""The ASE calculators: HTTP against a real server, in-process, and both against each other."""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import torch
from ase import Atoms, units
from ase.build import molecule
from ase.calculators.calculator import CalculationFailed, PropertyNotImplementedError
from ase.md.verlet import VelocityVerlet
from ase.optimize import BFGS

from clients import SO2Calculator, SO2LocalCalculator
from clients._properties import SerialCalculator
from clients.http import ServiceError
from service.api import ServiceSettings, create_app
from tests.service.fakes import (
    PairPotential,
    free_port_socket,
    rattled_copper,
    running_server,
    small_molecule,
)

RESULTS = ("energy", "free_energy", "forces", "energies")


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, PairPotential]]:
    potential = PairPotential()
    with running_server(create_app(ServiceSettings(), evaluator=potential)) as url:
        yield url, potential


def paired(atoms: Atoms, url: str, **http_options: Any) -> tuple[Atoms, Atoms]:
    """The same structure with the HTTP calculator and with the in-process one."""
    remote, local = atoms.copy(), atoms.copy()
    remote.calc = SO2Calculator(url, **http_options)
    local.calc = SO2LocalCalculator(PairPotential())
    return remote, local


def assert_identical(a: Atoms, b: Atoms, periodic: bool) -> None:
    for name in RESULTS + (("stress",) if periodic else ()):
        x, y = a.calc.get_property(name, a), b.calc.get_property(name, b)
        assert np.array_equal(x, y), name


@pytest.mark.parametrize("wire", ["json", "msgpack"])
def test_http_equals_in_process_bit_for_bit(server: tuple[str, PairPotential], wire: str) -> None:
    for atoms in (rattled_copper(2, seed=5), small_molecule("CH3OH", seed=2)):
        remote, local = paired(atoms, server[0], wire=wire)
        assert_identical(remote, local, periodic=bool(atoms.pbc.all()))
        assert remote.calc.provenance["model"]["name"] == "pair-test"
        # writable as in process (msgpack's arrays arrive as views of the message's bytes)
        arrays = [v for v in remote.calc.results.values() if isinstance(v, np.ndarray)]
        assert arrays and all(a.flags.writeable for a in arrays)


def test_results_are_cached_until_the_atoms_change(server: tuple[str, PairPotential]) -> None:
    url, pot = server
    atoms = rattled_copper(1, seed=7)
    atoms.calc = SO2Calculator(url)
    start = len(pot.calls)
    energy = atoms.get_potential_energy()
    atoms.get_forces()
    atoms.get_stress()  # computed with the first call: the cell is periodic
    assert len(pot.calls) == start + 1
    assert atoms.get_potential_energy() == energy
    atoms.positions[0, 0] += 0.01
    atoms.get_forces()
    assert len(pot.calls) == start + 2
    per_atom = atoms.get_potential_energies()  # not asked for so far: one more evaluation
    assert len(pot.calls) == start + 3
    assert per_atom.sum() == pytest.approx(atoms.get_potential_energy(), rel=1e-12)


def test_stress_of_a_molecule_is_not_implemented(server: tuple[str, PairPotential]) -> None:
    for atoms in paired(small_molecule(), server[0]):
        with pytest.raises(PropertyNotImplementedError, match="periodic along all three"):
            atoms.get_stress()


def test_bfgs_through_the_service_follows_the_in_process_path(
    server: tuple[str, PairPotential],
) -> None:
    remote, local = paired(small_molecule("CH3OH", seed=1), server[0])
    for atoms in (remote, local):
        BFGS(atoms, logfile=None).run(fmax=1e-3, steps=6)
    assert np.array_equal(remote.positions, local.positions)
    assert remote.get_potential_energy() == local.get_potential_energy()


def test_md_through_the_service_follows_the_in_process_trajectory(
    server: tuple[str, PairPotential],
) -> None:
    crystal = rattled_copper(1, seed=2)
    crystal.set_velocities(np.random.default_rng(0).normal(scale=0.02, size=(len(crystal), 3)))
    remote, local = paired(crystal, server[0], wire="msgpack")
    for atoms in (remote, local):
        VelocityVerlet(atoms, timestep=1.0 * units.fs).run(15)
    assert np.array_equal(remote.positions, local.positions)
    assert np.array_equal(remote.get_velocities(), local.get_velocities())
    assert_identical(remote, local, periodic=True)


def test_server_errors_become_calculation_failed(server: tuple[str, PairPotential]) -> None:
    uranium = Atoms("HU", positions=[[0, 0, 0], [2, 0, 0]])
    uranium.calc = SO2Calculator(server[0])
    with pytest.raises(CalculationFailed, match="this model knows only H, C, O, Cu") as info:
        uranium.get_potential_energy()
    assert isinstance(info.value, ServiceError)
    assert (info.value.status, info.value.code) == (422, "unknown_element")
    assert info.value.detail == {"field": "structures[0].species", "index": 0}


@pytest.mark.parametrize("kind", ["http", "local"])
@pytest.mark.parametrize("ask", ["get_properties", "calculate"])
def test_a_failed_calculation_leaves_no_earlier_results_behind(
    server: tuple[str, PairPotential], kind: str, ask: str
) -> None:
    # ASE stores the new atoms before the evaluation: results left from the previous structure
    # would be handed out for one the model refused (Atoms.get_properties and direct calculate
    # calls do not clear them).
    calc = SO2Calculator(server[0]) if kind == "http" else SO2LocalCalculator(PairPotential())
    water = small_molecule("H2O")
    water.calc = calc
    water.get_potential_energy()
    uranium = Atoms("HU", positions=[[0, 0, 0], [2, 0, 0]])
    uranium.calc = calc
    with pytest.raises(CalculationFailed, match=r"Z=92 is not supported|this model knows only"):
        if ask == "get_properties":
            uranium.get_properties(["energy", "forces"])
        else:
            calc.calculate(uranium, ["energy", "forces"])
    assert calc.results == {} and calc.atoms is None
    with pytest.raises(ValueError, match=r"Z=92 is not supported|this model knows only"):
        uranium.get_potential_energy()
    assert water.get_potential_energy() == pytest.approx(
        SO2LocalCalculator(PairPotential()).get_potential_energy(water.copy()), abs=1e-12
    )


@pytest.mark.parametrize("kind", ["http", "local"])
def test_a_refused_structure_is_a_value_error_and_calculation_failed_in_both(
    server: tuple[str, PairPotential], kind: str
) -> None:
    # It was a ValueError in process and a CalculationFailed over HTTP: code catching one of
    # them broke when the calculator was switched.
    calc = SO2Calculator(server[0]) if kind == "http" else SO2LocalCalculator(PairPotential())
    uranium = Atoms("HU", positions=[[0, 0, 0], [2, 0, 0]])
    with pytest.raises(ValueError) as info:
        calc.get_potential_energy(uranium)
    assert isinstance(info.value, CalculationFailed)
    assert getattr(info.value, "code", None) == "unknown_element"


def test_a_non_finite_in_process_result_raises_calculation_failed() -> None:
    class NaNEnergy(PairPotential):
        def predict(self, structures: Any, properties: Any) -> Any:
            out = super().predict(structures, properties)
            out.energy = torch.full_like(out.energy, float("nan"))
            return out

    atoms = small_molecule("H2O")
    atoms.calc = SO2LocalCalculator(NaNEnergy())
    with pytest.raises(CalculationFailed, match="non-finite energy"):
        atoms.get_potential_energy()


@pytest.mark.parametrize("device", ["gpu7", "mps", "cuda:99"])
def test_an_unusable_device_is_a_value_error(device: str, tiny_model_file: Path) -> None:
    if device == "cuda:99" and not torch.cuda.is_available():
        device = "cuda"  # on a CPU-only machine any CUDA device is unusable
    with pytest.raises(ValueError, match="device"):
        SO2LocalCalculator(tiny_model_file, device=device)


def test_unreachable_service_fails_after_retries() -> None:
    sock = free_port_socket()
    port = sock.getsockname()[1]
    sock.close()  # nobody listens there now
    atoms = small_molecule()
    atoms.calc = SO2Calculator(f"http://127.0.0.1:{port}", retries=1, backoff_s=0.01)
    with pytest.raises(CalculationFailed, match="unreachable") as info:
        atoms.get_potential_energy()
    assert isinstance(info.value, ServiceError) and info.value.code == "unreachable"


NO_ANSWER = None
"""A script entry: read the request and answer nothing (a server busy with a long pass)."""
Script = list[tuple[int, object, dict[str, str]] | None]


class ScriptedHandler(BaseHTTPRequestHandler):
    """Answers POSTs from the server's ``script`` of (status, body, headers), in turn, or
    ``NO_ANSWER`` until the server shuts down; the last entry repeats. HTTP/1.1, so
    connections are kept alive."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        server: ScriptedServer = self.server  # type: ignore[assignment]
        server.attempts += 1
        entry = server.script[min(server.attempts, len(server.script)) - 1]
        if entry is NO_ANSWER:
            server.closing.wait(10.0)
            return
        status, body, headers = entry
        payload = orjson.dumps(body)
        self.send_response(status)
        for name, value in {"Content-Type": "application/json", **headers}.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *_: object) -> None:
        pass


class ScriptedServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, script: Script) -> None:
        super().__init__(("127.0.0.1", 0), ScriptedHandler)
        self.script = script
        self.attempts = 0
        self.closing = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@contextmanager
def scripted(script: Script) -> Iterator[ScriptedServer]:
    server = ScriptedServer(script)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.closing.set()
        server.shutdown()
        server.server_close()


BUSY = (503, {"code": "queue_full", "message": "queue full", "detail": None}, {"Retry-After": "0"})
Canned = tuple[int, dict[str, Any], dict[str, str]]
ONE_H: Canned = (
    200,
    {"results": [{"n_atoms": 1, "energy": -1.5, "forces": [[0.0, 0.0, 0.5]]}]},
    {},
)


def test_transient_503_is_retried_then_reported() -> None:
    with scripted([BUSY, BUSY, ONE_H]) as server:
        atom = Atoms("H", positions=[[0, 0, 0]])
        atom.calc = SO2Calculator(server.url, retries=3, backoff_s=0.001)
        assert atom.get_potential_energy() == -1.5 and server.attempts == 3
        assert atom.get_forces().tolist() == [[0.0, 0.0, 0.5]]

    with scripted([BUSY]) as server:
        always_busy = Atoms("H", positions=[[0, 0, 0]])
        always_busy.calc = SO2Calculator(server.url, retries=2, backoff_s=0.001)
        with pytest.raises(CalculationFailed, match="503 queue_full: queue full"):
            always_busy.get_potential_energy()
        assert server.attempts == 3


def test_a_connection_the_server_closed_while_idle_is_replaced(
    server: tuple[str, PairPotential],
) -> None:
    """uvicorn drops idle keep-alive connections; the next call must neither fail nor wait
    for a retry backoff."""
    atoms = small_molecule(seed=3)
    atoms.calc = SO2Calculator(server[0], retries=0)
    energy = atoms.get_potential_energy()
    connection = atoms.calc._http._socket
    assert connection is not None
    connection.shutdown(socket.SHUT_RDWR)  # as if the server had closed it
    atoms.positions[0, 0] += 0.01
    assert atoms.get_potential_energy() != energy
    assert atoms.calc._http._socket is not connection


@pytest.fixture(scope="module")
def tiny_model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random DPA4 model (reference path on CPU), saved like a shipped model."""
    from service.model.config import preset
    from service.model.dpa4 import DPA4Model
    from service.model.io import save_model

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("model") / "tiny-water.safetensors"
    save_model(DPA4Model(preset("tiny", ["H", "O"])), path)
    return path


def water_box(shear: float = 0.0) -> Atoms:
    """Three waters in a (optionally sheared) periodic box, 9 atoms."""
    box = Atoms(cell=np.diag([5.5, 5.0, 4.8]), pbc=True)
    for k, shift in enumerate(([0.5, 0.6, 0.7], [2.9, 2.6, 2.4], [1.2, 3.4, 3.5])):
        water = molecule("H2O")
        water.rotate(40 * k, "x")
        water.translate(shift)
        box += water
    if shear:
        tilt = np.array([[0.0, 1.0, 0.5], [0.7, 0.0, 0.4], [0.3, 0.8, 0.0]]) * shear
        box.set_cell(box.cell.array + tilt, scale_atoms=True)
    return box


def test_the_real_potential_through_the_service(tiny_model_file: Path) -> None:
    """The full stack (model file → load_potential → engine → HTTP → ASE) against the
    in-process calculator on the same file."""
    settings = ServiceSettings(model=tiny_model_file, device="cpu")
    with running_server(create_app(settings), timeout_s=120) as url:
        remote = water_box()
        remote.calc = SO2Calculator(url)
        local = water_box()
        local.calc = SO2LocalCalculator(tiny_model_file, device="cpu")
        assert_identical(remote, local, periodic=True)
        assert remote.calc.provenance["model"]["name"] == "tiny-water"
        assert remote.calc.info()["model"]["elements"] == ["H", "O"]


def test_default_model_if_shipped() -> None:
    from service.model.potential import default_model_path

    if not default_model_path().is_file():
        pytest.skip("no default model shipped yet (service/models/default.safetensors)")
    with running_server(create_app(ServiceSettings(device="cpu")), timeout_s=300) as url:
        remote = water_box()
        remote.calc = SO2Calculator(url)
        local = water_box()
        local.calc = SO2LocalCalculator(device="cpu")
        assert_identical(remote, local, periodic=True)


THREADED_CALLS = 300
"""Per thread: enough for the unguarded calculators to fail every run of this test."""


def assert_each_thread_gets_its_own_forces(
    forces_of: Callable[[Atoms], np.ndarray], calls: int = THREADED_CALLS
) -> None:
    """Two threads ask ``forces_of`` (one shared calculator) for the forces of two different
    structures, changed every call so that every call computes."""
    structures = [small_molecule("CH3OH", seed=1), rattled_copper(1, seed=2)]
    failures: list[str] = []

    def worker(k: int) -> None:
        for step in range(calls):
            atoms = structures[k].copy()
            atoms.positions[0, 0] += 1e-4 * (step % 2)  # a change: every call computes
            try:
                forces = forces_of(atoms)
            except Exception as exc:  # e.g. results reset by the other thread
                failures.append(f"thread {k} step {step}: {exc!r}")
                continue
            reference = SO2LocalCalculator(PairPotential()).get_property("forces", atoms)
            if forces.shape != reference.shape or not np.allclose(forces, reference):
                failures.append(f"thread {k} step {step}: another structure's forces")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads between almost any two bytecodes
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not failures, failures[:5]


@pytest.mark.parametrize("kind", ["http", "local"])
def test_one_calculator_shared_by_threads_answers_each_for_its_own_atoms(
    server: tuple[str, PairPotential], kind: str
) -> None:
    # ASE keeps the last atoms and results on the calculator: without taking calls one at a
    # time, a thread could return the results another thread's structure left there.
    calc = (
        SO2Calculator(server[0], spin_lead_ms=0)
        if kind == "http"
        else SO2LocalCalculator(PairPotential())
    )
    assert_each_thread_gets_its_own_forces(lambda atoms: calc.get_property("forces", atoms))


def test_atoms_get_properties_takes_its_turn_on_a_shared_calculator() -> None:
    # Atoms.get_properties goes through Calculator.calculate_properties, not get_property.
    calc = SO2LocalCalculator(PairPotential())

    def forces_of(atoms: Atoms) -> np.ndarray:
        atoms.calc = calc
        forces: np.ndarray = atoms.get_properties(["forces"])["forces"]
        return forces

    assert_each_thread_gets_its_own_forces(forces_of)


def test_info_takes_its_turn_on_a_shared_calculator(server: tuple[str, PairPotential]) -> None:
    # info() and the property calls share the calculator's one connection.
    calc = SO2Calculator(server[0], spin_lead_ms=0)

    def forces_of(atoms: Atoms) -> np.ndarray:
        assert calc.info()["model"]["name"] == "pair-test"
        forces: np.ndarray = calc.get_property("forces", atoms)
        return forces

    assert_each_thread_gets_its_own_forces(forces_of, calls=50)


class _HeldInTheParent(SerialCalculator):
    """Energy = number of atoms; a call in the process that made it waits for ``release``."""

    def __init__(self) -> None:
        super().__init__()
        self.implemented_properties = ["energy"]
        self.parent = os.getpid()
        self.entered, self.release = threading.Event(), threading.Event()

    def evaluate(self, atoms: Atoms, wanted: frozenset[str]) -> dict[str, Any]:
        if os.getpid() == self.parent:
            self.entered.set()
            self.release.wait()
        return {"energy": float(len(atoms))}


def _energy_of_two_atoms(calc: _HeldInTheParent) -> None:
    assert calc.get_property("energy", Atoms("H2", positions=[[0, 0, 0], [0, 0, 0.7]])) == 2.0


def test_a_process_forked_during_another_threads_call_can_use_the_calculator() -> None:
    # The fork copies the lock held by a thread that does not exist in the child.
    calc = _HeldInTheParent()
    busy = threading.Thread(target=calc.get_property, args=("energy", Atoms("H")))
    busy.start()
    try:
        assert calc.entered.wait(10)
        child = multiprocessing.get_context("fork").Process(
            target=_energy_of_two_atoms, args=(calc,)
        )
        child.start()
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join()
            pytest.fail("the forked process waits forever for the calculator")
        assert child.exitcode == 0
    finally:
        calc.release.set()
        busy.join()
