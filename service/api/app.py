"""The FastAPI application: ``create_app(settings, evaluator=None)``.

The lifespan loads the model once (unless an evaluator is injected, as tests do), starts the
engine, runs one warm-up pass, tunes the interpreter for serving (``tuned_interpreter``) and
only then reports ready; on shutdown it stops the engine and restores the interpreter.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import logging
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.deps import ServiceState, request_id_from
from service.api.errors import install_error_handlers
from service.api.evaluate import EVALUATE_PATH, EvaluateEndpoint, openapi_operation, route_path
from service.api.http_protocol import HeadJoiningHTTPProtocol
from service.api.routes import api_router, health_router
from service.api.schemas import ErrorResponse, EvaluateRequest, EvaluateResponse
from service.api.settings import ServiceSettings
from service.engine import BatchLimits, Engine, Evaluator, ServiceMetrics, Worker
from service.engine.evaluator import model_elements
from service.engine.profiling import PassProfiler, ProfileRequest

log = logging.getLogger("so2serve.api")

KEEP_ALIVE_S = 120
"""Idle keep-alive connections are kept this long (uvicorn's default, 5 s, makes a client that
pauses between steps — an optimizer writing output, a screening script — reconnect)."""


@contextmanager
def tuned_interpreter(switch_interval_s: float) -> Iterator[None]:
    """Interpreter settings while serving, restored afterwards.

    * CPython's thread switch interval (``switch_interval_s``; the setting's default keeps
      CPython's 5 ms). The device thread and the event loop share the GIL: a worker coming
      back from a device synchronisation while the loop is busy (a crowd's requests to
      decode, answers to encode) gets the GIL only when the loop blocks or is forced to hand
      it over after this interval, while a shorter interval lets a busy loop interrupt the
      worker's launches more often. Which wins depends on the load: beside a loop that never
      blocks, a pass of ten synchronisations (12 ms alone) took 64 ms at 5 ms, 17 ms at
      0.5 ms; with 64 HTTP clients against a stand-in pass that holds the GIL for 30 % of its
      time, 5 ms gave 0.86–0.96 of the batched rate and 0.5 ms 0.74–0.85 (2-core VM).
    * Everything alive after start-up (model, framework, imported modules: ~350k objects) is
      frozen out of the cyclic garbage collector, whose full collections would otherwise
      traverse all of it (tens to hundreds of ms, in whichever thread triggers them, the
      device thread included).
    """
    previous = sys.getswitchinterval()
    sys.setswitchinterval(switch_interval_s)
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        sys.setswitchinterval(previous)


def server_version() -> str:
    try:
        return version("so2serve")
    except PackageNotFoundError:
        return "0+unknown"


def load_evaluators(settings: ServiceSettings) -> list[Evaluator]:
    """The model named by the settings (the shipped default when none), one copy on each of
    its devices."""
    from service.model.potential import load_potentials

    return list(
        load_potentials(
            settings.model,
            devices=settings.device,
            path=settings.execution,
            precision=settings.precision,
        )
    )


def batch_limits(
    settings: ServiceSettings, device: str, edge_capacity: int | None = None
) -> BatchLimits:
    """The engine's limits from the settings, for a model on ``device``; ``edge_capacity``: the
    most edges a CPU pass holds in the host's memory (``Potential.pass_edge_capacity``)."""
    inline_max_atoms = settings.inline_max_atoms
    max_batch_edges = settings.max_batch_edges
    if device == "cpu" and "inline_max_atoms" not in settings.model_fields_set:
        # A CPU pass of a few thousand atoms takes seconds; on the event loop it would hold up
        # every other connection (health checks, other clients' bodies) for that long, to save
        # a thread hop that costs a fraction of a millisecond. Set explicitly, it is obeyed.
        inline_max_atoms = 0
    if edge_capacity is not None and "max_batch_edges" not in settings.model_fields_set:
        # Batches sized to the host: a pass above it would be refused and bisected, each half
        # building its graph again. Set explicitly, it is obeyed.
        max_batch_edges = max(min(max_batch_edges, edge_capacity), 1)
    return BatchLimits(
        max_atoms=settings.max_atoms,
        max_batch_atoms=settings.max_batch_atoms,
        max_batch_edges=max_batch_edges,
        window_s=settings.batch_window_ms * 1e-3,
        max_queue=settings.max_queue,
        inline_max_atoms=inline_max_atoms,
    )


def pass_profiler(settings: ServiceSettings) -> PassProfiler | None:
    """The opt-in pass profiler (``SO2SERVE_PROFILE_PASSES``); None when off."""
    if settings.profile_passes <= 0:
        return None
    return PassProfiler(
        ProfileRequest(
            passes=settings.profile_passes,
            skip=settings.profile_skip_passes,
            out_dir=settings.profile_dir,
        )
    )


def refuses_coincident_atoms(evaluator: Evaluator) -> bool:
    """Whether ``evaluator.predict`` itself raises ``coincident_atoms`` (with the structure's
    index) for atoms closer than the validation's limit: ``Potential`` does, in its neighbour
    list (``build_graph``); an evaluator may also say so with a ``refuses_coincident_atoms``
    attribute. Then decoding skips that check."""
    from service.model.potential import Potential

    declared = getattr(evaluator, "refuses_coincident_atoms", None)
    if isinstance(declared, bool):
        return declared
    return isinstance(evaluator, Potential)


def pass_edge_capacity(evaluators: Sequence[Evaluator]) -> int | None:
    """The least edge capacity the evaluators report (``Potential.pass_edge_capacity``: CPU
    potentials only); None when none reports one (CUDA, test fakes)."""
    reported = [
        capacity
        for capacity in (getattr(e, "pass_edge_capacity", lambda: None)() for e in evaluators)
        if capacity is not None
    ]
    return min(reported) if reported else None


async def _start(state: ServiceState, evaluators: Sequence[Evaluator] | None) -> None:
    started = time.perf_counter()
    if not evaluators:
        evaluators = await asyncio.to_thread(load_evaluators, state.settings)
    evaluator = evaluators[0]
    info = dict(evaluator.info())
    elements = model_elements(info)
    execution = evaluator.execution
    engine = Engine(
        [Worker(e, state.metrics) for e in evaluators],
        batch_limits(state.settings, execution.device, pass_edge_capacity(evaluators)),
        state.metrics,
        rcut=float(info["rcut"]),
        elements=elements,
        profiler=pass_profiler(state.settings),
    )
    devices = ",".join(engine.devices)
    await engine.start()
    if state.settings.warm_up:
        # Silence of half a minute on a new machine would look like a hang.
        compiles = " (compiles the GPU kernels unless Triton's cache has them: 12-30 s)"
        log.info("warming up on %s%s", devices, compiles if "cuda" in devices else "")
        await engine.warm_up(elements)
    state.provenance = {
        "model": {"name": str(info.get("name", "")), "sha256": str(info.get("sha256", ""))},
        "execution": {
            "path": execution.path,
            "precision": execution.precision,
            "device": devices,
        },
    }
    state.metrics.model.info(
        {
            **state.provenance["model"],
            **state.provenance["execution"],
            "version": state.server_version,
        }
    )
    state.decode_checks_coincident = not refuses_coincident_atoms(evaluator)
    state.engine, state.evaluator, state.ready = engine, evaluator, True
    log.info(
        "ready in %.1f s: model %s (%s) on %s, %s path, %s",
        time.perf_counter() - started,
        state.provenance["model"]["name"],
        state.provenance["model"]["sha256"][:12],
        devices,
        execution.path,
        execution.precision,
    )


async def _stop(state: ServiceState) -> None:
    state.ready = False
    if state.engine is not None:
        await state.engine.stop()


class RequestContextMiddleware:
    """Request ids (``X-Request-ID``: the client's if sane, else a fresh one) and per-route
    request counts and latency. Pure ASGI: no per-request task or body copy."""

    def __init__(self, app: ASGIApp, state: ServiceState, routes: frozenset[str]) -> None:
        self.app = app
        self.state = state
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        request_id = request_id_from(self._sent_request_id(scope))
        scope.setdefault("state", {})["request_id"] = request_id
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            route = scope["path"] if scope["path"] in self.routes else "other"
            self.state.metrics.record_request(route, status, time.perf_counter() - started)

    @staticmethod
    def _sent_request_id(scope: Scope) -> str | None:
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                sent: str = value.decode("latin-1")
                return sent
        return None


_EVALUATE_PATHS = frozenset((EVALUATE_PATH, EVALUATE_PATH + "/"))


class ServiceApp(FastAPI):
    """FastAPI for every route but ``/evaluate``, which goes straight to its bare ASGI
    endpoint (see ``evaluate.py``) without passing FastAPI's middleware stack and router."""

    def __init__(self, state: ServiceState, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.state.service = state
        self.evaluate_endpoint = EvaluateEndpoint(state)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # "/evaluate/" too: the endpoint bypasses FastAPI's router, so the router's slash
        # redirect never applies to it and the slashed spelling would be a 404.
        if scope["type"] == "http" and route_path(scope) in _EVALUATE_PATHS:
            await self.evaluate_endpoint(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)


_SCHEMA_REF = "#/components/schemas/{}"


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema of its routes plus ``POST /evaluate`` (JSON and msgpack bodies)."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        _, models = models_json_schema(
            [
                (EvaluateRequest, "validation"),
                (EvaluateResponse, "serialization"),
                (ErrorResponse, "serialization"),
            ],
            ref_template=_SCHEMA_REF.replace("{}", "{model}"),
        )
        schema.setdefault("components", {}).setdefault("schemas", {}).update(models["$defs"])
        schema["paths"] = {EVALUATE_PATH: {"post": openapi_operation(_SCHEMA_REF)}} | schema.get(
            "paths", {}
        )
        app.openapi_schema = schema
    return app.openapi_schema


def create_app(
    settings: ServiceSettings | None = None,
    evaluator: Evaluator | Sequence[Evaluator] | None = None,
) -> FastAPI:
    """The service app. ``evaluator`` (one, or one per device) replaces the model named in
    ``settings`` (tests)."""
    evaluators = None if evaluator is None else _as_list(evaluator)
    settings = settings if settings is not None else ServiceSettings()
    state = ServiceState(
        settings=settings, metrics=ServiceMetrics(), server_version=server_version()
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await _start(state, evaluators)
        with tuned_interpreter(settings.switch_interval_ms * 1e-3):
            try:
                yield
            finally:
                await _stop(state)

    app = ServiceApp(
        state,
        title="so2serve",
        version=state.server_version,
        description="Energies, forces and stress of an SO(2)-convolution potential (DPA4 subset).",
        lifespan=lifespan,
    )
    install_error_handlers(app)
    routers = (health_router, api_router)
    for router in routers:
        app.include_router(router)
    routes = frozenset(getattr(route, "path", "") for r in routers for route in r.routes)
    app.add_middleware(RequestContextMiddleware, state=state, routes=routes)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _as_list(evaluator: Evaluator | Sequence[Evaluator]) -> list[Evaluator]:
    return list(evaluator) if isinstance(evaluator, Sequence) else [evaluator]


def serve(settings: ServiceSettings, evaluators: Sequence[Evaluator] | None = None) -> None:
    """Run the service with uvicorn until interrupted (the ``so2serve serve`` command, which
    loads ``evaluators`` first: a model that does not load is its error, not a traceback from
    the app's start-up)."""
    import uvicorn

    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    uvicorn.run(create_app(settings, evaluators), **uvicorn_options(settings))


def uvicorn_options(settings: ServiceSettings) -> dict[str, Any]:
    """How ``so2serve serve`` runs uvicorn: no access log (one log record per MD step), a
    keep-alive long enough for a client that pauses between steps, uvicorn's automatic
    choice of event loop and HTTP parser, which takes uvloop and httptools (uvicorn[standard])
    when installed (without them it falls back to asyncio and the pure-Python h11 parser,
    about 0.1 ms slower per request, and says so in the log), and that parser's protocol
    writing each answer's head and body together (``http_protocol.py``)."""
    missing = [name for name in ("uvloop", "httptools") if importlib.util.find_spec(name) is None]
    if missing:
        log.warning(
            "%s not installed: slower HTTP (install uvicorn[standard])", " and ".join(missing)
        )
    return {
        "host": settings.host,
        "port": settings.port,
        "log_level": settings.log_level,
        "access_log": False,
        "timeout_graceful_shutdown": 30,
        "timeout_keep_alive": KEEP_ALIVE_S,
        "http": HeadJoiningHTTPProtocol,
    }
