"""Wiring: settings + bus + blob store -> a running evaluator. No logic lives here.

``evaluator_main`` is the ``gyre serve evaluator`` entry (the service host opens NATS and
the blob store, serves /health and /metrics, and stops it on SIGTERM); ``build_evaluator``
is for tests and tools that bring their own bus and store.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import httpx

from libs.common.bus.port import BlobStore, EventBus

from .adapters.catalog import DirectoryTaskCatalog, TaskCatalog
from .adapters.judge_client import JudgeClient, JudgeConfig
from .adapters.plugin_scorers import load_scorers
from .adapters.sandbox import Sandbox, SandboxConfig
from .service import Evaluator
from .settings import EvaluatorSettings, JudgeSettings

if TYPE_CHECKING:
    from libs.common.service import ServiceContext


def build_evaluator(
    settings: EvaluatorSettings,
    *,
    bus: EventBus,
    store: BlobStore,
    catalog: TaskCatalog | None = None,
    http: httpx.AsyncClient | None = None,
) -> Evaluator:
    sandbox = Sandbox(SandboxConfig(isolation=settings.isolation, uid_base=settings.uid_base, slots=settings.workers))
    judge = JudgeClient(judge_config(settings.judge), http) if settings.judge else None
    return Evaluator(settings, bus, store, catalog or DirectoryTaskCatalog(settings.tasks_dir), sandbox, judge,
                     scorers=load_scorers(settings.scorers))


def judge_config(s: JudgeSettings) -> JudgeConfig:
    return JudgeConfig(
        base_url=s.base_url, model=s.model, api_key=s.api_key.get_secret_value() if s.api_key else None,
        timeout_s=s.timeout_s, attempts=s.attempts, backoff_s=s.backoff_s, max_tokens=s.max_tokens,
    )


def settings_for(ctx: ServiceContext) -> EvaluatorSettings:
    """``GYRE_EVALUATOR_*`` variables, then ``gyre serve`` options; the run is the stack's."""
    options = {k: v for k, v in ctx.options.items() if k in EvaluatorSettings.model_fields}
    options.setdefault("run_id", ctx.runtime.settings.run_id)
    return EvaluatorSettings(**options)


async def evaluator_main(ctx: ServiceContext, *, catalog: TaskCatalog | None = None) -> None:
    from prometheus_client import Gauge

    settings = settings_for(ctx)
    evaluator = build_evaluator(settings, bus=ctx.runtime.bus, store=ctx.runtime.blobs, catalog=catalog)
    outcomes = Gauge("gyre_evaluator_outcomes", "rollouts scored or failed by this evaluator", ["outcome"],
                     registry=ctx.registry)
    task = asyncio.create_task(evaluator.run(ctx.stop))
    try:
        while not task.done():
            if evaluator.sandbox.mode is not None:
                ctx.health.ok(isolation=evaluator.sandbox.description, workers=settings.workers,
                              judge=bool(evaluator.judge), scorers=",".join(evaluator.scorers) or "-",
                              **evaluator.counts)
            for name, n in evaluator.counts.items():
                outcomes.labels(name).set(n)
            await asyncio.wait({task}, timeout=0.5)
        task.result()
    finally:
        if evaluator.judge:
            await evaluator.judge.aclose()
