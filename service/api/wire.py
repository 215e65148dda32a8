"""Bytes ↔ documents: content negotiation, decoding and fast encoding (formats: schemas.py).

Decoding never runs code from the wire: JSON through orjson, msgpack without extension hooks.
Binary arrays of a msgpack request (bare ``bin`` or ``{"dtype", "shape", "data"}``) become
numpy views of the body here, checked for dtype and byte length, so that the schema and the
structure validation see the same arrays a JSON body gives. Encoding hands numpy arrays to
orjson directly (no Python lists) and writes msgpack arrays as raw little-endian float64
``bin`` values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any

import msgpack
import numpy as np
import orjson

from service.api.errors import ApiError
from service.api.schemas import CHECK_BOOLEANS, EvaluateRequest
from service.engine import EvaluationResult
from service.graph.errors import InvalidStructureError
from service.graph.structures import StructureArrays, Structures, symbols_to_numbers


class WireFormat(StrEnum):
    JSON = "application/json"
    MSGPACK = "application/msgpack"


_MSGPACK_TYPES = frozenset(
    ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")
)
_PER_ATOM = ("forces", "energies")
_PER_STRUCTURE = ("stress", "virial")


def _media_type(header: str) -> str:
    return header.split(";", 1)[0].strip().lower()


def request_format(content_type: str | None, content_encoding: str | None = None) -> WireFormat:
    """The body's format from ``Content-Type``; anything else, or a compressed body
    (``Content-Encoding`` other than identity), is 415."""
    if content_encoding is not None and content_encoding.strip().lower() not in ("", "identity"):
        raise ApiError(
            415,
            "unsupported_media_type",
            f"Content-Encoding {content_encoding!r} is not supported; send the body uncompressed",
        )
    media = _media_type(content_type or "")
    if media == "application/json":
        return WireFormat.JSON
    if media in _MSGPACK_TYPES:
        return WireFormat.MSGPACK
    raise ApiError(
        415,
        "unsupported_media_type",
        f"Content-Type must be application/json or application/msgpack, got {content_type!r}",
    )


def response_format(accept: str | None, default: WireFormat) -> WireFormat:
    """msgpack or JSON if ``Accept`` names one of them (msgpack first), else ``default``."""
    media = {_media_type(part) for part in (accept or "").split(",")}
    if media & _MSGPACK_TYPES:
        return WireFormat.MSGPACK
    if "application/json" in media:
        return WireFormat.JSON
    return default


def decode(body: bytes, fmt: WireFormat) -> Any:
    """Parse a body; malformed input is 400, a malformed binary array 422 ``bad_array``."""
    if fmt is WireFormat.JSON:
        return _parse(body, fmt)
    document = _parse(body, fmt)
    _unpack_binary_arrays(document)
    return document


# msgpack raises these with no text of their own.
_SILENT_MSGPACK_ERRORS: dict[type[Exception], str] = {
    msgpack.StackError: "nested too deeply",
    msgpack.FormatError: "a byte that starts no msgpack value (such as 0xc1, reserved)",
}


def _parse(body: bytes, fmt: WireFormat) -> Any:
    try:
        if fmt is WireFormat.JSON:
            return orjson.loads(body)
        return msgpack.unpackb(body, raw=False, strict_map_key=True)
    except (
        orjson.JSONDecodeError,
        ValueError,
        msgpack.ExtraData,
        msgpack.FormatError,
        msgpack.StackError,
    ) as exc:
        reason = str(exc) or _SILENT_MSGPACK_ERRORS.get(type(exc), type(exc).__name__)
        raise ApiError(
            400, "malformed_body", f"the body is not valid {fmt.name.lower()}: {reason}"
        ) from exc


FLOAT_DTYPES = frozenset(("<f8", "<f4"))
INT_DTYPES = frozenset(("|u1", "|i1", "<u2", "<i2", "<u4", "<i4", "<i8"))
_ARRAY_DTYPES = {"positions": FLOAT_DTYPES, "cell": FLOAT_DTYPES, "species": INT_DTYPES}
_TYPED_ARRAY_KEYS = frozenset(("dtype", "shape", "data"))


def _unpack_binary_arrays(document: Any) -> None:
    """Replace, in place, the binary arrays of a decoded msgpack request by numpy arrays.

    Anything that is not shaped like a request is left for the schema to report.
    """
    structures = document.get("structures") if isinstance(document, dict) else None
    if not isinstance(structures, list):
        return
    for index, item in enumerate(structures):
        if not isinstance(item, dict):
            continue
        for name, dtypes in _ARRAY_DTYPES.items():
            value = item.get(name)
            if isinstance(value, bytes | dict):
                item[name] = _binary_array(value, name, dtypes, f"structures[{index}].{name}")


def _binary_array(
    value: bytes | dict[str, Any], name: str, dtypes: frozenset[str], field: str
) -> np.ndarray:
    """A bare ``bin`` (float64 rows of 3; positions and cell only) or a typed array, as a
    read-only view of the body (the structure validation copies what it keeps)."""
    if isinstance(value, bytes):
        if dtypes is not FLOAT_DTYPES:
            raise _bad_array(field, f"{name} as binary needs the typed form {{dtype, shape, data}}")
        if len(value) % 24:
            raise _bad_array(
                field,
                f"{name} as bare binary must hold little-endian float64 in rows of 3 "
                f"(24 bytes per row), got {len(value)} bytes",
            )
        return np.frombuffer(value, dtype="<f8").reshape(-1, 3)
    if set(value) != _TYPED_ARRAY_KEYS:
        raise _bad_array(
            field, f"a typed array has exactly the keys dtype, shape, data; got {sorted(value)}"
        )
    dtype, shape, data = value["dtype"], value["shape"], value["data"]
    if not isinstance(dtype, str) or dtype not in dtypes:
        raise _bad_array(field, f"{name} dtype must be one of {sorted(dtypes)}, got {dtype!r}")
    if not isinstance(data, bytes):
        raise _bad_array(field, "data must be msgpack bin (raw bytes)")
    if not (
        isinstance(shape, list)
        and 1 <= len(shape) <= 2
        and all(type(n) is int and 0 <= n < _MAX_ARRAY_DIM for n in shape)
    ):
        raise _bad_array(field, f"shape must be a list of 1 or 2 sizes below 2^31, got {shape!r}")
    array = np.frombuffer(data, dtype=dtype) if len(data) % np.dtype(dtype).itemsize == 0 else None
    if array is None or array.size != math.prod(shape):
        raise _bad_array(
            field, f"{len(data)} bytes of {dtype} do not make an array of shape {shape}"
        )
    return array.reshape(shape)


_MAX_ARRAY_DIM = 2**31
"""Bound of one size of a typed array: far above any request the server takes, and low enough
that numpy can lay out the shape (a zero-size array may name sizes past its index range, and
``reshape`` then fails)."""


def _bad_array(field: str, message: str) -> ApiError:
    return ApiError(422, "bad_array", f"{field}: {message}", detail={"field": field})


def parse_evaluate(
    body: bytes, fmt: WireFormat, *, check_coincident: bool = True
) -> tuple[EvaluateRequest, Structures]:
    """Body → validated request and batched ``Structures`` (raises 400/422 errors).

    ``check_coincident=False`` leaves the coincident-atoms check (about half of the validation
    of a small structure) to a model whose neighbour list refuses such structures itself.
    """
    document = decode(body, fmt)
    context = {CHECK_BOOLEANS: may_hold_stray_booleans(body, fmt, document)}
    request = EvaluateRequest.model_validate(document, context=context)
    try:
        items = [
            StructureArrays(
                numbers=_atomic_numbers(s.species, i),
                positions=s.positions,
                cell=s.cell,
                pbc=s.pbc,
            )
            for i, s in enumerate(request.structures)
        ]
        return request, Structures.from_arrays(items, check_coincident=check_coincident)
    except InvalidStructureError as exc:
        # The graph layer calls the species field by its internal name.
        where = (exc.field or "").replace(".numbers", ".species")
        raise InvalidStructureError(exc.code, exc.message, field=where, index=exc.index) from None


def may_hold_stray_booleans(body: bytes, fmt: WireFormat, document: Any) -> bool:
    """Whether a boolean may sit where numbers belong, so that the schema must look at each
    element. A JSON body whose ``true``/``false`` byte strings are all accounted for by
    ``pbc`` fields holds no other booleans (a string can only add to the count), which rules
    them out in microseconds for the usual request. msgpack has no such tell, but its fast
    form, binary arrays, cannot hold booleans and is not looked at."""
    if fmt is not WireFormat.JSON:
        return True
    literals = body.count(b"true") + body.count(b"false")
    return literals > 0 and literals != _pbc_booleans(document)


def _pbc_booleans(document: Any) -> int:
    structures = document.get("structures") if isinstance(document, dict) else None
    if not isinstance(structures, list):
        return -1
    count = 0
    for item in structures:
        pbc = item.get("pbc") if isinstance(item, dict) else None
        values = pbc if isinstance(pbc, list) else [pbc]
        count += sum(type(v) is bool for v in values)
    return count


def _atomic_numbers(species: np.ndarray, index: int) -> np.ndarray:
    """Symbols → atomic numbers, converting each distinct symbol once (no per-atom loop)."""
    if species.dtype.kind != "U":
        return species
    field = f"structures[{index}].species"
    distinct, inverse = np.unique(species, return_inverse=True)
    try:
        return symbols_to_numbers(distinct, field=field)[inverse]
    except InvalidStructureError:
        pass
    try:  # again over all atoms, so that the message names the first bad atom
        symbols_to_numbers(species.tolist(), field=field)
    except InvalidStructureError as exc:
        raise InvalidStructureError(exc.code, exc.message, field=field, index=index) from None
    raise AssertionError("unreachable: the distinct symbols failed but all atoms passed")


def structure_results(
    result: EvaluationResult, properties: Sequence[str], periodic: np.ndarray
) -> list[dict[str, Any]]:
    """One dict per structure with numpy views for the arrays; stress is None where the
    structure is not periodic along all three axes."""
    ptr = result.atom_ptr
    wanted = set(properties)
    per_atom = [(k, getattr(result, k)) for k in _PER_ATOM if k in wanted]
    per_structure = [(k, getattr(result, k)) for k in _PER_STRUCTURE if k in wanted]
    out: list[dict[str, Any]] = []
    for i in range(len(ptr) - 1):
        a, b = int(ptr[i]), int(ptr[i + 1])
        row: dict[str, Any] = {"n_atoms": b - a, "energy": float(result.energy[i])}
        for name, table in per_atom:
            row[name] = table[a:b]
        for name, table in per_structure:
            row[name] = table[i] if name != "stress" or periodic[i] else None
        out.append(row)
    return out


def encode(document: Mapping[str, Any], fmt: WireFormat) -> bytes:
    """Serialise a response document holding numpy arrays."""
    if fmt is WireFormat.JSON:
        return orjson.dumps(document, option=orjson.OPT_SERIALIZE_NUMPY)
    packed: bytes = msgpack.packb(document, default=_msgpack_array, use_bin_type=True)
    return packed


def _msgpack_array(value: object) -> memoryview:
    """An array as msgpack ``bin``: msgpack copies straight from the array's buffer (a
    ``tobytes()`` first would double the copy; ~0.5 ms for 12k atoms' forces)."""
    if isinstance(value, np.ndarray):
        return np.ascontiguousarray(value, dtype="<f8").data
    raise TypeError(f"cannot encode {type(value).__name__} as msgpack")
