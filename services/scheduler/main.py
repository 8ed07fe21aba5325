"""Wiring for ``gyre serve scheduler``: the live elastic scheduler.

Environment: ``GYRE_PROXY_URL`` (required: calls in flight per cell come from the proxy's
``/admin/cells``), ``GYRE_ADMIN_TOKEN``, ``GYRE_SCHEDULER_POLICY`` (``elastic`` default,
``colocate``, ``async``), ``GYRE_SCHEDULER_TICK_S`` (2), and the elastic policy's knobs
``GYRE_SCHEDULER_HOLD_S``, ``GYRE_SCHEDULER_MIN_DWELL_S``, ``GYRE_SCHEDULER_SMOOTHING_S``,
``GYRE_SCHEDULER_LOW_WATERMARK``, ``GYRE_SCHEDULER_HIGH_WATERMARK``,
``GYRE_SCHEDULER_MAX_SWITCHES_IN_FLIGHT``, ``GYRE_SCHEDULER_MIN_INFERENCE_CELLS`` (1, at least 1);
``async``: ``GYRE_SCHEDULER_TRAINING_CELLS`` (1).
``GYRE_SCHEDULER_GROUPS_PER_STEP`` (else ``GYRE_TRAINER_GROUPS_PER_STEP``): a step's groups,
so the core is not pulled in for an update (nor, under ``colocate``, every cell for the
batch) before all of them have started. ``GYRE_SCHEDULER_MAX_RESENDS`` (2): re-sends of a
switch's command a hung cell agent may leave unanswered (each after the 300 s request
timeout and as long again of silence) before the scheduler declares the switch failed on
the cell's behalf (``live.py``). ``GYRE_SCHEDULER_UPDATE_NEEDS_TRAINING`` (0): 1 only for a
core trainer that applies a step's update only while its cell trains (the elastic policy's
first rule then pulls the core into training for it); Gyre's trainer applies it in any role.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import httpx

from libs.common.service import ServiceContext, ServiceSpec

from .core import AsyncPolicy, ColocatePolicy, ElasticPolicy
from .live import MAX_RESENDS, SWITCH_TIMEOUT_S, LiveScheduler


def policy_from_env() -> Any:
    name = os.environ.get("GYRE_SCHEDULER_POLICY", "elastic")
    if name == "elastic":
        knobs: dict[str, Any] = {
            k: float(os.environ[f"GYRE_SCHEDULER_{k.upper()}"])
            for k in ("hold_s", "min_dwell_s", "smoothing_s", "low_watermark", "high_watermark")
            if os.environ.get(f"GYRE_SCHEDULER_{k.upper()}")}
        for k in ("max_switches_in_flight", "min_inference_cells"):
            if os.environ.get(f"GYRE_SCHEDULER_{k.upper()}"):
                knobs[k] = int(os.environ[f"GYRE_SCHEDULER_{k.upper()}"])
        return ElasticPolicy(**knobs)
    if name == "colocate":
        return ColocatePolicy()
    if name == "async":
        return AsyncPolicy(training_cells=int(os.environ.get("GYRE_SCHEDULER_TRAINING_CELLS") or 1))
    raise ValueError(f"GYRE_SCHEDULER_POLICY: expected elastic, colocate or async, got {name!r}")


def max_resends_from_env() -> int:
    raw = (os.environ.get("GYRE_SCHEDULER_MAX_RESENDS") or "").strip()
    if not raw:
        return MAX_RESENDS
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"GYRE_SCHEDULER_MAX_RESENDS: expected a whole number >= 0, got {raw!r}")
    return value


async def scheduler_main(ctx: ServiceContext) -> None:
    from services.cell.agent import request_switch

    settings = ctx.runtime.settings
    max_resends = max_resends_from_env()
    proxy_url = os.environ.get("GYRE_PROXY_URL", "").strip()
    if not proxy_url:
        raise ValueError("GYRE_PROXY_URL is not set: the scheduler reads calls in flight from the proxy")
    headers = {"Authorization": f"Bearer {settings.admin_token}"} if settings.admin_token else {}
    http = httpx.AsyncClient(base_url=proxy_url, headers=headers, timeout=10)

    async def proxy_stats() -> dict[str, Any]:
        r = await http.get("/admin/cells")
        r.raise_for_status()
        return r.json()

    async def send_switch(cell: str, to_role: str, causation: str) -> dict[str, Any]:
        return await request_switch(ctx.runtime.bus.nc, settings.run_id, cell, to_role, causation_id=causation,
                                    timeout_s=SWITCH_TIMEOUT_S)

    stale = settings.run_dir / SCHEDULE_FILE
    if stale.exists():  # an earlier scheduler's: never compared with this one's log
        stale.unlink()
    groups = (os.environ.get("GYRE_SCHEDULER_GROUPS_PER_STEP") or os.environ.get("GYRE_TRAINER_GROUPS_PER_STEP")
              or "").strip()
    live = LiveScheduler(run_id=settings.run_id, bus=ctx.runtime.bus, policy=policy_from_env(),
                         proxy_stats=proxy_stats, send_switch=send_switch,
                         tick_s=float(os.environ.get("GYRE_SCHEDULER_TICK_S", "2")),
                         groups_per_step=int(groups) if groups else None, max_resends=max_resends,
                         update_needs_training=os.environ.get("GYRE_SCHEDULER_UPDATE_NEEDS_TRAINING", "0").strip()
                         in ("1", "true", "yes", "on"))
    ctx.health.ok(policy=live.policy.name)

    async def show() -> None:  # water level and roles for gyre up's live view
        while not ctx.stop.is_set():
            await asyncio.sleep(1)
            roles = live.state.roles_count()
            ctx.health.detail.update(level=round(live.state.level, 2), pressure=live.state.pressure.value,
                                     **{f"cells_{k}": v for k, v in roles.items()})

    shower = asyncio.create_task(show())
    try:
        await live.run(ctx.stop)
    finally:
        shower.cancel()
        await http.aclose()
        if live.final is not None:  # what `gyre replay --cells` compares its rebuild with
            write_schedule(settings.run_dir, live.final)


SCHEDULE_FILE = "scheduler/schedule.json"


def write_schedule(run_dir: Any, final: dict[str, Any]) -> None:
    import json
    from pathlib import Path

    path = Path(run_dir) / SCHEDULE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(final, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


SPEC = ServiceSpec("scheduler", scheduler_main,
                   summary="elastic scheduler: switches cells between inference and training by water level")
