"""Silent cells and the training group, and declarations matched to their switch (pure:
the rules a live scheduler and a replay share).

- the core does not start leaving training under a satellite silent where its seat may
  have joined (declared in releasing or joining), and the satellite's late join lands in
  a group the core still roots;
- a silent core roots no new training group: no satellite is released under it;
- the update waiting on a silent core does not stop the other rules;
- silent cells take no slot in the candidate lists;
- a declaration whose causation id names an older switch is void.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from libs.common.events import CellRegistered, SwitchFailed, SwitchPhaseEntered, SwitchRequested
from services.scheduler.core import (
    AsyncPolicy,
    CellAdded,
    CellPhase,
    ColocatePolicy,
    ElasticPolicy,
    IllegalTransition,
    PhaseReached,
    Role,
    SwitchAborted,
    SwitchFinished,
    SwitchStarted,
    Tick,
    decide,
    evolve,
    evolve_all,
)
from services.scheduler.core.translate import declared_reason, from_event, to_event
from services.scheduler.replay import CellsFold, state_digest

from ._helpers import cluster

POLICY = ElasticPolicy(hold_s=0, min_dwell_s=0)


def _switches(facts) -> list[tuple[str, str]]:
    return [(f.cell, f.to_role.value) for f in facts if isinstance(f, SwitchStarted)]


def _held(state, ticks, policy=POLICY):
    """Decides each tick, applying only the observations (the pressure is held); the last
    tick's switches."""
    facts = []
    for tick in ticks:
        facts = decide(state, tick, policy)
        state = evolve_all(state, [f for f in facts if not isinstance(f, SwitchStarted)])
    return state, _switches(facts)


def _satellite_declared_in(phase: CellPhase):
    """c0 (core) trains; c1 on its way to training, declared failed in ``phase``."""
    path = [CellPhase.MIGRATING, CellPhase.RELEASING, CellPhase.JOINING]
    facts = [SwitchStarted(cell="c1", to_role=Role.TRAINING, at=10.0, reason="release")]
    facts += [PhaseReached(cell="c1", phase=p, at=11.0) for p in path[: path.index(phase) + 1]] if phase in path else []
    facts.append(SwitchAborted(cell="c1", role=Role.INFERENCE, phase=phase, reason=declared_reason("hung"),
                               at=1600.0, declared=True))
    return evolve_all(cluster(4, training=1), facts)


# -- F1: a satellite whose seat may have joined holds the core in training -----------------

@pytest.mark.parametrize("phase", [CellPhase.RELEASING, CellPhase.JOINING])
def test_the_core_does_not_leave_training_under_a_satellite_silent_where_its_seat_may_have_joined(phase) -> None:
    state = _satellite_declared_in(phase)
    c1 = state.cell("c1")
    assert c1.silent and c1.phase is CellPhase.INFERENCE and c1.silent_in is phase and c1.may_train
    # demand waits, no training work: idle trainers, but the core stays
    _, switches = _held(state, [Tick(at=2000.0 + k, queued_calls=50) for k in range(3)])
    assert switches == []
    with pytest.raises(IllegalTransition, match="c1 \\(silent, its seat may have joined\\)"):
        evolve(state, SwitchStarted(cell="c0", to_role=Role.INFERENCE, at=2000.0, reason="t"))
    # colocate's "update applied" moves the training cells back: not the core
    assert _switches(decide(state, Tick(at=2000.0), ColocatePolicy())) == []


def test_a_late_join_of_a_silent_satellite_lands_in_the_group_the_core_still_roots() -> None:
    """The review's sequence: c1 declared failed in joining, the policy wants cells back,
    then c1's agent finishes its join. The core never left: c1 trains under it."""
    state = _satellite_declared_in(CellPhase.JOINING)
    tick = Tick(at=2000.0, queued_calls=50)
    state = evolve_all(state, decide(state, tick, POLICY))
    assert state.cell("c0").phase is CellPhase.TRAINING
    state = evolve(state, SwitchFinished(cell="c1", role=Role.TRAINING, at=2001.0))
    assert state.cell("c1").phase is CellPhase.TRAINING and not state.cell("c1").silent
    assert state.cell("c0").phase is CellPhase.TRAINING and not state.switching


def test_a_satellite_silent_before_its_release_does_not_hold_the_core() -> None:
    """Declared in migrating: an agent that wakes up reads the declaration before it can
    join (at most it announces releasing, and then is heading to training again)."""
    state = _satellite_declared_in(CellPhase.MIGRATING)
    assert not state.cell("c1").may_train
    state = evolve(state, SwitchStarted(cell="c0", to_role=Role.INFERENCE, at=2000.0, reason="t"))
    assert state.cell("c0").phase is CellPhase.LEAVING


def test_once_heard_from_the_satellite_no_longer_holds_the_core() -> None:
    state = _satellite_declared_in(CellPhase.JOINING)
    state = evolve(state, CellAdded(cell="c1", role=Role.INFERENCE, capacity=8, at=1700.0))  # its agent restarted
    assert not state.cell("c1").silent and state.cell("c1").silent_in is None
    _, switches = _held(state, [Tick(at=2000.0 + k, queued_calls=50) for k in range(3)])
    assert switches == [("c0", "inference")]


# -- F2: the update waiting on a silent core does not freeze the policy --------------------

def _silent_core_with_a_trainer():
    """c0 (core) started to training, c1 followed and trains; c0 declared failed in migrating."""
    return evolve_all(cluster(4), [
        SwitchStarted(cell="c0", to_role=Role.TRAINING, at=1.0, reason="r"),
        SwitchStarted(cell="c1", to_role=Role.TRAINING, at=2.0, reason="r"),
        PhaseReached(cell="c1", phase=CellPhase.MIGRATING, at=3.0),
        PhaseReached(cell="c1", phase=CellPhase.RELEASING, at=3.0),
        PhaseReached(cell="c1", phase=CellPhase.JOINING, at=3.0),
        SwitchFinished(cell="c1", role=Role.TRAINING, at=3.0),
        PhaseReached(cell="c0", phase=CellPhase.MIGRATING, at=4.0),
        SwitchAborted(cell="c0", role=Role.INFERENCE, phase=CellPhase.MIGRATING, reason=declared_reason("hung"),
                      at=1600.0, declared=True)])


@pytest.mark.parametrize("update_pending", [False, True])
def test_an_update_waiting_on_a_silent_core_does_not_stop_a_reclaim(update_pending) -> None:
    state = _silent_core_with_a_trainer()
    assert state.cell("c0").silent and state.cell("c0").phase is CellPhase.INFERENCE
    ticks = [Tick(at=2000.0 + 100 * k, queued_calls=500, update_pending=update_pending) for k in range(3)]
    state, switches = _held(state, ticks)
    assert state.pressure.value == "reclaim" and switches == [("c1", "inference")]


# -- F3: silent cells take no slot ---------------------------------------------------------

def _silent_training_satellite():
    """c0, c1, c2 train; c1 declared failed on its way back (kept in training, silent)."""
    return evolve_all(cluster(4, training=3), [
        SwitchStarted(cell="c1", to_role=Role.INFERENCE, at=700.0, reason="r"),
        SwitchAborted(cell="c1", role=Role.TRAINING, phase=CellPhase.LEAVING, reason=declared_reason("hung"),
                      at=2300.0, declared=True)])


@pytest.mark.parametrize("policy", [POLICY, ElasticPolicy(hold_s=0, min_dwell_s=0, max_switches_in_flight=1)])
def test_a_silent_trainer_takes_no_reclaim_slot(policy) -> None:
    state = _silent_training_satellite()
    assert state.cell("c1").silent and state.cell("c1").phase is CellPhase.TRAINING
    ticks = [Tick(at=5000.0 + 100 * k, queued_calls=12, training_backlog=5, busy_trainers=frozenset({"c0", "c2"}))
             for k in range(3)]
    state, switches = _held(state, ticks, policy)
    assert state.pressure.value == "reclaim" and switches == [("c2", "inference")]


def test_a_silent_trainer_takes_no_idle_trainer_slot() -> None:
    state = _silent_training_satellite()
    policy = ElasticPolicy(hold_s=0, min_dwell_s=0, max_switches_in_flight=1)
    state, switches = _held(state, [Tick(at=5000.0 + 100 * k, queued_calls=4) for k in range(3)], policy)
    assert state.pressure.value == "idle_trainers" and switches == [("c2", "inference")]


def test_async_a_silent_cell_takes_no_slot_when_the_split_is_restored() -> None:
    state = evolve_all(cluster(4, training=1), [
        SwitchStarted(cell="c1", to_role=Role.TRAINING, at=1.0, reason="r"),
        SwitchAborted(cell="c1", role=Role.INFERENCE, phase=CellPhase.DRAINING, reason=declared_reason("h"),
                      at=1600.0, declared=True)])
    assert _switches(decide(state, Tick(at=3000.0), AsyncPolicy(training_cells=2))) == [("c2", "training")]


# -- F4: a silent core roots no new training group -----------------------------------------

def _silent_core_in_training():
    """The core declared failed in resuming: kept in training, silent (its seat has left)."""
    return evolve_all(cluster(4, training=1), [
        SwitchStarted(cell="c0", to_role=Role.INFERENCE, at=700.0, reason="r"),
        PhaseReached(cell="c0", phase=CellPhase.RESUMING, at=701.0),
        SwitchAborted(cell="c0", role=Role.TRAINING, phase=CellPhase.RESUMING, reason=declared_reason("hung"),
                      at=2300.0, declared=True)])


def test_no_satellite_is_released_under_a_silent_core() -> None:
    state = _silent_core_in_training()
    assert state.cell("c0").silent and state.cell("c0").phase is CellPhase.TRAINING
    for k in range(3):
        facts = decide(state, Tick(at=3000.0 + 10 * k, training_backlog=20), POLICY)
        assert _switches(facts) == []
        state = evolve_all(state, facts)
    assert state.pressure.value == "steady"


def test_the_fold_refuses_a_satellite_joining_under_a_silent_core() -> None:
    with pytest.raises(IllegalTransition, match="core cell is silent"):
        evolve(_silent_core_in_training(), SwitchStarted(cell="c1", to_role=Role.TRAINING, at=3000.0, reason="t"))


@pytest.mark.parametrize("policy", [ColocatePolicy(), AsyncPolicy(training_cells=2)])
def test_the_baselines_start_no_satellite_under_a_silent_core(policy) -> None:
    state = _silent_core_in_training()
    tick = Tick(at=3000.0, batch_ready=True, training_backlog=4)
    assert _switches(decide(state, tick, policy)) == []  # and no IllegalTransition raised


# -- F6: a declaration is matched to its switch by causation id ----------------------------

def _events_to_a_second_switch(run: str = "r"):
    """c0's switch A to training declared failed, then rolled back by its agent; its switch
    B under way (migrating)."""
    a = SwitchRequested(run_id=run, cell="c0", from_role="inference", to_role="training", water_level=0, reason="A")
    b = SwitchRequested(run_id=run, cell="c0", from_role="inference", to_role="training", water_level=0, reason="B")
    events = [CellRegistered(run_id=run, cell="c0", role="inference", is_core=True, capacity=4),
              CellRegistered(run_id=run, cell="c1", role="inference", capacity=4), a,
              SwitchPhaseEntered(run_id=run, cell="c0", phase="migrating", causation_id=a.event_id),
              SwitchFailed(run_id=run, cell="c0", role="inference", phase="migrating", reason=declared_reason("x"),
                           declared_by_scheduler=True, causation_id=a.event_id),
              SwitchFailed(run_id=run, cell="c0", role="inference", phase="migrating", reason="own rollback",
                           causation_id=a.event_id),
              b, SwitchPhaseEntered(run_id=run, cell="c0", phase="migrating", causation_id=b.event_id)]
    return a, b, events


def test_a_late_declaration_for_an_older_switch_is_void() -> None:
    a, b, events = _events_to_a_second_switch()
    fold = CellsFold()
    for ev in events:
        fold.apply(ev)
    assert fold.state.cell("c0").request == b.event_id
    stale = SwitchFailed(run_id="r", cell="c0", role="inference", phase="migrating", reason=declared_reason("x"),
                         declared_by_scheduler=True, causation_id=a.event_id)
    fold.apply(stale)
    c0 = fold.state.cell("c0")
    assert c0.phase is CellPhase.MIGRATING and not c0.silent and not fold.errors
    # the declaration for the switch under way still counts
    fold.apply(SwitchFailed(run_id="r", cell="c0", role="inference", phase="migrating", reason=declared_reason("x"),
                            declared_by_scheduler=True, causation_id=b.event_id))
    c0 = fold.state.cell("c0")
    assert c0.phase is CellPhase.INFERENCE and c0.silent and not fold.errors


def test_the_request_id_is_not_in_the_state_digest() -> None:
    """Digests of logs written before the fold kept request ids do not change."""
    _, _, events = _events_to_a_second_switch()
    fold = CellsFold()
    for ev in events:
        fold.apply(ev)
    state = fold.state
    bare = replace(state, cells=tuple(replace(c, request=None) for c in state.cells))
    assert state.cell("c0").request is not None and state_digest(bare) == state_digest(state)


def test_the_ids_go_through_translation() -> None:
    _, b, _ = _events_to_a_second_switch()
    started = from_event(b)
    assert started.request == b.event_id
    declared = SwitchAborted(cell="c0", role=Role.INFERENCE, phase=CellPhase.MIGRATING, reason=declared_reason("x"),
                             at=1.0, declared=True, causation="req-1")
    event = to_event(declared, "r")
    assert event.causation_id == "req-1" and from_event(event).causation == "req-1"
    assert from_event(event) == declared  # ids are not compared: decided and read back are equal
    assert from_event(to_event(replace(declared, causation=None), "r")) == declared
