"""The main job, as orchestration: run N RL steps on a started stack.

For each step: sample the step's tasks, let the runner run each ``group_size`` times
through the proxy (rollouts are recorded, scored, merged into trees and queued as
micro-steps by the services), wait until every rollout of the step is scored and, when a
trainer serves the run, until the step's update is applied (``StepApplied``); then the
next step runs on the new weight version. Progress goes into a shared dict that the live
view shows.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libs.common.blobs import ObjectStoreBlobStore
from libs.common.bus.jetstream import JetStreamBus
from libs.common.events import Context, RolloutScored, RolloutScoringFailed, StepApplied
from gyre.metrics import RunMetrics
from libs.common.runconfig import RunConfig


@dataclass
class Progress:
    step: int = -1
    steps: int = 0
    running: int = 0
    finished: int = 0
    timed_out: int = 0
    scored: int = 0
    rewards: list[float] = field(default_factory=list)  # mean reward per step
    weight_version: int = 0
    status: str = "starting"
    errors: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    last_tasks: list[str] = field(default_factory=list)
    last_scores: list[float] = field(default_factory=list)

    def row(self) -> str:
        last = f"{self.rewards[-1]:.3f}" if self.rewards else "-"
        return (f"step {self.step + 1}/{self.steps} · rollouts running {self.running}, finished {self.finished}, "
                f"timed out {self.timed_out}, scored {self.scored} · last reward {last} · "
                f"weights v{self.weight_version} · {self.status}")


async def _scores(bus: JetStreamBus, run_id: str, rollouts: set[str], timeout_s: float,
                  partial: dict[str, bool] | None = None) -> dict[str, float]:
    """Wait until every rollout is scored (or failed to score: reward 0); returns rewards."""
    got: dict[str, float] = {}
    partial = partial if partial is not None else {}
    deadline = time.monotonic() + timeout_s
    start = 1
    while set(got) < rollouts and time.monotonic() < deadline:
        async for d in bus.read(Context.SCORES, start_seq=start, filter_subject=f"gyre.{run_id}.scores.>"):
            start = d.seq + 1
            ev = d.event
            if isinstance(ev, RolloutScored) and ev.rollout_id in rollouts:
                got[ev.rollout_id] = ev.score
                partial[ev.rollout_id] = ev.partial
            elif isinstance(ev, RolloutScoringFailed) and ev.rollout_id in rollouts:
                got[ev.rollout_id] = 0.0
        await asyncio.sleep(0.5)
    return got


async def _step_applied(bus: JetStreamBus, run_id: str, step: int, timeout_s: float) -> StepApplied | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        async for d in bus.read(Context.TRAINING, filter_subject=f"gyre.{run_id}.training.StepApplied"):
            if isinstance(d.event, StepApplied) and d.event.step == step:
                return d.event
        await asyncio.sleep(0.5)
    return None


async def run_steps(cfg: RunConfig, nats_url: str, proxy_url: str, progress: Progress, *,
                    trainer_running: bool, score_timeout_s: float = 900.0) -> Progress:
    from services.runner.harness import PRESETS, gyre_agent
    from services.runner.main import create_runner, runner_config
    from services.runner.tasks import load_tasks

    bus = await JetStreamBus.connect(nats_url, name="gyre-run")
    try:
        blobs = await ObjectStoreBlobStore.open(bus.js)
        runner = create_runner(runner_config(cfg.run.id, {
            "proxy_url": proxy_url, "harness": cfg.harness.name, "model": cfg.model.policy_name,
            "max_parallel": cfg.harness.max_parallel, "max_turns": cfg.harness.max_turns,
            "time_limit_scale": cfg.harness.time_limit_scale,
            "work_root": str((cfg.run_dir / "workspaces").resolve()),
            **({"tasks_dir": str(cfg.tasks.dir)} if cfg.tasks.dir else {}),
        }), bus=bus, blobs=blobs)
        if cfg.harness.name not in PRESETS:
            raise ValueError(f"unknown harness {cfg.harness.name!r}")
        harness = PRESETS[cfg.harness.name]
        if cfg.harness.name == "gyre_agent":  # the run config's API and sampling reach the reference harness
            harness = gyre_agent(cfg.harness.api, "--temperature", str(cfg.sampling.temperature),
                                 "--max-tokens", str(cfg.sampling.max_tokens))
        split = None if cfg.tasks.split == "all" else cfg.tasks.split
        tasks = load_tasks(Path(cfg.tasks.dir) if cfg.tasks.dir else None, split=split)
        if not tasks:
            raise ValueError(f"no tasks of split {cfg.tasks.split!r} found")
        rng = random.Random(cfg.run.seed)
        progress.steps = cfg.run.steps
        metrics = RunMetrics(cfg.run_dir / "tensorboard", enabled=cfg.metrics.tensorboard)
        for step in range(cfg.run.steps):
            progress.step, progress.status = step, "rollouts"
            chosen = rng.sample(tasks, min(cfg.tasks.per_step, len(tasks)))
            progress.last_tasks = [t.task_id for t in chosen]
            progress.running += len(chosen) * cfg.group_size
            outcomes = await runner.run_step(step, chosen, cfg.group_size, weight_version=progress.weight_version,
                                             harness=harness)
            progress.running -= len(outcomes)
            progress.finished += sum(1 for o in outcomes if o.status == "finished")
            progress.timed_out += sum(1 for o in outcomes if o.status == "timed_out")
            progress.status = "scoring"
            partial: dict[str, bool] = {}
            rewards = await _scores(bus, cfg.run.id, {o.rollout_id for o in outcomes}, score_timeout_s, partial)
            progress.scored += len(rewards)
            progress.last_scores = list(rewards.values())
            progress.rewards.append(sum(rewards.values()) / max(len(rewards), 1))
            applied = None
            if trainer_running:
                progress.status = "training"
                applied = await _step_applied(bus, cfg.run.id, step, score_timeout_s)
                if applied is None:
                    progress.errors.append(f"step {step}: no StepApplied within {score_timeout_s:.0f}s")
                else:
                    progress.weight_version = applied.weight_version
            metrics.step(step, list(rewards.values()), list(partial.values()),
                         sum(1 for o in outcomes if o.status == "timed_out"), len(outcomes),
                         applied.loss if applied is not None else None)
        metrics.close()
        progress.status = "done"
        return progress
    finally:
        await bus.close()


def summary(progress: Progress, *, role_switches: int, agent_errors: int) -> dict[str, Any]:
    r = progress.rewards
    return {
        "steps": len(r),
        "reward_first3": round(sum(r[:3]) / max(len(r[:3]), 1), 4),
        "reward_last3": round(sum(r[-3:]) / max(len(r[-3:]), 1), 4),
        "heldout_success_before": None, "heldout_success_after": None,  # gyre eval: not built yet
        "role_switches": role_switches, "agent_errors": agent_errors, "replay_identical": None,
        "wall_s": round(time.monotonic() - progress.started, 1), "errors": progress.errors,
    }


def eval_summary(progress: Progress, split: str) -> dict[str, Any]:
    """Greedy success on a split: one rollout per task, temperature 0 (``gyre eval``)."""
    scores = progress.last_scores
    return {"split": split, "tasks": len(progress.last_tasks), "scored": len(scores),
            "mean_score": round(sum(scores) / max(len(scores), 1), 4),
            "pass_rate": round(sum(1 for s in scores if s >= 1.0) / max(len(scores), 1), 4),
            "errors": progress.errors}
