"""Every failure becomes JSON ``{code, message, detail}`` with the right HTTP status.

Status, code and when:

* 400 ``malformed_body``: body is not valid JSON / msgpack; 400 ``malformed_http``: the bytes
  are not an HTTP/1.1 request at all (answered by the protocol, ``http_protocol.py``).
* 401 ``unauthorized``: API key missing or wrong (when one is set).
* 404 ``not_found``: unknown route; 405 ``method_not_allowed``: wrong method for the route.
* 408 ``body_timeout``: the body did not arrive within ``body_timeout_s`` (``evaluate.py``).
* 413 ``too_many_atoms``: a structure, or a request's structures together, above the atom
  limits (``--max-atoms``, ``/info``); 413 ``body_too_large``: body above ``--max-body-mb``.
* 415 ``unsupported_media_type``: neither JSON nor msgpack.
* 422 ``invalid_request``: schema violation (unknown property, wrong type, …);
  ``detail.errors`` names each field. 422 ``bad_array``: a msgpack binary array of the wrong
  dtype, shape or byte length (``wire.py``); ``detail.field`` names it.
* 422 with the graph layer's code for an invalid structure (``non_finite_positions``,
  ``singular_cell``, ``unknown_element``, ``coincident_atoms``, …); ``detail.field`` names it.
* 431 ``headers_too_large``: request line and headers above 64 KiB (the protocol again).
* 500 ``evaluation_failed``: the model failed on one structure; 500 ``internal_error``: a bug.
* 503 ``queue_full`` / ``not_ready`` (both with ``Retry-After``): overload, or the model is not
  loaded yet / the server is shutting down.
* 507 ``out_of_memory``: one structure does not fit even alone.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from service.engine import (
    DeviceFaultError,
    EngineClosedError,
    EvaluationFailedError,
    QueueFullError,
    StructureTooLargeError,
    TooManyAtomsError,
)
from service.graph.errors import InvalidStructureError

log = logging.getLogger("so2serve.api")

JSON_MEDIA_TYPE = "application/json"


class ApiError(Exception):
    """An HTTP error raised by the API layer itself."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        detail: Any = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.detail = detail
        self.headers = dict(headers or {})


def error_body(code: str, message: str, detail: Any = None) -> bytes:
    """The JSON ``{code, message, detail}`` document of every error answer."""
    return orjson.dumps({"code": code, "message": message, "detail": detail}, default=str)


def error_response(
    status: int,
    code: str,
    message: str,
    detail: Any = None,
    headers: Mapping[str, str] | None = None,
) -> Response:
    """The JSON error answer of a FastAPI route."""
    body = error_body(code, message, detail)
    return Response(body, status_code=status, media_type=JSON_MEDIA_TYPE, headers=headers)


def field_path(loc: tuple[int | str, ...]) -> str:
    """pydantic ``loc`` → ``structures[3].positions`` (the field a client has to fix)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part not in ("body", "query", "path", "header"):
            out += f".{part}" if out else str(part)
    return out or "body"


def _validation_error(errors: Sequence[Mapping[str, Any]]) -> ApiError:
    details = [
        {"field": field_path(tuple(e["loc"])), "message": e["msg"], "type": e["type"]}
        for e in errors
    ]
    first = details[0]
    return ApiError(
        422, "invalid_request", f"{first['field']}: {first['message']}", detail={"errors": details}
    )


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


def as_api_error(exc: Exception) -> ApiError | None:
    """The HTTP error a known failure maps to; None for anything else (a server bug)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ValidationError):
        return _validation_error(exc.errors(include_url=False))
    if isinstance(exc, RequestValidationError):
        return _validation_error(exc.errors())
    if isinstance(exc, InvalidStructureError):
        return ApiError(422, exc.code, exc.message, detail={"field": exc.field, "index": exc.index})
    if isinstance(exc, TooManyAtomsError):
        detail = {
            "field": f"structures[{exc.index}]",
            "index": exc.index,
            "n_atoms": exc.n_atoms,
            "limit": exc.limit,
        }
        return ApiError(413, exc.code, exc.message, detail=detail)
    if isinstance(exc, QueueFullError):
        return ApiError(
            503,
            exc.code,
            exc.message,
            detail={"retry_after_s": exc.retry_after_s},
            headers={"Retry-After": str(exc.retry_after_s)},
        )
    if isinstance(exc, EngineClosedError):
        return ApiError(503, exc.code, exc.message, headers={"Retry-After": "5"})
    if isinstance(exc, DeviceFaultError):  # no Retry-After: this server will not recover
        return ApiError(503, exc.code, exc.message, detail={"device": exc.device})
    if isinstance(exc, StructureTooLargeError):
        detail = {
            "field": f"structures[{exc.index}]",
            "index": exc.index,
            "n_atoms": exc.n_atoms,
            "device": exc.device,
        }
        return ApiError(507, exc.code, exc.message, detail=detail)
    if isinstance(exc, EvaluationFailedError):
        return ApiError(500, exc.code, exc.message, detail={"index": exc.index})
    if isinstance(exc, StarletteHTTPException):
        code = _HTTP_CODES.get(exc.status_code, f"http_{exc.status_code}")
        return ApiError(exc.status_code, code, str(exc.detail), headers=exc.headers)
    return None


def internal_error(where: str, exc: Exception) -> ApiError:
    """A server bug: logged with its traceback, answered 500 without internals."""
    log.error("unhandled error on %s", where, exc_info=exc)
    return ApiError(
        500, "internal_error", f"internal server error ({type(exc).__name__}); see server log"
    )


_MAPPED = (
    ApiError,
    ValidationError,
    RequestValidationError,
    InvalidStructureError,
    TooManyAtomsError,
    QueueFullError,
    EngineClosedError,
    DeviceFaultError,
    StructureTooLargeError,
    EvaluationFailedError,
    StarletteHTTPException,
)


def install_error_handlers(app: FastAPI) -> None:
    """Answer every exception a FastAPI route raises with its JSON error."""

    async def handle(request: Request, exc: Exception) -> Response:
        error = as_api_error(exc) or internal_error(request.url.path, exc)
        return error_response(error.status, error.code, error.message, error.detail, error.headers)

    for exc_type in (*_MAPPED, Exception):
        app.add_exception_handler(exc_type, handle)
