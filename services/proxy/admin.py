"""Control endpoints (admin token): cells, draining, session moves, stats.

The scheduler drives these (through its NATS commands in the live system, or HTTP):
- ``POST /admin/cells`` ``{"name", "url", "capacity"}``: add or re-activate a cell;
- ``POST /admin/cells/{name}/drain`` ``{"timeout_s"}``: no new sessions; waits (bounded)
  for calls in flight; answers with the sessions still pinned there, to be moved;
- ``POST /admin/cells/{name}/evacuate`` ``{"timeout_s", "migrate", "deadline_s"}``: drain,
  then move every session to another cell with its KV cache (``migration.py``), one
  ``SessionRerouted`` each (none when calls outlast the drain: the switch then rolls back and
  the sessions stay; a session a new turn took elsewhere meanwhile stays where it went).
  ``deadline_s`` (optional, a positive number; else 400 ``invalid_request``) bounds the
  whole of it: no move starts past it. The answer lists the ``moves``, the sessions ``left``
  on the cell, ``complete`` and why it ``stopped`` early (``deadline``, ``reactivated``);
- ``POST /admin/cells/{name}/activate``, ``DELETE /admin/cells/{name}``;
- ``POST /admin/sessions/move`` ``{"session", "to_cell"}``: the session's next call goes
  to ``to_cell`` (KV migration, when wanted, is the scheduler's step before this);
- ``GET /admin/cells``, ``GET /admin/stats``.

Fields are checked: ``capacity`` an integer >= 1, ``timeout_s`` seconds >= 0, ``migrate`` a
JSON boolean, ``session``/``to_cell`` strings; anything else is a 400 naming the field.
A caller that leaves while still sending its body gets a quiet 499 (logged at INFO), as on
the chat routes: nobody is there to answer.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from .api.common import ApiError
from .core.routing import NoCellAvailable

log = logging.getLogger(__name__)


def add_admin_routes(app: FastAPI, service: Any, admin_token: str | None) -> None:
    from .app import require_admin

    def fail(e: ApiError) -> JSONResponse:
        return JSONResponse({"error": {"message": e.message, "type": e.kind}}, status_code=e.status)

    async def guarded(request: Request, fn) -> Any:
        try:
            require_admin(request, admin_token)
            body = {}
            if request.method == "POST":
                raw = await request.body()
                if raw:
                    import json

                    body = json.loads(raw)
                    if not isinstance(body, dict):
                        raise ApiError(400, "invalid_request", "body must be a JSON object")
            return await fn(body)
        except ClientDisconnect:  # the caller left while its body was being read
            log.info("%s %s: the caller left while sending its request", request.method, request.url.path)
            return Response(status_code=499)
        except ApiError as e:
            return fail(e)
        except (NoCellAvailable, ValueError, KeyError) as e:
            return fail(ApiError(400, "invalid_request", str(e)))

    @app.post("/admin/cells")
    async def add_cell(request: Request) -> Any:
        async def run(body: dict) -> Any:
            name, url = body.get("name"), body.get("url")
            if not isinstance(name, str) or not isinstance(url, str):
                raise ApiError(400, "invalid_request", "'name' and 'url' are required strings")
            service.add_cell(name, url, _int_field(body, "capacity", 8, minimum=1))
            return {"ok": True, "cells": _cells(service)}

        return await guarded(request, run)

    @app.delete("/admin/cells/{name}")
    async def remove_cell(name: str, request: Request) -> Any:
        async def run(body: dict) -> Any:
            service.router.remove_cell(name)
            return {"ok": True}

        return await guarded(request, run)

    @app.post("/admin/cells/{name}/drain")
    async def drain(name: str, request: Request) -> Any:
        async def run(body: dict) -> Any:
            from .migration import drain as drain_cell

            if name not in service.router.cells:
                raise ApiError(404, "not_found", f"unknown cell {name!r}")
            left = await drain_cell(service.router, name, _seconds_field(body, "timeout_s", 30.0))
            return {"ok": left == 0, "in_flight": left, "sessions": service.router.sessions_on(name)}

        return await guarded(request, run)

    @app.post("/admin/cells/{name}/evacuate")
    async def evacuate_cell(name: str, request: Request) -> Any:
        async def run(body: dict) -> Any:
            from dataclasses import asdict

            from .migration import check_deadline, evacuate

            try:
                deadline_s = check_deadline(body.get("deadline_s"))
            except ValueError as exc:
                raise ApiError(400, "invalid_request", str(exc)) from None
            if name not in service.router.cells:
                raise ApiError(404, "not_found", f"unknown cell {name!r}")
            ev = await evacuate(service, name, timeout_s=_seconds_field(body, "timeout_s", 30.0),
                                migrate=_bool_field(body, "migrate", True), mover=getattr(service, "kv_mover", None),
                                deadline_s=deadline_s)
            return {**asdict(ev), "complete": ev.complete}

        return await guarded(request, run)

    @app.post("/admin/cells/{name}/activate")
    async def activate(name: str, request: Request) -> Any:
        async def run(body: dict) -> Any:
            service.router.activate(name)
            return {"ok": True}

        return await guarded(request, run)

    @app.post("/admin/sessions/move")
    async def move(request: Request) -> Any:
        async def run(body: dict) -> Any:
            session, to_cell = body.get("session"), body.get("to_cell")
            if not isinstance(session, str) or not isinstance(to_cell, str):
                raise ApiError(400, "invalid_request", "'session' and 'to_cell' are required strings")
            before = service.router.move_session(session, to_cell)
            return {"ok": True, "from_cell": before}

        return await guarded(request, run)

    @app.get("/admin/cells")
    async def cells(request: Request) -> Any:
        async def run(body: dict) -> Any:
            return {"cells": _cells(service)}

        return await guarded(request, run)

    @app.get("/admin/stats")
    async def stats(request: Request) -> Any:
        async def run(body: dict) -> Any:
            s = service.stats
            return {"calls": s.calls, "undelivered": s.undelivered, "drift": s.drift}

        return await guarded(request, run)


def _cells(service: Any) -> list[dict[str, Any]]:
    return [{"name": c.name, "state": c.state.value, "capacity": c.capacity, "in_flight": c.in_flight,
             "sessions": service.router.pinned(c.name)} for c in service.router.cells.values()]


def _int_field(body: dict, key: str, default: int, *, minimum: int) -> int:
    """``body[key]``, an integer of at least ``minimum`` (JSON booleans and fractions are not)."""
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ApiError(400, "invalid_request", f"'{key}' must be an integer >= {minimum}, not {value!r}", key)
    return value


def _seconds_field(body: dict, key: str, default: float) -> float:
    """``body[key]``, a finite number of seconds >= 0."""
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ApiError(400, "invalid_request", f"'{key}' must be a number of seconds >= 0, not {value!r}", key)
    return float(value)


def _bool_field(body: dict, key: str, default: bool) -> bool:
    """``body[key]``, a JSON boolean (the string "false" is not one)."""
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise ApiError(400, "invalid_request", f"'{key}' must be true or false, not {value!r}", key)
    return value
