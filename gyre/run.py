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
import fnmatch
import logging
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libs.common.blobs import ObjectStoreBlobStore
from libs.common.bus.jetstream import JetStreamBus
from libs.common.runtime import connect_tool_bus
from libs.common.events import Context, HeldoutEvaluated, RolloutScored, RolloutScoringFailed, StepApplied, decode
from gyre.metrics import RunMetrics
from libs.common.runconfig import RunConfig

log = logging.getLogger(__name__)


class RunFailed(RuntimeError):
    """The run cannot go on (a step whose rollouts the runner failed on); its message is one
    line, also in ``Progress.errors`` (so in the summary's "errors")."""


def _failed_line(what: str, exc: Any) -> str:
    """One line for a ``StepFailed``: which rollouts (of which groups) failed, and why."""
    parts = []
    for err in exc.errors:
        where = "; ".join(getattr(err, "__notes__", ())) or "a rollout"
        cause = " ".join(str(err).split())
        parts.append(f"{where} ({type(err).__name__}{': ' + cause if cause else ''})")
    total = len(exc.errors) + len(exc.outcomes)
    return (f"{what}: {len(exc.errors)} of {total} rollouts failed in the runner: {', '.join(parts)}; "
            "the run stops here")


async def _run_rollouts(what: str, runner: Any, progress: "Progress", *args: Any, **kw: Any) -> list[Any]:
    """``runner.run_step``, with a step the runner failed on turned into ``RunFailed``."""
    from services.runner.runner import StepFailed

    try:
        return await runner.run_step(*args, **kw)
    except StepFailed as exc:
        line = _failed_line(what, exc)
        progress.errors.append(line)
        progress.running = 0
        progress.status = f"failed: {line}"
        log.error("%s", line)
        raise RunFailed(line) from exc


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
    evals: dict[str, dict[str, Any]] = field(default_factory=dict)  # "before"/"after" -> held-out result

    def row(self) -> str:
        if "eval" in self.evals:  # gyre eval: one greedy pass, no steps
            e = self.evals["eval"]
            return (f"eval: {e.get('scored', 0)}/{e.get('tasks', 0)} scored · pass rate {e.get('success', 0.0)} · "
                    f"mean score {e.get('mean_score', 0.0)} · {self.status}")
        last = f"{self.rewards[-1]:.3f}" if self.rewards else "-"
        return (f"step {self.step + 1}/{self.steps} · rollouts running {self.running}, finished {self.finished}, "
                f"timed out {self.timed_out}, scored {self.scored} · last reward {last} · "
                f"weights v{self.weight_version} · {self.status}")


async def _scores(bus: JetStreamBus, run_id: str, rollouts: set[str], timeout_s: float,
                  partial: dict[str, bool] | None = None, tests: dict[str, float] | None = None) -> dict[str, float]:
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
                if tests is not None:  # the hidden tests' share alone (a judge or scorer plugins may blend in)
                    tests[ev.rollout_id] = ev.components.get("tests", ev.score)
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


def select_tasks(cfg: RunConfig, split: str | None) -> list[Any]:
    """The run's tasks of a split (``None``: all), narrowed by ``tasks.include`` globs."""
    from services.runner.tasks import load_tasks

    tasks = load_tasks(Path(cfg.tasks.dir) if cfg.tasks.dir else None, split=split)
    if cfg.tasks.include:
        tasks = [t for t in tasks if any(fnmatch.fnmatchcase(t.task_id, pat) for pat in cfg.tasks.include)]
    return tasks


@dataclass
class ResumePoint:
    """Where a run with this id stopped, from its log: the steps applied (contiguous from
    0), the weights they left, the rewards they had, the held-out results recorded."""

    first_step: int = 0
    weight_version: int = 0
    rewards: list[float] = field(default_factory=list)
    evals: dict[str, dict[str, Any]] = field(default_factory=dict)
    started_steps: set[int] = field(default_factory=set)  # steps with rollouts in the log
    attempt: int = 0  # how many times the run was started before
    queued_groups: dict[int, set[str]] = field(default_factory=dict)  # step -> groups settled (GroupQueued)

    def settled_tasks(self, step: int) -> set[str]:
        """The tasks of ``step`` whose group (of any attempt) the log shows settled: their
        micro-steps are queued, so a re-run of the step leaves them out (the trainer counts
        a step's groups; a task run twice would be trained twice and push another out)."""
        prefix = f"s{step}-"
        out = set()
        for group in self.queued_groups.get(step, set()):
            base = re.sub(r"^re\d+-", "", group)
            if base.startswith(prefix):
                out.add(base[len(prefix):])
        return out


async def resume_point(bus: Any, run_id: str) -> ResumePoint:
    from gyre.report import collect

    facts = await collect(bus, run_id)
    applied = {s["step"]: s for s in facts.steps_applied}
    point = ResumePoint(started_steps=set(facts.step_of.values()), attempt=max(facts.run_starts - 1, 0))
    from libs.common.events import GroupQueued

    async for d in bus.read(Context.TREES, filter_subject=f"gyre.{run_id}.trees.{GroupQueued.TYPE}.>"):
        if isinstance(d.event, GroupQueued):
            point.queued_groups.setdefault(d.event.step, set()).add(d.event.group_id)
    while point.first_step in applied:
        point.first_step += 1
    point.evals = {phase: dict(result) for phase, result in facts.evals.items() if phase == "before"}
    if point.first_step:
        point.weight_version = int(applied[point.first_step - 1]["weight_version"])
        by_step = facts.rewards_by_step()
        point.rewards = [sum(by_step.get(k, [])) / max(len(by_step.get(k, [])), 1) for k in range(point.first_step)]
    return point


def eval_result(outcomes: list[Any], rewards: dict[str, float], weight_version: int) -> dict[str, Any]:
    """Greedy success on a split from each rollout's hidden-test share (``rewards``):
    ``success`` is the share of tasks whose hidden tests all pass; ``mean_score`` the mean
    share of hidden tests passed."""
    scores = [rewards.get(o.rollout_id, 0.0) for o in outcomes]
    n = max(len(scores), 1)
    return {"tasks": len(scores), "scored": sum(1 for o in outcomes if o.rollout_id in rewards),
            "success": round(sum(1 for x in scores if x >= 1.0) / n, 4), "mean_score": round(sum(scores) / n, 4),
            "weight_version": weight_version,
            "per_task": {o.task_id: round(rewards.get(o.rollout_id, 0.0), 4) for o in outcomes}}


async def _evaluate(phase: str, step: int, runner: Any, bus: JetStreamBus, cfg: RunConfig, tasks: list[Any],
                    harness: Any, progress: Progress, score_timeout_s: float) -> dict[str, Any]:
    """One greedy rollout per held-out task, marked ``purpose="eval"`` (never trained on)."""
    progress.status = f"eval {phase}: {len(tasks)} held-out tasks"
    progress.running += len(tasks)
    outcomes = await _run_rollouts(f"eval {phase}", runner, progress, step, tasks, 1,
                                   weight_version=progress.weight_version, harness=harness, purpose="eval",
                                   group_prefix=f"eval-{phase}-")
    progress.running -= len(outcomes)
    tests: dict[str, float] = {}
    await _scores(bus, cfg.run.id, {o.rollout_id for o in outcomes}, score_timeout_s, tests=tests)
    result = eval_result(outcomes, tests, progress.weight_version)
    if result["scored"] < result["tasks"]:
        progress.errors.append(f"eval {phase}: {result['tasks'] - result['scored']} of {result['tasks']} rollouts "
                               "not scored (counted as 0)")
    progress.evals[phase] = result
    split = "heldout" if phase in ("before", "after") else cfg.tasks.split
    await bus.publish(HeldoutEvaluated(run_id=cfg.run.id, phase=phase, split=split, weight_version=progress.weight_version,
                                       tasks=result["tasks"], success=result["success"],
                                       mean_score=result["mean_score"], per_task=result["per_task"]))
    return result


async def _weights_published(bus: JetStreamBus, run_id: str, version: int, timeout_s: float) -> bool:
    """Wait until the trainer has pushed ``version`` to the inference cells (it publishes
    ``WeightsPublished`` after the push), so what runs next is generated by it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        raw = await bus.last_on_subject(Context.TRAINING, f"gyre.{run_id}.training.WeightsPublished")
        if raw is not None and decode(raw.data).weight_version >= version:
            return True
        await asyncio.sleep(0.25)
    return False


async def run_steps(cfg: RunConfig, nats_url: str, proxy_url: str, progress: Progress, *,
                    trainer_running: bool, score_timeout_s: float = 900.0, eval_only: bool = False,
                    publish_timeout_s: float = 120.0, blob_bucket: str = "gyre-blobs") -> Progress:
    from services.runner.harness import PRESETS, gyre_agent
    from services.runner.main import create_runner, runner_config

    bus = await connect_tool_bus(nats_url, name="gyre-run")
    try:
        blobs = await ObjectStoreBlobStore.open(bus.js, blob_bucket)  # the services' GYRE_BLOB_BUCKET
        runner = create_runner(runner_config(cfg.run.id, {
            "proxy_url": proxy_url, "harness": cfg.harness.name, "model": cfg.model.policy_name,
            "max_parallel": cfg.harness.max_parallel, "max_turns": cfg.harness.max_turns,
            "time_limit_scale": cfg.harness.time_limit_scale,
            "work_root": str((cfg.run_dir / "workspaces").resolve()),
            **({"tasks_dir": str(cfg.tasks.dir)} if cfg.tasks.dir else {}),
        }), bus=bus, blobs=blobs)
        if cfg.harness.name not in PRESETS:
            raise ValueError(f"unknown harness {cfg.harness.name!r}")
        harness = greedy = PRESETS[cfg.harness.name]
        if cfg.harness.name in ("gyre_agent", "gyre_agent_anthropic"):
            # the run config's sampling reaches the reference harness (and its API, unless the preset names one)
            api = "anthropic" if cfg.harness.name == "gyre_agent_anthropic" else cfg.harness.api
            top_p = () if cfg.sampling.top_p == 1.0 else ("--top-p", str(cfg.sampling.top_p))
            harness = gyre_agent(api, "--temperature", str(cfg.sampling.temperature),
                                 "--max-tokens", str(cfg.sampling.max_tokens), *top_p)
            greedy = gyre_agent(api, "--temperature", "0", "--max-tokens", str(cfg.sampling.max_tokens))
        split = None if cfg.tasks.split == "all" else cfg.tasks.split
        tasks = select_tasks(cfg, split)
        if not tasks:
            raise ValueError(f"no tasks of split {cfg.tasks.split!r} found"
                             + (f" matching {cfg.tasks.include}" if cfg.tasks.include else ""))
        heldout = select_tasks(cfg, "heldout") if cfg.eval.heldout else []
        if cfg.eval.heldout and not heldout:
            raise ValueError("eval.heldout is set but the task set has no held-out tasks")
        overlap = sorted({t.task_id for t in tasks} & {t.task_id for t in heldout})
        if overlap and not eval_only:
            raise ValueError(f"eval.heldout measures tasks that RL would train on ({', '.join(overlap[:5])}): "
                             "use tasks.split=train")
        rng = random.Random(cfg.run.seed)
        progress.steps = cfg.run.steps
        if eval_only:  # gyre eval: every task of the split once, greedy, never trained on
            progress.steps = 1
            await _evaluate("eval", 0, runner, bus, cfg, tasks, greedy, progress, score_timeout_s)
            progress.last_tasks = list(progress.evals["eval"]["per_task"])
            progress.status = "done"
            return progress
        metrics = RunMetrics.for_run(cfg)
        resume = await resume_point(bus, cfg.run.id)
        progress.evals.update(resume.evals)
        if resume.first_step:
            progress.weight_version = resume.weight_version
            progress.rewards = list(resume.rewards)
            progress.status = f"resuming after step {resume.first_step - 1} (weights v{resume.weight_version})"
        if heldout and "before" not in progress.evals:
            if resume.first_step:  # turned on after RL began: there is no "before RL" to measure any more
                progress.errors.append("eval.heldout: no 'before' result recorded before step 0; not measured")
            else:
                await _evaluate("before", 0, runner, bus, cfg, heldout, greedy, progress, score_timeout_s)
        for step in range(cfg.run.steps):
            chosen = rng.sample(tasks, min(cfg.tasks.per_step, len(tasks)))  # drawn for every step: same tasks on resume
            if step < resume.first_step:
                continue
            progress.step, progress.status = step, "rollouts"
            progress.last_tasks = [t.task_id for t in chosen]
            progress.running += len(chosen) * cfg.group_size
            # a step begun before a restart runs again under new group ids (its old groups may
            # never complete), except the tasks whose groups were settled already
            prefix = f"re{resume.attempt}-" if step in resume.started_steps else ""
            settled = resume.settled_tasks(step) if prefix else set()
            todo = [t for t in chosen if t.task_id not in settled]
            if settled:
                log.info("step %d: %d of its groups were settled before the restart; re-running the other %d tasks",
                         step, len(chosen) - len(todo), len(todo))
            outcomes = await _run_rollouts(f"step {step}", runner, progress, step, todo, cfg.group_size,
                                           weight_version=progress.weight_version, harness=harness,
                                           group_prefix=prefix)
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
                    # the next rollouts (and the "after" evaluation) start on the new weights
                    progress.status = f"publishing weights v{applied.weight_version}"
                    if not await _weights_published(bus, cfg.run.id, applied.weight_version, publish_timeout_s):
                        progress.errors.append(f"step {step}: weights v{applied.weight_version} not published "
                                               f"within {publish_timeout_s:.0f}s")
            metrics.step(step, list(rewards.values()), list(partial.values()),
                         sum(1 for o in outcomes if o.status == "timed_out"), len(outcomes),
                         applied.loss if applied is not None else None)
        if heldout:
            await _evaluate("after", cfg.run.steps, runner, bus, cfg, heldout, greedy, progress, score_timeout_s)
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
        "heldout_success_before": progress.evals.get("before", {}).get("success"),
        "heldout_success_after": progress.evals.get("after", {}).get("success"),
        "heldout_score_before": progress.evals.get("before", {}).get("mean_score"),
        "heldout_score_after": progress.evals.get("after", {}).get("mean_score"),
        "role_switches": role_switches, "agent_errors": agent_errors, "replay_identical": None,
        "wall_s": round(time.monotonic() - progress.started, 1), "errors": progress.errors,
    }


def eval_summary(progress: Progress, split: str) -> dict[str, Any]:
    """Greedy success on a split: one rollout per task, temperature 0 (``gyre eval``)."""
    result = progress.evals.get("eval", {})
    return {"split": split, "tasks": result.get("tasks", 0), "scored": result.get("scored", 0),
            "mean_score": result.get("mean_score", 0.0), "pass_rate": result.get("success", 0.0),
            "per_task": result.get("per_task", {}), "errors": progress.errors}
