"""The host every ``gyre serve <service>`` runs in: health and metrics over HTTP, the
service's own coroutine, and a clean stop on SIGTERM/SIGINT.

A service is a ``ServiceSpec``: a name and ``async def main(ctx)``; its wiring module
builds its adapters from ``ctx.runtime`` and reports progress through ``ctx.health``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from .bus_metrics import ConsumerLagMetrics
from .runtime import Runtime, open_runtime
from .settings import GyreSettings

log = logging.getLogger(__name__)


@dataclass
class Health:
    service: str
    status: str = "starting"  # starting | ok | degraded | stopping
    detail: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)

    def ok(self, **detail: Any) -> None:
        self.status = "ok"
        self.detail.update(detail)

    def as_dict(self) -> dict[str, Any]:
        return {"service": self.service, "status": self.status, "uptime_s": round(time.monotonic() - self.started, 1),
                **self.detail}


@dataclass
class ServiceContext:
    runtime: Runtime
    health: Health
    stop: asyncio.Event
    registry: CollectorRegistry
    options: dict[str, Any]
    app: FastAPI  # the served app: a service may mount its own API on it (after /health, /metrics)


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    main: Callable[[ServiceContext], Awaitable[None]]
    database: bool = False
    summary: str = ""


def create_app(health: Health, registry: CollectorRegistry) -> FastAPI:
    app = FastAPI(title=f"gyre {health.service}", docs_url=None, redoc_url=None)

    @app.get("/health")
    async def _health(response: Response) -> dict[str, Any]:
        if health.status not in ("ok", "degraded"):
            response.status_code = 503
        return health.as_dict()

    @app.get("/metrics")
    async def _metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


class ServiceStartError(OSError):
    """The service could not start for a reason the user can fix (its port is taken)."""


def _listen(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound here so that a taken port is one clear error (uvicorn's own
    bind logs and exits)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ServiceStartError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.set_inheritable(True)
    except OSError as exc:
        sock.close()
        raise ServiceStartError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


async def serve(spec: ServiceSpec, settings: GyreSettings, *, port: int, options: dict[str, Any] | None = None) -> None:
    health = Health(spec.name)
    registry = CollectorRegistry()
    stop = asyncio.Event()
    sock = _listen(settings.host, port)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    app = create_app(health, registry)
    config = uvicorn.Config(app, host=settings.host, port=port, log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    http = asyncio.create_task(server.serve(sockets=[sock]))
    opened = asyncio.Event()

    async def run() -> None:
        async with open_runtime(settings, name=spec.name, database=spec.database, migrate=spec.database) as rt:
            opened.set()
            ctx = ServiceContext(rt, health, stop, registry, options or {}, app)
            lag = asyncio.create_task(ConsumerLagMetrics(registry).run(rt.bus, stop))
            main = asyncio.create_task(spec.main(ctx))
            waiter = asyncio.create_task(stop.wait())
            done, _ = await asyncio.wait({main, waiter}, return_when=asyncio.FIRST_COMPLETED)
            health.status = "stopping"
            stop.set()
            lag.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await lag
            if main in done:
                main.result()  # a crashed service exits non-zero
            else:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(main, 10)

    runner = asyncio.create_task(run())
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({runner, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not runner.done() and not opened.is_set():  # stopped while still connecting (NATS down)
            log.info("%s: stopped before it connected", spec.name)
            runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await runner
        else:
            await runner
    finally:
        stopped.cancel()
        if not runner.done():
            runner.cancel()
        server.should_exit = True
        await http
