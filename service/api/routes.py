"""HTTP routes: /evaluate, /info, /metrics (behind the API key) and /health/* (open).

``/evaluate`` is the hot path (an MD client calls it every step), so it takes the bare
``Request`` and does its two checks (API key, model ready) inline: FastAPI's dependency
resolution for them measured ~60 µs per request, against a 1 ms overhead budget.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from service.api.deps import (
    Authorized,
    EngineDep,
    ServiceState,
    State,
    engine_when_ready,
    require_api_key,
)
from service.api.errors import JSON_MEDIA_TYPE, ApiError, error_response
from service.api.schemas import (
    ErrorResponse,
    EvaluateRequest,
    EvaluateResponse,
    Health,
    InfoResponse,
)
from service.api.wire import (
    WireFormat,
    encode,
    parse_evaluate,
    request_format,
    response_format,
    structure_results,
)
from service.engine import EvaluationResult
from service.engine.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE

PARSE_IN_THREAD_BYTES = 1 << 20
"""Bodies above this are parsed in a thread so the event loop keeps serving others."""

CLIENT_CLOSED_REQUEST = 499
"""Status recorded (never seen by anyone) when the client left before the answer."""

health_router = APIRouter(tags=["health"])
api_router = APIRouter(dependencies=[Authorized])
evaluate_router = APIRouter()  # checks the key itself

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 413, 415, 422, 500, 503, 507)
}


def _json(document: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(document), status_code=status, media_type=JSON_MEDIA_TYPE)


@health_router.get("/health/live", response_model=Health)
async def live() -> Response:
    """The process is up (the model may still be loading)."""
    return _json({"status": "alive"})


@health_router.get(
    "/health/ready", response_model=Health, responses={503: {"model": ErrorResponse}}
)
async def ready(state: State) -> Response:
    """The model is loaded, warmed up and accepting work."""
    if not state.ready:
        return error_response(
            503, "not_ready", "the model is not loaded yet, or the server is stopping"
        )
    return _json({"status": "ready"})


@api_router.get("/info", response_model=InfoResponse, responses=_ERRORS)
async def info(state: State, engine: EngineDep) -> Response:
    """Model metadata (elements, rcut, config, hash), execution path, device and limits."""
    assert state.evaluator is not None
    limits = engine.limits
    document = {
        "server_version": state.server_version,
        "model": dict(state.evaluator.info()),
        "execution": state.provenance["execution"],
        "limits": {
            "max_atoms": limits.max_atoms,
            "max_batch_atoms": limits.max_batch_atoms,
            "max_batch_edges": limits.max_batch_edges,
            "batch_window_ms": limits.window_s * 1e3,
            "max_queue": limits.max_queue,
            "max_body_bytes": state.settings.max_body_bytes,
        },
        "auth_required": state.settings.api_key is not None,
    }
    return Response(orjson.dumps(document, default=str), media_type=JSON_MEDIA_TYPE)


@api_router.get("/metrics", response_class=Response)
async def metrics(state: State) -> Response:
    """Prometheus text exposition."""
    return Response(state.metrics.render(), media_type=METRICS_CONTENT_TYPE)


@evaluate_router.post(
    "/evaluate",
    response_model=EvaluateResponse,
    responses=_ERRORS,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                media: {"schema": {"$ref": f"#/components/schemas/{EvaluateRequest.__name__}"}}
                for media in (WireFormat.JSON.value, WireFormat.MSGPACK.value)
            },
        }
    },
)
async def evaluate(request: Request) -> Response:
    """Energy (and forces, stress, per-atom energies, virial) of each structure.

    Body: ``EvaluateRequest`` as JSON or msgpack (see the wire formats in ``schemas.py``).
    """
    t_start = time.perf_counter()
    state: ServiceState = request.app.state.service
    require_api_key(request, state)
    engine = engine_when_ready(state)
    fmt_in = request_format(request.headers.get("content-type"))
    fmt_out = response_format(request.headers.get("accept"), fmt_in)
    body = await _read_body(request, state.settings.max_body_bytes)
    if len(body) > PARSE_IN_THREAD_BYTES:
        parsed, structures = await run_in_threadpool(parse_evaluate, body, fmt_in)
    else:
        parsed, structures = parse_evaluate(body, fmt_in)
    t_decoded = time.perf_counter()
    result = await _unless_disconnected(request, engine.submit(structures, parsed.properties))
    if result is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    periodic = structures.pbc.all(dim=1).numpy()
    document = {
        "results": structure_results(result, parsed.properties, periodic),
        "provenance": _provenance(state, request, result, t_start, t_decoded),
    }
    return Response(encode(document, fmt_out), media_type=fmt_out.value)


def _provenance(
    state: ServiceState,
    request: Request,
    result: EvaluationResult,
    t_start: float,
    t_decoded: float,
) -> dict[str, Any]:
    t = result.timings
    return {
        "request_id": request.state.request_id,
        "server_version": state.server_version,
        **state.provenance,
        "timings": {
            "decode_ms": (t_decoded - t_start) * 1e3,
            "queue_ms": t.queue_s * 1e3,
            "compute_ms": t.compute_s * 1e3,
            "total_ms": (time.perf_counter() - t_start) * 1e3,
        },
        "passes": t.passes,
    }


async def _read_body(request: Request, limit: int) -> bytes:
    """The whole body, refusing (413) anything above ``limit`` bytes before buffering it."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _body_too_large(int(declared), limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _body_too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _body_too_large(size: int, limit: int) -> ApiError:
    return ApiError(
        413,
        "body_too_large",
        f"the request body has {size} bytes or more, above the limit of {limit} (--max-body-mb); "
        "send fewer structures per request",
        detail={"limit_bytes": limit},
    )


async def _unless_disconnected(
    request: Request, evaluation: asyncio.Future[EvaluationResult]
) -> EvaluationResult | None:
    """Wait for the evaluation, or cancel it (and return None) if the client goes away first.

    Once the body is read, the next ASGI message is ``http.disconnect``, which arrives only
    when the connection drops; cancelling the evaluation withdraws whatever has not started.
    """
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((evaluation, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        evaluation.cancel()  # no-op once it has a result
    if evaluation.cancelled():
        return None
    return evaluation.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
