"""Wiring for ``gyre serve cell``: the agent of one cell, beside its engine.

Environment: ``GYRE_CELL_NAME`` (required), ``GYRE_CELL_ENGINE_URL`` (the inference engine
this cell hosts: an embedded engine or an SGLang server), ``GYRE_PROXY_URL`` (the proxy's
admin endpoints), ``GYRE_CELL_CORE=1`` for the core cell, ``GYRE_CELL_CAPACITY``
(concurrent calls, default 8), ``GYRE_MODEL`` (policy weights the training seat loads;
default ``tiny-qwen``), ``GYRE_ADMIN_TOKEN``, ``GYRE_CELL_SEAT`` (what the cell hosts while
it trains: ``satellite``, a trainer replica that claims micro-steps and sends gradients
to the core, the default for every cell but the core; ``weights``, which only loads the
policy weights, the default for the core cell, whose optimizer lives in the trainer
service; ``trainer``, the core cell when the trainer service follows its role: join and
leave are requests to that trainer; ``none``, nothing). A satellite takes the trainer's
``GYRE_TRAINER_*`` options (backend, objective, ``GYRE_TRAINER_TRANSFER``) so it computes
exactly what the core's own worker would; it
prefetches each newly published version's weights into host memory while the cell serves
(``GYRE_CELL_PREFETCH_WEIGHTS=0`` turns that off: joining then reads them from the blob
store).
"""

from __future__ import annotations

import os
from pathlib import Path

from libs.common.service import ServiceContext, ServiceSpec

from .adapters import EngineControl, LatestWeights, NoSeat, ProxyControl, TrainerSeat, WeightsSeat
from .agent import CellAgent


def _require(name: str) -> str:
    value = os.environ.get(name, "").strip()
    if not value:
        raise ValueError(f"{name} is not set (see `gyre serve cell` in docs)")
    return value


def training_seat(kind: str, *, name: str, run_id: str, bus, blobs, environ=os.environ):
    """The seat a cell hosts while it trains (``GYRE_CELL_SEAT``)."""
    from services.engine.model_store import resolve_model

    if kind == "weights":
        return WeightsSeat(Path(resolve_model(environ.get("GYRE_MODEL", "tiny-qwen")).folder))
    if kind == "none":
        return NoSeat()
    if kind == "trainer":
        return TrainerSeat(bus, run_id, name)
    if kind == "satellite":
        from services.trainer.main import env_options, satellite_seat

        seat = satellite_seat(run_id, name, env_options({}, environ), bus=bus, blobs=blobs)
        seat.prefetch = environ.get("GYRE_CELL_PREFETCH_WEIGHTS", "1").strip() not in ("0", "false", "no", "off")
        return seat
    raise ValueError(f"GYRE_CELL_SEAT={kind!r}: expected 'satellite', 'weights', 'trainer' or 'none'")


async def cell_main(ctx: ServiceContext) -> None:
    from services.engine.client import EngineClient

    settings = ctx.runtime.settings
    name = _require("GYRE_CELL_NAME")
    engine_url = _require("GYRE_CELL_ENGINE_URL")
    proxy = ProxyControl(_require("GYRE_PROXY_URL"), settings.admin_token)
    engine = EngineControl(EngineClient(engine_url, admin_token=settings.admin_token, timeout=600))
    is_core = os.environ.get("GYRE_CELL_CORE") == "1"
    seat = training_seat(os.environ.get("GYRE_CELL_SEAT", "").strip() or ("weights" if is_core else "satellite"),
                         name=name, run_id=settings.run_id, bus=ctx.runtime.bus, blobs=ctx.runtime.blobs)
    agent = CellAgent(name=name, run_id=settings.run_id, bus=ctx.runtime.bus, proxy=proxy, engine=engine,
                      seat=seat, engine_url=engine_url,
                      capacity=int(os.environ.get("GYRE_CELL_CAPACITY", "8")),
                      is_core=is_core,
                      latest_weights=LatestWeights(ctx.runtime.bus, ctx.runtime.blobs, settings.run_id))
    await agent.register()
    sub = await agent.serve_commands(ctx.runtime.bus.nc)
    ctx.health.ok(cell=name, role=agent.role, core=agent.is_core, seat=type(seat).__name__)
    agent.on_role = lambda role: ctx.health.detail.update(role=role)  # gyre up shows it live
    try:
        await agent.keep_registered(ctx.stop)
    finally:
        await sub.unsubscribe()
        if hasattr(seat, "close"):  # a satellite stops after its micro-step in hand, and its prefetching
            await seat.close()
        elif agent.role == "training":
            await seat.leave()
        await proxy.aclose()


SPEC = ServiceSpec("cell", cell_main, summary="cell agent: carries out the scheduler's role switches for one cell")
