"""Evaluation rollouts (``RolloutStarted.purpose == "eval"``) are sealed and shown like any
other, but never queued for training."""

from __future__ import annotations

from libs.common.events import MicroStepQueued, RolloutScored, RolloutStarted, SamplesSelected, TreeSealed
from services.trajectory.ledger import LedgerConfig, TrajectoryLedger

from ._calls import SYSTEM, TASK, Agent, Recorder

RUN = "run1"


def _run(purpose: str):
    ledger = TrajectoryLedger(LedgerConfig(RUN))
    events = []
    for r in ("r1", "r2"):
        ledger.rollout_started(RolloutStarted(run_id=RUN, rollout_id=r, task_id="t", group_id="g", harness="gyre_agent",
                                              weight_version=0, api_key_digest="a" * 64, step=0, purpose=purpose))
        rec = Recorder(r)
        Agent(rec, SYSTEM + TASK).say([20, 21, 2], [3, 90, 91])
        for c in rec.calls:
            assert not ledger.call_recorded(c).rejected
    for r, score in (("r1", 1.0), ("r2", 0.0)):
        ev = RolloutScored(run_id=RUN, rollout_id=r, score=score)
        ledger.rollout_ended(r)
        ledger.rollout_judged(ev)
        events += ledger.seal(r, ev).events
    return events


def test_eval_rollouts_are_sealed_but_never_queued():
    events = _run("eval")
    assert sum(isinstance(e, TreeSealed) for e in events) == 2
    assert any(isinstance(e, SamplesSelected) for e in events)
    assert not any(isinstance(e, MicroStepQueued) for e in events)


def test_training_rollouts_of_the_same_shape_are_queued():
    assert any(isinstance(e, MicroStepQueued) for e in _run("train"))


def test_purpose_defaults_to_train_and_is_validated():
    ev = RolloutStarted(run_id=RUN, rollout_id="r", task_id="t", group_id="g", harness="h", weight_version=0,
                        api_key_digest="a" * 64)
    assert ev.purpose == "train"
    try:
        RolloutStarted(run_id=RUN, rollout_id="r", task_id="t", group_id="g", harness="h", weight_version=0,
                       api_key_digest="a" * 64, purpose="bogus")
    except ValueError:
        pass
    else:
        raise AssertionError("an unknown purpose must be refused")
