"""Wiring for ``gyre serve runner``: settings and live handles in, the runner serving.

The lead registers ``SPEC`` in ``gyre/services.py``. In-process callers (``gyre up``) use
``create_runner(...)`` and ``await runner.run_step(step, tasks, group_size)``. The served
form takes the same call over HTTP on the service's own port::

    POST /run_step {"step": 3, "task_ids": ["slugify", ...], "group_size": 4, "weight_version": 2}
    -> {"outcomes": [{"rollout_id": ..., "status": "finished" | "timed_out", ...}, ...]}

Options (run config or command line): ``proxy_url`` (required), ``work_root``,
``tasks_dir``, ``harness`` (a preset of ``harness.PRESETS``), ``model``, ``max_parallel``,
``max_turns``, ``time_limit_scale``, ``keep_workspaces``.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

from fastapi import HTTPException
from pydantic import BaseModel, Field

from libs.common.bus.port import BlobStore, EventBus
from libs.common.service import ServiceContext, ServiceSpec

from .harness import PRESETS
from .runner import RolloutRunner, RunnerConfig
from .tasks import Task, default_tasks_dir, load_tasks


def runner_config(run_id: str, options: dict[str, Any]) -> RunnerConfig:
    if not options.get("proxy_url"):
        raise ValueError("runner: option proxy_url is required (the proxy's root URL)")
    harness = str(options.get("harness") or "gyre_agent")
    if harness not in PRESETS:
        raise ValueError(f"runner: unknown harness {harness!r}; presets: {', '.join(PRESETS)}")
    work_root = Path(options.get("work_root") or tempfile.mkdtemp(prefix="gyre-rollouts-"))
    return RunnerConfig(
        run_id=run_id, proxy_url=str(options["proxy_url"]), work_root=work_root, harness=PRESETS[harness],
        model=str(options.get("model") or "policy"), max_parallel=int(options.get("max_parallel") or 4),
        max_turns=int(options.get("max_turns") or 40),
        time_limit_scale=float(options.get("time_limit_scale") or 1.0),
        keep_workspaces=str(options.get("keep_workspaces", "")).lower() in ("1", "true", "yes"))


def create_runner(config: RunnerConfig, *, bus: EventBus, blobs: BlobStore) -> RolloutRunner:
    config.work_root.mkdir(parents=True, exist_ok=True)
    return RolloutRunner(config, bus=bus, blobs=blobs)


class RunStepRequest(BaseModel):
    step: int = Field(ge=0)
    task_ids: list[str] = Field(min_length=1)
    group_size: int = Field(ge=1)
    weight_version: int = Field(default=0, ge=0)


async def runner_main(ctx: ServiceContext) -> None:
    config = runner_config(ctx.runtime.settings.run_id, ctx.options)
    runner = create_runner(config, bus=ctx.runtime.bus, blobs=ctx.runtime.blobs)
    tasks = {t.task_id: t for t in load_tasks(Path(ctx.options.get("tasks_dir") or default_tasks_dir()))}

    @ctx.app.post("/run_step")
    async def run_step(body: RunStepRequest) -> dict[str, Any]:
        chosen: list[Task] = []
        for task_id in body.task_ids:
            if task_id not in tasks:
                raise HTTPException(404, f"unknown task {task_id!r}")
            chosen.append(tasks[task_id])
        outcomes = await runner.run_step(body.step, chosen, body.group_size, weight_version=body.weight_version)
        return {"outcomes": [dataclasses.asdict(o) for o in outcomes]}

    ctx.health.ok(run_id=config.run_id, harness=config.harness.name, tasks=len(tasks))
    await ctx.stop.wait()


SPEC = ServiceSpec("runner", runner_main,
                   summary="runs agent harnesses on tasks, one workspace and proxy URL per rollout, snapshots them")
