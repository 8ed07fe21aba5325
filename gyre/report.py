"""The run report, rebuilt from the event log alone: ``runs/<run>/report.html`` + PNGs.

Plots: reward per step (mean and spread), cell roles over time under the water level,
tree statistics (stored vs selected tokens per rollout), fork types, and the score
distribution of finished vs timed-out (partially scored) rollouts.

An event stored twice (a publisher's retry after a lost ack, past the bus's duplicate
window: same event id) counts once: ``RunFacts.add`` ignores an event id it has seen.
"""

from __future__ import annotations

import html
import json
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libs.common.events import (
    CallRecorded, Context, Event, ForkDetected, RolloutFinished, RolloutScored, RolloutScoringFailed, RolloutStarted, RolloutTimedOut,
    CellRegistered, HeldoutEvaluated, MicroStepDone, MicroStepQueued, RunStarted, SamplesSelected, StepApplied,
    WarmStartCompleted, SwitchCompleted, SwitchFailed, TreeSealed, WaterLevelSampled,
)


@dataclass
class RunFacts:
    run_id: str
    step_of: dict[str, int] = field(default_factory=dict)
    scores: dict[str, tuple[float, bool]] = field(default_factory=dict)  # rollout -> (score, partial)
    scoring_failed: set[str] = field(default_factory=set)  # rollouts with a RolloutScoringFailed
    ended: dict[str, str] = field(default_factory=dict)  # rollout -> finished | timed_out
    exit_status: dict[str, int | None] = field(default_factory=dict)
    water: list[tuple[float, float, float]] = field(default_factory=list)  # (t, level, capacity)
    roles: list[tuple[float, str, str]] = field(default_factory=list)  # (t, cell, role)
    switches: int = 0
    switch_failures: int = 0
    forks: Counter = field(default_factory=Counter)
    stored_tokens: dict[str, int] = field(default_factory=dict)
    selected_tokens: dict[str, int] = field(default_factory=dict)
    flattened_tokens: Counter = field(default_factory=Counter)  # rollout -> sum of every call's input + output
    calls: int = 0
    undelivered: int = 0
    drift: Counter = field(default_factory=Counter)
    eval_rollouts: set[str] = field(default_factory=set)  # purpose "eval": not part of any step's reward
    evals: dict[str, dict[str, Any]] = field(default_factory=dict)  # phase -> HeldoutEvaluated fields
    warm_start: dict[str, Any] | None = None
    run_starts: int = 0  # RunStarted events: more than one when the run was resumed
    steps_applied: list[dict[str, Any]] = field(default_factory=list)
    micro_steps_by_cell: Counter = field(default_factory=Counter)  # MicroStepDone per cell (core and satellites)
    sample_tokens: dict[str, int] = field(default_factory=dict)  # packed sample digest -> its tokens
    # MicroStepQueued by (step, micro_step): (laid-out tokens, samples)
    queued: dict[tuple[int, str], tuple[int, list[str]]] = field(default_factory=dict)
    t0: float | None = None
    seen: set[str] = field(default_factory=set, repr=False)  # event ids added: a second stored copy is skipped

    def add(self, ev: Event) -> None:
        if ev.event_id in self.seen:
            return  # a second stored copy of an event already counted
        self.seen.add(ev.event_id)
        t = ev.time.timestamp()
        self.t0 = t if self.t0 is None else min(self.t0, t)
        if isinstance(ev, RolloutStarted):
            if ev.purpose == "eval":
                self.eval_rollouts.add(ev.rollout_id)
            else:
                self.step_of[ev.rollout_id] = ev.step
        elif isinstance(ev, RunStarted):
            self.run_starts += 1
        elif isinstance(ev, HeldoutEvaluated):
            self.evals[ev.phase] = {"success": ev.success, "mean_score": ev.mean_score, "tasks": ev.tasks,
                                    "weight_version": ev.weight_version}
        elif isinstance(ev, WarmStartCompleted):
            self.warm_start = {"tasks": len(ev.tasks), "demos": ev.demos, "steps": ev.steps,
                               "loss_first": ev.loss_first, "loss_last": ev.loss_last, "seconds": ev.seconds,
                               "reused": ev.reused, "flaw_rate": ev.flaw_rate}
        elif isinstance(ev, (RolloutFinished, RolloutTimedOut)):
            self.ended[ev.rollout_id] = "finished" if isinstance(ev, RolloutFinished) else "timed_out"
            self.exit_status[ev.rollout_id] = ev.exit_status
        elif isinstance(ev, RolloutScored):
            self.scores[ev.rollout_id] = (ev.score, ev.partial)
        elif isinstance(ev, RolloutScoringFailed):
            self.scoring_failed.add(ev.rollout_id)
        elif isinstance(ev, WaterLevelSampled):
            self.water.append((t, ev.level, float(ev.inference_capacity)))
        elif isinstance(ev, CellRegistered):
            self.roles.append((t, ev.cell, str(ev.role)))  # where each cell starts
        elif isinstance(ev, SwitchCompleted):
            self.switches += 1
            self.roles.append((t, ev.cell, str(ev.role)))
        elif isinstance(ev, SwitchFailed):
            self.switch_failures += 1
        elif isinstance(ev, ForkDetected):
            self.forks[ev.fork_type] += 1
        elif isinstance(ev, TreeSealed):
            self.stored_tokens[ev.rollout_id] = ev.n_tokens
        elif isinstance(ev, SamplesSelected):
            self.selected_tokens[ev.rollout_id] = sum(s.n_tokens for s in ev.samples)
            self.sample_tokens.update((s.digest, s.n_tokens) for s in ev.samples)
        elif isinstance(ev, MicroStepQueued):
            self.queued.setdefault((ev.step, ev.micro_step), (ev.n_tokens, list(ev.sample_digests)))
        elif isinstance(ev, CallRecorded):
            self.flattened_tokens[ev.rollout_id] += ev.prefix_len + ev.n_new_input_tokens + ev.n_output_tokens
            self.calls += 1
            self.undelivered += not ev.delivered
            self.drift[ev.drift.value] += 1
        elif isinstance(ev, MicroStepDone):
            self.micro_steps_by_cell[ev.cell] += 1
        elif isinstance(ev, StepApplied):
            self.steps_applied.append({"step": ev.step, "weight_version": ev.weight_version, **ev.loss})

    def rewards_by_step(self) -> dict[int, list[float]]:
        """Each step's rollout rewards as the step loop counted them: a rollout whose scoring
        failed (and was not scored after all) counts 0."""
        out: dict[int, list[float]] = defaultdict(list)
        for rollout, (score, _) in self.scores.items():
            if rollout in self.step_of:
                out[self.step_of[rollout]].append(score)
        for rollout in self.scoring_failed - self.scores.keys():
            if rollout in self.step_of:
                out[self.step_of[rollout]].append(0.0)
        return dict(sorted(out.items()))


async def collect(bus: Any, run_id: str) -> RunFacts:
    facts = RunFacts(run_id)
    for context in Context:
        async for d in bus.read(context, filter_subject=f"gyre.{run_id}.{context.value}.>"):
            facts.add(d.event)
    return facts


def _plots(facts: RunFacts, out: Path) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made: list[tuple[str, str]] = []

    def save(fig: Any, name: str, title: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=90)
        plt.close(fig)
        made.append((name, title))

    by_step = facts.rewards_by_step()
    if by_step:
        fig, ax = plt.subplots(figsize=(6, 3))
        steps = list(by_step)
        means = [statistics.fmean(v) for v in by_step.values()]
        spread = [statistics.pstdev(v) if len(v) > 1 else 0.0 for v in by_step.values()]
        ax.errorbar(steps, means, yerr=spread, marker="o", capsize=3)
        ax.set(xlabel="step", ylabel="reward", ylim=(-0.05, 1.05))
        save(fig, "reward.png", "Reward per step (mean ± spread)")
    if facts.water or facts.roles:
        fig, ax = plt.subplots(figsize=(7, 3))
        t0 = facts.t0 or 0.0
        if facts.water:
            ax.plot([w[0] - t0 for w in facts.water], [w[1] for w in facts.water], label="water level")
            ax.plot([w[0] - t0 for w in facts.water], [w[2] for w in facts.water], "--", label="inference capacity")
        ax2 = ax.twinx()
        cells = sorted({c for _, c, _ in facts.roles})
        for i, cell in enumerate(cells):
            pts = [(t - t0, 1 if role == "training" else 0) for t, c, role in facts.roles if c == cell]
            end = max([w[0] for w in facts.water] + [r[0] for r in facts.roles]) - t0
            pts.append((end, pts[-1][1]))  # the last role holds to the end of the record
            ax2.step([p[0] for p in pts], [i * 1.2 + p[1] for p in pts], where="post", color=f"C{i + 2}",
                     label=f"{cell} ({i * 1.2:g}: inference, {i * 1.2 + 1:g}: training)")
        ax.set(xlabel="seconds", ylabel="calls")
        if facts.water:
            ax.legend(loc="upper left", fontsize=7)
        if cells:
            ax2.legend(loc="upper right", fontsize=7)
        save(fig, "cells.png", "Cell roles over time, under the water level")
    if facts.stored_tokens:
        fig, (ax, ax_forks) = plt.subplots(1, 2, figsize=(8, 3), gridspec_kw={"width_ratios": [3, 2]})
        ids = list(facts.stored_tokens)
        flat = sum(facts.flattened_tokens.get(r, 0) for r in ids)
        stored = sum(facts.stored_tokens.values())
        selected = sum(facts.selected_tokens.get(r, 0) for r in ids)
        laid_out = sum(n for n, _ in facts.queued.values())
        ax.bar(range(4), [flat, stored, selected, laid_out], color=["C0", "C1", "C2", "C4"])
        ax.set_xticks(range(4), ["flattened\n(every call's in + out)", "stored\n(trees)", "selected\nbranches",
                                 "trained\n(micro-steps)"], fontsize=7)
        ax.set(ylabel="tokens", title=f"{len(ids)} trees; flattened / stored = {flat / max(stored, 1):.2f}")
        kinds = sorted(facts.forks)
        if kinds:
            ax_forks.bar(range(len(kinds)), [facts.forks[k] for k in kinds], color="C3")
            ax_forks.set_xticks(range(len(kinds)), kinds, rotation=30, fontsize=7)
        else:
            ax_forks.text(0.5, 0.5, "no forks", ha="center", va="center", transform=ax_forks.transAxes)
            ax_forks.set_xticks([])
        ax_forks.set(ylabel="forks", title="fork types")
        save(fig, "trees.png", "Tree statistics: flattened vs stored tokens, fork types")
    if facts.scores:
        fig, ax = plt.subplots(figsize=(6, 3))
        full = [s for s, partial in facts.scores.values() if not partial]
        part = [s for s, partial in facts.scores.values() if partial]
        ax.hist([full, part], bins=10, range=(0, 1), label=["finished", "timed out (partial)"], stacked=True)
        ax.set(xlabel="score", ylabel="rollouts")
        ax.legend(fontsize=7)
        save(fig, "scores.png", "Score distribution: finished vs partially scored")
    return made


def figures(facts: RunFacts) -> dict[str, Any]:
    by_step = facts.rewards_by_step()
    train_scores = [v for r, v in facts.scores.items() if r not in facts.eval_rollouts]
    means = [statistics.fmean(v) for v in by_step.values()]
    return {
        "run": facts.run_id, "steps_with_rewards": len(means), "reward_per_step": [round(m, 4) for m in means],
        "rollouts": len(facts.step_of),  # training rollouts; eval ones are counted apart (eval_rollouts)
        "finished": sum(1 for r, s in facts.ended.items() if s == "finished" and r not in facts.eval_rollouts),
        "timed_out": sum(1 for r, s in facts.ended.items() if s == "timed_out" and r not in facts.eval_rollouts),
        "scored": len(train_scores),
        "scoring_failed": len({r for r in facts.scoring_failed - facts.scores.keys() if r not in facts.eval_rollouts}),
        "partial_share": round(sum(1 for _, p in train_scores if p) / max(len(train_scores), 1), 4),
        "harness_failures": sum(1 for s in facts.exit_status.values() if s not in (0, None)),  # eval ones too
        "calls": facts.calls, "undelivered_calls": facts.undelivered, "drift": dict(facts.drift),
        "role_switches": facts.switches, "switch_failures": facts.switch_failures, "forks": dict(facts.forks),
        "flattened_tokens": sum(facts.flattened_tokens[r] for r in facts.stored_tokens),
        "stored_tokens": sum(facts.stored_tokens.values()), "selected_tokens": sum(facts.selected_tokens.values()),
        # what the trainer lays out (a micro-step's shared prompt once) against its samples' own tokens
        "micro_step_tokens": sum(n for n, _ in facts.queued.values()),
        "micro_step_sample_tokens": sum(facts.sample_tokens.get(d, 0) for _, ds in facts.queued.values() for d in ds),
        "steps_applied": facts.steps_applied, "micro_steps_by_cell": dict(sorted(facts.micro_steps_by_cell.items())),
        "warm_start": facts.warm_start,
        "heldout": facts.evals, "eval_rollouts": len(facts.eval_rollouts),
    }


def write_report(facts: RunFacts, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    plots = _plots(facts, out)
    fig = figures(facts)
    (out / "report.json").write_text(json.dumps(fig, indent=2))
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(json.dumps(v))}</td></tr>" for k, v in fig.items())
    imgs = "".join(f"<h2>{html.escape(t)}</h2><img src='{n}' alt='{html.escape(t)}'>" for n, t in plots)
    page = (f"<!doctype html><meta charset='utf-8'><title>Gyre run {html.escape(facts.run_id)}</title>"
            "<style>body{font-family:sans-serif;max-width:900px;margin:2em auto}th{text-align:left;padding-right:1em}"
            "</style>"
            f"<h1>Gyre run {html.escape(facts.run_id)}</h1><p>Rebuilt from the event log.</p>"
            f"<table>{rows}</table>{imgs}")
    path = out / "report.html"
    path.write_text(page)
    return path
