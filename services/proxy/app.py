"""The proxy's HTTP face: OpenAI Chat Completions, OpenAI Responses and Anthropic
Messages under each rollout's own base URL ``/r/<rollout>``, plus admin endpoints for the
scheduler (cells, drain, session moves). Every error is in the caller's API shape."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import time

import anyio
import orjson
from collections.abc import AsyncIterator, Callable
from types import ModuleType
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from .api import anthropic, openai_chat, openai_responses
from .api.common import Accepted, ApiError, ChatRequest, Finished, GenEvent, Keepalive, StreamState
from .core.routing import NoCellAvailable
from .queue_metrics import CellWaitCollector
from .service import CallHints, ProxyService

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024 * 1024

# each API's module: parse, response, stream (which answers a Keepalive with its own), error_body,
# stream_error, REQUEST_ID_HEADER
API: dict[str, ModuleType] = {"openai_chat": openai_chat, "openai_responses": openai_responses,
                              "anthropic_messages": anthropic}
DISCONNECT_POLL_S = 0.5  # how often a call whose caller waits in silence checks that it is still there
# an accepted stream still waits this long (at most keepalive_s) for its first event before
# its headers go out: a cell that refuses the call, or fails, answers within it, and that
# stays an HTTP error (a 400 "prompt is too long" Claude Code compacts on, a 529 the SDKs retry)
FIRST_EVENT_GRACE_S = 1.0
_WAITING = object()  # _watched's answer when its timeout passed first


class Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.calls = Counter("gyre_proxy_calls", "calls served", ["api", "drift", "delivered"], registry=registry)
        self.errors = Counter("gyre_proxy_errors", "calls refused or failed", ["api", "kind"], registry=registry)
        self.tokens = Counter("gyre_proxy_tokens", "tokens", ["kind"], registry=registry)
        self.latency = Histogram("gyre_proxy_call_seconds", "call latency", ["api"], registry=registry,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600))


def _api_key(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return request.headers.get("x-api-key")


async def _json_body(request: Request, max_bytes: int) -> Any:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, "too_large", f"request body of {declared} bytes is over the {max_bytes}-byte limit")
    raw = await request.body()
    if len(raw) > max_bytes:
        raise ApiError(413, "too_large", f"request body of {len(raw)} bytes is over the {max_bytes}-byte limit")
    try:
        body = orjson.loads(raw)  # contexts reach megabytes: the C parser keeps this off the hot path
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, "invalid_request", f"request body is not valid JSON: {exc}") from exc
    if _LONG_NUMBER.search(raw):
        # orjson reads an integer beyond 64 bits as a float; a tool call's argument echoed
        # back must stay the integer the model wrote (the standard parser keeps it exact)
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            pass
    return body


_LONG_NUMBER = re.compile(rb"\d{19}")  # 19 digits or more: maybe beyond 64 bits


def create_app(service: ProxyService, *, admin_token: str | None, registry: CollectorRegistry | None = None,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="gyre proxy", docs_url=None, redoc_url=None)
    registry = registry or CollectorRegistry()
    metrics = Metrics(registry)
    registry.register(CellWaitCollector(service.cell_waits))  # read at scrape time
    service.on_recorded.append(
        lambda api, drift, delivered: metrics.calls.labels(api, drift, str(delivered).lower()).inc())

    def err(api: str, e: ApiError) -> JSONResponse:
        metrics.errors.labels(api, e.kind).inc()
        headers = {"x-should-retry": "true"} if e.status >= 500 else None
        return JSONResponse(API[api].error_body(e), status_code=e.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def unrouted(request: Request, exc: StarletteHTTPException) -> Response:
        """A path or method no route takes (404, 405) answers in the caller's API's error
        shape (the SDKs show its message), not FastAPI's ``{"detail": ...}``."""
        path = request.url.path
        api = "anthropic_messages" if "/v1/messages" in path else (
            "openai_responses" if "/v1/responses" in path else "openai_chat")
        kind = {404: "not_found", 405: "invalid_request", 401: "authentication", 413: "too_large"}.get(
            exc.status_code, "invalid_request" if exc.status_code < 500 else "internal")
        what = {404: f"no such endpoint: {request.method} {path}",
                405: f"{request.method} is not allowed on {path}"}.get(exc.status_code, str(exc.detail))
        response = err(api, ApiError(exc.status_code, kind, what))
        for name, value in (exc.headers or {}).items():  # e.g. Allow on a 405
            response.headers[name] = value
        return response

    async def handle(api: str, rollout: str, request: Request) -> Response:
        mod = API[api]
        events: AsyncIterator[GenEvent] | None = None
        streaming = False  # the response is a stream, which closes ``events`` itself
        state = StreamState()
        try:
            await service.authorize(rollout, _api_key(request))
            req: ChatRequest = mod.parse(await _json_body(request, max_body_bytes))
            service.resolve_model(req.model)
            hints = CallHints(request.headers.get("x-claude-code-agent-id"),
                              request.headers.get("x-claude-code-parent-agent-id"), request.headers.get("x-gyre-role"))
            events = service.serve(rollout, req, hints, state if req.stream else None)
            started = time.monotonic()
            if not req.stream:
                # the whole call, watched from the start: a caller gone before the first token
                # is noticed too (the call is aborted and recorded undelivered)
                fin = await _collect(events, request)
                if fin is None:
                    return Response(status_code=499)
                _count(metrics, api, fin, started)
                return JSONResponse(mod.response(req, fin), headers={mod.REQUEST_ID_HEADER: fin.call_id})
            # errors until the call is accepted are HTTP errors (Claude Code compacts on a 400
            # "prompt is too long"); from then on the stream is open and they go in it
            accepted = await _watched(events.__anext__(), request)
            if accepted is None:
                return Response(status_code=499)
            if not isinstance(accepted, Accepted):
                raise RuntimeError(f"the call began with {type(accepted).__name__}, not Accepted")
            nxt = asyncio.ensure_future(events.__anext__())
            first = await _watched(nxt, request, min(FIRST_EVENT_GRACE_S, service.config.keepalive_s))
            if first is None:
                return Response(status_code=499)
            streaming = state.opened = True  # from now on a failure before any content waits for a cell
        except ClientDisconnect:  # the caller left while its body was being read: nobody to answer
            log.info("%s call of %s: the caller left while sending its request", api, rollout)
            return Response(status_code=499)
        except ApiError as e:
            return err(api, e)
        except NoCellAvailable as e:
            return err(api, ApiError(529, "overloaded", str(e)))
        except Exception as e:  # a bug or an outage: still an answer the caller's SDK understands
            return err(api, internal_error(e))
        finally:
            # a non-streaming call (or a stream that never started) ends now, not when the
            # collector finalises it; a handler cancelled at shutdown may find the generator
            # still running: its own cancellation ends it
            if events is not None and not streaming:
                with contextlib.suppress(RuntimeError):
                    await events.aclose()
        body = _sse(req, accepted.call_id, nxt, events, mod, service.config.keepalive_s, api, metrics, started)
        # background: a caller gone before the first bytes went out leaves the body generator
        # unstarted (its own finally never runs); closing it and ``events`` here aborts the
        # call on its cell and records it undelivered (a no-op when they are closed)
        return StreamingResponse(body, media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", "x-accel-buffering": "no",
                                          mod.REQUEST_ID_HEADER: accepted.call_id},
                                 background=BackgroundTask(_close, nxt, body, events))

    for api, path in (("openai_chat", "/v1/chat/completions"), ("openai_responses", "/v1/responses"),
                      ("anthropic_messages", "/v1/messages")):
        app.add_api_route("/r/{rollout}" + path, _route(handle, api), methods=["POST"])
        app.add_api_route(path, _no_rollout(api, err), methods=["POST"])

    @app.post("/r/{rollout}/v1/messages/count_tokens")
    async def count_tokens(rollout: str, request: Request) -> Response:
        try:
            await service.authorize(rollout, _api_key(request))
            req = anthropic.parse(await _json_body(request, max_body_bytes), count_only=True)
            return JSONResponse({"input_tokens": await service.count_tokens(rollout, req)})
        except ClientDisconnect:
            log.info("count_tokens call of %s: the caller left while sending its request", rollout)
            return Response(status_code=499)
        except ApiError as e:
            return err("anthropic_messages", e)
        except Exception as e:
            return err("anthropic_messages", internal_error(e))

    @app.get("/r/{rollout}/v1/models")
    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        names = [service.config.policy_model, *service.config.aliases]
        return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "gyre"}
                                           for n in names]}

    @app.head("/")
    @app.head("/r/{rollout}")
    @app.head("/r/{rollout}/")
    async def head(rollout: str = "") -> Response:
        return Response(status_code=200)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "cells": {n: c.state.value for n, c in service.router.cells.items()}}

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    from .admin import add_admin_routes

    add_admin_routes(app, service, admin_token)
    return app


def internal_error(exc: BaseException) -> ApiError:
    log.error("call failed: %r", exc, exc_info=exc)
    return ApiError(500, "internal", f"the proxy failed to serve the call: {type(exc).__name__}")


def _route(handle: Callable, api: str) -> Callable:
    async def route(rollout: str, request: Request) -> Response:
        return await handle(api, rollout, request)

    return route


def _no_rollout(api: str, err: Callable) -> Callable:
    async def route() -> Response:
        return err(api, ApiError(401, "authentication", "use your rollout's base URL: /r/<rollout_id>/v1/..."))

    return route


async def _watched(aw: Any, request: Request, timeout: float | None = None) -> Any:
    """Await ``aw`` (a generator's ``__anext__``, or a task of it) while watching the caller:
    None if it left first (``aw`` is cancelled: the generator ends, which aborts its call
    and records it undelivered); ``_WAITING`` if ``timeout`` passed first (``aw`` goes on)."""
    task = asyncio.ensure_future(aw)
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    keep = False
    try:
        while not task.done():
            wait = DISCONNECT_POLL_S if deadline is None else min(DISCONNECT_POLL_S, deadline - loop.time())
            done, _ = await asyncio.wait({task}, timeout=max(0.0, wait))
            if done:
                break
            if await request.is_disconnected():
                task.cancel()  # the generator must be at rest before it can be closed
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                return None
            if deadline is not None and loop.time() >= deadline:
                keep = True
                return _WAITING
        return task.result()
    finally:
        if not task.done() and not keep:
            task.cancel()


async def _collect(events: AsyncIterator[GenEvent], request: Request) -> Finished | None:
    """Run a call to its end (None: the caller left before it, checked from the start)."""
    async def run() -> Finished | None:
        async for ev in events:
            if isinstance(ev, Finished):
                return ev
        return None

    fin = await _watched(run(), request)
    if fin is None:
        with contextlib.suppress(RuntimeError):
            await events.aclose()
    return fin


async def _close(nxt: asyncio.Future, body: AsyncIterator[str], events: AsyncIterator[GenEvent]) -> None:
    if not nxt.done():  # the stream never started: the call still waits for its first event
        nxt.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await nxt
    for gen in (body, events):
        with contextlib.suppress(RuntimeError):
            await gen.aclose()  # type: ignore[attr-defined]


async def _sse(req: ChatRequest, call_id: str, nxt: asyncio.Future, events: AsyncIterator[GenEvent],
               mod: ModuleType, keepalive_s: float, api: str, metrics: Metrics,
               started: float) -> AsyncIterator[str]:
    """The API's stream of the call, with the API's keepalive whenever nothing went out for
    ``keepalive_s`` (a tool call is streamed only once complete; a long prefill, a queue, a
    call waiting for a cell are silent too): a ``Keepalive`` put in the formatter's events,
    while the call's next event is still awaited (not cancelled). An error in the call
    reaches the API's formatter as an ApiError, which it ends its stream with in its own
    format. ``nxt``: the call's next event after ``Accepted``, maybe still to come."""
    fin: list[Finished] = []
    loop = asyncio.get_running_loop()
    last_out = [loop.time()]  # when the last chunk (or keepalive) went out
    waiting: list[asyncio.Future | None] = [None]  # the call's next event, awaited across keepalives

    async def rest() -> AsyncIterator[GenEvent]:
        try:
            ev = await nxt
        except StopAsyncIteration:
            return
        yield ev
        async for ev in events:
            yield ev

    inner = rest()

    async def tracked() -> AsyncIterator[GenEvent]:
        try:
            while True:
                if waiting[0] is None:
                    waiting[0] = asyncio.ensure_future(inner.__anext__())
                quiet = last_out[0] + keepalive_s - loop.time()
                if quiet > 0:
                    await asyncio.wait({waiting[0]}, timeout=quiet)
                if not waiting[0].done():
                    last_out[0] = loop.time()  # even if a formatter sent nothing for it: no busy loop
                    yield Keepalive()
                    continue
                task, waiting[0] = waiting[0], None
                try:
                    ev = task.result()
                except StopAsyncIteration:
                    return
                if isinstance(ev, Finished):
                    fin.append(ev)
                yield ev
        except ApiError as e:
            metrics.errors.labels(api, e.kind).inc()
            raise
        except Exception as exc:  # the headers are out: the error goes in the stream, not silence
            e = internal_error(exc)
            metrics.errors.labels(api, e.kind).inc()
            raise e from exc

    source = tracked()
    out = mod.stream(req, call_id, source)
    try:
        async for chunk in out:
            last_out[0] = loop.time()
            yield chunk
    except ApiError as e:  # a formatter that let one through
        yield mod.stream_error(e, call_id)
    except Exception as exc:  # a bug in a formatter: still an error the caller's SDK reads
        e = internal_error(exc)
        metrics.errors.labels(api, e.kind).inc()
        yield mod.stream_error(e, call_id)
    finally:
        # the caller left (or the stream ended): the call's generator is cancelled where it
        # waits, which aborts it on its cell and records it undelivered; shielded, as the
        # server's cancellation would otherwise interrupt this clean-up too
        with anyio.CancelScope(shield=True):
            for fut in (waiting[0], nxt):
                if fut is not None and not fut.done():
                    fut.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await fut
            for gen in (out, source, inner, events):
                with contextlib.suppress(RuntimeError):
                    await gen.aclose()  # type: ignore[attr-defined]
    if fin:
        _count(metrics, api, fin[0], started)


def _count(metrics: Metrics, api: str, fin: Finished, started: float) -> None:
    metrics.latency.labels(api).observe(time.monotonic() - started)
    metrics.tokens.labels("prompt").inc(fin.prompt_tokens)
    metrics.tokens.labels("completion").inc(fin.completion_tokens)


def require_admin(request: Request, token: str | None) -> None:
    if token is None:
        raise ApiError(403, "permission", "control endpoints are disabled: set GYRE_ADMIN_TOKEN")
    if not hmac.compare_digest(_api_key(request) or "", token):
        raise ApiError(401, "authentication", "admin token required")
