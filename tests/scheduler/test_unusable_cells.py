"""A cell whose agent could not finish rolling a failed switch back reports it
(``SwitchFailed.unusable`` -> ``SwitchAborted(unusable=True)``): the fold keeps the cell in
the role it reports but *unusable* until ``CellRepaired``. Like a silent cell, it is not
serving capacity, no policy switches it, an unusable core roots no training group; a
replay of the log rebuilds the same state. All pure."""

from __future__ import annotations

import pytest

from libs.common.events import (CellRegistered, CellRepaired as CellRepairedEvent, SwitchFailed, SwitchPhaseEntered,
                                SwitchRequested)
from services.scheduler.core import (
    CellPhase,
    CellRepaired,
    ColocatePolicy,
    ElasticPolicy,
    IllegalTransition,
    PhaseReached,
    Role,
    SwitchAborted,
    SwitchStarted,
    Tick,
    decide,
    evolve,
    evolve_all,
)
from services.scheduler.core.policy import serving_capacity
from services.scheduler.core.translate import from_event, to_event
from services.scheduler.replay import CellsFold, state_digest

from ._helpers import cluster


def _unusable(cell: str = "c0", n: int = 3):
    """``cell`` tried training, joining failed, and resuming its engine failed too."""
    facts = [SwitchStarted(cell=cell, to_role=Role.TRAINING, at=1.0, reason="t"),
             PhaseReached(cell=cell, phase=CellPhase.MIGRATING, at=2.0),
             PhaseReached(cell=cell, phase=CellPhase.RELEASING, at=3.0),
             PhaseReached(cell=cell, phase=CellPhase.JOINING, at=4.0),
             SwitchAborted(cell=cell, role=Role.INFERENCE, phase=CellPhase.JOINING, at=5.0,
                           reason="core unreachable; rollback to inference failed, the cell is not usable: OOM",
                           unusable=True)]
    return evolve_all(cluster(n), facts)


def test_an_unusable_cell_is_not_serving_capacity() -> None:
    state = _unusable()
    c0 = state.cell("c0")
    assert c0.phase is CellPhase.INFERENCE and c0.unusable and not c0.silent
    assert [c.name for c in state.serving] == ["c1", "c2"] and serving_capacity(state) == 16


def test_no_policy_switches_an_unusable_core() -> None:
    """Release pressure with training work waiting: "core first" must not pick an unusable
    core every RETRY_AFTER_FAILURE_S (its agent refuses), nor the update's rule 1."""
    state = _unusable()
    elastic = ElasticPolicy(hold_s=0, min_dwell_s=0)
    for k, tick in enumerate([Tick(at=1000.0, running_calls=1, training_backlog=4),
                              Tick(at=1001.0, running_calls=1, update_pending=True)]):
        facts = decide(state, tick, elastic)
        assert not [f for f in facts if isinstance(f, SwitchStarted)], k
    facts = decide(state, Tick(at=1000.0, batch_ready=True), ColocatePolicy())
    assert not [f for f in facts if isinstance(f, SwitchStarted)]


def test_an_unusable_core_roots_no_training_group() -> None:
    state = evolve(cluster(3), SwitchStarted(cell="c0", to_role=Role.TRAINING, at=1.0, reason="t"))
    state = evolve_all(state, [PhaseReached(cell="c0", phase=p, at=2.0) for p in
                               (CellPhase.MIGRATING, CellPhase.RELEASING, CellPhase.JOINING)])
    state = evolve(state, _finished_training("c0"))
    state = evolve(state, SwitchStarted(cell="c0", to_role=Role.INFERENCE, at=10.0, reason="t"))
    state = evolve(state, SwitchAborted(cell="c0", role=Role.TRAINING, phase=CellPhase.LEAVING, at=11.0,
                                        reason="x; rollback to training failed", unusable=True))
    assert state.cell("c0").phase is CellPhase.TRAINING and not state.training_group_open
    with pytest.raises(IllegalTransition, match="unusable"):
        evolve(state, SwitchStarted(cell="c1", to_role=Role.TRAINING, at=12.0, reason="t"))


def _finished_training(cell: str):
    from services.scheduler.core import SwitchFinished

    return SwitchFinished(cell=cell, role=Role.TRAINING, at=5.0)


def test_a_refusal_while_unusable_keeps_it_and_a_repair_ends_it() -> None:
    state = evolve(_unusable(), SwitchAborted(cell="c0", role=Role.INFERENCE, phase=None, at=70.0,
                                              reason="cell is not usable as inference: OOM", unusable=True))
    assert state.cell("c0").unusable
    with pytest.raises(IllegalTransition, match="repaired as training"):
        evolve(state, CellRepaired(cell="c0", role=Role.TRAINING, at=80.0))
    repaired = evolve(state, CellRepaired(cell="c0", role=Role.INFERENCE, at=80.0))
    c0 = repaired.cell("c0")
    assert not c0.unusable and c0.since == 70.0 and serving_capacity(repaired) == 24


def test_a_restarted_agent_ends_it() -> None:
    from services.scheduler.core import CellAdded

    state = evolve(_unusable(), CellAdded(cell="c0", role=Role.INFERENCE, capacity=8, at=90.0, is_core=True))
    assert not state.cell("c0").unusable


def test_the_log_carries_it_and_a_replay_rebuilds_it() -> None:
    run = "r"
    events = [CellRegistered(run_id=run, cell=f"c{i}", role="inference", is_core=i == 0, capacity=8)
              for i in range(3)]
    req = SwitchRequested(run_id=run, cell="c0", from_role="inference", to_role="training", water_level=0.0,
                          reason="t")
    events += [req] + [SwitchPhaseEntered(run_id=run, cell="c0", phase=p)
                       for p in ("draining", "migrating", "releasing", "joining")]
    failed = SwitchFailed(run_id=run, cell="c0", role="inference", phase="joining", reason="rollback failed",
                          causation_id=req.event_id, unusable=True)
    events.append(failed)
    fact = from_event(failed)
    assert isinstance(fact, SwitchAborted) and fact.unusable
    assert to_event(fact, run).unusable
    fold = CellsFold()
    for ev in events:
        fold.apply(ev)
    assert fold.state.cell("c0").unusable and not fold.errors
    unusable_digest = state_digest(fold.state)
    repaired = CellRepairedEvent(run_id=run, cell="c0", role="inference")
    assert isinstance(from_event(repaired), CellRepaired)
    fold.apply(repaired)
    assert not fold.state.cell("c0").unusable and not fold.errors
    assert state_digest(fold.state) != unusable_digest  # the digest says it only while it is so
    assert "unusable" not in failed.model_copy(update={"unusable": False}).to_json().decode()


def test_schedules_without_an_unusable_cell_keep_their_digests() -> None:
    """``SwitchAborted.unusable`` enters a schedule's digest only when set: the tiny preset
    with failing switches (every failure a plain rollback) has the digest it had before."""
    from dataclasses import replace

    from services.scheduler.sim.config import preset
    from services.scheduler.sim.modes import simulate
    from services.scheduler.sim.report import schedule_digest

    run = simulate(replace(preset("tiny"), switch_failure_rate=0.2), "elastic")
    assert any(isinstance(f, SwitchAborted) for f in run.facts)
    assert run.digest == "04c00992badc140d8875e354e8aace98f211ee5609600369b7ec33e484985b6a"
    aborted = next(f for f in run.facts if isinstance(f, SwitchAborted))
    assert schedule_digest([aborted]) != schedule_digest([replace(aborted, unusable=True)])
