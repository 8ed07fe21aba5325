"""Wiring for ``gyre serve cell``: the agent of one cell, beside its engine.

Environment: ``GYRE_CELL_NAME`` (required), ``GYRE_CELL_ENGINE_URL`` (the inference engine
this cell hosts: an embedded engine or an SGLang server), ``GYRE_PROXY_URL`` (the proxy's
admin endpoints), ``GYRE_CELL_CORE=1`` for the core cell, ``GYRE_CELL_CAPACITY``
(concurrent calls, default 8), ``GYRE_MODEL`` (policy weights the training seat loads;
default ``tiny-qwen``), ``GYRE_ADMIN_TOKEN``.
"""

from __future__ import annotations

import os
from pathlib import Path

from libs.common.service import ServiceContext, ServiceSpec

from .adapters import EngineControl, LatestWeights, ProxyControl, WeightsSeat
from .agent import CellAgent


def _require(name: str) -> str:
    value = os.environ.get(name, "").strip()
    if not value:
        raise ValueError(f"{name} is not set (see `gyre serve cell` in docs)")
    return value


async def cell_main(ctx: ServiceContext) -> None:
    from services.engine.client import EngineClient
    from services.engine.model_store import resolve_model

    settings = ctx.runtime.settings
    name = _require("GYRE_CELL_NAME")
    engine_url = _require("GYRE_CELL_ENGINE_URL")
    proxy = ProxyControl(_require("GYRE_PROXY_URL"), settings.admin_token)
    engine = EngineControl(EngineClient(engine_url, admin_token=settings.admin_token, timeout=600))
    folder = Path(resolve_model(os.environ.get("GYRE_MODEL", "tiny-qwen")).folder)
    agent = CellAgent(name=name, run_id=settings.run_id, bus=ctx.runtime.bus, proxy=proxy, engine=engine,
                      seat=WeightsSeat(folder), engine_url=engine_url,
                      capacity=int(os.environ.get("GYRE_CELL_CAPACITY", "8")),
                      is_core=os.environ.get("GYRE_CELL_CORE") == "1",
                      latest_weights=LatestWeights(ctx.runtime.bus, ctx.runtime.blobs, settings.run_id))
    await agent.register()
    sub = await agent.serve_commands(ctx.runtime.bus.nc)
    ctx.health.ok(cell=name, role=agent.role, core=agent.is_core)
    agent.on_role = lambda role: ctx.health.detail.update(role=role)  # gyre up shows it live
    try:
        await agent.keep_registered(ctx.stop)
    finally:
        await sub.unsubscribe()
        await proxy.aclose()


SPEC = ServiceSpec("cell", cell_main, summary="cell agent: carries out the scheduler's role switches for one cell")
