"""Schemas, wire formats and settings, without a server."""

from __future__ import annotations

import msgpack
import numpy as np
import orjson
import pytest
import torch
from pydantic import SecretStr, ValidationError

from service.api.errors import ApiError, field_path
from service.api.schemas import EvaluateRequest
from service.api.settings import ServiceSettings
from service.api.wire import (
    INT_DTYPES,
    WireFormat,
    decode,
    encode,
    may_hold_stray_booleans,
    parse_evaluate,
    request_format,
    response_format,
)
from service.graph.errors import InvalidStructureError
from tests.service.fakes import rattled_copper, request_document, small_molecule


def _json(document: object) -> bytes:
    return orjson.dumps(document)


def test_json_and_msgpack_bodies_give_identical_structures() -> None:
    crystal = rattled_copper()
    rng = np.random.default_rng(0)
    crystal.positions += rng.normal(scale=1e-3, size=crystal.positions.shape)  # full-precision bits
    doc = request_document([crystal, small_molecule()], ["energy", "stress"])
    _, from_json = parse_evaluate(_json(doc), WireFormat.JSON)
    binary = {
        "structures": [
            {
                "species": crystal.numbers.tolist(),
                "positions": crystal.positions.astype("<f8").tobytes(),
                "cell": crystal.cell.array.astype("<f8").tobytes(),
            },
            doc["structures"][1],
        ],
        "properties": ["energy", "stress"],
    }
    _, from_msgpack = parse_evaluate(msgpack.packb(binary), WireFormat.MSGPACK)
    for name in ("numbers", "positions", "cells", "pbc", "ptr"):
        a, b = getattr(from_json, name), getattr(from_msgpack, name)
        assert a.dtype == b.dtype and bool((a == b).all()), name
    assert np.array_equal(from_json.positions[: len(crystal)].numpy(), crystal.positions)


def test_symbols_and_numbers_are_equivalent() -> None:
    mol = small_molecule()
    by_symbol = request_document([mol])
    by_number = {
        **by_symbol,
        "structures": [{**by_symbol["structures"][0], "species": mol.numbers.tolist()}],
    }
    _, a = parse_evaluate(_json(by_symbol), WireFormat.JSON)
    _, b = parse_evaluate(_json(by_number), WireFormat.JSON)
    assert bool((a.numbers == b.numbers).all())


def test_default_properties_and_extra_fields() -> None:
    request = EvaluateRequest.model_validate(
        request_document([small_molecule()]) | {"properties": []}
    )
    assert request.properties == []
    doc = request_document([small_molecule()])
    del doc["properties"]
    assert EvaluateRequest.model_validate(doc).properties == ["energy", "forces"]
    doc["structures"][0]["position"] = [[0, 0, 0]]  # a typo must not be ignored
    with pytest.raises(ValidationError) as info:
        EvaluateRequest.model_validate(doc)
    assert field_path(info.value.errors()[0]["loc"]) == "structures[0].position"


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.update(properties=["energy", "hessian"]), "properties[1]"),
        (lambda d: d["structures"][0].update(positions=[["a", 0, 0]]), "structures[0].positions"),
        (lambda d: d["structures"][0].update(species="CH4"), "structures[0].species"),
        (lambda d: d["structures"][0].update(species=[6.0, 1.0]), "structures[0].species"),
        (lambda d: d["structures"][0].update(species=["C", "H\x00"]), "structures[0].species"),
        (lambda d: d["structures"][0].update(species=[6, "H"]), "structures[0].species"),
        (lambda d: d["structures"][0].update(pbc=[1, 0, 0]), "structures[0].pbc"),
        (lambda d: d.update(structures=[]), "structures"),
    ],
)
def test_schema_errors_name_the_field(mutate, field: str) -> None:  # type: ignore[no-untyped-def]
    doc = request_document([small_molecule()])
    mutate(doc)
    with pytest.raises(ValidationError) as info:
        parse_evaluate(_json(doc), WireFormat.JSON)
    assert field_path(info.value.errors()[0]["loc"]).startswith(field)


def typed(array: np.ndarray, dtype: str) -> dict[str, object]:
    """A msgpack typed array: ``{"dtype", "shape", "data"}``."""
    raw = np.ascontiguousarray(array, dtype=dtype)
    return {"dtype": dtype, "shape": list(raw.shape), "data": raw.tobytes()}


def test_typed_binary_arrays_give_the_structures_of_nested_lists() -> None:
    crystal = rattled_copper(seed=2)
    doc = request_document([crystal], ["energy", "stress"])
    _, from_json = parse_evaluate(_json(doc), WireFormat.JSON)
    for species_dtype in sorted(INT_DTYPES):
        item = {
            "species": typed(crystal.numbers, species_dtype),
            "positions": typed(crystal.positions, "<f8"),
            "cell": typed(crystal.cell.array, "<f8"),
        }
        body = msgpack.packb({"structures": [item], "properties": ["energy", "stress"]})
        _, from_msgpack = parse_evaluate(body, WireFormat.MSGPACK)
        for name in ("numbers", "positions", "cells", "pbc", "ptr"):
            a, b = getattr(from_json, name), getattr(from_msgpack, name)
            assert a.dtype == b.dtype and bool((a == b).all()), (species_dtype, name)


def test_float32_arrays_are_widened_exactly() -> None:
    mol = small_molecule()
    single = mol.positions.astype(np.float32)
    item = {"species": typed(mol.numbers, "|u1"), "positions": typed(single, "<f4")}
    _, structures = parse_evaluate(msgpack.packb({"structures": [item]}), WireFormat.MSGPACK)
    assert structures.positions.dtype == torch.float64
    assert np.array_equal(structures.positions.numpy(), single.astype(np.float64))


def _one_atom(**fields: object) -> bytes:
    item = {"species": [1], "positions": [[0.0, 0.0, 0.0]], **fields}
    packed: bytes = msgpack.packb({"structures": [item]})
    return packed


F8_ATOM = typed(np.zeros((1, 3)), "<f8")
BAD_ARRAYS = [
    ("positions as integers", {"positions": typed(np.zeros((1, 3)), "<i8")}, "positions"),
    ("big-endian positions", {"positions": typed(np.zeros((1, 3)), ">f8")}, "positions"),
    ("numpy dtype name", {"positions": {**F8_ATOM, "dtype": "float64"}}, "positions"),
    ("species as floats", {"species": typed(np.ones(1), "<f8")}, "species"),
    ("bytes short of the shape", {"positions": {**F8_ATOM, "shape": [2, 3]}}, "positions"),
    ("bytes beyond the shape", {"positions": {**F8_ATOM, "shape": [1, 2]}}, "positions"),
    ("partial item", {"positions": {**F8_ATOM, "data": b"\x00" * 20}}, "positions"),
    ("shape not a list", {"positions": {**F8_ATOM, "shape": 3}}, "positions"),
    ("negative size", {"positions": {**F8_ATOM, "shape": [-1, -3]}}, "positions"),
    (
        "empty with a huge size",
        {"positions": {**F8_ATOM, "shape": [2**62, 0], "data": b""}},
        "positions",
    ),
    (
        "empty species with a huge size",
        {"species": {"dtype": "|u1", "shape": [2**63, 0], "data": b""}},
        "species",
    ),
    ("data as a list", {"positions": {**F8_ATOM, "data": [0.0, 0.0, 0.0]}}, "positions"),
    ("missing shape", {"positions": {"dtype": "<f8", "data": bytes(24)}}, "positions"),
    ("extra key", {"positions": {**F8_ATOM, "order": "C"}}, "positions"),
    ("bare bin, not rows of 3", {"positions": b"\x00" * 20}, "positions"),
    ("bare bin species", {"species": b"\x01"}, "species"),
    ("cell of integers", {"cell": typed(np.eye(3), "<i4")}, "cell"),
    ("dtype not a string", {"positions": {**F8_ATOM, "dtype": ["<f8"]}}, "positions"),
    ("dtype a map", {"positions": {**F8_ATOM, "dtype": {"kind": "f"}}}, "positions"),
]


@pytest.mark.parametrize(("case", "fields", "field"), BAD_ARRAYS, ids=[c[0] for c in BAD_ARRAYS])
def test_malformed_binary_arrays_are_422_bad_array(
    case: str, fields: dict[str, object], field: str
) -> None:
    with pytest.raises(ApiError) as info:
        parse_evaluate(_one_atom(**fields), WireFormat.MSGPACK)
    assert (info.value.status, info.value.code) == (422, "bad_array")
    assert info.value.detail == {"field": f"structures[0].{field}"}


@pytest.mark.parametrize(
    ("fields", "code", "field"),
    [
        ({"positions": typed(np.zeros((2, 3)), "<f8")}, "shape_mismatch", "positions"),
        ({"positions": typed(np.zeros(3), "<f8")}, "ragged_positions", "positions"),
        ({"positions": typed(np.full((1, 3), np.nan), "<f8")}, "non_finite_positions", "positions"),
        ({"positions": np.full((1, 3), np.inf).tobytes()}, "non_finite_positions", "positions"),
        ({"positions": typed(np.full((1, 3), np.inf), "<f4")}, "non_finite_positions", "positions"),
        (
            {"positions": typed(np.full((1, 3), 1e308), "<f8")},
            "positions_out_of_range",
            "positions",
        ),
        ({"cell": typed(np.diag([np.nan, 1.0, 1.0]), "<f8")}, "non_finite_cell", "cell"),
        ({"cell": typed(np.eye(2), "<f8")}, "bad_cell", "cell"),
        ({"species": typed(np.array([0]), "<i8")}, "unknown_element", "species"),
        ({"species": typed(np.array([[1]]), "<i8")}, "invalid_request", "species"),
    ],
)
def test_well_formed_binary_arrays_of_a_bad_structure_get_its_code(
    fields: dict[str, object], code: str, field: str
) -> None:
    with pytest.raises((InvalidStructureError, ValidationError)) as info:
        parse_evaluate(_one_atom(**fields), WireFormat.MSGPACK)
    error = info.value
    if isinstance(error, ValidationError):
        assert code == "invalid_request"
        assert field_path(error.errors()[0]["loc"]) == f"structures[0].{field}"
    else:
        assert isinstance(error, InvalidStructureError)
        assert (error.code, error.field) == (code, f"structures[0].{field}")


def _with_boolean(doc: dict, field: str) -> None:  # type: ignore[type-arg]
    structure = doc["structures"][0]
    if field == "species":
        structure["species"] = [True, *structure["species"][1:]]
    elif field == "cell":
        structure["cell"] = [[True, 0.0, 0.0], [0.0, 9.0, 0.0], [0.0, 0.0, 9.0]]
    else:
        structure["positions"][1] = [0.5, False, 0.0]


@pytest.mark.parametrize("fmt", [WireFormat.JSON, WireFormat.MSGPACK])
@pytest.mark.parametrize("pbc", [None, [True, False, True]])
@pytest.mark.parametrize("field", ["positions", "cell", "species"])
def test_booleans_among_numbers_are_refused(
    field: str, pbc: list[bool] | None, fmt: WireFormat
) -> None:
    # numpy alone would read them as 1 and 0: an atom moved to x = 1 Å, a hydrogen.
    doc = request_document([small_molecule()])
    doc["structures"][0]["species"] = [6, 1, 1, 1, 1][: len(doc["structures"][0]["positions"])]
    if pbc is not None:
        doc["structures"][0] |= {"pbc": pbc, "cell": np.diag([9.0, 9.0, 9.0]).tolist()}
    _with_boolean(doc, field)
    body = _json(doc) if fmt is WireFormat.JSON else msgpack.packb(doc)
    with pytest.raises(ValidationError) as info:
        parse_evaluate(body, fmt)
    assert field_path(info.value.errors()[0]["loc"]) == f"structures[0].{field}"


def test_booleans_are_ruled_out_from_the_body_bytes() -> None:
    doc = request_document([small_molecule(), small_molecule()])
    doc["structures"][0] |= {"pbc": [True, False, True], "cell": np.eye(3).tolist()}
    doc["structures"][1] |= {"pbc": False}
    assert not may_hold_stray_booleans(_json(doc), WireFormat.JSON, doc)
    doc["structures"][1]["pbc"] = [False, False, False]  # two more than the structures count
    assert may_hold_stray_booleans(
        _json(doc), WireFormat.JSON, {**doc, "structures": doc["structures"][:1]}
    )
    assert may_hold_stray_booleans(b"", WireFormat.MSGPACK, doc)


ORIGIN, UNIT_X = [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]
BAD_STRUCTURES = [
    ({"species": ["H", "Xx"], "positions": [ORIGIN, UNIT_X]}, "unknown_element", "species"),
    ({"species": [1, 1], "positions": [ORIGIN]}, "shape_mismatch", "positions"),
    ({"species": [1], "positions": [[0, 0]]}, "ragged_positions", "positions"),
    ({"species": [1, 1], "positions": [ORIGIN, ORIGIN]}, "coincident_atoms", "positions"),
    ({"species": [1], "positions": [ORIGIN], "pbc": True}, "bad_pbc", "pbc"),
    ({"species": [], "positions": []}, "empty_structure", "positions"),
    ({"species": [2**63], "positions": [ORIGIN]}, "unknown_element", "species"),
    ({"species": [1], "positions": [[1e300, 0, 0]]}, "positions_out_of_range", "positions"),
    (
        {"species": [1], "positions": [ORIGIN], "cell": [UNIT_X, [2, 0, 0], [0, 0, 1]]},
        "singular_cell",
        "cell",
    ),
]


@pytest.mark.parametrize(("structure", "code", "field"), BAD_STRUCTURES)
def test_invalid_structures_raise_typed_errors(structure: dict, code: str, field: str) -> None:  # type: ignore[type-arg]
    good = request_document([small_molecule()])["structures"][0]
    body = _json({"structures": [good, structure]})
    with pytest.raises(InvalidStructureError) as info:
        parse_evaluate(body, WireFormat.JSON)
    assert info.value.code == code
    assert info.value.field == f"structures[1].{field}"
    assert info.value.index == 1


def test_non_finite_positions_only_in_msgpack() -> None:
    # JSON has no NaN literal (a 400); msgpack can carry one (a 422 from validation).
    with pytest.raises(ApiError) as info:
        decode(b'{"structures": [{"species": [1], "positions": [[NaN, 0, 0]]}]}', WireFormat.JSON)
    assert info.value.status == 400
    body = msgpack.packb({"structures": [{"species": [1], "positions": [[float("nan"), 0, 0]]}]})
    with pytest.raises(InvalidStructureError) as bad:
        parse_evaluate(body, WireFormat.MSGPACK)
    assert bad.value.code == "non_finite_positions"


@pytest.mark.parametrize("body", [b"{", b"\xc1", b"[1, 2", b"\x92\x01"])
def test_malformed_bodies_are_400(body: bytes) -> None:
    fmt = WireFormat.JSON if body[:1] in b"{[" else WireFormat.MSGPACK
    with pytest.raises(ApiError) as info:
        decode(body, fmt)
    assert (info.value.status, info.value.code) == (400, "malformed_body")


def test_compressed_bodies_are_415() -> None:
    with pytest.raises(ApiError) as info:
        request_format("application/json", "gzip")
    assert (info.value.status, info.value.code) == (415, "unsupported_media_type")
    assert request_format("application/json", "identity") is WireFormat.JSON


def test_content_negotiation() -> None:
    assert request_format("application/json; charset=utf-8") is WireFormat.JSON
    assert request_format("application/x-msgpack") is WireFormat.MSGPACK
    for bad in (None, "text/plain", "application/x-www-form-urlencoded"):
        with pytest.raises(ApiError) as info:
            request_format(bad)
        assert info.value.status == 415
    assert response_format(None, WireFormat.MSGPACK) is WireFormat.MSGPACK
    assert response_format("*/*", WireFormat.JSON) is WireFormat.JSON
    assert (
        response_format("application/msgpack, application/json", WireFormat.JSON)
        is WireFormat.MSGPACK
    )
    assert response_format("application/json", WireFormat.MSGPACK) is WireFormat.JSON


def test_encoders_carry_float64_exactly() -> None:
    rng = np.random.default_rng(1)
    forces = rng.normal(size=(5, 3)) * 10.0 ** rng.integers(-300, 300, size=(5, 3))
    document = {"results": [{"n_atoms": 5, "energy": float(rng.normal()), "forces": forces}]}
    as_json = orjson.loads(encode(document, WireFormat.JSON))["results"][0]
    as_msgpack = msgpack.unpackb(encode(document, WireFormat.MSGPACK))["results"][0]
    assert np.array_equal(np.array(as_json["forces"]), forces)
    assert np.array_equal(np.frombuffer(as_msgpack["forces"], "<f8").reshape(5, 3), forces)
    assert as_json["energy"] == as_msgpack["energy"] == document["results"][0]["energy"]


def test_settings_from_environment_and_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SO2SERVE_MAX_ATOMS", "123")
    monkeypatch.setenv("SO2SERVE_BATCH_WINDOW_MS", "0.5")
    settings = ServiceSettings(max_queue=7)
    assert (settings.max_atoms, settings.batch_window_ms, settings.max_queue) == (123, 0.5, 7)
    assert ServiceSettings(max_atoms=5).max_atoms == 5  # explicit beats environment
    with pytest.raises(ValidationError, match="device"):
        ServiceSettings(device="gpu0")
    with pytest.raises(ValidationError):
        ServiceSettings(unknown_setting=1)  # type: ignore[call-arg]


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.7", "example.org", "::"])
def test_refuses_exposed_host_without_key(host: str) -> None:
    with pytest.raises(ValidationError, match="refusing to listen"):
        ServiceSettings(host=host)
    assert ServiceSettings(host=host, api_key=SecretStr("k")).host == host
    assert ServiceSettings(host=host, insecure=True).insecure


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_loopback_hosts_need_no_key(host: str) -> None:
    assert ServiceSettings(host=host).api_key is None
