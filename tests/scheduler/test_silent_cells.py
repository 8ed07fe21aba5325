"""A switch the scheduler declared failed for a hung cell agent (``SwitchAborted(declared=True)``):
the cell rolls back and is *silent*; the agent's own later word is taken as it comes; a
declaration that lands after the cell's own outcome is void; the policies leave a silent
cell alone and do not count it as serving. All pure: the same rules a replay applies."""

from __future__ import annotations

import pytest

from services.scheduler.core import (
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
from services.scheduler.core.translate import DECLARED, declared_reason, from_event, to_event
from services.scheduler.live import declared_role

from ._helpers import cluster


def _core_in(phase: CellPhase, n: int = 3):
    """c0 (the core) half-way to training, stopped in ``phase``."""
    path = [CellPhase.MIGRATING, CellPhase.RELEASING, CellPhase.JOINING]
    facts = [SwitchStarted(cell="c0", to_role=Role.TRAINING, at=1.0, reason="t")]
    facts += [PhaseReached(cell="c0", phase=p, at=2.0) for p in path[: path.index(phase) + 1]] \
        if phase in path else []
    return evolve_all(cluster(n), facts)


def _declare(state, phase: CellPhase, role: Role = Role.INFERENCE, at: float = 1000.0):
    return evolve(state, SwitchAborted(cell="c0", role=role, phase=phase, reason=declared_reason("no answer"),
                                       at=at, declared=True))


def test_a_declared_failure_rolls_back_and_leaves_the_cell_silent() -> None:
    state = _declare(_core_in(CellPhase.RELEASING), CellPhase.RELEASING)
    c0 = state.cell("c0")
    assert c0.phase is CellPhase.INFERENCE and c0.silent and c0.last_failure.startswith(DECLARED)
    assert "c0" not in {c.name for c in state.serving}  # not counted as serving


def test_a_declaration_must_name_a_safe_role() -> None:
    with pytest.raises(IllegalTransition, match="must roll back to inference"):
        _declare(_core_in(CellPhase.JOINING), CellPhase.JOINING, role=Role.TRAINING)


def test_a_declaration_after_the_cells_own_outcome_is_void() -> None:
    """The agent finished just before the scheduler's declaration was written."""
    state = _core_in(CellPhase.JOINING)
    state = evolve(state, SwitchFinished(cell="c0", role=Role.TRAINING, at=999.0))
    after = _declare(state, CellPhase.JOINING)
    assert after.cell("c0") == state.cell("c0") and not after.cell("c0").silent


def test_a_declaration_after_a_further_phase_rolls_back_from_there() -> None:
    state = evolve(_core_in(CellPhase.MIGRATING), PhaseReached(cell="c0", phase=CellPhase.RELEASING, at=999.0))
    after = _declare(state, CellPhase.MIGRATING)
    assert after.cell("c0").phase is CellPhase.INFERENCE and after.cell("c0").silent


def test_the_agent_waking_up_goes_on_with_its_switch_and_is_taken_at_its_word() -> None:
    state = _declare(_core_in(CellPhase.RELEASING), CellPhase.RELEASING)
    state = evolve(state, PhaseReached(cell="c0", phase=CellPhase.JOINING, at=1001.0))
    assert state.cell("c0").phase is CellPhase.JOINING and not state.cell("c0").silent
    state = evolve(state, SwitchFinished(cell="c0", role=Role.TRAINING, at=1002.0))
    assert state.cell("c0").phase is CellPhase.TRAINING and state.cell("c0").last_failure is None


def test_the_agent_waking_up_finishing_or_failing_is_taken_at_its_word() -> None:
    silent = _declare(_core_in(CellPhase.JOINING), CellPhase.JOINING)
    done = evolve(silent, SwitchFinished(cell="c0", role=Role.TRAINING, at=1001.0))
    assert done.cell("c0").phase is CellPhase.TRAINING and not done.cell("c0").silent
    failed = evolve(silent, SwitchAborted(cell="c0", role=Role.INFERENCE, phase=CellPhase.JOINING,
                                          reason="declared: rolled back", at=1001.0))
    assert failed.cell("c0").phase is CellPhase.INFERENCE and not failed.cell("c0").silent
    assert failed.cell("c0").last_failure == "declared: rolled back"


def test_a_silent_cell_registering_again_is_taken_at_the_role_it_states() -> None:
    silent = _declare(_core_in(CellPhase.JOINING), CellPhase.JOINING)
    state = evolve(silent, CellAdded(cell="c0", role=Role.TRAINING, capacity=8, at=1001.0, is_core=True))
    assert state.cell("c0").phase is CellPhase.TRAINING and not state.cell("c0").silent


def test_a_silent_cell_announcing_a_phase_of_no_switch_it_was_in_is_refused() -> None:
    silent = _declare(_core_in(CellPhase.JOINING), CellPhase.JOINING)
    with pytest.raises(IllegalTransition):  # in inference; "resuming" heads to inference
        evolve(silent, PhaseReached(cell="c0", phase=CellPhase.RESUMING, at=1001.0))


def test_the_declaration_survives_the_log() -> None:
    fact = SwitchAborted(cell="c0", role=Role.INFERENCE, phase=CellPhase.JOINING, reason="no answer", at=5.0,
                         declared=True)
    event = to_event(fact, "r")
    assert event.declared_by_scheduler and event.reason.startswith(DECLARED)
    back = from_event(event)
    assert back.declared and back.reason == event.reason
    assert not from_event(to_event(SwitchAborted(cell="c0", role=Role.INFERENCE, phase=CellPhase.JOINING,
                                                 reason="oom", at=5.0), "r")).declared
    # the field decides, not the words: a cell's own failure that quotes them is its own
    own = to_event(SwitchAborted(cell="c0", role=Role.INFERENCE, phase=CellPhase.JOINING,
                                 reason=DECLARED + "quoted", at=5.0), "r")
    assert not own.declared_by_scheduler and not from_event(own).declared


def test_the_policies_leave_a_silent_cell_alone_and_do_not_count_it_serving() -> None:
    silent = _declare(_core_in(CellPhase.MIGRATING, n=2), CellPhase.MIGRATING)
    # colocate would move every inference cell to training: not the silent core
    facts = decide(silent, Tick(at=2000.0, batch_ready=True), ColocatePolicy())
    assert [f.cell for f in facts if isinstance(f, SwitchStarted)] == []  # c1 waits behind its core
    # elastic: the step's update waits on the core, which is silent: nothing is started for it,
    # and the capacity observed is c1's alone
    facts = decide(silent, Tick(at=2000.0, update_pending=True), ElasticPolicy())
    assert not [f for f in facts if isinstance(f, SwitchStarted)]
    assert facts[0].inference_capacity == 8
    # once it registers again, it is switched as any cell
    back = evolve(silent, CellAdded(cell="c0", role=Role.INFERENCE, capacity=8, at=2001.0, is_core=True))
    facts = decide(back, Tick(at=2100.0, update_pending=True), ElasticPolicy())
    assert [f.cell for f in facts if isinstance(f, SwitchStarted)] == ["c0"]


def test_a_silent_satellite_is_not_the_last_serving_cell() -> None:
    """Two cells: the satellite is silent in inference; the core must not be released to
    training (min_inference_cells counts only cells that serve)."""
    state = evolve_all(cluster(2), [
        SwitchStarted(cell="c0", to_role=Role.TRAINING, at=1.0, reason="t"),
        SwitchStarted(cell="c1", to_role=Role.TRAINING, at=1.0, reason="t"),
        SwitchAborted(cell="c1", role=Role.INFERENCE, phase=CellPhase.DRAINING, reason=declared_reason("x"),
                      at=2.0, declared=True),
        SwitchAborted(cell="c0", role=Role.INFERENCE, phase=CellPhase.DRAINING, reason="oom", at=2.0),
    ])
    policy = ElasticPolicy(hold_s=0, min_dwell_s=0, smoothing_s=0)
    facts = decide(state, Tick(at=5000.0, update_pending=True), policy)
    assert not [f for f in facts if isinstance(f, SwitchStarted)]
    facts = decide(state, Tick(at=5000.0, training_backlog=3), policy)
    assert not [f for f in facts if isinstance(f, SwitchStarted)]


@pytest.mark.parametrize(("phase", "role", "doubt"), [
    (CellPhase.DRAINING, Role.INFERENCE, "still holds its memory"),
    (CellPhase.JOINING, Role.INFERENCE, "no safe role is known"),
    (CellPhase.LEAVING, Role.TRAINING, "may still hold a micro-step"),
    (CellPhase.RESUMING, Role.TRAINING, "no safe role is known"),
])
def test_the_declared_role_is_the_lifecycles_safe_one_with_the_doubts_spelled_out(phase, role, doubt) -> None:
    from dataclasses import replace

    c0 = replace(cluster(1).cell("c0"), phase=phase)
    back, why = declared_role(c0)
    assert back is role and doubt in why
