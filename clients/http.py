"""``SO2Calculator``: an ASE calculator that evaluates through a running so2serve service.

One persistent HTTP connection (keep-alive, ``clients/_connection.py``) per calculator.
By default requests and answers are msgpack with arrays as raw little-endian bytes (typed
arrays out, bare float64 ``bin`` back, read with ``np.frombuffer``); ``wire="json"`` sends
JSON instead. Both carry float64 exactly, so the numbers equal the in-process calculator's bit
for bit. Transient
failures (connection errors, 502/503/504) are retried with backoff; everything else raises
``ServiceError``, an ``ase.calculators.calculator.CalculationFailed`` carrying the server's code
and message. A request without an answer within ``timeout`` is not resent (the server may still
be computing it) and raises code ``timeout``; an answer that is not so2serve's (a redirect,
another web service) raises code ``http_<status>`` or ``bad_response``.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Collection, Mapping
from typing import Any, Literal

import msgpack
import numpy as np
import orjson
from ase import Atoms
from ase.calculators.calculator import CalculationFailed

from clients._connection import AnswerTimeout, KeepAliveConnection, Reply, TransportError
from clients._properties import IMPLEMENTED_PROPERTIES, SerialCalculator

WireChoice = Literal["json", "msgpack"]
_JSON = "application/json"
_MSGPACK = "application/msgpack"
TRANSIENT_STATUS = frozenset((502, 503, 504))
"""Statuses worth retrying: the service (or a proxy before it) is restarting or saturated."""
_FLOAT64_LE = np.dtype("<f8")

DEFAULT_SPIN_LEAD_MS = 0.4
"""On a 2-core VM against a lone-client server busy for 2–9 ms per request, polling from
0.4 ms before the answer was due cut the answer's wake-up delay from 0.18–0.33 ms to
0.11–0.29 ms (every one of six interleaved comparisons) for +0.3–0.4 ms of client CPU per
request (``benchmarks/service.py``, ``http_echo``)."""


class ServiceError(CalculationFailed):
    """The service refused or failed a request; ``code``/``status``/``detail`` say why."""

    def __init__(self, message: str, *, code: str, status: int | None, detail: Any = None):
        super().__init__(message)
        self.code = code
        self.status = status
        self.detail = detail


class RejectedStructureServiceError(ServiceError, ValueError):
    """The service refused a structure itself (422, or 413 ``too_many_atoms``): also a
    ValueError, as the in-process calculator's refusal is, so that one ``except`` (ValueError
    or ASE's CalculationFailed) serves both calculators."""


def typed_array(values: np.ndarray, dtype: str) -> dict[str, Any]:
    """A msgpack typed array ``{"dtype", "shape", "data"}`` (raw bytes, C order); ``data`` is
    a view that msgpack packs as ``bin`` straight from the array's buffer."""
    raw = np.ascontiguousarray(values, dtype=dtype)
    return {"dtype": dtype, "shape": list(raw.shape), "data": raw.data}


def encode_structure(atoms: Atoms, binary: bool) -> dict[str, Any]:
    """One structure of an ``/evaluate`` body (binary: msgpack typed arrays; else numpy arrays
    that orjson writes as nested lists)."""
    cell = atoms.cell.array
    has_cell = bool(atoms.pbc.any()) or bool(cell.any())
    item: dict[str, Any] = {"pbc": [bool(p) for p in atoms.pbc]}
    if binary:
        item["species"] = typed_array(atoms.numbers, "<i8")
        item["positions"] = typed_array(atoms.positions, "<f8")
        if has_cell:
            item["cell"] = typed_array(cell, "<f8")
    else:
        item["species"] = np.ascontiguousarray(atoms.numbers, dtype=np.int64)
        item["positions"] = np.ascontiguousarray(atoms.positions, dtype=np.float64)
        if has_cell:
            item["cell"] = np.ascontiguousarray(cell, dtype=np.float64)
    return item


def encode_request(
    structures: list[dict[str, Any]], properties: Collection[str], binary: bool
) -> bytes:
    document = {"structures": structures, "properties": sorted(properties)}
    if binary:
        packed: bytes = msgpack.packb(document, use_bin_type=True)
        return packed
    return orjson.dumps(document, option=orjson.OPT_SERIALIZE_NUMPY)


def decode_response(content: bytes, media_type: str) -> dict[str, Any]:
    if media_type.startswith(_MSGPACK):
        document: dict[str, Any] = msgpack.unpackb(content, raw=False)
    else:
        document = orjson.loads(content)
    return document


def result_arrays(result: Mapping[str, Any]) -> dict[str, Any]:
    """A result of either wire format as float64 numpy arrays.

    msgpack ``bin`` values are copied out of the message (a microsecond at thousands of atoms),
    so that results are writable arrays whichever the wire, as they are in process; JSON lists
    are flattened in C (``np.fromiter``), several times faster than ``np.asarray`` on nested
    lists.
    """
    n_atoms = int(result["n_atoms"])
    shapes = {"forces": (n_atoms, 3), "energies": (n_atoms,), "stress": (6,), "virial": (3, 3)}
    out: dict[str, Any] = {"energy": float(result["energy"])}
    for name, shape in shapes.items():
        value = result.get(name)
        if value is None:
            continue
        size = math.prod(shape)
        if isinstance(value, bytes):
            flat = np.frombuffer(value, dtype=_FLOAT64_LE, count=size).copy()
        else:
            items = itertools.chain.from_iterable(value) if len(shape) == 2 else value
            flat = np.fromiter(items, dtype=np.float64, count=size)
        out[name] = flat.reshape(shape)
    return out


def error_from_response(status: int, content: bytes) -> ServiceError:
    """The server's ``{code, message, detail}`` error body as a ``ServiceError``."""
    try:
        body = orjson.loads(content)
        code, message, detail = str(body["code"]), str(body["message"]), body.get("detail")
    except (orjson.JSONDecodeError, KeyError, TypeError):
        text = content[:500].decode("utf-8", "replace")
        code, message, detail = f"http_{status}", text, None
    refused = status == 422 or (status == 413 and code == "too_many_atoms")
    kind = RejectedStructureServiceError if refused else ServiceError
    return kind(
        f"so2serve answered {status} {code}: {message}", code=code, status=status, detail=detail
    )


UNDECODABLE = (ValueError, KeyError, IndexError, TypeError, msgpack.UnpackException)
"""What decoding an answer that is not an so2serve document raises."""


def bad_response(url: str, status: int, content: bytes, reason: Exception) -> ServiceError:
    """A 2xx answer that is not an so2serve document (``url`` names another service)."""
    text = content[:200].decode("utf-8", "replace")
    return ServiceError(
        f"{url} answered {status} with something that is not an so2serve answer "
        f"({type(reason).__name__}: {reason}): {text!r}",
        code="bad_response",
        status=status,
    )


def retry_delay(attempt: int, backoff_s: float, retry_after: str | None) -> float:
    """Exponential backoff, or the server's Retry-After when it is longer (capped at 30 s)."""
    delay: float = backoff_s * 2.0**attempt
    if retry_after is not None and retry_after.isdigit():
        delay = max(delay, float(retry_after))
    return min(delay, 30.0)


class SO2Calculator(SerialCalculator):
    """ASE calculator backed by an so2serve service.

    Args:
        url: base URL of the service.
        api_key: sent as ``X-API-Key`` (default: none).
        timeout: seconds for the answer to one request (a request without an answer in
            time fails with code ``timeout``, not resent); connecting waits at most
            ``CONNECT_TIMEOUT_S`` (10 s) of it.
        wire: ``"msgpack"`` (raw binary arrays both ways) or ``"json"``.
        retries: attempts after the first on transient failures (no connection, 502/503/504).
        backoff_s: first retry delay, doubled each attempt.
        spin_lead_ms: poll the socket from this long before the answer is due (predicted from
            the last answer to a request of the same size) instead of sleeping through the
            server's pass, so that the answer is not read late by a thread waking from a deep
            sleep state (0.1–0.4 ms on some hosts). Costs about 0.3–0.4 ms of one core's CPU
            time per call (at most twice this lead plus the poll calls) and, in a threaded
            client, that much interpreter time; 0 sleeps. See ``clients/_connection.py``.
    """

    implemented_properties = IMPLEMENTED_PROPERTIES

    def __init__(
        self,
        url: str = "http://127.0.0.1:8000",
        api_key: str | None = None,
        timeout: float = 60.0,
        *,
        wire: WireChoice = "msgpack",
        retries: int = 3,
        backoff_s: float = 0.25,
        spin_lead_ms: float = DEFAULT_SPIN_LEAD_MS,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if wire not in ("json", "msgpack"):
            raise ValueError(f"wire must be 'json' or 'msgpack', got {wire!r}")
        if retries < 0 or not backoff_s >= 0:
            raise ValueError(f"retries and backoff_s must be >= 0, got {retries}, {backoff_s}")
        if api_key is not None and not api_key.isprintable():
            # A line break would end the request's headers early: the server then sees a
            # broken request (400 malformed_http) instead of a key.
            raise ValueError(
                "api_key contains a line break or another control character "
                "(a key read from a file with its trailing newline?)"
            )
        headers = {"Accept": _MSGPACK if wire == "msgpack" else _JSON}
        if api_key is not None:
            headers["X-API-Key"] = api_key
        self.url = url
        self.wire = wire
        self.retries = retries
        self.backoff_s = backoff_s
        self.provenance: dict[str, Any] | None = None
        self._http = KeepAliveConnection(url, timeout, headers, spin_lead_s=spin_lead_ms * 1e-3)

    def evaluate(self, atoms: Atoms, wanted: frozenset[str]) -> dict[str, Any]:
        binary = self.wire == "msgpack"
        body = encode_request([encode_structure(atoms, binary)], wanted, binary)
        reply = self._request("POST", "/evaluate", body, _MSGPACK if binary else _JSON)
        try:
            document = decode_response(reply.content, reply.header("content-type", _JSON) or _JSON)
            result = result_arrays(document["results"][0])
        except UNDECODABLE as exc:
            raise bad_response(self.url, reply.status, reply.content, exc) from exc
        self.provenance = document.get("provenance")
        return {
            "energy": result["energy"],
            "free_energy": result["energy"],
            **{k: result[k] for k in ("forces", "stress", "energies") if k in result},
        }

    def info(self) -> dict[str, Any]:
        """The service's ``/info`` (model, execution path, limits)."""
        with self._calls:  # the connection is the property calls' too
            reply = self._request("GET", "/info", None, None)
        try:
            info: dict[str, Any] = orjson.loads(reply.content)
        except orjson.JSONDecodeError as exc:
            raise bad_response(self.url, reply.status, reply.content, exc) from exc
        return info

    def close(self) -> None:
        """Close the HTTP connection."""
        self._http.close()

    def __enter__(self) -> SO2Calculator:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _request(
        self, method: str, path: str, body: bytes | None, content_type: str | None
    ) -> Reply:
        headers = {"Content-Type": content_type} if content_type else None
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            try:
                reply = self._http.request(method, path, body, headers)
            except AnswerTimeout as exc:
                raise ServiceError(
                    f"so2serve at {self.url}: {exc}", code="timeout", status=None
                ) from exc
            except TransportError as exc:
                if last:
                    raise ServiceError(
                        f"so2serve at {self.url} unreachable: {exc}",
                        code="unreachable",
                        status=None,
                    ) from exc
                time.sleep(retry_delay(attempt, self.backoff_s, None))
                continue
            if 200 <= reply.status < 300:
                return reply
            if reply.status not in TRANSIENT_STATUS or last:
                raise error_from_response(reply.status, reply.content)
            time.sleep(retry_delay(attempt, self.backoff_s, reply.header("retry-after")))
        raise AssertionError("unreachable: the loop returns or raises on its last attempt")
