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

import orjson
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from .api import anthropic, openai_chat, openai_responses
from .api.common import ApiError, ChatRequest, Finished, GenEvent
from .core.routing import NoCellAvailable
from .service import CallHints, ProxyService

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024 * 1024

API = {
    "openai_chat": (openai_chat.parse, openai_chat.response, openai_chat.stream, openai_chat.error_body,
                    openai_chat.stream_error),
    "openai_responses": (openai_responses.parse, openai_responses.response, openai_responses.stream,
                         openai_responses.error_body, openai_responses.stream_error),
    "anthropic_messages": (anthropic.parse, anthropic.response, anthropic.stream, anthropic.error_body,
                           anthropic.stream_error),
}


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
    service.on_recorded.append(
        lambda api, drift, delivered: metrics.calls.labels(api, drift, str(delivered).lower()).inc())

    def err(api: str, e: ApiError) -> JSONResponse:
        metrics.errors.labels(api, e.kind).inc()
        headers = {"x-should-retry": "true"} if e.status >= 500 else None
        return JSONResponse(API[api][3](e), status_code=e.status, headers=headers)

    async def handle(api: str, rollout: str, request: Request) -> Response:
        parse, respond, stream, _, stream_error = API[api]
        try:
            await service.authorize(rollout, _api_key(request))
            req: ChatRequest = parse(await _json_body(request, max_body_bytes))
            service.resolve_model(req.model)
            hints = CallHints(request.headers.get("x-claude-code-agent-id"),
                              request.headers.get("x-claude-code-parent-agent-id"), request.headers.get("x-gyre-role"))
            events = service.serve(rollout, req, hints)
            first = await events.__anext__()  # errors before the first token become HTTP errors
        except ApiError as e:
            return err(api, e)
        except NoCellAvailable as e:
            return err(api, ApiError(529, "overloaded", str(e)))
        except Exception as e:  # a bug or an outage: still an answer the caller's SDK understands
            return err(api, internal_error(e))
        started = time.monotonic()
        if req.stream:
            # background: a caller gone before the first bytes went out leaves the body
            # generator unstarted, so its own finally never runs; closing ``events`` here
            # aborts the call on its cell and records it undelivered without waiting for
            # the garbage collector to finalise the generator (a no-op when it is closed)
            return StreamingResponse(_sse(req, first, events, stream, stream_error, api, metrics, started),
                                     media_type="text/event-stream",
                                     headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
                                     background=BackgroundTask(events.aclose))
        try:
            fin = await _collect(first, events, request)
        except ApiError as e:
            return err(api, e)
        except Exception as e:
            return err(api, internal_error(e))
        finally:
            # the call ends now (not when the collector finalises it); a handler cancelled at
            # shutdown may find the generator still running: its own cancellation ends it
            with contextlib.suppress(RuntimeError):
                await events.aclose()
        if fin is None:
            return Response(status_code=499)
        _count(metrics, api, fin, started)
        return JSONResponse(respond(req, fin))

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


async def _collect(first: GenEvent, events: AsyncIterator[GenEvent], request: Request) -> Finished | None:
    async def run() -> Finished | None:
        ev: GenEvent | None = first
        while ev is not None and not isinstance(ev, Finished):
            ev = await events.__anext__()
        return ev

    task = asyncio.create_task(run())
    try:
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if not done and await request.is_disconnected():
                task.cancel()  # the generator must be at rest before it can be closed
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                await events.aclose()
                return None
        return task.result()
    finally:
        if not task.done():
            task.cancel()


async def _sse(req: ChatRequest, first: GenEvent, events: AsyncIterator[GenEvent], stream: Callable,
               stream_error: Callable, api: str, metrics: Metrics, started: float) -> AsyncIterator[str]:
    fin: list[Finished] = []

    async def chained() -> AsyncIterator[GenEvent]:
        yield first
        if isinstance(first, Finished):
            fin.append(first)
            return
        async for ev in events:
            if isinstance(ev, Finished):
                fin.append(ev)
            yield ev

    try:
        async for chunk in stream(req, chained()):
            yield chunk
    except ApiError as e:
        metrics.errors.labels(api, e.kind).inc()
        yield stream_error(e)
    except Exception as exc:  # the headers are out: the error goes in the stream, not silence
        e = internal_error(exc)
        metrics.errors.labels(api, e.kind).inc()
        yield stream_error(e)
    finally:
        await events.aclose()
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
