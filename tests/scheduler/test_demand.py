"""What the live scheduler reads of demand from the log (``services/scheduler/demand.py``)."""

from __future__ import annotations

from libs.common.events import GroupQueued, MicroStepDone, MicroStepQueued, RolloutStarted, StepApplied
from services.scheduler.demand import Demand

RUN = "d"
D = "ab" * 32


def _started(rollout: str, group: str, step: int, purpose: str = "train") -> RolloutStarted:
    return RolloutStarted(run_id=RUN, rollout_id=rollout, task_id="t", group_id=group, harness="h",
                          weight_version=0, api_key_digest=D, step=step, purpose=purpose)


def _queued(name: str, group: str, step: int, of: int | None = None) -> MicroStepQueued:
    return MicroStepQueued(run_id=RUN, step=step, micro_step=name, group_id=group, sample_digests=[D],
                           advantages=[0.5], n_tokens=10, group_micro_steps=of)


def _done(name: str, step: int) -> MicroStepDone:
    return MicroStepDone(run_id=RUN, step=step, micro_step=name, cell="c0", n_tokens=10, weight_version=0, loss=0.1)


def test_the_update_waits_for_every_group_of_the_step() -> None:
    d = Demand()
    for ev in (_started("a1", "ga", 0), _started("b1", "gb", 0), _started("e1", "ge", 0, purpose="eval"),
               _started("n1", "gn", 1)):
        d.apply(ev)
    d.apply(_queued("ga-m0", "ga", 0))
    d.apply(_done("ga-m0", 0))
    assert d.backlog == 0 and not d.update_pending  # group gb of step 0 is still being generated
    d.apply(_queued("gb-m0", "gb", 0, of=2))
    d.apply(_done("gb-m0", 0))
    assert d.backlog == 0 and not d.update_pending  # gb's second micro-step is not read yet
    d.apply(_queued("gb-m1", "gb", 0, of=2))
    d.apply(GroupQueued(run_id=RUN, step=0, group_id="gb", micro_steps=2))
    assert d.backlog == 1 and not d.update_pending
    d.apply(_done("gb-m1", 0))
    assert d.update_pending  # the eval group never trains; step 1's group is not step 0's
    d.apply(StepApplied(run_id=RUN, step=0, weight_version=1))
    assert not d.update_pending


def test_a_log_without_the_starts_counts_what_was_queued() -> None:
    d = Demand()
    d.apply(_queued("g-m0", "g", 3))
    d.apply(_done("g-m0", 3))
    assert d.update_pending


def test_with_the_step_size_known_the_update_waits_for_groups_not_started_yet() -> None:
    d = Demand(groups_per_step=2)
    d.apply(_started("a1", "ga", 0))  # gb has not started: the runner runs a few at a time
    d.apply(_queued("ga-m0", "ga", 0, of=1))
    d.apply(GroupQueued(run_id=RUN, step=0, group_id="ga", micro_steps=1))
    d.apply(_done("ga-m0", 0))
    assert not d.update_pending
    d.apply(_started("b1", "gb", 0))
    d.apply(GroupQueued(run_id=RUN, step=0, group_id="gb", micro_steps=0))  # nothing to train in gb
    assert d.update_pending


def test_the_batch_is_ready_once_every_group_of_the_step_is_queued() -> None:
    """What ``colocate`` waits for live: the step's whole batch queued, until its update."""
    d = Demand(groups_per_step=2)
    d.apply(_started("a1", "ga", 0))
    d.apply(_queued("ga-m0", "ga", 0, of=1))
    d.apply(GroupQueued(run_id=RUN, step=0, group_id="ga", micro_steps=1))
    assert not d.batch_ready  # gb has not started
    d.apply(_started("b1", "gb", 0))
    d.apply(_queued("gb-m0", "gb", 0, of=1))
    assert not d.batch_ready  # gb's GroupQueued is not read yet
    d.apply(GroupQueued(run_id=RUN, step=0, group_id="gb", micro_steps=1))
    assert d.batch_ready
    d.apply(_done("ga-m0", 0))
    d.apply(_done("gb-m0", 0))
    assert d.batch_ready and d.update_pending  # trained, not applied: every cell still trains
    d.apply(StepApplied(run_id=RUN, step=0, weight_version=1))
    assert not d.batch_ready
