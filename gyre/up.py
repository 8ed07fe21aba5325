"""``gyre up``: the embedded stack on one machine, with a live status view.

Starts a nats-server (unless ``GYRE_NATS_URL`` is given), migrates the database (SQLite
under the run folder unless ``GYRE_DATABASE_URL``), records the run's resolved settings as
its first event (``RunStarted``), starts every service as its own ``gyre serve``
process, and shows their health until Ctrl-C (or ``--duration``/``--check``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx
from rich.console import Console
from rich.live import Live
from rich.table import Table

from gyre.services import SERVICES
from libs.common.bus.jetstream import JetStreamBus
from libs.common.db.engine import upgrade
from libs.common.events import RunStarted
from libs.common.natsserver import EmbeddedNats, free_port
from libs.common.settings import GyreSettings

SECRET_KEYS = {"admin_token", "nats_creds"}


@dataclass
class Child:
    name: str
    port: int
    proc: subprocess.Popen[bytes]
    health: dict[str, Any] | None = None

    @property
    def state(self) -> str:
        if self.proc.poll() is not None:
            return f"exited ({self.proc.returncode})"
        return (self.health or {}).get("status", "starting")


def resolved_config(settings: GyreSettings) -> dict[str, Any]:
    data = settings.model_dump(mode="json")
    for key in SECRET_KEYS:
        if data.get(key):
            data[key] = "***"
    data["services"] = sorted(SERVICES)
    return data


async def _record_run_started(settings: GyreSettings) -> None:
    config = resolved_config(settings)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    bus = await JetStreamBus.connect(settings.nats_url or "", name="gyre-up")
    try:
        from gyre import __version__

        await bus.publish(RunStarted(run_id=settings.run_id, config=config, config_digest=digest,
                                     gyre_version=__version__))
    finally:
        await bus.close()


def _spawn(name: str, env: dict[str, str], log_dir: Any) -> Child:
    port = free_port()
    log = open(log_dir / f"{name}.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "gyre", "serve", name, "--port", str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    log.close()
    return Child(name, port, proc)


def _poll(children: list[Child], client: httpx.Client) -> None:
    for c in children:
        try:
            c.health = client.get(f"http://127.0.0.1:{c.port}/health", timeout=0.5).json()
        except (httpx.HTTPError, ValueError):
            c.health = None


def _table(settings: GyreSettings, nats_url: str, children: list[Child]) -> Table:
    t = Table(title=f"gyre up · run {settings.run_id} · {settings.run_dir}", expand=False)
    for col in ("service", "state", "pid", "port", "detail"):
        t.add_column(col)
    t.add_row("nats", "ok", "", nats_url.rsplit(":", 1)[-1], nats_url)
    t.add_row("database", "ok", "", "", settings.sqlalchemy_url)
    for c in children:
        detail = {k: v for k, v in (c.health or {}).items() if k not in ("service", "status")}
        colour = "green" if c.state == "ok" else "yellow" if c.state == "starting" else "red"
        t.add_row(c.name, f"[{colour}]{c.state}[/]", str(c.proc.pid), str(c.port),
                  " ".join(f"{k}={v}" for k, v in detail.items())[:90])
    return t


def run_up(settings: GyreSettings, *, check: bool = False, duration: float = 0.0) -> int:
    console = Console(stderr=check)
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    log_dir = settings.run_dir / "logs"
    log_dir.mkdir(exist_ok=True)
    nats = None
    if not settings.nats_url:
        nats = EmbeddedNats(settings.nats_store_dir).start()
        settings = settings.model_copy(update={"nats_url": nats.url})
    children: list[Child] = []
    stopping = False

    def _stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    try:
        upgrade(settings.sqlalchemy_url)
        asyncio.run(_record_run_started(settings))
        env = {**os.environ, "GYRE_NATS_URL": settings.nats_url or "", "GYRE_RUN_ID": settings.run_id,
               "GYRE_RUN_DIR": str(settings.run_dir), "GYRE_DATABASE_URL": settings.sqlalchemy_url}
        children = [_spawn(name, env, log_dir) for name in SERVICES]
        return _watch(settings, children, console, check=check, duration=duration, stopping=lambda: stopping)
    except KeyboardInterrupt:
        return 0
    finally:
        for c in children:
            if c.proc.poll() is None:
                c.proc.terminate()
        for c in children:
            try:
                c.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                c.proc.kill()
        if nats is not None:
            nats.stop()


def _watch(settings: GyreSettings, children: list[Child], console: Console, *, check: bool, duration: float,
           stopping: Any) -> int:
    start = time.monotonic()
    with httpx.Client() as client, Live(console=console, refresh_per_second=4, transient=False) as live:
        while not stopping():
            _poll(children, client)
            live.update(_table(settings, settings.nats_url or "", children))
            healthy = all(c.state == "ok" for c in children)
            exited = [c for c in children if c.proc.poll() is not None]
            if exited:
                live.update(_table(settings, settings.nats_url or "", children))
                for c in exited:
                    log = settings.run_dir / "logs" / f"{c.name}.log"
                    tail = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else []
                    console.print(f"[red]{c.name} exited ({c.proc.returncode}); last lines of {log}:[/]")
                    console.print("\n".join(tail), markup=False, highlight=False)
                return 1
            if check and healthy:
                return 0
            elapsed = time.monotonic() - start
            if check and elapsed > 60:
                console.print("[red]services not healthy within 60 s[/]")
                return 1
            if duration and elapsed >= duration:
                return 0
            time.sleep(0.5)
    return 0
