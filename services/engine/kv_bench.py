"""The engine half of ``gyre bench migrate``: two embedded engines in this process, each
with its own transfer agent and KV port routes, driven over in-process HTTP (ASGI).

``libs.common.transfer.bench.run_bench("migrate", cells="services.engine.kv_bench:bench_cells")``
"""

from __future__ import annotations

from contextlib import asynccontextmanager

import httpx

from libs.common.transfer.default import open_agent

from .kv_port import PortCellClient, attach
from .main import build
from .settings import EngineSettings


@asynccontextmanager
async def bench_cells(model: str = "tiny-qwen", backend: str | None = None):
    """Yields (source cell, target cell, facts) and closes both engines afterwards."""
    services, cells = [], []
    try:
        for name in ("A", "B"):
            service = build(EngineSettings(model=model, kv_cache_bytes=1 << 30, running_kv_bytes=2 << 30))
            services.append(service)
            port = attach(service, open_agent(prefer=backend))
            cells.append(PortCellClient(name, "http://engine", transport=httpx.ASGITransport(app=service.app)))
        engine = services[0].engine
        facts = {"backend": port.agent.backend, "max_positions": engine.max_context,
                 "vocab": engine.vocab_limit - 300}
        yield cells[0], cells[1], facts
    finally:
        for cell in cells:
            await cell.aclose()
        for service in services:
            service.close()
