"""Every failure becomes JSON ``{code, message, detail}`` with the right HTTP status.

Status, code and when:

* 400 ``malformed_body``: body is not valid JSON / msgpack.
* 401 ``unauthorized``: API key missing or wrong (when one is set).
* 404 ``not_found``: unknown route; 405 ``method_not_allowed``: wrong method for the route.
* 413 ``too_many_atoms``: a structure above ``--max-atoms``; 413 ``body_too_large``: body above
  ``--max-body-mb``.
* 415 ``unsupported_media_type``: neither JSON nor msgpack.
* 422 ``invalid_request``: schema violation (unknown property, wrong type, …);
  ``detail.errors`` names each field.
* 422 with the graph layer's code for an invalid structure (``non_finite_positions``,
  ``singular_cell``, ``unknown_element``, ``coincident_atoms``, …); ``detail.field`` names it.
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


def error_response(
    status: int,
    code: str,
    message: str,
    detail: Any = None,
    headers: Mapping[str, str] | None = None,
) -> Response:
    """The JSON error body every failing route answers with."""
    body = orjson.dumps({"code": code, "message": message, "detail": detail}, default=str)
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


def _validation_response(errors: Sequence[Mapping[str, Any]]) -> Response:
    details = [
        {"field": field_path(tuple(e["loc"])), "message": e["msg"], "type": e["type"]}
        for e in errors
    ]
    first = details[0]
    return error_response(
        422, "invalid_request", f"{first['field']}: {first['message']}", {"errors": details}
    )


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


def install_error_handlers(app: FastAPI) -> None:
    """Register the mapping of every exception type to its JSON error answer."""

    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError) -> Response:
        return error_response(exc.status, exc.code, exc.message, exc.detail, exc.headers)

    @app.exception_handler(ValidationError)
    async def _pydantic(_: Request, exc: ValidationError) -> Response:
        return _validation_response(exc.errors(include_url=False))

    @app.exception_handler(RequestValidationError)
    async def _fastapi(_: Request, exc: RequestValidationError) -> Response:
        return _validation_response(exc.errors())

    @app.exception_handler(InvalidStructureError)
    async def _structure(_: Request, exc: InvalidStructureError) -> Response:
        detail = {"field": exc.field, "index": exc.index}
        return error_response(422, exc.code, exc.message, detail)

    @app.exception_handler(TooManyAtomsError)
    async def _too_many(_: Request, exc: TooManyAtomsError) -> Response:
        detail = {
            "field": f"structures[{exc.index}]",
            "index": exc.index,
            "n_atoms": exc.n_atoms,
            "limit": exc.limit,
        }
        return error_response(413, exc.code, exc.message, detail)

    @app.exception_handler(QueueFullError)
    async def _queue_full(_: Request, exc: QueueFullError) -> Response:
        headers = {"Retry-After": str(exc.retry_after_s)}
        detail = {"retry_after_s": exc.retry_after_s}
        return error_response(503, exc.code, exc.message, detail, headers)

    @app.exception_handler(EngineClosedError)
    async def _closed(_: Request, exc: EngineClosedError) -> Response:
        return error_response(503, exc.code, exc.message, None, {"Retry-After": "5"})

    @app.exception_handler(StructureTooLargeError)
    async def _oom(_: Request, exc: StructureTooLargeError) -> Response:
        detail = {
            "field": f"structures[{exc.index}]",
            "index": exc.index,
            "n_atoms": exc.n_atoms,
            "device": exc.device,
        }
        return error_response(507, exc.code, exc.message, detail)

    @app.exception_handler(EvaluationFailedError)
    async def _failed(_: Request, exc: EvaluationFailedError) -> Response:
        return error_response(500, exc.code, exc.message, {"index": exc.index})

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        code = _HTTP_CODES.get(exc.status_code, f"http_{exc.status_code}")
        return error_response(exc.status_code, code, str(exc.detail), None, exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.error("unhandled error on %s", request.url.path, exc_info=exc)
        return error_response(
            500, "internal_error", f"internal server error ({type(exc).__name__}); see server log"
        )
