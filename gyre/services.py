"""The services ``gyre serve`` can run, by name. Each entry wires one service's adapters.

Only services that exist are listed: a name is added here when its issue lands.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from libs.common.db.projection import ProjectionRunner
from libs.common.db.readmodels import readmodels
from libs.common.service import ServiceContext, ServiceSpec


async def projector_main(ctx: ServiceContext) -> None:
    """Keep the SQL read models up to date with the log (``readmodels`` projection)."""
    from prometheus_client import Gauge

    assert ctx.runtime.engine is not None
    batch = int(ctx.options.get("batch", 500))
    runner = ProjectionRunner(ctx.runtime.engine, ctx.runtime.bus, readmodels, batch_max=batch)
    applied = Gauge("gyre_projection_applied_total", "events applied by this projector", ["projection"],
                    registry=ctx.registry)
    dead = Gauge("gyre_projection_dead_lettered_total", "events dead-lettered", ["projection"], registry=ctx.registry)
    lag = Gauge("gyre_projection_lag", "events stored but not yet projected", ["projection", "stream"],
                registry=ctx.registry)
    ctx.health.ok(projection=readmodels.name, database=ctx.runtime.engine.url.render_as_string(hide_password=True))
    task = asyncio.create_task(runner.run(ctx.stop))
    ticks = 0
    while not task.done():
        applied.labels(readmodels.name).set(runner.applied)
        dead.labels(readmodels.name).set(runner.dead_lettered)
        ctx.health.detail.update(applied=runner.applied, dead_lettered=runner.dead_lettered)
        if ticks % 4 == 0:  # every 2 s: the stream heads against the committed offsets
            await _projection_lag(ctx, lag)
        ticks += 1
        await asyncio.wait({task}, timeout=0.5)
    task.result()


async def _projection_lag(ctx: ServiceContext, gauge) -> None:
    from libs.common.db.projection import offsets

    try:
        done = await asyncio.to_thread(offsets, ctx.runtime.engine, readmodels.name)
        for context in readmodels.contexts():
            head = await ctx.runtime.bus.last_seq(context)
            gauge.labels(readmodels.name, context.stream).set(max(head - done.get(context.stream, 0), 0))
    except Exception:  # a restarting server or database: the next tick tries again
        pass


async def proxy_main(ctx: ServiceContext) -> None:
    from services.proxy.main import proxy_main as run

    await run(ctx)


def _trajectory_spec() -> ServiceSpec:
    from services.trajectory.main import SPEC

    return SPEC


async def evaluator_main(ctx: ServiceContext) -> None:
    from services.evaluator.main import evaluator_main as run

    await run(ctx)


async def cell_main(ctx: ServiceContext) -> None:
    from services.cell.main import cell_main as run

    await run(ctx)


async def scheduler_main(ctx: ServiceContext) -> None:
    from services.scheduler.main import scheduler_main as run

    await run(ctx)


RUNNER_ENV = {"proxy_url": "GYRE_PROXY_URL", "tasks_dir": "GYRE_TASKS_DIR", "harness": "GYRE_RUNNER_HARNESS",
              "work_root": "GYRE_RUNNER_WORK_ROOT", "max_parallel": "GYRE_RUNNER_MAX_PARALLEL",
              "model": "GYRE_POLICY_MODEL"}  # model: the name the agents send, the proxy's policy name


def runner_env_options(options: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """The runner's options with those ``RUNNER_ENV`` names filled from the environment
    (an option given on the command line wins)."""
    extra = {o: environ[v] for o, v in RUNNER_ENV.items() if environ.get(v) and o not in options}
    return {**options, **extra}


async def runner_main(ctx: ServiceContext) -> None:
    import os

    from services.runner.main import runner_main as run

    ctx.options.update(runner_env_options(ctx.options, os.environ))
    await run(ctx)


async def trainer_main(ctx: ServiceContext) -> None:
    import os

    from services.trainer.main import env_options
    from services.trainer.main import trainer_main as run

    ctx.options.update(env_options(ctx.options, os.environ))
    await run(ctx)


SERVICES: dict[str, ServiceSpec] = {
    "projector": ServiceSpec("projector", projector_main, database=True,
                             summary="applies the event log to the SQL read models"),
    "proxy": ServiceSpec("proxy", proxy_main, summary="recording proxy: OpenAI/Anthropic APIs, token-exact (TITO)"),
    "trajectory": _trajectory_spec(),
    "evaluator": ServiceSpec("evaluator", evaluator_main,
                             summary="scores finished and timed-out rollouts from their artifacts, in sandboxes"),
    "cell": ServiceSpec("cell", cell_main, summary="cell agent: carries out the scheduler's role switches for one cell"),
    "trainer": ServiceSpec("trainer", trainer_main,
                           summary="trainer: tree-attention policy optimisation, core cell and satellites, weight publication"),
    "runner": ServiceSpec("runner", runner_main,
                          summary="starts agent harnesses for a step's tasks, enforces time limits, snapshots workspaces"),
    "scheduler": ServiceSpec("scheduler", scheduler_main,
                             summary="elastic scheduler: switches cells between inference and training by water level"),
}
