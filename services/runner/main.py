"""Wiring for ``gyre serve runner``: settings and live handles in, the runner serving.

The lead registers ``SPEC`` in ``gyre/services.py``. In-process callers (``gyre up``) use
``create_runner(...)`` and ``await runner.run_step(step, tasks, group_size)``. The served
form takes the same call over HTTP on the service's own port::

    POST /run_step {"step": 3, "task_ids": ["slugify", ...], "group_size": 4, "weight_version": 2}
    -> {"outcomes": [{"rollout_id": ..., "status": "finished" | "timed_out", ...}, ...]}

Options: ``proxy_url`` (required), ``work_root``, ``tasks_dir``, ``harness`` (a preset of
``harness.PRESETS``), ``model``, ``max_parallel``, ``max_turns`` (the turn budget of a task
that names none; default 40, ``gyre up`` gives ``harness.max_turns``, 8),
``time_limit_scale`` (multiplies each task's time limit; a number > 0, default 1),
``keep_workspaces`` (keep each rollout's workspace after its snapshot; default off).
``gyre up`` passes them in process from the run config. ``gyre serve runner`` has no
command-line options for them: it reads environment variables, ``GYRE_PROXY_URL``,
``GYRE_TASKS_DIR``, ``GYRE_RUNNER_HARNESS``, ``GYRE_RUNNER_WORK_ROOT``,
``GYRE_RUNNER_MAX_PARALLEL`` and ``GYRE_POLICY_MODEL`` (``gyre/services.py``,
``RUNNER_ENV``), and ``GYRE_RUNNER_MAX_TURNS``, ``GYRE_RUNNER_TIME_LIMIT_SCALE`` and
``GYRE_RUNNER_KEEP_WORKSPACES`` (``ENV`` below). A malformed value stops the service at
start with an error that names its variable.

While the bus refuses a rollout's event (the runner keeps trying: ``runner.py``,
``RolloutRunner._publish``) ``/health`` says ``degraded`` with ``waiting_for_bus``, and
``/metrics`` has ``gyre_runner_rollouts_waiting_for_bus`` and
``gyre_runner_publish_failures_total``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from fastapi import HTTPException
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import BaseModel, Field

from libs.common.bus.port import BlobStore, EventBus
from libs.common.options import number_option
from libs.common.service import ServiceContext, ServiceSpec

from .harness import PRESETS
from .runner import RolloutRunner, RunnerConfig
from .tasks import Task, default_tasks_dir, load_tasks


# The options ``gyre serve runner`` reads from the environment here (the others come from
# ``gyre/services.py``'s ``RUNNER_ENV``): option -> variable.
ENV = {"max_turns": "GYRE_RUNNER_MAX_TURNS", "time_limit_scale": "GYRE_RUNNER_TIME_LIMIT_SCALE",
       "keep_workspaces": "GYRE_RUNNER_KEEP_WORKSPACES", "max_parallel": "GYRE_RUNNER_MAX_PARALLEL"}

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def env_options(options: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """``options`` plus each variable of ``ENV`` that is set and not given already."""
    extra = {o: environ[v] for o, v in ENV.items() if environ.get(v) and o not in options}
    return {**options, **extra}


def _name(option: str) -> str:
    return f"{option} ({ENV[option]})" if option in ENV else option


def _max_turns(options: dict[str, Any]) -> int:
    return number_option(options, "max_turns", default=40, integer=True, minimum=1,
                         label=f"runner: {_name('max_turns')}", must_be="an integer >= 1")


def _max_parallel(options: dict[str, Any]) -> int:
    return number_option(options, "max_parallel", default=4, integer=True, minimum=1,
                         label=f"runner: {_name('max_parallel')}", must_be="an integer >= 1")


def _time_limit_scale(options: dict[str, Any]) -> float:
    return number_option(options, "time_limit_scale", default=1.0, above=0,
                         label=f"runner: {_name('time_limit_scale')}", must_be="a finite number > 0")


def _keep_workspaces(options: dict[str, Any]) -> bool:
    value = options.get("keep_workspaces")
    if value is None or isinstance(value, bool):
        return bool(value)
    word = str(value).strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise ValueError(f"runner: {_name('keep_workspaces')} must be 1/true/yes/on or 0/false/no/off, not {value!r}")


def runner_config(run_id: str, options: dict[str, Any]) -> RunnerConfig:
    if not options.get("proxy_url"):
        raise ValueError("runner: option proxy_url is required (the proxy's root URL)")
    harness = str(options.get("harness") or "gyre_agent")
    if harness not in PRESETS:
        raise ValueError(f"runner: unknown harness {harness!r}; presets: {', '.join(PRESETS)}")
    work_root = Path(options.get("work_root") or tempfile.mkdtemp(prefix="gyre-rollouts-"))
    return RunnerConfig(
        run_id=run_id, proxy_url=str(options["proxy_url"]), work_root=work_root, harness=PRESETS[harness],
        model=str(options.get("model") or "policy"), max_parallel=_max_parallel(options),
        max_turns=_max_turns(options), time_limit_scale=_time_limit_scale(options),
        keep_workspaces=_keep_workspaces(options))


def create_runner(config: RunnerConfig, *, bus: EventBus, blobs: BlobStore) -> RolloutRunner:
    config.work_root.mkdir(parents=True, exist_ok=True)
    return RolloutRunner(config, bus=bus, blobs=blobs)


class RunnerCollector(Collector):
    """The runner's figures, read at scrape time."""

    def __init__(self, runner: RolloutRunner) -> None:
        self.runner = runner

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        waiting = GaugeMetricFamily("gyre_runner_rollouts_waiting_for_bus",
                                    "rollouts whose RolloutStarted or ended event the bus refuses now (tried again)")
        waiting.add_metric([], len(self.runner.waiting_for_bus))
        failures = CounterMetricFamily("gyre_runner_publish_failures", "publishes of rollout events the bus refused")
        failures.add_metric([], self.runner.publish_failures)
        yield from (waiting, failures)


def show_health(ctx: ServiceContext, runner: RolloutRunner) -> None:
    """``degraded`` while the bus refuses a rollout's event, ``ok`` otherwise."""
    waiting = len(runner.waiting_for_bus)
    ctx.health.detail["waiting_for_bus"] = waiting
    ctx.health.status = "degraded" if waiting else "ok"


class RunStepRequest(BaseModel):
    step: int = Field(ge=0)
    task_ids: list[str] = Field(min_length=1)
    group_size: int = Field(ge=1)
    weight_version: int = Field(default=0, ge=0)


async def runner_main(ctx: ServiceContext) -> None:
    options = env_options(ctx.options, os.environ)
    config = runner_config(ctx.runtime.settings.run_id, options)
    runner = create_runner(config, bus=ctx.runtime.bus, blobs=ctx.runtime.blobs)
    tasks = {t.task_id: t for t in load_tasks(Path(options.get("tasks_dir") or default_tasks_dir()))}

    @ctx.app.post("/run_step")
    async def run_step(body: RunStepRequest) -> dict[str, Any]:
        chosen: list[Task] = []
        for task_id in body.task_ids:
            if task_id not in tasks:
                raise HTTPException(404, f"unknown task {task_id!r}")
            chosen.append(tasks[task_id])
        outcomes = await runner.run_step(body.step, chosen, body.group_size, weight_version=body.weight_version)
        return {"outcomes": [dataclasses.asdict(o) for o in outcomes]}

    ctx.registry.register(RunnerCollector(runner))
    ctx.health.ok(run_id=config.run_id, harness=config.harness.name, tasks=len(tasks))
    while not ctx.stop.is_set():
        show_health(ctx, runner)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(ctx.stop.wait(), 1.0)


SPEC = ServiceSpec("runner", runner_main,
                   summary="runs agent harnesses on tasks, one workspace and proxy URL per rollout, snapshots them")
