"""The HTTP calculator where a demanding user takes it: worker processes (pickled or
forked), slow or oversized requests, answers that are not so2serve's, API keys, one
connection per run, and agreement with the in-process calculator on awkward inputs."""

from __future__ import annotations

import copy
import multiprocessing
import pickle
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection

import numpy as np
import orjson
import pytest
from ase import Atoms, units
from ase.calculators.calculator import PropertyNotImplementedError
from ase.md.verlet import VelocityVerlet

from clients import SO2Calculator, SO2LocalCalculator
from clients.http import ServiceError
from service.api import ServiceSettings, create_app
from tests.clients.test_calculators import ONE_H, scripted
from tests.clients.test_connection import ok, raw_server
from tests.service.fakes import PairPotential, rattled_copper, running_server, small_molecule


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with running_server(create_app(ServiceSettings(), evaluator=PairPotential())) as base:
        yield base


def hydrogen() -> Atoms:
    return Atoms("H", positions=[[0.0, 0.0, 0.0]])


def test_refuses_a_property_it_cannot_compute_without_asking_the_server() -> None:
    with scripted([ONE_H]) as server:
        calc = SO2Calculator(server.url)
        with pytest.raises(PropertyNotImplementedError, match="magmom"):
            calc.calculate(hydrogen(), ["energy", "magmom"])
        assert server.attempts == 0


def test_a_used_calculator_pickles_and_copies_for_worker_processes(url: str) -> None:
    """``multiprocessing`` (spawn) pickles the calculator; ``copy.deepcopy`` copies it. Both
    must work after the calculator has talked to the server, and the copy must get its own
    connection."""
    atoms = small_molecule(seed=1)
    calc = SO2Calculator(url)
    energy = calc.get_potential_energy(atoms)
    for clone in (pickle.loads(pickle.dumps(calc)), copy.deepcopy(calc)):
        assert clone.get_potential_energy(atoms.copy()) == energy
        assert clone._http._socket is not calc._http._socket
    assert calc.get_potential_energy(atoms) == energy  # the original still works


def _forked_worker(calc: SO2Calculator, atoms: Atoms, pipe: Connection) -> None:
    energy = calc.get_potential_energy(atoms)
    sock = calc._http._socket
    pipe.send((energy, None if sock is None else sock.getsockname()))


def test_a_forked_worker_does_not_share_the_parents_connection(url: str) -> None:
    """Two processes writing requests into one inherited socket read each other's answers."""
    calc = SO2Calculator(url)
    atoms = small_molecule(seed=2)
    calc.get_potential_energy(atoms)
    sock = calc._http._socket
    assert sock is not None
    moved = atoms.copy()
    moved.positions[0, 0] += 0.05
    parent_end, child_end = multiprocessing.get_context("fork").Pipe()
    child = multiprocessing.get_context("fork").Process(
        target=_forked_worker, args=(calc, moved, child_end)
    )
    child.start()
    child.join(30)
    assert child.exitcode == 0
    energy, address = parent_end.recv()
    assert address is not None and address != sock.getsockname()
    assert energy == SO2LocalCalculator(PairPotential()).get_potential_energy(moved)
    assert calc._http._socket is sock  # the parent keeps its own
    assert calc.get_potential_energy(moved) == energy


@pytest.mark.parametrize("spin_lead_ms", [0.0, 0.4])
def test_a_request_without_an_answer_in_time_fails_once_as_a_timeout(spin_lead_ms: float) -> None:
    """Not 'unreachable', not resent (the server may still be computing it: a resend only
    queues the same work again), and after ``timeout`` seconds, not twice that."""
    body = orjson.dumps(ONE_H[1])
    with raw_server([(ok(body), False)] * 4, [1.5] * 4) as server:
        calc = SO2Calculator(
            server.url, timeout=0.4, retries=3, backoff_s=0.01, spin_lead_ms=spin_lead_ms
        )
        start = time.perf_counter()
        with pytest.raises(ServiceError, match=r"no answer within 0\.4 s") as info:
            calc.get_potential_energy(hydrogen())
        elapsed = time.perf_counter() - start
        assert info.value.code == "timeout" and info.value.status is None
        assert 0.4 <= elapsed < 0.79  # one timeout, not two, and no resends
        assert not calc._http.connected  # a late answer must not be read as the next one
        assert len(server.requests) == 1


@pytest.mark.parametrize(
    "answer",
    [
        (307, {}, {"Location": "/v2/evaluate"}),
        (200, {"greeting": "hello"}, {}),
        (200, {"results": []}, {}),
        (200, {"results": [{"energy": 1.0}]}, {}),
    ],
    ids=["redirect", "foreign-json", "no-result", "no-n_atoms"],
)
def test_an_answer_that_is_not_so2serves_is_a_service_error(
    answer: tuple[int, object, dict[str, str]],
) -> None:
    """The URL points at something else (a proxy's redirect, another web app)."""
    with scripted([answer]) as server:
        calc = SO2Calculator(server.url, retries=0)
        with pytest.raises(ServiceError, match=str(answer[0])) as info:
            calc.get_potential_energy(hydrogen())
        assert info.value.status == answer[0]
        assert info.value.code == ("http_307" if answer[0] == 307 else "bad_response")


def test_a_non_http_json_body_is_a_service_error() -> None:
    with raw_server([(ok(b"<html>not so2serve</html>", b"Content-Type: text/html"), False)]) as srv:
        calc = SO2Calculator(srv.url.rsplit("/", 1)[0], retries=0)
        with pytest.raises(ServiceError, match="not an so2serve answer") as info:
            calc.get_potential_energy(hydrogen())
        assert info.value.code == "bad_response"


def test_an_oversized_request_reports_the_servers_413() -> None:
    """The server answers 413 before reading the whole body and closes: the client must
    report that answer, not a reset connection as 'unreachable' after resending megabytes."""
    settings = ServiceSettings(max_body_mb=0.25)
    with running_server(create_app(settings, evaluator=PairPotential())) as base:
        positions = np.random.default_rng(0).uniform(0, 200, size=(200_000, 3))
        big = Atoms(numbers=np.ones(len(positions), dtype=int), positions=positions)
        calc = SO2Calculator(base, retries=3, backoff_s=0.2)
        assert calc.get_potential_energy(hydrogen()) == 0.0  # the big one reuses a connection
        start = time.perf_counter()
        with pytest.raises(ServiceError, match="body_too_large") as info:
            calc.get_potential_energy(big)
        assert (info.value.status, info.value.code) == (413, "body_too_large")
        assert time.perf_counter() - start < 1.0  # no retries (their backoff alone: 1.4 s)
        assert calc.get_potential_energy(hydrogen()) == 0.0  # and the calculator goes on


def test_the_api_key_is_sent_and_a_wrong_one_is_a_clear_401() -> None:
    settings = ServiceSettings(api_key="s3cret")
    with running_server(create_app(settings, evaluator=PairPotential())) as base:
        atoms = small_molecule()
        assert SO2Calculator(base, api_key="s3cret").get_potential_energy(atoms) < 0
        for key, reason in ((None, "missing"), ("wrong", "wrong")):
            with pytest.raises(ServiceError, match=f"401 unauthorized: {reason}") as info:
                SO2Calculator(base, api_key=key, retries=3).get_potential_energy(atoms)
            assert info.value.code == "unauthorized"


@pytest.mark.parametrize("key", ["clé", "k€y"])
def test_a_non_ascii_api_key_is_accepted(key: str) -> None:
    """The server compares the header's bytes with the key's UTF-8, so the client sends it so."""
    settings = ServiceSettings(api_key=key)
    with running_server(create_app(settings, evaluator=PairPotential())) as base:
        assert SO2Calculator(base, api_key=key).get_potential_energy(small_molecule()) < 0


@pytest.mark.parametrize("key", ["s3cret\n", "s3cret\r\n", "s3\tcret"])
def test_an_api_key_with_a_line_break_is_refused_up_front(key: str) -> None:
    """A key read from a file keeps its newline; sent as is, it ends the request's headers
    early and the server sees garbage (400 malformed_http), not a wrong key."""
    with pytest.raises(ValueError, match="api_key"):
        SO2Calculator("http://127.0.0.1:8000", api_key=key)


@pytest.mark.parametrize(
    ("option", "value"),
    [("timeout", 0.0), ("timeout", -1.0), ("retries", -1), ("backoff_s", -0.1)],
)
def test_unusable_options_are_refused_up_front(option: str, value: float) -> None:
    """Not an AssertionError (retries < 0) or a non-blocking socket (timeout 0) later."""
    with pytest.raises(ValueError, match=option):
        SO2Calculator("http://127.0.0.1:8000", **{option: value})


def test_one_connection_carries_a_whole_md_run(url: str) -> None:
    atoms = rattled_copper(1, seed=3)
    atoms.calc = SO2Calculator(url)
    atoms.get_forces()
    sock = atoms.calc._http._socket
    VelocityVerlet(atoms, 1.0 * units.fs).run(10)
    assert atoms.calc._http._socket is sock


def awkward_structures() -> dict[str, Atoms]:
    slab = rattled_copper(1, seed=4)
    slab.pbc = [True, True, False]
    boxed = small_molecule(seed=5)
    boxed.center(vacuum=3.0)  # a cell, but no periodicity
    unwrapped = rattled_copper(1, seed=6)
    unwrapped.positions[0] += 2 * unwrapped.cell[0] - unwrapped.cell[2]
    sheared = rattled_copper(1, seed=7)
    tilt = np.array([[0, 0.4, 0.2], [0.3, 0, 0], [0, 0.5, 0]])
    sheared.set_cell(sheared.cell.array + tilt, scale_atoms=True)
    return {"slab": slab, "boxed": boxed, "unwrapped": unwrapped, "sheared": sheared}


@pytest.mark.parametrize("wire", ["json", "msgpack"])
def test_http_and_in_process_agree_on_awkward_structures(url: str, wire: str) -> None:
    for name, atoms in awkward_structures().items():
        remote, local = atoms.copy(), atoms.copy()
        remote.calc = SO2Calculator(url, wire=wire)
        local.calc = SO2LocalCalculator(PairPotential())
        names = ["energy", "free_energy", "forces", "energies"]
        names += ["stress"] if atoms.pbc.all() else []
        for prop in names:
            a, b = remote.calc.get_property(prop, remote), local.calc.get_property(prop, local)
            assert np.array_equal(a, b), (name, prop)


def test_the_shipped_model_agrees_through_the_service_on_awkward_water() -> None:
    """The real model's neighbour search sees slabs, boxed molecules, unwrapped positions and
    a skewed basis of the same lattice (evaluated in its reduced basis): both calculators,
    bit for bit, and the skewed basis gives the box's own energy."""
    from service.model.potential import default_model_path
    from tests.clients.test_ase_workflows import water_box

    if not default_model_path().is_file():
        pytest.skip("no default model shipped")
    slab = water_box()
    slab.pbc = [True, True, False]
    boxed = water_box()
    boxed.pbc = False
    unwrapped = water_box()
    unwrapped.positions[[0, 4]] += [2 * unwrapped.cell[0], -unwrapped.cell[2]]
    skewed = water_box()  # the same lattice; lattice planes 0.25 Å apart in this basis
    x, y, z = skewed.cell.array
    skewed.set_cell([x, y + 20 * x, z], scale_atoms=False)
    local = SO2LocalCalculator(device="cpu")
    with running_server(create_app(ServiceSettings(device="cpu")), timeout_s=300) as base:
        remote = SO2Calculator(base)
        for name, atoms in {"slab": slab, "boxed": boxed, "unwrapped": unwrapped,
                            "skewed": skewed}.items():  # fmt: skip
            names = ["energy", "forces", "energies"] + (["stress"] if atoms.pbc.all() else [])
            for prop in names:
                a = remote.get_property(prop, atoms.copy())
                b = local.get_property(prop, atoms.copy())
                assert np.array_equal(a, b), (name, prop)
    box = water_box()
    assert local.get_potential_energy(skewed) == pytest.approx(
        local.get_potential_energy(box), rel=1e-6
    )
    for prop in ("forces", "stress"):
        reference = local.get_property(prop, box)
        scale = np.abs(reference).max()
        np.testing.assert_allclose(local.get_property(prop, skewed), reference, atol=1e-5 * scale)
