"""A `gyre run` restarted mid-step: its in-process runner died with some rollouts (a
``RolloutStarted`` and no end), and the step's unsettled tasks run again under ``re<N>-``
group ids. The scheduler's demand lets the orphans go (the reviewer's r3 case): the re-run
supersedes the old group, and a rollout past its time limit (and a grace) expires."""

from __future__ import annotations

from datetime import UTC, datetime

from libs.common.events import GroupQueued, MicroStepDone, MicroStepQueued, RolloutFinished, RolloutStarted
from services.scheduler.core import Tick
from services.scheduler.core.policy import water_level
from services.scheduler.demand import ORPHAN_GRACE_S, Demand

H = "0" * 64
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _started(d: Demand, rollout: str, group: str, *, limit_s: float | None = None, purpose: str = "train") -> None:
    d.apply(RolloutStarted(run_id="r", rollout_id=rollout, task_id="t", group_id=group, step=0, harness="h",
                           weight_version=0, api_key_digest=H, group_size=4, time_limit_s=limit_s, purpose=purpose,
                           time=T0))


def _finished(d: Demand, rollout: str) -> None:
    d.apply(RolloutFinished(run_id="r", rollout_id=rollout, wall_time_s=1.0))


def _queued_and_done(d: Demand, group: str, *, done: bool = True) -> None:
    d.apply(MicroStepQueued(run_id="r", step=0, micro_step=group + "-m0", group_id=group, sample_digests=["a" * 64],
                            advantages=[1.0], n_tokens=1, group_micro_steps=1))
    d.apply(GroupQueued(run_id="r", step=0, group_id=group, micro_steps=1, rollout_ids=[], samples=1))
    if done:
        d.apply(MicroStepDone(run_id="r", step=0, micro_step=group + "-m0", cell="c1", weight_version=0, n_tokens=1,
                              loss=0.0))


def test_a_re_run_supersedes_the_group_the_restart_left_behind() -> None:
    d = Demand(groups_per_step=2)
    for i in range(4):  # before the restart: task A's group settled, task B's running
        _started(d, f"s0-A-{i}", "s0-A")
        _finished(d, f"s0-A-{i}")
    _queued_and_done(d, "s0-A")
    for i in range(4):
        _started(d, f"s0-B-{i}", "s0-B")  # the runner dies with these
    assert not d.batch_ready and len(d.running_rollouts) == 4
    for i in range(4):  # after the restart: task B again, as re1-s0-B
        _started(d, f"re1-s0-B-{i}", "re1-s0-B")
    assert sorted(d.running_rollouts) == [f"re1-s0-B-{i}" for i in range(4)]  # the orphans are gone
    assert d.step_groups[0] == {"s0-A", "re1-s0-B"} and d.superseded == {"s0-B"}
    for i in range(4):
        _finished(d, f"re1-s0-B-{i}")
    _queued_and_done(d, "re1-s0-B")
    assert not d.running_rollouts
    assert water_level(Tick(at=0, rollouts_between_calls=len(d.running_rollouts)), 0.5) == 0.0
    assert d.update_pending and d.batch_ready


def test_micro_steps_of_a_superseded_group_are_not_waited_on() -> None:
    d = Demand(groups_per_step=2)
    _started(d, "s0-A-0", "s0-A")
    _queued_and_done(d, "s0-A")
    _started(d, "s0-B-0", "s0-B")
    _queued_and_done(d, "s0-B", done=False)  # queued (not its GroupQueued: below) before the restart
    d.queued_groups.discard("s0-B")
    _started(d, "re1-s0-B-0", "re1-s0-B")
    assert d.step_groups[0] == {"s0-A", "re1-s0-B"}  # the settled group stays
    _queued_and_done(d, "re1-s0-B")
    assert d.backlog == 0 and d.update_pending  # s0-B's micro-step is not waited on


def test_a_rollout_past_its_time_limit_expires() -> None:
    d = Demand()
    _started(d, "eval-before-s0-t-0", "eval-before-s0-t", limit_s=3600.0, purpose="eval")  # no re-run supersedes it
    _started(d, "s0-X-0", "s0-X")  # no time limit known: kept
    start = T0.timestamp()
    assert d.expire(start + 3600.0 + ORPHAN_GRACE_S - 1) == []
    assert d.expire(start + 3600.0 + ORPHAN_GRACE_S) == ["eval-before-s0-t-0"]
    assert d.running_rollouts == {"s0-X-0"}
    _finished(d, "eval-before-s0-t-0")  # its end, if it comes after all, changes nothing
    assert d.running_rollouts == {"s0-X-0"}
