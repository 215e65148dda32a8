"""Screening: evaluate every structure of some files, through the service or in this process.

* Inputs: anything ``ase.io.iread`` reads. Each structure is identified as ``<path>@<frame>``
  (the path as given on the command line, so resume with the same spelling; a path given twice
  is read once). A frame that does not parse is recorded as failed (``unreadable``) and reading
  goes on with the next.
* Structures travel in batches (bounded by atoms and count) with a bounded number of requests
  in flight; the service coalesces them further on the device. The inputs are read in a
  thread while the first batches are evaluated.
* Outputs in the output folder:
  ``results.extxyz`` (one frame per evaluated structure, in completion order, with energy,
  forces, stress when periodic, and ``screen_id``/``source``/``frame``/``model``/
  ``model_hash`` in the info line; the input's own info entries and per-atom arrays that
  extxyz can hold unchanged come along, one under a name of ours (a reference ``energy`` or
  ``forces`` of the input, its own ``source``) as ``input_<name>``), ``summary.csv`` (one row
  per structure, in input order: status, energy, energy per atom, max force on the atoms free
  to move, error), ``journal.jsonl`` (the resume log, with the model of every result).
* Failures: transient ones (connection, 502/503/504) are retried with exponential backoff; a
  batch without an answer within the timeout is not sent again (the server may still be
  computing it): its structures are recorded as failed with code ``timeout``. A
  structure the service rejects (422/413/507/500) is recorded as failed and the rest of its
  batch is resubmitted, so one bad structure costs nothing else; its row's message is about it
  alone (no place in a batch). Authentication and addressing errors (401/403/404/415, 501
  from a server that takes no POST) abort the run, and so does a service that stays
  unreachable or unavailable through every retry, or in process a GPU that broke down (no
  structure's fault: the same command resumes the run).
* One folder, one run, one model: a lock file keeps a second run out of a folder being
  written, and a resumed run whose evaluator answers with another model than the folder's
  results stops before writing any.
* Resume: every finished structure is appended to ``results.extxyz`` and flushed, then
  journalled with the byte offset where its frame ends. On restart the journal is read, the
  extxyz is cut back to the last journalled frame (dropping a frame half-written when the run
  was killed), and finished structures are skipped (failed ones too, unless ``retry_failed``).
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import errno
import io
import itertools
import json
import os
import re
import ssl
import sys
import time
import warnings
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

import ase.io
import httpx
import numpy as np
from ase import Atoms
from ase.calculators.singlepoint import SinglePointCalculator
from ase.io.extxyz import per_atom_properties, per_config_properties
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

from clients._connection import CONNECT_TIMEOUT_S, split_service_url
from clients.http import (
    TRANSIENT_STATUS,
    UNDECODABLE,
    bad_response,
    decode_response,
    encode_request,
    encode_structure,
    error_from_response,
    result_arrays,
    retry_delay,
)

if TYPE_CHECKING:
    from service.engine import Engine
    from service.engine.evaluator import Evaluator

PROPERTIES = ("energy", "forces", "stress")
RESULTS_FILE = "results.extxyz"
SUMMARY_FILE = "summary.csv"
JOURNAL_FILE = "journal.jsonl"
LOCK_FILE = ".screen.lock"
PLAIN_PROGRESS_S = 30.0
"""Seconds between the progress lines written where stderr is not a terminal (a batch job's
log, which a live bar reaches only at the end)."""
READ_CHUNK = 64
"""Frames parsed per hand-over from the reading thread."""

_FATAL_STATUS = frozenset((401, 403, 404, 405, 415, 501))  # 501: a server without POST
_NO_CONNECTION = (httpx.ConnectError, httpx.ConnectTimeout)
_ID_KEYS = ("screen_id", "source", "frame", "model", "model_hash")
"""info keys of the frames written: an input's own entry under one of them is kept as input_*."""
_STRUCTURE_FIELD = re.compile(r"^structures\[(\d+)\]")


@dataclass(frozen=True)
class ScreenOptions:
    """How to screen. ``url`` selects the service; without it the model runs in process."""

    output_dir: Path
    url: str | None = None
    api_key: str | None = None
    model: str | Path | None = None  # in process: model file (None = shipped default)
    device: str = "auto"  # in process: as ``so2serve serve --device`` (cuda:all: every GPU)
    concurrency: int = 4  # requests in flight
    batch_atoms: int = 4096  # atoms per request
    batch_structures: int = 64  # structures per request
    retries: int = 4
    backoff_s: float = 0.5
    timeout_s: float = 600.0
    retry_failed: bool = False
    progress: bool = True


@dataclass(frozen=True)
class ScreenReport:
    total: int  # frames found in the inputs (plus unreadable rests of files)
    skipped: int  # finished in an earlier run
    succeeded: int  # evaluated in this run
    failed: int  # recorded as failed in this run
    output: Path
    summary: Path
    seconds: float


class ScreenAborted(RuntimeError):
    """A failure that no retry or skip can fix (wrong key or URL); the run stops."""


ModelIdentity = dict[str, str]
"""``name``, ``sha256`` and ``precision`` of the model that answered (journalled per entry)."""


def _model_identity(model: Mapping[str, Any], precision: str) -> ModelIdentity:
    """A model's identity from its ``name`` and ``sha256`` (an answer's provenance, an
    evaluator's info), and the precision it ran at."""
    return {"name": str(model["name"]), "sha256": str(model["sha256"]), "precision": precision}


@dataclass(frozen=True)
class _Item:
    id: str
    source: str
    frame: int
    atoms: Atoms


@dataclass(frozen=True)
class _Outcome:
    item: _Item
    result: dict[str, Any] | None  # energy, forces, stress (numpy) when it succeeded
    error: tuple[str, str] | None = None  # (code, message) when it failed
    model: ModelIdentity | None = None  # the model that computed ``result``


class _Rejected(Exception):
    """The evaluator refused a batch because of one structure (``index``) or of the batch."""

    def __init__(self, code: str, message: str, index: int | None) -> None:
        super().__init__(message)
        self.code, self.message, self.index = code, message, index


class _GaveUp(Exception):
    """No answer for the batch in time: its structures fail (``--retry-failed`` reruns them)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class _Backend(Protocol):
    async def evaluate(self, atoms: list[Atoms]) -> tuple[list[dict[str, Any]], ModelIdentity]:
        """Results per structure, and the model that computed them."""
        ...

    async def aclose(self) -> None: ...


def _structure_index(detail: Any) -> int | None:
    """Which structure of the batch an error is about, from the server's ``detail``."""
    if not isinstance(detail, dict):
        return None
    index = detail.get("index")
    if isinstance(index, int):
        return index
    errors = detail.get("errors") or [{}]
    match = _STRUCTURE_FIELD.match(str(errors[0].get("field", "")))
    return int(match.group(1)) if match else None


def _service_url(url: str) -> str:
    """``url``, if it names an http(s) host; otherwise the run aborts (every request would
    fail)."""
    try:
        split_service_url(url)
    except ValueError:
        raise ScreenAborted(f"expected an http:// or https:// service URL, got {url!r}") from None
    return url


class _HttpBackend:
    """Batches as msgpack requests to the service, with retries on transient failures."""

    def __init__(self, options: ScreenOptions) -> None:
        assert options.url is not None
        headers = {b"Accept": b"application/msgpack"}
        if options.api_key is not None:
            # As bytes: httpx encodes str values as ASCII, the server reads the key's UTF-8.
            headers[b"X-API-Key"] = options.api_key.encode()
        self._options = options
        self._client = httpx.AsyncClient(
            base_url=_service_url(options.url),
            timeout=httpx.Timeout(
                options.timeout_s, connect=min(options.timeout_s, CONNECT_TIMEOUT_S)
            ),
            headers=headers,
            limits=httpx.Limits(max_connections=options.concurrency),
            # As the ASE calculator: no http_proxy from the environment (HPC login nodes set
            # one, and it took even 127.0.0.1 to the proxy); and as it, the system's CA store
            # with OpenSSL's SSL_CERT_FILE/SSL_CERT_DIR (which trust_env=False alone drops).
            trust_env=False,
            verify=ssl.create_default_context(),
        )

    def _results(
        self, response: httpx.Response, n_structures: int
    ) -> tuple[list[dict[str, Any]], ModelIdentity]:
        """A 2xx answer's results and model; anything but one so2serve result per structure
        sent stops the run (every batch would meet the same service)."""
        try:
            document = decode_response(
                response.content, response.headers.get("content-type", "application/json")
            )
            results = [result_arrays(r) for r in document["results"]]
            if len(results) != n_structures:
                raise ScreenAborted(
                    f"{self._options.url} answered {len(results)} result(s) for {n_structures} "
                    "structure(s): not an so2serve answer"
                )
            provenance = document["provenance"]
            model = _model_identity(provenance["model"], str(provenance["execution"]["precision"]))
        except UNDECODABLE as exc:
            error = bad_response(
                str(self._options.url), response.status_code, response.content, exc
            )
            raise ScreenAborted(str(error)) from exc
        return results, model

    async def evaluate(self, atoms: list[Atoms]) -> tuple[list[dict[str, Any]], ModelIdentity]:
        body = encode_request([encode_structure(a, binary=True) for a in atoms], PROPERTIES, True)
        retries = self._options.retries
        for attempt in range(retries + 1):
            try:
                response = await self._client.post(
                    "/evaluate", content=body, headers={"Content-Type": "application/msgpack"}
                )
            except httpx.ReadTimeout as exc:
                # Not sent again: the server may still be computing it, and a copy would queue
                # the same work behind it (the ASE calculator does not resend either).
                raise _GaveUp(
                    "timeout",
                    f"no answer within {self._options.timeout_s:g} s (--timeout) for a batch of "
                    f"{len(atoms)} structure(s); not sent again (--retry-failed reruns it)",
                ) from exc
            except httpx.TransportError as exc:
                if attempt == retries:
                    # No structure's fault, and every other batch would go the same way.
                    how = "unreachable" if isinstance(exc, _NO_CONNECTION) else "failing"
                    raise ScreenAborted(
                        f"so2serve at {self._options.url} {how} after {retries} retries "
                        f"({type(exc).__name__}: {exc}); run the same command again to resume "
                        "once it is up"
                    ) from None
                await asyncio.sleep(retry_delay(attempt, self._options.backoff_s, None))
                continue
            if 200 <= response.status_code < 300:
                return self._results(response, len(atoms))
            if response.status_code < 400:
                # A redirect (e.g. http:// to https://) is not followed: the batch's body would
                # not go with every kind of redirect, and the address should be the service's.
                raise ScreenAborted(
                    f"{self._options.url} answered {response.status_code} "
                    f"{response.headers.get('location', '')}: --url must name the so2serve "
                    "service itself"
                )
            error = error_from_response(response.status_code, response.content)
            if response.status_code in _FATAL_STATUS:
                raise ScreenAborted(str(error))
            if response.status_code not in TRANSIENT_STATUS:
                raise _Rejected(error.code, str(error), _structure_index(error.detail))
            if attempt == retries:
                # A restarting or saturated service (or a proxy before it): no structure's
                # fault, so nothing is journalled as failed and the same command resumes.
                raise ScreenAborted(
                    f"{error} (after {retries} retries); run the same command again to resume "
                    "once the service answers (a proxy's 504 on big batches: lower "
                    "--batch-atoms)"
                )
            delay = retry_delay(
                attempt, self._options.backoff_s, response.headers.get("retry-after")
            )
            await asyncio.sleep(delay)
        raise AssertionError("unreachable: the loop returns or raises on its last attempt")

    async def aclose(self) -> None:
        await self._client.aclose()


class _EngineBackend:
    """Batches through the service's engine in this process, without HTTP: a copy of the model
    on each device (one queue), the server's out-of-memory bisection and per-structure
    failures."""

    def __init__(self, evaluators: Sequence[Evaluator]) -> None:
        self._evaluators = list(evaluators)
        self._engine: Engine | None = None
        first = self._evaluators[0]
        self._model = _model_identity(first.info(), first.execution.precision)

    async def evaluate(self, atoms: list[Atoms]) -> tuple[list[dict[str, Any]], ModelIdentity]:
        from service.engine.errors import DeviceFaultError, EngineError
        from service.graph.errors import InvalidStructureError
        from service.graph.structures import Structures

        try:
            structures = Structures.from_atoms(atoms)
            result = await (await self._running()).evaluate(structures, PROPERTIES)
        except DeviceFaultError as exc:  # no structure's fault, and this process is done
            raise ScreenAborted(
                f"{exc.message}; run the same command again to resume in a new process"
            ) from None
        except (InvalidStructureError, EngineError) as exc:
            raise _Rejected(exc.code, exc.message, getattr(exc, "index", None)) from exc
        ptr = result.atom_ptr.tolist()
        out = []
        for b, a in enumerate(atoms):
            row: dict[str, Any] = {"energy": float(result.energy[b])}
            if result.forces is not None:
                row["forces"] = result.forces[ptr[b] : ptr[b + 1]]
            if result.stress is not None and a.pbc.all():
                row["stress"] = result.stress[b]
            out.append(row)
        return out, self._model

    async def _running(self) -> Engine:
        if self._engine is None:
            from service.engine import BatchLimits, Engine, ServiceMetrics, Worker
            from service.engine.evaluator import model_elements
            from service.engine.kernel_sets import preload_recorded_kernels

            metrics = ServiceMetrics()
            info = self._evaluators[0].info()
            # No per-structure limit of a server to enforce, and no lone client to serve on
            # the event loop: every pass goes to a device thread.
            limits = BatchLimits(max_atoms=2**31 - 1, inline_max_atoms=0)
            workers = [Worker(e, metrics) for e in self._evaluators]
            # Compile each device's recorded kernel set at once (about half the time of the
            # first batches compiling kernel after kernel on an empty Triton cache).
            for evaluator in self._evaluators:
                await asyncio.to_thread(preload_recorded_kernels, evaluator)
            self._engine = Engine(
                workers,
                limits,
                metrics,
                rcut=float(info["rcut"]),
                elements=model_elements(info),
            )
            await self._engine.start()
        return self._engine

    async def aclose(self) -> None:
        if self._engine is not None:
            await self._engine.stop()


class _ResultStore:
    """results.extxyz + journal.jsonl (append-only, flushed per structure) + summary.csv."""

    def __init__(self, output_dir: Path) -> None:
        output_dir.mkdir(parents=True, exist_ok=True)
        self._lock = _hold_folder(output_dir)
        try:
            self.results_path = output_dir / RESULTS_FILE
            self.summary_path = output_dir / SUMMARY_FILE
            self._journal_path = output_dir / JOURNAL_FILE
            self.entries = self._recover()
            self.model = next((e["model"] for e in self.entries.values() if "model" in e), None)
            self._results = self.results_path.open("ab")
            self._journal = self._journal_path.open("a", encoding="utf-8")
        except BaseException:
            # The exception may live on (a notebook's last error): the folder must not stay
            # locked behind it once the user has fixed what it says.
            self._lock.close()
            raise

    def _recover(self) -> dict[str, dict[str, Any]]:
        """Entries of earlier runs whose frames are intact; cut off anything half-written."""
        size = self.results_path.stat().st_size if self.results_path.exists() else 0
        if size and not self._journal_path.exists():
            # Every folder this store writes has its journal before any frame: these frames
            # are someone else's, and resuming would cut them all off.
            raise ScreenAborted(
                f"{self.results_path} exists without {JOURNAL_FILE}, so it was not written by "
                "so2serve screen; choose another --out folder or move the file away"
            )
        entries: dict[str, dict[str, Any]] = {}
        committed = 0
        if self._journal_path.exists():
            for line in self._journal_path.read_text(encoding="utf-8").splitlines():
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    continue  # the line being written when the run was killed
                if entry["status"] == "ok":
                    if entry["xyz_end"] > size:
                        continue  # its frame never reached the file
                    committed = max(committed, entry["xyz_end"])
                entries[entry["id"]] = entry
        if size > committed:
            with self.results_path.open("r+b") as f:
                f.truncate(committed)
        tmp = self._journal_path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(e) + "\n" for e in entries.values()), encoding="utf-8")
        os.replace(tmp, self._journal_path)
        return entries

    def finished(self, retry_failed: bool) -> set[str]:
        return {k for k, e in self.entries.items() if e["status"] == "ok" or not retry_failed}

    def record(self, outcome: _Outcome) -> None:
        item = outcome.item
        if outcome.model is not None:
            self._check_model(outcome.model)
        entry: dict[str, Any] = {
            "id": item.id,
            "source": item.source,
            "frame": item.frame,
            "formula": item.atoms.get_chemical_formula(),
            "n_atoms": len(item.atoms),
        }
        if outcome.result is not None:
            assert outcome.model is not None
            self._results.write(_extxyz_frame(item, outcome.result, outcome.model))
            self._results.flush()
            forces = outcome.result.get("forces")
            entry |= {
                "status": "ok",
                "energy": outcome.result["energy"],
                "fmax": None if forces is None else _fmax(item.atoms, forces),
                "model": outcome.model,
                "xyz_end": self._results.tell(),
            }
        else:
            assert outcome.error is not None
            entry |= {"status": "failed", "error_code": outcome.error[0], "error": outcome.error[1]}
        self._journal.write(json.dumps(entry) + "\n")
        self._journal.flush()
        self.entries[item.id] = entry

    def _check_model(self, model: ModelIdentity) -> None:
        """Every result of one output folder comes from one model: a run resumed against
        another (a server restarted on a retrained file) stops before mixing them."""
        if self.model is None:
            self.model = model
        elif not _same_model(model, self.model):
            raise ScreenAborted(
                f"the results in {self.results_path.parent} come from model "
                f"{_model_label(self.model)}, but this run's evaluator answers with "
                f"{_model_label(model)}; choose another --out folder, or screen with the "
                "model and precision the run began with"
            )

    def write_summary(self, sources: Sequence[str]) -> None:
        """Rows in input order: by source (``sources``, as :func:`_distinct_sources` gives
        them), then frame, which needs no reading of the inputs (a run stopped early has not
        read them all); rows of sources not given this time last, in journal order."""
        ranked = {source: k for k, source in enumerate(sources)}

        def place(entry: dict[str, Any]) -> tuple[int, int]:
            rank = ranked.get(entry["source"])
            return (len(ranked), 0) if rank is None else (rank, entry["frame"])

        rows = sorted(self.entries.values(), key=place)
        columns = [
            "id",
            "source",
            "frame",
            "formula",
            "n_atoms",
            "status",
            "energy_eV",
            "energy_per_atom_eV",
            "fmax_eV_per_A",
            "error_code",
            "error",
        ]
        with self.summary_path.open("w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(columns)
            for e in rows:
                energy = e.get("energy")
                per_atom = None if energy is None else energy / e["n_atoms"]
                writer.writerow(
                    [
                        e["id"],
                        e["source"],
                        e["frame"],
                        e["formula"],
                        e["n_atoms"],
                        e["status"],
                        _fmt(energy),
                        _fmt(per_atom),
                        _fmt(e.get("fmax")),
                        e.get("error_code", ""),
                        e.get("error", ""),
                    ]
                )

    def close(self) -> None:
        self._results.close()
        self._journal.close()
        self._lock.close()


def _hold_folder(output_dir: Path) -> IO[bytes]:
    """An exclusive lock on ``output_dir`` for this run (held while the returned file stays
    open): a second run into the same folder (a requeued cluster job) would rewrite the journal
    the first is appending to, losing its entries."""
    lock = (output_dir / LOCK_FILE).open("ab")
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks of this kind; the folder is not guarded
        return lock
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise ScreenAborted(
            f"another so2serve screen is writing to {output_dir}; wait for it to finish or "
            "choose another --out folder"
        ) from None
    except OSError as exc:
        if exc.errno not in _NO_FLOCK:
            lock.close()
            raise
        # Lustre mounted noflock, NFSv3 without lockd: screening works there, unguarded.
        warnings.warn(
            f"{output_dir} takes no file locks ({exc.strerror}): nothing keeps a second "
            "so2serve screen out of it",
            RuntimeWarning,
            stacklevel=2,
        )
    return lock


_NO_FLOCK = frozenset((errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL))
"""flock's errors on file systems that take no locks."""


def _same_model(a: ModelIdentity, b: ModelIdentity) -> bool:
    """By content hash where both have one (a name is the file's stem: a copy staged under
    another name is the same model); by name for models without a hash (in memory). At the
    same precision too: fp64 and fp16x3 answers differ from fp32 ones in their last digits."""
    if a.get("precision") != b.get("precision"):
        return False
    if a["sha256"] and b["sha256"]:
        return a["sha256"] == b["sha256"]
    return a["name"] == b["name"] and a["sha256"] == b["sha256"]


def _model_label(model: ModelIdentity) -> str:
    name = model["name"] or "(unnamed)"
    return f"{name} (sha256 {model['sha256'][:12]}, precision {model.get('precision', '?')})"


def _fmax(atoms: Atoms, forces: np.ndarray) -> float:
    """The largest force on an atom free to move, as ASE's optimisers measure it: forces with
    the structure's constraints applied (fixed atoms count zero)."""
    adjusted = np.array(forces, dtype=np.float64)
    for constraint in atoms.constraints:
        constraint.adjust_forces(atoms, adjusted)
    return float(np.linalg.norm(adjusted, axis=1).max())


def _fmt(value: float | None) -> str:
    return "" if value is None else repr(float(value))


def _extxyz_frame(item: _Item, result: dict[str, Any], model: ModelIdentity) -> bytes:
    """The structure with its results as one extxyz frame, carrying the input's own ``info``
    and per-atom arrays where extxyz can hold them unchanged (:func:`_portable_metadata`);
    if ASE still cannot write them, the frame carries the structure and its ids alone."""
    ids = {"screen_id": item.id, "source": item.source, "frame": item.frame}
    # An empty string would not read back (ASE writes it as nothing), and a bare hex digest
    # may read back as a number: "sha256:<hex>".
    if model["name"]:
        ids["model"] = model["name"]
    if model["sha256"]:
        ids["model_hash"] = f"sha256:{model['sha256']}"
    if model.get("precision"):
        ids["model_precision"] = model["precision"]
    atoms = item.atoms
    bare = Atoms(atoms.numbers, atoms.positions, cell=atoms.cell, pbc=atoms.pbc)
    info, arrays = _portable_metadata(atoms)
    full = bare.copy()
    full.info.update(info)
    for key, values in arrays.items():
        full.set_array(key, values)
    full.set_constraint(atoms.constraints)
    try:
        return _write_frame(full, ids, result)
    except Exception:  # ASE's writer raises many types for metadata it cannot encode
        return _write_frame(bare, ids, result)


def _write_frame(atoms: Atoms, ids: dict[str, Any], result: dict[str, Any]) -> bytes:
    atoms.info.update(ids)
    atoms.calc = SinglePointCalculator(
        atoms,
        energy=result["energy"],
        free_energy=result["energy"],
        forces=result.get("forces"),
        stress=result.get("stress"),
    )
    buffer = io.StringIO()
    ase.io.write(buffer, atoms, format="extxyz")
    return buffer.getvalue().encode("utf-8")


_CALCULATOR_ARRAYS = frozenset(per_atom_properties)
"""Per-atom results ASE's extxyz reader hands to a calculator (forces, energies, charges, ...)."""
_FRAME_INFO_KEYS = frozenset((*per_config_properties, *_ID_KEYS, "Lattice", "Properties", "pbc"))
"""info keys that would read back as our results or as extxyz's own fields: kept as input_*."""
_FRAME_ARRAY_KEYS = _CALCULATOR_ARRAYS | {"numbers", "positions", "species", "pos"}
_PORTABLE_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")
_UNPORTABLE_TEXT = re.compile(r"[\\\x00-\x1f\x7f]")


def _portable_metadata(atoms: Atoms) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The ``info`` entries and per-atom arrays of ``atoms`` that an extxyz comment line and
    its columns carry through a write and a read unchanged.

    ASE's extxyz writer silently corrupts the rest: a key with a space or ``=``, an empty
    string, a backslash, a tab or line break (the whole file then fails to read), None. Results
    a reader stored with the structure (a DFT energy and forces from an extxyz or .traj file)
    come along too. A value under one of our results' names (``energy``, ``forces``, ...) is
    kept as ``input_<name>``.
    """
    info: dict[str, Any] = {}
    stored = atoms.calc.results if atoms.calc is not None else {}  # a reader's reference values
    per_atom = {k: v for k, v in stored.items() if k in _CALCULATOR_ARRAYS}
    per_structure = {k: v for k, v in stored.items() if k not in per_atom}
    for key, value in {**per_structure, **atoms.info}.items():
        name = f"input_{key}" if key in _FRAME_INFO_KEYS else key
        if isinstance(name, str) and _PORTABLE_KEY.match(name) and _portable_value(value):
            info[name] = value
    arrays: dict[str, np.ndarray] = {}
    for key, values in {**per_atom, **atoms.arrays}.items():
        if key in ("numbers", "positions"):
            continue
        name = f"input_{key}" if key in _FRAME_ARRAY_KEYS else key
        values = np.asarray(values)
        if _PORTABLE_KEY.match(name) and values.dtype.kind in "biuf" and values.ndim <= 2:
            arrays[name] = values
    return info, arrays


def _portable_value(value: Any) -> bool:
    if isinstance(value, str):
        return bool(value) and not _UNPORTABLE_TEXT.search(value)
    if isinstance(value, bool | int | float | np.bool_ | np.integer | np.floating):
        return True
    if isinstance(value, list | tuple | np.ndarray):
        try:
            values = np.asarray(value)
        except ValueError:  # ragged nesting
            return False
        return values.size > 0 and values.dtype.kind in "biuf" and values.ndim <= 2
    return False


async def _entries(sources: Sequence[str]) -> AsyncIterator[_Item | _Outcome]:
    """Every structure of every file of ``sources`` (:func:`_distinct_sources`) in order, each
    malformed frame a failure of its own, parsed in a thread (``READ_CHUNK`` frames at a time)
    so that the first batches are evaluated while the rest is read."""
    frames = itertools.chain.from_iterable(map(_read_frames, sources))
    while chunk := await asyncio.to_thread(_take, frames, READ_CHUNK):
        for entry in chunk:
            yield entry


def _distinct_sources(paths: Sequence[Path]) -> list[str]:
    """The input paths as given, each once: a path given twice (overlapping shell globs) would
    give its structures colliding ids."""
    return list(dict.fromkeys(str(p) for p in paths))


def _take(entries: Iterator[_Item | _Outcome], count: int) -> list[_Item | _Outcome]:
    return list(itertools.islice(entries, count))


def _read_frames(source: str) -> Iterator[_Item | _Outcome]:
    """The frames of ``source`` in order: an item per frame that parses, a failure per frame
    that does not.

    One streaming pass when every frame parses. After a failure at frame k the file is read
    again from frame k + 1 (ASE's extxyz reader locates frames from their atom-count lines, so
    a malformed coordinate spoils only its own frame), unless the failure is not about frame k
    alone: then the rest of the file is one failure. Each malformed frame costs one more scan
    of the atom-count lines (about a tenth of parsing the file, for extxyz).
    """
    start = 0
    alone: bool | None = None  # whether a failure spoils only its frame: same for every frame
    while True:
        frame = start
        try:
            for atoms in ase.io.iread(source, index=slice(start, None)):
                yield _Item(f"{source}@{frame}", source, frame, atoms)
                frame += 1
            if frame == 0:  # e.g. a text file or a mistyped glob: not a finished, empty run
                message = f"no structures in {source} (not a structure file ASE reads?)"
                yield _Outcome(_Item(f"{source}@0", source, 0, Atoms()), None,
                               ("unreadable", message))  # fmt: skip
            return
        except Exception as exc:  # ASE raises many types for files it cannot parse
            if alone is None:
                alone = _frames_read_apart(source)
            where = f"frame {frame} of {source}" if alone else f"{source} from frame {frame} on"
            message = f"cannot read {where}: {type(exc).__name__}: {exc}"
            placeholder = _Item(f"{source}@{frame}", source, frame, Atoms())
            yield _Outcome(placeholder, None, ("unreadable", message))
            if not alone:
                return
            start = frame + 1


def _frames_read_apart(source: str) -> bool:
    """Whether ASE can skip to the end of ``source`` without parsing (or failing on) a frame.

    Only then does a read that starts after a failed frame get past it (and end), rather
    than failing on the same spot again (a broken frame index, a single-structure format,
    a reader that parses every frame on its way to a slice's start).
    """
    try:
        past_the_end = ase.io.iread(source, index=slice(sys.maxsize, None))
        return next(past_the_end, None) is None
    except Exception:  # it fails before reaching any frame: the file cannot be read apart
        return False


class _Batcher:
    """Consecutive structures in batches bounded by atoms and count."""

    def __init__(self, max_atoms: int, max_structures: int) -> None:
        self._max_atoms, self._max_structures = max_atoms, max_structures
        self._batch: list[_Item] = []
        self._atoms = 0

    def add(self, item: _Item) -> list[_Item] | None:
        """Adds ``item``; returns the batch it closed by not fitting in, if any."""
        n = len(item.atoms)
        full = None
        if self._batch and (
            self._atoms + n > self._max_atoms or len(self._batch) == self._max_structures
        ):
            full = self.flush()
        self._batch.append(item)
        self._atoms += n
        return full

    def flush(self) -> list[_Item]:
        batch, self._batch, self._atoms = self._batch, [], 0
        return batch


async def _evaluate_isolating(backend: _Backend, batch: list[_Item]) -> list[_Outcome]:
    """Evaluate a batch; a structure the evaluator rejects fails alone, the rest go again."""
    outcomes: list[_Outcome] = []
    pending = list(batch)
    while pending:
        try:
            results, model = await backend.evaluate([item.atoms for item in pending])
        except _GaveUp as exc:
            return outcomes + [_Outcome(item, None, (exc.code, exc.message)) for item in pending]
        except _Rejected as exc:
            index = 0 if len(pending) == 1 else exc.index
            if index is None or not 0 <= index < len(pending):
                for item in pending:  # the error names no structure: try each alone
                    outcomes += await _evaluate_isolating(backend, [item])
                return outcomes
            message = _about_structure_alone(exc.message, index)
            outcomes.append(_Outcome(pending[index], None, (exc.code, message)))
            del pending[index]
            continue
        return outcomes + [
            _Outcome(i, r, model=model) for i, r in zip(pending, results, strict=True)
        ]
    return outcomes


def _about_structure_alone(message: str, index: int) -> str:
    """The evaluator's ``message`` about structure ``index`` of a batch, worded for that
    structure's own row: its place in the batch means nothing there (after a rejection the
    rest of a batch goes again, renumbered).

    ``"structure 2: atoms 0 and 1 …"`` → ``"atoms 0 and 1 …"``,
    ``"structures[2].positions: …"`` → ``"positions: …"``,
    ``"evaluating structures[2] failed"`` → ``"evaluating the structure failed"``.
    """
    message = re.sub(rf"\bstructure {index}: ", "", message)
    message = re.sub(rf"\bstructures\[{index}\]\.", "", message)
    return re.sub(rf"\bstructures\[{index}\]", "the structure", message)


def _average_rate(task: Task) -> float | None:
    """Structures per second since the run began. Not rich's own speed, which is taken over
    its recent samples: results are recorded a batch at a time, all within a millisecond,
    so after one batch that speed was thousands of structures per second (the ETA zero)."""
    elapsed = task.finished_time if task.finished else task.elapsed
    if not task.completed or not elapsed:
        return None
    return task.completed / elapsed


class _RateColumn(ProgressColumn):
    def render(self, task: Task) -> Text:
        rate = _average_rate(task)
        return Text("" if rate is None else f"{rate:.1f} structures/s", style="cyan")


def _remaining(task: Task) -> str:
    """Time left at the run's average rate (``_average_rate``), as ``H:MM:SS``."""
    rate = _average_rate(task)
    if task.finished:
        seconds = 0
    elif rate is None or task.total is None:
        return "-:--:--"
    else:
        seconds = int((task.total - task.completed) / rate)
    minutes, seconds = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}"


class _RemainingColumn(ProgressColumn):
    def render(self, task: Task) -> Text:
        return Text(_remaining(task), style="progress.remaining")


def _plain_progress_line(task: Task) -> str:
    """The bar's numbers as one line of text, for a log file."""
    rate = _average_rate(task)
    total = "?" if task.total is None else int(task.total)
    speed = "" if rate is None else f", {rate:.1f} structures/s"
    return (
        f"screening: {int(task.completed)}/{total} done, {task.fields['failed']} failed"
        f"{speed}, ETA {_remaining(task)}"
    )


async def _log_progress(progress: Progress, task: TaskID) -> None:
    """Where stderr is not a terminal, rich draws the bar once, at the end: a line every
    ``PLAIN_PROGRESS_S`` instead, so a batch job's log shows the run moving."""
    while True:
        await asyncio.sleep(PLAIN_PROGRESS_S)
        (current,) = (t for t in progress.tasks if t.id == task)
        progress.console.print(_plain_progress_line(current), highlight=False)


def _progress(enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]screening"),
        BarColumn(),
        MofNCompleteColumn(),
        _RateColumn(),
        TextColumn("failed {task.fields[failed]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        _RemainingColumn(),
        console=Console(stderr=True),
        disable=not enabled,
    )


@dataclass
class _Tally:
    read: int = 0  # ids read, skipped ones included
    skipped: int = 0
    succeeded: int = 0
    failed: int = 0


async def _run(
    backend: _Backend,
    store: _ResultStore,
    sources: Sequence[str],
    options: ScreenOptions,
    tally: _Tally,
) -> None:
    finished = store.finished(options.retry_failed)
    queue: asyncio.Queue[list[_Item] | None] = asyncio.Queue(maxsize=2 * options.concurrency)
    with _progress(options.progress) as progress:
        task = progress.add_task("screen", total=0, failed=0)

        def record(outcome: _Outcome) -> None:
            store.record(outcome)
            if outcome.result is None:
                tally.failed += 1
            else:
                tally.succeeded += 1
            progress.update(task, advance=1, failed=tally.failed)

        async def produce() -> None:
            batcher = _Batcher(options.batch_atoms, options.batch_structures)
            async for entry in _entries(sources):
                item = entry if isinstance(entry, _Item) else entry.item
                tally.read += 1
                if item.id in finished:
                    tally.skipped += 1
                    continue
                progress.update(task, total=tally.read - tally.skipped)
                if isinstance(entry, _Outcome):  # a frame that does not parse
                    record(entry)
                elif (full := batcher.add(entry)) is not None:
                    await queue.put(full)
            if rest := batcher.flush():
                await queue.put(rest)
            for _ in range(options.concurrency):
                await queue.put(None)

        async def consume() -> None:
            while (batch := await queue.get()) is not None:
                for outcome in await _evaluate_isolating(backend, batch):
                    record(outcome)

        logging = None
        if options.progress and not progress.console.is_terminal:
            logging = asyncio.create_task(_log_progress(progress, task))
        try:
            await asyncio.gather(produce(), *(consume() for _ in range(options.concurrency)))
        finally:
            if logging is not None:
                logging.cancel()


def screen(
    inputs: Sequence[Path], options: ScreenOptions, *, evaluator: Evaluator | None = None
) -> ScreenReport:
    """Screen ``inputs`` into ``options.output_dir``; see the module docstring.

    ``evaluator`` (tests, or an already loaded ``Potential``) replaces both the service and
    ``options.model``.
    """
    return asyncio.run(_screen(inputs, options, evaluator))


async def _screen(
    inputs: Sequence[Path], options: ScreenOptions, evaluator: Evaluator | None
) -> ScreenReport:
    started = time.perf_counter()
    tally = _Tally()
    sources = _distinct_sources(inputs)
    async with contextlib.AsyncExitStack() as cleanup:
        # The backend first: a model file that does not load leaves no output folder behind.
        backend = _backend(options, evaluator)
        cleanup.push_async_callback(backend.aclose)
        store = _ResultStore(options.output_dir)
        cleanup.callback(store.close)
        try:
            await _run(backend, store, sources, options, tally)
        finally:
            store.write_summary(sources)
    return ScreenReport(
        total=tally.read,
        skipped=tally.skipped,
        succeeded=tally.succeeded,
        failed=tally.failed,
        output=store.results_path,
        summary=store.summary_path,
        seconds=time.perf_counter() - started,
    )


def _backend(options: ScreenOptions, evaluator: Evaluator | None) -> _Backend:
    if evaluator is not None:
        return _EngineBackend([evaluator])
    if options.url is not None:
        return _HttpBackend(options)
    from service.model.potential import load_potentials, resolve_devices

    try:  # a device this machine lacks aborts the run (the model file is not at fault)
        resolve_devices(options.device)
    except ValueError as exc:
        raise ScreenAborted(str(exc)) from None
    return _EngineBackend(load_potentials(options.model, devices=options.device))
