"""HTTP routes of FastAPI: /info, /metrics (behind the API key) and /health/* (open).

``POST /evaluate``, the hot path, is a bare ASGI endpoint (``evaluate.py``).
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter
from starlette.responses import Response

from service.api.deps import Authorized, EngineDep, State
from service.api.errors import JSON_MEDIA_TYPE, error_response
from service.api.schemas import ErrorResponse, Health, InfoResponse
from service.engine.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE

health_router = APIRouter(tags=["health"])
api_router = APIRouter(dependencies=[Authorized])

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (401, 503)
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
    """The model is loaded, warmed up and accepting work, and no device has broken down (a
    broken one stays broken until the server restarts: an orchestrator should restart it)."""
    if not state.ready:
        return error_response(
            503, "not_ready", "the model is not loaded yet, or the server is stopping"
        )
    faults = [] if state.engine is None else state.engine.faults
    if faults:
        devices = [fault.device for fault in faults]
        return error_response(503, faults[0].code, faults[0].message, {"devices": devices})
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
            "max_request_atoms": state.settings.max_request_atoms,
            "max_batch_atoms": limits.max_batch_atoms,
            "max_batch_edges": limits.max_batch_edges,
            "batch_window_ms": limits.window_s * 1e3,
            "max_queue": limits.max_queue,
            "inline_max_atoms": limits.inline_max_atoms,
            "max_body_bytes": state.settings.max_body_bytes,
        },
        "auth_required": state.settings.api_key is not None,
    }
    return Response(orjson.dumps(document, default=str), media_type=JSON_MEDIA_TYPE)


@api_router.get("/metrics", response_class=Response)
async def metrics(state: State) -> Response:
    """Prometheus text exposition."""
    return Response(state.metrics.render(), media_type=METRICS_CONTENT_TYPE)
