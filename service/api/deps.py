"""FastAPI dependencies: the per-app state, the engine, the API key check.

The dependencies are ``async def``: FastAPI runs a plain ``def`` dependency in a worker thread,
and those hops cost more than the whole rest of a small request. The checks they wrap are
plain functions, which ``/evaluate`` (bare ASGI, ``evaluate.py``) calls directly.
"""

from __future__ import annotations

import itertools
import os
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Request

from service.api.errors import ApiError
from service.api.settings import ServiceSettings
from service.engine import Engine, Evaluator, ServiceMetrics

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class _FreshIds:
    """Request ids: 32 hex digits, a prefix drawn once per process and a serial number. Not
    ``uuid4()``, which reads ``os.urandom`` for every request: a system call made without the
    GIL, which the event loop then has to win back from the device thread in the middle of its
    launches. A forked child draws its own prefix (it would otherwise repeat its parent's ids)."""

    def __init__(self) -> None:
        self.restart()
        os.register_at_fork(after_in_child=self.restart)

    def restart(self) -> None:
        self._prefix = secrets.token_hex(10)
        self._serial = itertools.count()

    def next(self) -> str:
        return f"{self._prefix}{next(self._serial) % (1 << 48):012x}"


_fresh_ids = _FreshIds()


def request_id_from(sent: str | None) -> str:
    """The client's ``X-Request-ID`` if it is a sane token, else a fresh one."""
    if sent is not None and _REQUEST_ID.match(sent):
        return sent
    return _fresh_ids.next()


@dataclass
class ServiceState:
    """Everything one app instance owns; lives in ``app.state.service``."""

    settings: ServiceSettings
    metrics: ServiceMetrics
    server_version: str
    engine: Engine | None = None
    evaluator: Evaluator | None = None
    provenance: dict[str, Any] = field(default_factory=dict)  # the per-model part
    ready: bool = False
    # Whether /evaluate checks for coincident atoms while decoding; off where the model's
    # neighbour list refuses them (a 422 from the worker instead, same code and field).
    decode_checks_coincident: bool = True


async def get_state(request: Request) -> ServiceState:
    state: ServiceState = request.app.state.service
    return state


State = Annotated[ServiceState, Depends(get_state)]


def engine_when_ready(state: ServiceState) -> Engine:
    """The engine, once the model is loaded and warmed up (else 503 not_ready)."""
    if not state.ready or state.engine is None:
        raise ApiError(
            503,
            "not_ready",
            "the model is not loaded yet, or the server is stopping",
            headers={"Retry-After": "5"},
        )
    return state.engine


async def get_engine(state: State) -> Engine:
    return engine_when_ready(state)


def _presented_key(headers: Mapping[str, str]) -> str | None:
    key = headers.get("x-api-key")
    if key is not None:
        return key
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _why_refused(headers: Mapping[str, str], presented: str | None) -> str:
    if presented is not None:
        return "wrong API key"
    scheme = headers.get("authorization", "").strip().partition(" ")[0]
    if scheme and scheme.lower() != "bearer":
        return (
            f"missing API key: the Authorization scheme {scheme[:20]!r} is not accepted; "
            "send 'Authorization: Bearer <key>' or 'X-API-Key: <key>'"
        )
    return "missing API key"


def require_api_key(headers: Mapping[str, str], state: ServiceState) -> None:
    """401 unless the request headers (lower-case names, values decoded as latin-1, as the
    ASGI servers give them) carry the server's key, when it has one."""
    expected = state.settings.api_key
    if expected is None:
        return
    presented = _presented_key(headers)
    # The header's bytes against the key's UTF-8: latin-1 gives the text back its bytes (the
    # text's own UTF-8 would never match a key with a non-ASCII character).
    if presented is None or not secrets.compare_digest(
        presented.encode("latin-1"), expected.get_secret_value().encode()
    ):
        raise ApiError(
            401,
            "unauthorized",
            _why_refused(headers, presented),
            detail={"accepted": ["X-API-Key: <key>", "Authorization: Bearer <key>"]},
            headers={"WWW-Authenticate": "Bearer"},
        )


async def authorized(request: Request, state: State) -> None:
    require_api_key(request.headers, state)


EngineDep = Annotated[Engine, Depends(get_engine)]
Authorized = Depends(authorized)
