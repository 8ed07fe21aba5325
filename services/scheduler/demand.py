"""What the live scheduler knows of demand and training work, from the log (pure).

Fed with events from the rollouts, trees and training streams; read as the fields of a
``core.Tick`` (the proxy adds the calls in flight per cell).
"""

from __future__ import annotations

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

    def apply(self, ev: Event) -> None:
        if isinstance(ev, RolloutStarted):
            self.running_rollouts.add(ev.rollout_id)
            if ev.purpose == "train":
                self.step_groups.setdefault(ev.step, set()).add(ev.group_id)
        elif isinstance(ev, (RolloutFinished, RolloutTimedOut)):
            self.running_rollouts.discard(ev.rollout_id)
        elif isinstance(ev, MicroStepQueued):
            self.queued[ev.micro_step] = ev.step
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

    @property
    def backlog(self) -> int:
        """Micro-steps queued and neither claimed nor done (claimable now)."""
        return sum(1 for m, step in self.queued.items()
                   if m not in self.claimed and m not in self.done and step not in self.applied_steps)

    @property
    def update_pending(self) -> bool:
        """A step's whole batch is trained: every group started for it is queued in full
        (its ``GroupQueued`` read, which follows its micro-steps) and all are done.
        With ``groups_per_step`` known, that many groups must have started first (the runner
        may start a step's groups over time); without it, steps whose rollouts were never
        seen (a log cut short) count what was queued."""
        steps = {s for s in self.queued.values() if s not in self.applied_steps}
        return any(self._all_groups_in(step) and all(m in self.done for m, s in self.queued.items() if s == step)
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
