"""The rollout lifecycle core: pure decide/evolve, no I/O."""

from __future__ import annotations

from libs.common.events import RolloutFinished, RolloutStarted, RolloutTimedOut
from services.runner import core

PLAN = core.RolloutPlan(run_id="r", rollout_id="s0-t-0-x", task_id="t", group_id="s0-t", step=0, harness="h",
                        weight_version=2, api_key_digest="a" * 64, time_limit_s=60.0, group_size=4)
DIGEST = "b" * 64


def run(*commands):
    state, effects = core.planned(PLAN), []
    for c in commands:
        state, fx = core.step(state, c)
        effects.append(fx)
    return state, effects


def test_finished_rollout() -> None:
    state, fx = run(core.Register(0.0), core.Launched(1.0), core.Exited(0, 11.0), core.Snapshotted(DIGEST, 12.0))
    started = fx[0][0].event
    assert isinstance(started, RolloutStarted) and started.group_size == 4 and started.weight_version == 2
    assert started.api_key_digest == "a" * 64 and started.time_limit_s == 60.0
    assert fx[1] == [] and fx[2] == [core.TakeSnapshot()]
    ended = fx[3][0].event
    assert isinstance(ended, RolloutFinished)
    assert (ended.snapshot_digest, ended.exit_status, ended.wall_time_s, ended.task_id) == (DIGEST, 0, 10.0, "t")
    assert state.phase is core.Phase.ENDED and state.deadline == 61.0


def test_timeout_kills_then_snapshots_and_keeps_the_killed_status() -> None:
    state, fx = run(core.Register(0.0), core.Launched(1.0), core.DeadlinePassed(61.0), core.Exited(-15, 61.5),
                    core.Snapshotted(DIGEST, 62.0))
    assert fx[2] == [core.KillGroup(), core.TakeSnapshot()]
    assert fx[3] == []  # the exit of a killed harness decides nothing
    ended = fx[4][0].event
    assert isinstance(ended, RolloutTimedOut) and ended.exit_status == -15 and ended.wall_time_s == 60.0


def test_exit_before_deadline_wins_and_late_deadline_is_ignored() -> None:
    state, fx = run(core.Register(0.0), core.Launched(0.0), core.Exited(1, 5.0), core.DeadlinePassed(60.0))
    assert fx[3] == [] and not state.timed_out and state.exit_status == 1


def test_launch_failure_still_ends_the_rollout() -> None:
    state, fx = run(core.Register(0.0), core.LaunchFailed(0.5, "no such program"), core.Snapshotted(None, 0.6))
    assert fx[1] == [core.TakeSnapshot()]
    ended = fx[2][0].event
    assert isinstance(ended, RolloutFinished) and ended.exit_status == core.LAUNCH_FAILED_STATUS
    assert ended.snapshot_digest is None and state.note == "no such program"


def test_commands_out_of_order_change_nothing() -> None:
    s0 = core.planned(PLAN)
    for c in (core.Launched(0.0), core.Exited(0, 1.0), core.DeadlinePassed(2.0), core.Snapshotted(DIGEST, 3.0)):
        assert core.step(s0, c) == (s0, [])
    state, _ = run(core.Register(0.0))
    assert core.step(state, core.Register(1.0)) == (state, [])


def test_a_rollout_the_runner_fails_on_before_registering_is_registered_and_ended() -> None:
    state, fx = run(core.Failed(3.0, "its workspace could not be prepared: OSError"))
    started, ended = (e.event for e in fx[0])
    assert isinstance(started, RolloutStarted) and started.group_size == 4
    assert isinstance(ended, RolloutFinished) and ended.causation_id == started.event_id
    assert (ended.exit_status, ended.snapshot_digest, ended.wall_time_s) == (core.LAUNCH_FAILED_STATUS, None, 0.0)
    assert state.phase is core.Phase.ENDED and state.note.startswith("its workspace")


def test_a_rollout_the_runner_fails_on_later_ends_from_where_it_is() -> None:
    _, fx = run(core.Register(0.0), core.Failed(0.5, "bug"))
    [ended] = [e.event for e in fx[1]]  # registered already: only its end
    assert isinstance(ended, RolloutFinished) and ended.exit_status == core.LAUNCH_FAILED_STATUS
    _, fx = run(core.Register(0.0), core.Launched(1.0), core.Failed(4.0, "bug"))
    [ended] = [e.event for e in fx[2]]
    assert (ended.exit_status, ended.wall_time_s, ended.snapshot_digest) == (core.LAUNCH_FAILED_STATUS, 3.0, None)
    _, fx = run(core.Register(0.0), core.Launched(1.0), core.DeadlinePassed(61.0), core.Exited(-15, 61.5),
                core.Failed(62.0, "bug"))
    [ended] = [e.event for e in fx[4]]  # the harness's own status and the timeout are kept; no snapshot
    assert isinstance(ended, RolloutTimedOut) and ended.exit_status == -15 and ended.snapshot_digest is None
    assert ended.wall_time_s == 60.0


def test_a_failure_after_the_end_changes_nothing() -> None:
    state, _ = run(core.Register(0.0), core.Launched(1.0), core.Exited(0, 2.0), core.Snapshotted(DIGEST, 3.0))
    assert core.step(state, core.Failed(4.0, "bug")) == (state, [])
