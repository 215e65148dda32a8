"""Request and response schemas of the HTTP API, and the wire formats that carry them.

Wire formats (chosen by ``Content-Type``; the answer by ``Accept``, else the request's format):

``application/json``
    Plain JSON as in the schemas below. Floats are written in shortest round-trip form, so a
    float64 survives the trip bit for bit.
``application/msgpack`` (also ``application/x-msgpack``, ``application/vnd.msgpack``)
    The same document as MessagePack, except that arrays may travel as raw bytes, row-major
    (C order), in one of two forms:

    * a typed array ``{"dtype": str, "shape": [int, ...], "data": bin}``: request
      ``positions`` and ``cell`` with dtype ``<f8`` or ``<f4``, ``species`` (atomic numbers)
      with dtype ``|u1``, ``|i1``, ``<u2``, ``<i2``, ``<u4``, ``<i4`` or ``<i8``; ``data`` holds
      exactly prod(shape) items;
    * a bare ``bin`` of little-endian float64 in rows of three: request ``positions`` (24·n
      bytes) and ``cell`` (72 bytes);
    * response ``forces`` (n, 3), ``energies`` (n,), ``stress`` (6,), ``virial`` (3, 3): always
      a bare ``bin`` of little-endian float64 in a msgpack answer; shapes follow from
      ``n_atoms`` in the same result.

    Nested arrays and symbol lists are accepted too. A binary array with a dtype, shape or
    byte length that does not fit is refused (422 ``bad_array``). ``energy`` is a float64. No
    extension types are used or accepted, and nothing is ever unpickled.

Units: Å, eV, eV/Å, eV/Å³. ``stress`` is ASE's: σ = (1/V) ∂E/∂ε in Voigt order
(xx, yy, zz, yz, xz, xy), for structures periodic along all three axes (``null`` otherwise).
``virial`` is W = −∂E/∂ε (eV, 3×3), defined for every structure.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationInfo,
    WithJsonSchema,
)

Property = Literal["energy", "forces", "stress", "energies", "virial"]
DEFAULT_PROPERTIES: tuple[Property, ...] = ("energy", "forces")

# Validation context key: the document may hold booleans outside ``pbc``. numpy reads a boolean
# among numbers as 1 (``[[true, 0, 0]]`` would be an atom at x = 1 Å), and looking at every
# element costs more than the rest of a small request's validation, so the decoder sets this
# only when it cannot rule booleans out more cheaply (``wire.may_hold_stray_booleans``).
CHECK_BOOLEANS = "check_booleans"
_MIXED_SPECIES = "species must be all element symbols or all atomic numbers (integers 1..118)"


def _check_booleans(info: ValidationInfo) -> bool:
    return bool(info.context and info.context.get(CHECK_BOOLEANS))


def _leaves(items: list[Any] | tuple[Any, ...]) -> Iterator[Any]:
    """The elements of a list, or of a list of lists."""
    for item in items:
        yield from item if isinstance(item, list | tuple) else (item,)


def _holds_boolean(items: list[Any] | tuple[Any, ...]) -> bool:
    """Whether a list, or a list of lists, holds a boolean."""
    return any(type(x) is bool for x in _leaves(items))


def _numbers_or_nulls(items: list[Any]) -> bool:
    """Whether a list, or a list of lists, holds only numbers (not booleans) and nulls."""
    return all(
        x is None or (type(x) is not bool and isinstance(x, int | float)) for x in _leaves(items)
    )


def _numeric_array(value: object, info: ValidationInfo, what: str) -> object:
    """float64 array of JSON/msgpack numbers (or of a msgpack binary array, already numpy).
    Shapes, ragged nesting included, are checked with the structure
    (``InvalidStructureError``), so that every shape error reads the same."""
    try:
        raw = np.asarray(value)
    except ValueError:
        return value
    if raw.dtype.kind == "O" and isinstance(value, list) and _numbers_or_nulls(value):
        # JSON has no NaN or infinity: orjson and JavaScript write them as null. Read null as
        # NaN, so that the structure check answers as it does for msgpack and in process
        # (non_finite_positions / non_finite_cell, naming the atom), not "not numbers".
        return np.asarray(value, dtype=np.float64)
    if raw.dtype.kind not in "iuf" or (
        isinstance(value, list) and _check_booleans(info) and _holds_boolean(value)
    ):
        raise ValueError(f"{what} must contain only numbers")
    return raw.astype(np.float64, copy=False)


def _positions(value: object, info: ValidationInfo) -> object:
    return _numeric_array(value, info, "positions")


def _cell(value: object, info: ValidationInfo) -> object:
    return _numeric_array(value, info, "cell")


def _species(value: object, info: ValidationInfo) -> np.ndarray:
    """Integer atomic numbers, or a str array of symbols (converted with the structure)."""
    if isinstance(value, np.ndarray):  # a msgpack typed array, integer by its dtype
        if value.ndim == 1:
            return value
        raise ValueError(f"species must be one-dimensional, got shape {value.shape}")
    if not isinstance(value, list | tuple):
        raise ValueError("species must be a list of element symbols or atomic numbers")
    if not value:  # np.asarray([]) is float: let validation report the empty structure
        return np.zeros(0, dtype=np.int64)
    raw = np.asarray(value)
    if raw.dtype.kind == "U" and raw.ndim == 1:
        try:
            joined = "".join(value)
        except TypeError:  # numpy turns [6, "H"] into ["6", "H"]
            raise ValueError(_MIXED_SPECIES) from None
        if "\x00" in joined:
            # numpy drops trailing NULs from str elements: "H\x00" would be read as hydrogen.
            raise ValueError("species symbols must not contain NUL characters")
        return raw
    if raw.dtype.kind in "iu" and not (_check_booleans(info) and _holds_boolean(value)):
        return raw
    raise ValueError(_MIXED_SPECIES)


def _array_schema(depth: int, inner: int | None = None) -> WithJsonSchema:
    schema: dict[str, Any] = {"type": "number"}
    for level in range(depth):
        schema = {"type": "array", "items": schema}
        if level == 0 and inner is not None:
            schema |= {"minItems": inner, "maxItems": inner}
    return WithJsonSchema(schema)


Species = Annotated[
    np.ndarray,
    PlainValidator(_species),
    WithJsonSchema(
        {"type": "array", "items": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}
    ),
]


def _pbc(value: object) -> bool | list[bool]:
    """One boolean or a list of them (its length is checked with the structure). One
    validator rather than a union, whose errors name pydantic's branches (``pbc.bool``,
    ``pbc.list[bool][0]``) instead of the field."""
    if isinstance(value, bool):
        return value
    if isinstance(value, list) and all(isinstance(v, bool) for v in value):
        return value
    raise ValueError(f"pbc must be one boolean or a list of three booleans, got {value!r:.40}")


Positions = Annotated[np.ndarray, PlainValidator(_positions), _array_schema(2, 3)]
Cell = Annotated[np.ndarray, PlainValidator(_cell), _array_schema(2, 3)]
Pbc = Annotated[
    bool | list[bool],
    PlainValidator(_pbc),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "boolean"},
                {"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 3},
            ]
        }
    ),
]


class StructureIn(BaseModel):
    """One structure. Without ``pbc``: periodic along all axes if a cell is given, else none."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    species: Species = Field(description="element symbols or atomic numbers, one per atom")
    positions: Positions = Field(description="Cartesian positions (n, 3), Å")
    cell: Cell | None = Field(default=None, description="lattice vectors as rows (3, 3), Å")
    pbc: Pbc | None = Field(
        default=None, description="periodicity per axis (three booleans, or one)"
    )


class EvaluateRequest(BaseModel):
    """Body of ``POST /evaluate``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    structures: list[StructureIn] = Field(min_length=1)
    properties: list[Property] = Field(
        default_factory=lambda: list(DEFAULT_PROPERTIES),
        description="what to compute; energy is always returned",
    )


class StructureResult(BaseModel):
    """Results of one structure; only the properties asked for are present."""

    n_atoms: int
    energy: float = Field(description="eV")
    forces: list[list[float]] | None = Field(default=None, description="(n, 3) eV/Å")
    energies: list[float] | None = Field(default=None, description="per-atom energies (n,), eV")
    stress: list[float] | None = Field(
        None, description="(6,) eV/Å³, ASE Voigt order; null unless periodic on all axes"
    )
    virial: list[list[float]] | None = Field(default=None, description="(3, 3) eV")


class ModelRef(BaseModel):
    name: str
    sha256: str = Field(
        description="the model's identity: sha256 over its weights' hash and canonical config"
    )


class Execution(BaseModel):
    path: str = Field(description="'fused' (Triton kernels) or 'reference' (eager)")
    precision: str
    device: str


class Timings(BaseModel):
    read_ms: float = Field(description="receiving the request body")
    decode_ms: float = Field(description="parsing and validating the request")
    admit_ms: float = Field(description="the engine's admission checks and edge estimate")
    queue_ms: float = Field(description="waiting for the first device pass")
    compute_ms: float = Field(description="device passes that carried this request (shared)")
    handoff_ms: float = Field(description="last pass ended → the request's handler runs again")
    return_ms: float = Field(description="last pass ended → its results reached the event loop")
    resume_ms: float = Field(description="results on the event loop → the handler runs again")
    total_ms: float = Field(description="server time before encoding the answer")


class Provenance(BaseModel):
    request_id: str
    server_version: str
    model: ModelRef
    execution: Execution
    timings: Timings
    passes: int = Field(description="device passes this request was spread over")
    inline: bool = Field(
        description="its pass ran on the server's event loop (a lone client) rather than "
        "in the device worker thread"
    )


class EvaluateResponse(BaseModel):
    """Answer of ``POST /evaluate``: results in request order, and what produced them."""

    results: list[StructureResult]
    provenance: Provenance


class ErrorResponse(BaseModel):
    """Every 4xx/5xx answer."""

    code: str = Field(description="machine-readable reason, e.g. 'non_finite_positions'")
    message: str
    detail: Any = Field(default=None, description="structured context, e.g. the offending field")


class Limits(BaseModel):
    max_atoms: int
    max_request_atoms: int
    max_batch_atoms: int
    max_batch_edges: int
    batch_window_ms: float
    max_queue: int
    inline_max_atoms: int
    max_body_bytes: int


class InfoResponse(BaseModel):
    server_version: str
    model: dict[str, Any] = Field(description="model metadata: elements, rcut, config, hash …")
    execution: Execution
    limits: Limits
    auth_required: bool


class Health(BaseModel):
    status: str
