"""Bytes ↔ documents: content negotiation, decoding and fast encoding (formats: schemas.py).

Decoding never runs code from the wire: JSON through orjson, msgpack without extension hooks.
Encoding hands numpy arrays to orjson directly (no Python lists) and writes msgpack arrays as
raw little-endian float64 ``bin`` values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any

import msgpack
import numpy as np
import orjson

from service.api.errors import ApiError
from service.api.schemas import EvaluateRequest
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


def request_format(content_type: str | None) -> WireFormat:
    """The body's format from ``Content-Type``; anything else is 415."""
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
    """Parse a body; malformed input is 400."""
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
        raise ApiError(
            400, "malformed_body", f"the body is not valid {fmt.name.lower()}: {exc}"
        ) from exc


def parse_evaluate(body: bytes, fmt: WireFormat) -> tuple[EvaluateRequest, Structures]:
    """Body → validated request and batched ``Structures`` (raises 400/422 errors)."""
    request = EvaluateRequest.model_validate(decode(body, fmt))
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
        return request, Structures.from_arrays(items)
    except InvalidStructureError as exc:
        # The graph layer calls the species field by its internal name.
        where = (exc.field or "").replace(".numbers", ".species")
        raise InvalidStructureError(exc.code, exc.message, field=where, index=exc.index) from None


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


def _msgpack_array(value: object) -> bytes:
    if isinstance(value, np.ndarray):
        return np.ascontiguousarray(value, dtype="<f8").tobytes()
    raise TypeError(f"cannot encode {type(value).__name__} as msgpack")
