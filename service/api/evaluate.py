"""``POST /evaluate`` as a bare ASGI endpoint: the hot path of the service.

An MD client calls it every step, so it bypasses FastAPI's router, middleware stack,
dependency resolution and response classes (about 0.1 ms per request on loopback, a tenth of
the overhead budget): the API key and readiness are checked inline, the body is read straight
from the ASGI channel and parsed once, and the answer goes out as two ASGI messages. It
answers as a FastAPI route would: the same JSON errors, ``X-Request-ID``, request metrics;
``app.py`` routes ``/evaluate`` here and documents it in the OpenAPI schema.

Timings in each answer's ``provenance.timings`` (ms): ``read`` (receiving the body),
``decode`` (parsing and validating it), ``admit`` (the engine's admission checks and edge
estimate), ``queue`` (admission → first device pass),
``compute`` (device passes that carried the request, shared with the others in them),
``handoff`` (last pass ended in the worker thread → this handler runs again), split into
``return`` (pass ended → the event loop set the result) and ``resume`` (result set → this
handler runs), ``total`` (arrival → answer ready to encode); ``provenance.inline`` says
whether the pass ran on the event loop itself (a lone client: no thread hop, handoff ≈ 0).
Encoding the answer and handing it to the HTTP server are observed in the
``so2serve_encode_seconds`` and ``so2serve_respond_seconds`` histograms.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.types import Receive, Scope, Send

from service.api.deps import ServiceState, engine_when_ready, request_id_from, require_api_key
from service.api.errors import JSON_MEDIA_TYPE, ApiError, as_api_error, error_body, internal_error
from service.api.wire import (
    WireFormat,
    encode,
    parse_evaluate,
    request_format,
    response_format,
    structure_results,
)
from service.engine import Engine, EvaluationResult, QueueFullError

EVALUATE_PATH = "/evaluate"

PARSE_IN_THREAD_BYTES = 32 << 10
"""Bodies above this are parsed in a thread so the event loop keeps serving others. Parsing
costs per structure more than per byte: 1 MiB of one-atom structures held the loop for ~1.9 s
(2-core CPU), 32 KiB of them ~60 ms; a 192-atom structure (~15 KB of JSON) stays inline. The
JSON parser holds the GIL, so a very large JSON body still pauses the other threads (~1.8 s for
70 MB); msgpack bodies with raw arrays are unpacked without building a Python float per value."""

ENCODE_IN_THREAD_ITEMS = 16384
"""Answers for more atoms plus structures than this are built and encoded in a thread. On a
2-core CPU an answer for 16k atoms took 2–3 ms of loop time as JSON (0.1–2 ms as msgpack), a
20,000 × 100-atom one 1.2 s, during which the loop served no one (health checks included);
below it, the thread hop would cost an MD step more than the encoding."""

CLIENT_CLOSED_REQUEST = 499
"""Status recorded (never seen by anyone) when the client left before the answer."""


def route_path(scope: Scope) -> str:
    """The request path below the app's mount point (``root_path``)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


@dataclass(frozen=True)
class _Answer:
    payload: bytes
    fmt: WireFormat
    encode_s: float  # result in hand → answer encoded


def connection_of(scope: Scope) -> tuple[str, int] | None:
    """The client's (host, port): one keep-alive connection is one sequential client, whose
    pace the engine learns (see ``service.engine.batcher``). None where the server has no
    peer address (a Unix socket)."""
    peer = scope.get("client")
    return None if not peer else (str(peer[0]), int(peer[1]))


class EvaluateEndpoint:
    """The ASGI app answering ``/evaluate`` for one service instance."""

    def __init__(self, state: ServiceState) -> None:
        self._state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        # The first of a repeated header, as FastAPI's routes and the middleware read it.
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in reversed(scope["headers"])}
        request_id = request_id_from(headers.get("x-request-id"))
        extra: Mapping[str, str] = {}
        answer: _Answer | None = None
        payload: bytes | None
        try:
            if scope["method"] != "POST":
                raise ApiError(
                    405, "method_not_allowed", "Method Not Allowed", headers={"Allow": "POST"}
                )
            answer = await self._answer(headers, request_id, scope, receive, started)
        except asyncio.CancelledError:
            # The server cancelled this request: it was still queued or running when the
            # graceful-shutdown deadline passed (a client that leaves is answered above, not
            # cancelled). Answer what a stopping server answers, 503 not_ready, which the
            # clients retry, instead of letting uvicorn send its plain-text 500. Not re-raised:
            # the handler ends here either way, and uvicorn would log a re-raised cancellation
            # as an application error with its traceback, once per request cut off.
            status, media = 503, JSON_MEDIA_TYPE
            payload = error_body(
                "not_ready", "the server stopped before this request was evaluated", None
            )
            extra = {"Retry-After": "5"}
        except Exception as exc:  # every failure becomes its JSON error answer
            error = as_api_error(exc) or internal_error(EVALUATE_PATH, exc)
            status, media = error.status, JSON_MEDIA_TYPE
            payload = error_body(error.code, error.message, error.detail)
            extra = error.headers
        else:
            status, media = (200, answer.fmt.value) if answer else (CLIENT_CLOSED_REQUEST, "")
            payload = answer.payload if answer else None
        responding = time.perf_counter()
        try:
            if payload is not None:
                await _respond(send, status, payload, media, request_id, extra)
        finally:
            # Metrics once the answer is out: none of this delays the client.
            metrics = self._state.metrics
            done = time.perf_counter()
            metrics.record_request(EVALUATE_PATH, status, done - started)
            if answer is not None:
                metrics.encode_seconds.observe(answer.encode_s)
                metrics.respond_seconds.observe(done - responding)

    async def _answer(
        self,
        headers: Mapping[str, str],
        request_id: str,
        scope: Scope,
        receive: Receive,
        started: float,
    ) -> _Answer | None:
        """The encoded answer; None if the client went away."""
        state = self._state
        require_api_key(headers, state)
        engine = engine_when_ready(state)
        fmt_in = request_format(headers.get("content-type"), headers.get("content-encoding"))
        fmt_out = response_format(headers.get("accept"), fmt_in)
        settings = state.settings
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > PARSE_IN_THREAD_BYTES:
            _refuse_unread_if_full(engine)
        body = await _read_body(receive, declared, settings.max_body_bytes, settings.body_timeout_s)
        if body is None:
            return None
        read = time.perf_counter()
        check = state.decode_checks_coincident
        if len(body) > PARSE_IN_THREAD_BYTES:
            parsed, structures = await asyncio.to_thread(
                functools.partial(parse_evaluate, check_coincident=check), body, fmt_in
            )
        else:
            parsed, structures = parse_evaluate(body, fmt_in, check_coincident=check)
        decoded = time.perf_counter()
        if structures.n_atoms > settings.max_request_atoms:
            state.metrics.rejected.labels("too_many_atoms").inc()
            raise ApiError(
                413,
                "too_many_atoms",
                f"the request holds {structures.n_atoms} atoms, above this server's limit of "
                f"{settings.max_request_atoms} atoms per request (SO2SERVE_MAX_REQUEST_ATOMS); "
                "send fewer structures per request",
                detail={"n_atoms": structures.n_atoms, "limit": settings.max_request_atoms},
            )
        evaluation = engine.submit(structures, parsed.properties, client=connection_of(scope))
        result = await _unless_disconnected(receive, evaluation)
        if result is None:
            return None
        resumed = time.perf_counter()
        # (B,) periodic along all axes; numpy: a fraction of a torch op's dispatch cost
        periodic = np.logical_and.reduce(structures.pbc.numpy(), axis=1)
        timings = _timings(result, started, read, decoded, resumed)
        provenance = {
            "request_id": request_id,
            "server_version": state.server_version,
            **state.provenance,
            "timings": timings,
            "passes": result.timings.passes,
            "inline": result.timings.inline,
        }
        answer = functools.partial(
            _encode_answer, result, parsed.properties, periodic, provenance, fmt_out
        )
        if structures.n_atoms + structures.n_structures > ENCODE_IN_THREAD_ITEMS:
            payload = await asyncio.to_thread(answer)
        else:
            payload = answer()
        return _Answer(payload, fmt_out, time.perf_counter() - resumed)


def _encode_answer(
    result: EvaluationResult,
    properties: Sequence[str],
    periodic: np.ndarray,
    provenance: dict[str, Any],
    fmt: WireFormat,
) -> bytes:
    """The answer's bytes: a result per structure, then the provenance."""
    results = structure_results(result, properties, periodic)
    return encode({"results": results, "provenance": provenance}, fmt)


def _timings(
    result: EvaluationResult, started: float, read: float, decoded: float, resumed: float
) -> dict[str, float]:
    t = result.timings
    return {
        "read_ms": (read - started) * 1e3,
        "decode_ms": (decoded - read) * 1e3,
        "admit_ms": max(0.0, t.admitted_at - decoded) * 1e3,
        "queue_ms": t.queue_s * 1e3,
        "compute_ms": t.compute_s * 1e3,
        "handoff_ms": max(0.0, resumed - t.finished_at) * 1e3,
        "return_ms": max(0.0, t.delivered_at - t.finished_at) * 1e3,
        "resume_ms": max(0.0, resumed - t.delivered_at) * 1e3,
        "total_ms": (resumed - started) * 1e3,
    }


_MEDIA_BYTES = {fmt.value: fmt.value.encode() for fmt in WireFormat}


async def _respond(
    send: Send,
    status: int,
    payload: bytes,
    media_type: str,
    request_id: str,
    headers: Mapping[str, str],
) -> None:
    raw: list[tuple[bytes, bytes]] = [
        (b"content-type", _MEDIA_BYTES.get(media_type) or media_type.encode()),
        (b"content-length", str(len(payload)).encode()),
        (b"x-request-id", request_id.encode()),
    ]
    raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})


async def _read_body(
    receive: Receive, declared: str | None, limit: int, timeout_s: float
) -> bytes | None:
    """The whole body (None if the client disconnected first), refusing (413) anything above
    ``limit`` bytes before buffering it, and (408) a body still incomplete after ``timeout_s``:
    a client that stops sending must not hold its buffer and connection for ever."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _body_too_large(int(declared), limit)
    try:
        async with asyncio.timeout(timeout_s):
            return await _receive_body(receive, limit)
    except TimeoutError:
        raise ApiError(
            408,
            "body_timeout",
            f"the request body did not arrive within {timeout_s:g} s",
            detail={"timeout_s": timeout_s},
            headers=_CLOSE,
        ) from None


async def _receive_body(receive: Receive, limit: int) -> bytes | None:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _body_too_large(size, limit)
        if not message.get("more_body", False):
            return b"".join((*chunks, chunk)) if chunks else chunk
        chunks.append(chunk)


def _refuse_unread_if_full(engine: Engine) -> None:
    """503 queue_full before reading a large body: reading and parsing it (seconds of a core
    for megabytes of JSON) would be wasted, and a client retrying on 503 sends it again."""
    try:
        engine.refuse_if_full()
    except QueueFullError as exc:
        error = as_api_error(exc)
        assert error is not None
        error.headers.update(_CLOSE)
        raise error from None


def _body_too_large(size: int, limit: int) -> ApiError:
    return ApiError(
        413,
        "body_too_large",
        f"the request body has {size} bytes or more, above the limit of {limit} (--max-body-mb); "
        "send fewer structures per request",
        detail={"limit_bytes": limit},
        headers=_CLOSE,
    )


_CLOSE = {"connection": "close"}
"""On a refused body: the rest of it may still be on its way, so the connection cannot be
reused; closing it also spares the server reading and discarding what remains."""


async def _unless_disconnected(
    receive: Receive, evaluation: asyncio.Future[EvaluationResult]
) -> EvaluationResult | None:
    """Wait for the evaluation, or cancel it (and return None) if the client goes away first.

    Once the body is read, the next ASGI message is ``http.disconnect``, which arrives only
    when the connection drops; cancelling the evaluation withdraws whatever has not started.
    A done-callback links the two (no ``asyncio.wait`` and its waiter per request). A pass
    run inline has finished inside ``submit``: there is nothing left to cancel or watch.
    """
    if evaluation.done():
        return evaluation.result()
    watcher = asyncio.ensure_future(_disconnected(receive))
    watcher.add_done_callback(lambda w: None if w.cancelled() else evaluation.cancel())
    try:
        return await evaluation
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            return None  # the client left; this handler itself was not cancelled
        raise
    finally:
        watcher.cancel()
        evaluation.cancel()  # no-op once it has a result


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def openapi_operation(schema_ref: str) -> dict[str, Any]:
    """The OpenAPI operation object of ``POST /evaluate`` (``schema_ref`` formats a model
    name into its ``$ref``)."""
    media = (WireFormat.JSON.value, WireFormat.MSGPACK.value)
    errors = {
        "400": "malformed body",
        "401": "API key missing or wrong",
        "405": "not a POST",
        "408": "the body did not arrive in time (connection closed)",
        "413": "too many atoms in a structure, or body too large",
        "415": "neither JSON nor msgpack",
        "422": "invalid request, binary array or structure",
        "500": "evaluation failed",
        "503": "queue full or not ready (Retry-After)",
        "507": "a structure does not fit in device memory",
    }

    def body(model: str, *media_types: str) -> dict[str, Any]:
        return {m: {"schema": {"$ref": schema_ref.format(model)}} for m in media_types}

    responses: dict[str, Any] = {
        "200": {
            "description": "results in request order, and their provenance",
            "content": {
                m: {"schema": {"$ref": schema_ref.format("EvaluateResponse")}} for m in media
            },
        },
        **{
            code: {"description": why, "content": body("ErrorResponse", JSON_MEDIA_TYPE)}
            for code, why in errors.items()
        },
    }
    return {
        "tags": ["evaluate"],
        "summary": "Evaluate",
        "operationId": "evaluate",
        "description": "Energy (and forces, stress, per-atom energies, virial) of each "
        "structure. Body and answer as JSON or msgpack (see the wire formats in schemas.py); "
        "the answer follows Accept, else the request's format.",
        "requestBody": {
            "required": True,
            "content": {
                m: {"schema": {"$ref": schema_ref.format("EvaluateRequest")}} for m in media
            },
        },
        "responses": responses,
    }
