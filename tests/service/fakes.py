"""Test doubles: an analytic potential with the serving surface of ``Potential``, and a real
uvicorn server on a free loopback port (in a thread, or as the ``so2serve serve`` command).

``PairPotential`` is a smooth Morse pair potential with a cosine cutoff, evaluated in float64
with torch autograd, so its forces are exactly −∂E/∂r and its virial the strain derivative.
It can inject delays (to hold the device busy) and out-of-memory errors (above an atom count).
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
import uvicorn
from ase import Atoms
from ase.build import bulk, molecule
from ase.data import atomic_numbers
from fastapi import FastAPI

from service.api.http_protocol import HeadJoiningHTTPProtocol
from service.graph.errors import InvalidStructureError
from service.graph.structures import Structures


@dataclass(frozen=True)
class FakeExecution:
    path: str = "reference"
    precision: str = "fp64"
    device: str = "cpu"


@dataclass
class FakePrediction:
    energy: torch.Tensor
    energies: torch.Tensor | None = None
    forces: torch.Tensor | None = None
    virial: torch.Tensor | None = None
    stress: torch.Tensor | None = None


@dataclass
class PairPotential:
    """Morse pair potential, element-dependent depth; the ``Evaluator`` surface."""

    rcut: float = 4.0
    elements: tuple[str, ...] = ("H", "C", "O", "Cu")
    delay_s: float = 0.0
    oom_above_atoms: int | None = None
    # Like ``Potential``, whose neighbour list refuses coincident atoms: the server then
    # leaves that check out of decoding (``service.api.app.refuses_coincident_atoms``).
    refuses_coincident_atoms: bool = False
    execution: FakeExecution = field(default_factory=FakeExecution)
    calls: list[tuple[int, int]] = field(default_factory=list)  # (structures, atoms) per call
    lock: threading.Lock = field(default_factory=threading.Lock)

    def info(self) -> dict[str, Any]:
        return {
            "name": "pair-test",
            "sha256": "0" * 64,
            "elements": list(self.elements),
            "rcut": self.rcut,
            "config": {"kind": "morse"},
        }

    def predict(self, structures: Structures, properties: Collection[str]) -> FakePrediction:
        with self.lock:
            self.calls.append((structures.n_structures, structures.n_atoms))
        if self.delay_s:
            time.sleep(self.delay_s)
        self._check_elements(structures)
        if self.refuses_coincident_atoms:
            structures.check_coincident()  # names the structure by its index in the batch
        if self.oom_above_atoms is not None and structures.n_atoms > self.oom_above_atoms:
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB (injected)"
            )
        return self._evaluate(structures, set(properties))

    def _check_elements(self, s: Structures) -> None:
        """Like ``Potential.predict``: an element the model lacks is an input error."""
        known = torch.tensor([atomic_numbers[e] for e in self.elements])
        unknown = torch.nonzero(~torch.isin(s.numbers, known))
        if unknown.numel():
            atom = int(unknown[0, 0])
            index = int(torch.searchsorted(s.ptr, atom, right=True)) - 1
            raise InvalidStructureError(
                "unknown_element",
                f"element Z={int(s.numbers[atom])} is not supported by this model",
                field=f"structures[{index}].numbers",
                index=index,
            )

    def _evaluate(self, s: Structures, properties: set[str]) -> FakePrediction:
        ptr = s.ptr.tolist()
        src, dst, shift, batch = self._edges(s, ptr)
        pos = s.positions.detach().clone().double().requires_grad_(True)
        strain = torch.zeros(s.n_structures, 3, 3, dtype=torch.float64, requires_grad=True)
        atom_batch = torch.repeat_interleave(
            torch.arange(s.n_structures), torch.tensor(np.diff(ptr))
        )
        deform = torch.eye(3, dtype=torch.float64) + strain
        x = torch.einsum("na,nab->nb", pos, deform[atom_batch])
        cell = torch.einsum("bca,bad->bcd", s.cells.double(), deform)
        r = x[src] + torch.einsum("ec,ecd->ed", shift, cell[batch]) - x[dst]
        pair = self._pair_energy(r.norm(dim=1), s.numbers[src], s.numbers[dst])
        atom_energy = torch.zeros(s.n_atoms, dtype=torch.float64).index_add(0, dst, 0.5 * pair)
        energy = torch.zeros(s.n_structures, dtype=torch.float64).index_add(
            0, atom_batch, atom_energy
        )
        g_pos, g_strain = torch.autograd.grad(energy.sum(), (pos, strain), allow_unused=True)
        g_pos = torch.zeros_like(pos) if g_pos is None else g_pos
        g_strain = torch.zeros_like(strain) if g_strain is None else g_strain
        virial = -g_strain.transpose(1, 2)
        out = FakePrediction(energy=energy.detach())
        if "energies" in properties:
            out.energies = atom_energy.detach()
        if "forces" in properties:
            out.forces = -g_pos
        if properties & {"virial", "stress"}:
            out.virial = virial
        if "stress" in properties:
            volume = torch.linalg.det(s.cells.double()).abs()
            sym = -0.5 * (virial + virial.transpose(1, 2)) / volume[:, None, None]
            voigt = sym[:, [0, 1, 2, 1, 0, 0], [0, 1, 2, 2, 2, 1]]
            periodic = s.pbc.all(dim=1)
            out.stress = torch.where(periodic[:, None], voigt, torch.full_like(voigt, math.nan))
        return out

    def _edges(
        self, s: Structures, ptr: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """All (src, dst, shift) pairs within rcut, brute force over the needed images."""
        src, dst, shift, batch = [], [], [], []
        for b in range(s.n_structures):
            a, e = ptr[b], ptr[b + 1]
            x = s.positions[a:e].double()
            images = self._image_shifts(s.cells[b].double(), s.pbc[b])
            offsets = images @ s.cells[b].double()
            r = x[None, :, None, :] + offsets[None, None] - x[:, None, None, :]  # (i, j, S, 3)
            d = r.norm(dim=-1)
            hit = (d < self.rcut) & (d > 0)
            i, j, k = torch.nonzero(hit, as_tuple=True)
            dst.append(i + a)
            src.append(j + a)
            shift.append(images[k])
            batch.append(torch.full_like(i, b))
        return torch.cat(src), torch.cat(dst), torch.cat(shift), torch.cat(batch)

    def _image_shifts(self, cell: torch.Tensor, pbc: torch.Tensor) -> torch.Tensor:
        reach = []
        for axis in range(3):
            if not bool(pbc[axis]):
                reach.append(0)
                continue
            normal = torch.linalg.cross(cell[(axis + 1) % 3], cell[(axis + 2) % 3])
            height = torch.linalg.det(cell).abs() / normal.norm()
            reach.append(math.ceil(self.rcut / float(height)))
        axes = [torch.arange(-n, n + 1, dtype=torch.float64) for n in reach]
        return torch.cartesian_prod(*axes).reshape(-1, 3)

    def _pair_energy(
        self, r: torch.Tensor, z_src: torch.Tensor, z_dst: torch.Tensor
    ) -> torch.Tensor:
        depth = 0.2 * ((z_src * z_dst).double() ** 0.25)
        morse = (1.0 - torch.exp(-1.5 * (r - 1.6))) ** 2 - 1.0
        cutoff = 0.5 * (1.0 + torch.cos(math.pi * r / self.rcut))
        return depth * morse * cutoff


def element_numbers(potential: PairPotential) -> list[int]:
    return [atomic_numbers[s] for s in potential.elements]


def free_port_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextmanager
def running_server(app: FastAPI, *, timeout_s: float = 30.0) -> Iterator[str]:
    """Serve ``app`` with real uvicorn on a free loopback port; yields the base URL."""
    sock = free_port_socket()
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        log_level="warning",
        lifespan="on",
        timeout_graceful_shutdown=5,
        http=HeadJoiningHTTPProtocol,  # as uvicorn_options() serves
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)
        sock.close()


REPO = Path(__file__).resolve().parents[2]


@contextmanager
def serve_command(
    model: Path, device: str, log: Path, *, timeout_s: float = 300.0
) -> Iterator[str]:
    """``so2serve serve --model MODEL --device DEVICE`` in its own process, on a free loopback
    port; yields the base URL once ``/health/ready`` answers 200. Its output goes to ``log``."""
    sock = free_port_socket()
    port = sock.getsockname()[1]
    sock.close()  # uvicorn binds it again; nothing else takes a fresh ephemeral port meanwhile
    command = [sys.executable, "-m", "service.cli", "serve", "--model", str(model)]
    command += ["--device", device, "--port", str(port), "--log-level", "warning"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    with log.open("wb") as out:
        process = subprocess.Popen(command, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while not _ready(url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"so2serve serve did not become ready:\n{log.read_text()}")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health/ready", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def rattled_copper(repeat: int = 2, seed: int = 0) -> Atoms:
    """Periodic fcc copper, 4·repeat³ atoms, rattled so forces and shear stress are non-zero."""
    atoms: Atoms = bulk("Cu", "fcc", a=3.6, cubic=True) * (repeat, repeat, repeat)
    atoms.rattle(0.05, seed=seed)
    return atoms


def small_molecule(name: str = "CH3OH", seed: int = 0) -> Atoms:
    """A non-periodic molecule, slightly rattled."""
    atoms: Atoms = molecule(name)
    atoms.rattle(0.02, seed=seed)
    return atoms


def request_document(
    structures: list[Atoms], properties: Collection[str] = ("energy", "forces")
) -> dict[str, Any]:
    """An /evaluate body (JSON form) for ASE structures."""
    items = []
    for atoms in structures:
        item: dict[str, Any] = {
            "species": atoms.get_chemical_symbols(),
            "positions": atoms.positions.tolist(),
        }
        if atoms.pbc.any():
            item |= {"cell": atoms.cell.array.tolist(), "pbc": atoms.pbc.tolist()}
        items.append(item)
    return {"structures": items, "properties": list(properties)}
