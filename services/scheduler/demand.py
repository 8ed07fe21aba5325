"""What the live scheduler knows of demand and training work, from the log (pure).

Fed with events from the rollouts, trees and training streams; read as the fields of a
``core.Tick`` (the proxy adds the calls in flight per cell).

A ``gyre run`` restarted mid-step leaves rollouts with a ``RolloutStarted`` and no end (its
in-process runner died with it) and re-runs the step's unsettled tasks under new group ids
(``re<N>-`` before the old id: ``gyre/run.py``). Two signals of the log let them go:

- a group re-run supersedes the group it re-runs (same id without the ``re<N>-`` prefix,
  or an older prefix) unless that one was queued already: it leaves the step's groups (the
  step waits for the re-run, not for it), its rollouts still running are orphans and leave
  the water level, and its micro-steps, if any were queued, are not waited on;
- a rollout still running :data:`ORPHAN_GRACE_S` past its time limit (``time_limit_s``,
  from its start) has no runner any more (the runner ends each at its limit and writes its
  end then): ``expire(now)`` drops it from the water level.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from libs.common.events import (
    Event, GroupQueued, MicroStepClaimed, MicroStepDone, MicroStepQueued, RolloutFinished, RolloutStarted, RolloutTimedOut,
    StepApplied,
)


@dataclass
class Demand:
    running_rollouts: set[str] = field(default_factory=set)
    queued: dict[str, int] = field(default_factory=dict)  # micro-step -> step
    claimed: dict[str, str] = field(default_factory=dict)  # micro-step -> cell
    done: dict[str, int] = field(default_factory=dict)  # micro-step -> step
    applied_steps: set[int] = field(default_factory=set)
    step_groups: dict[int, set[str]] = field(default_factory=dict)  # step -> its training groups started
    queued_groups: set[str] = field(default_factory=set)  # groups with micro-steps queued
    groups_per_step: int | None = None  # when known: a step has this many training groups
    superseded: set[str] = field(default_factory=set)  # groups a re-run replaced before they were queued
    _running_group: dict[str, str] = field(default_factory=dict)  # running rollout -> its group
    _overdue_at: dict[str, float] = field(default_factory=dict)  # running rollout -> when it surely has no runner
    _micro_group: dict[str, str] = field(default_factory=dict)  # queued micro-step -> its group

    def apply(self, ev: Event) -> None:
        if isinstance(ev, RolloutStarted):
            if ev.group_id in self.superseded:
                return  # a late start of a group re-run already
            self.running_rollouts.add(ev.rollout_id)
            self._running_group[ev.rollout_id] = ev.group_id
            if ev.time_limit_s is not None:
                self._overdue_at[ev.rollout_id] = ev.time.timestamp() + ev.time_limit_s + ORPHAN_GRACE_S
            if ev.purpose == "train":
                self._supersede(ev.step, ev.group_id)
                self.step_groups.setdefault(ev.step, set()).add(ev.group_id)
        elif isinstance(ev, (RolloutFinished, RolloutTimedOut)):
            self._stop(ev.rollout_id)
        elif isinstance(ev, MicroStepQueued):
            self.queued[ev.micro_step] = ev.step
            self._micro_group[ev.micro_step] = ev.group_id
            if ev.group_micro_steps is None:  # a log from before GroupQueued: count it at once
                self.queued_groups.add(ev.group_id)
        elif isinstance(ev, GroupQueued):  # after all of the group's micro-steps in the stream
            self.queued_groups.add(ev.group_id)
        elif isinstance(ev, MicroStepClaimed):
            self.claimed[ev.micro_step] = ev.cell
        elif isinstance(ev, MicroStepDone):
            self.claimed.pop(ev.micro_step, None)
            self.done[ev.micro_step] = ev.step
        elif isinstance(ev, StepApplied):
            self.applied_steps.add(ev.step)

    def _stop(self, rollout: str) -> None:
        self.running_rollouts.discard(rollout)
        self._running_group.pop(rollout, None)
        self._overdue_at.pop(rollout, None)

    def _supersede(self, step: int, group: str) -> None:
        """``group`` re-runs (``re<N>-<base>``) the step's unqueued groups of the same base
        from earlier attempts: they will never be queued, and their running rollouts are
        orphans of a runner that stopped."""
        base, attempt = _attempt(group)
        if attempt == 0:
            return
        old = {g for g in self.step_groups.get(step, set())
               if g != group and g not in self.queued_groups and _attempt(g)[0] == base and _attempt(g)[1] < attempt}
        if not old:
            return
        self.superseded |= old
        self.step_groups[step] -= old
        for rollout in [r for r, g in self._running_group.items() if g in old]:
            self._stop(rollout)

    def expire(self, now: float) -> list[str]:
        """Drops the rollouts still running :data:`ORPHAN_GRACE_S` past their time limit
        at ``now`` (seconds since the epoch); returns them."""
        gone = [r for r, at in self._overdue_at.items() if at <= now]
        for rollout in gone:
            self._stop(rollout)
        return gone

    def _counted(self, micro_step: str) -> bool:
        return self._micro_group.get(micro_step) not in self.superseded

    @property
    def backlog(self) -> int:
        """Micro-steps queued and neither claimed nor done (claimable now)."""
        return sum(1 for m, step in self.queued.items()
                   if m not in self.claimed and m not in self.done and step not in self.applied_steps
                   and self._counted(m))

    @property
    def update_pending(self) -> bool:
        """A step's whole batch is trained: every group started for it is queued in full
        (its ``GroupQueued`` read, which follows its micro-steps) and all are done.
        With ``groups_per_step`` known, that many groups must have started first (the runner
        may start a step's groups over time); without it, steps whose rollouts were never
        seen (a log cut short) count what was queued."""
        steps = {s for s in self.queued.values() if s not in self.applied_steps}
        return any(self._all_groups_in(step)
                   and all(m in self.done for m, s in self.queued.items() if s == step and self._counted(m))
                   for step in steps)

    @property
    def batch_ready(self) -> bool:
        """A step's whole batch is collected and its update is not applied yet (what the
        ``colocate`` policy waits for before every cell trains): every group started for it
        is queued in full, ``groups_per_step`` of them when known (else a log cut short
        counts what was queued)."""
        steps = set(self.queued.values()) | {s for s, groups in self.step_groups.items() if groups & self.queued_groups}
        return any(self._all_groups_in(step) for step in steps - self.applied_steps)

    def _all_groups_in(self, step: int) -> bool:
        groups = self.step_groups.get(step, set())
        started = self.groups_per_step is None or len(groups) >= self.groups_per_step
        return started and groups <= self.queued_groups

    @property
    def busy_trainers(self) -> frozenset[str]:
        return frozenset(self.claimed.values())


ORPHAN_GRACE_S = 900.0  # past a rollout's time limit: its runner would have ended it (kill, snapshot, event) by then
_RERUN = re.compile(r"^re(\d+)-")


def _attempt(group: str) -> tuple[str, int]:
    """``re<N>-<base>`` -> (base, N); any other group id -> (itself, 0)."""
    m = _RERUN.match(group)
    return (group[m.end():], int(m.group(1))) if m else (group, 0)
