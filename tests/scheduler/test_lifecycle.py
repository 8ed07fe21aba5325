"""Cell lifecycle and ``evolve``: legal paths, and illegal moves rejected with clear errors."""

from __future__ import annotations

import pytest

from services.scheduler.core import (
    CellAdded,
    CellPhase,
    IllegalTransition,
    PhaseReached,
    Role,
    SchedulerState,
    SwitchAborted,
    SwitchFinished,
    SwitchStarted,
    evolve,
    evolve_all,
)

from ._helpers import cluster


def to_training(cell: str, at: float = 1.0) -> list:
    return [
        SwitchStarted(cell=cell, to_role=Role.TRAINING, at=at, reason="test"),
        PhaseReached(cell=cell, phase=CellPhase.MIGRATING, at=at + 1),
        PhaseReached(cell=cell, phase=CellPhase.RELEASING, at=at + 2),
        PhaseReached(cell=cell, phase=CellPhase.JOINING, at=at + 3),
        SwitchFinished(cell=cell, role=Role.TRAINING, at=at + 4),
    ]


def to_inference(cell: str, at: float = 10.0) -> list:
    return [
        SwitchStarted(cell=cell, to_role=Role.INFERENCE, at=at, reason="test"),
        PhaseReached(cell=cell, phase=CellPhase.RESUMING, at=at + 1),
        SwitchFinished(cell=cell, role=Role.INFERENCE, at=at + 2),
    ]


def test_full_round_trip_walks_every_phase() -> None:
    state = cluster(2)
    seen = []
    for fact in to_training("c0") + to_inference("c0"):
        state = evolve(state, fact)
        seen.append(state.cell("c0").phase)
    assert seen == [
        CellPhase.DRAINING, CellPhase.MIGRATING, CellPhase.RELEASING, CellPhase.JOINING, CellPhase.TRAINING,
        CellPhase.LEAVING, CellPhase.RESUMING, CellPhase.INFERENCE,
    ]
    assert state.cell("c0").switches == 2
    assert state.now == 12.0


@pytest.mark.parametrize(
    ("facts", "message"),
    [
        ([PhaseReached(cell="c0", phase=CellPhase.MIGRATING, at=1)], "no switch in progress"),
        ([SwitchStarted(cell="c0", to_role=Role.TRAINING, at=1, reason="t"),
          PhaseReached(cell="c0", phase=CellPhase.JOINING, at=2)], "draining -> joining is not a legal step"),
        ([SwitchStarted(cell="c0", to_role=Role.TRAINING, at=1, reason="t"),
          SwitchFinished(cell="c0", role=Role.TRAINING, at=2)], "must pass through draining -> migrating"),
        ([SwitchStarted(cell="c0", to_role=Role.TRAINING, at=1, reason="t"),
          SwitchStarted(cell="c0", to_role=Role.INFERENCE, at=2, reason="t")], "already in progress"),
        ([SwitchStarted(cell="c0", to_role=Role.INFERENCE, at=1, reason="t")], "already in role inference"),
        ([SwitchStarted(cell="c1", to_role=Role.TRAINING, at=1, reason="t")], "satellite cannot move to training"),
        ([SwitchStarted(cell="zz", to_role=Role.TRAINING, at=1, reason="t")], "unknown cell 'zz'"),
        ([CellAdded(cell="c9", role=Role.INFERENCE, capacity=8, is_core=True)], "a core cell already exists"),
        ([CellAdded(cell="c1", role=Role.INFERENCE, capacity=8, is_core=True)], "registered again as core"),
        ([CellAdded(cell="c9", role=Role.INFERENCE, capacity=0)], "capacity must be >= 1"),
        ([SwitchStarted(cell="c0", to_role=Role.TRAINING, at=1, reason="t"),
          SwitchAborted(cell="c0", role=Role.TRAINING, phase=CellPhase.DRAINING, reason="x", at=2)],
         "must roll back to inference"),
        ([SwitchStarted(cell="c0", to_role=Role.TRAINING, at=1, reason="t"),
          SwitchAborted(cell="c0", role=Role.INFERENCE, phase=CellPhase.JOINING, reason="x", at=2)],
         "failure reported in joining but the cell is draining"),
        ([SwitchAborted(cell="c0", role=Role.INFERENCE, phase=CellPhase.INFERENCE, reason="x", at=2)],
         "no switch in progress to fail"),
    ],
)
def test_illegal_transitions_are_rejected_with_the_reason(facts: list, message: str) -> None:
    state = cluster(2)
    with pytest.raises(IllegalTransition, match=message):
        evolve_all(state, facts)


def test_a_cell_registering_again_is_in_the_role_it_states() -> None:
    # c0's agent restarted in the middle of a switch: the switch died with it
    state = evolve_all(cluster(2), to_training("c0")[:2])
    assert state.cell("c0").phase is CellPhase.MIGRATING
    state = evolve(state, CellAdded(cell="c0", role=Role.INFERENCE, capacity=8, is_core=True, at=5))
    c0 = state.cell("c0")
    assert (c0.phase, c0.since, c0.switches) == (CellPhase.INFERENCE, 5, 1)
    assert c0.last_failure == "registered again as inference while migrating"
    state = evolve(state, CellAdded(cell="c1", role=Role.INFERENCE, capacity=4, at=6))  # same role: no note
    assert (state.cell("c1").capacity, state.cell("c1").last_failure) == (4, None)


def test_a_refused_switch_leaves_the_cell_in_the_role_it_reports() -> None:
    # the scheduler thought c0 trained; its agent (restarted) serves inference and refuses
    state = evolve_all(cluster(2), to_training("c0"))
    state = evolve(state, SwitchStarted(cell="c0", to_role=Role.INFERENCE, at=20, reason="t"))
    state = evolve(state, SwitchAborted(cell="c0", role=Role.INFERENCE, phase=None, at=21,
                                        reason="refused: already in inference"))
    assert state.cell("c0").phase is CellPhase.INFERENCE
    assert state.cell("c0").last_failure == "refused: already in inference"


def test_core_cannot_leave_training_while_satellites_train() -> None:
    state = evolve_all(cluster(3), to_training("c0") + to_training("c1", at=6.0))
    with pytest.raises(IllegalTransition, match="core cell cannot leave training while satellites c1"):
        evolve(state, SwitchStarted(cell="c0", to_role=Role.INFERENCE, at=20, reason="t"))
    state = evolve_all(state, to_inference("c1", at=20))
    state = evolve_all(state, to_inference("c0", at=30))  # once the satellites have left, it may
    assert state.cell("c0").phase is CellPhase.INFERENCE
    assert state.cell("c0").owns_optimizer  # and it keeps the optimizer while serving


def test_satellite_cannot_register_in_training_without_the_core() -> None:
    state = evolve(SchedulerState(), CellAdded(cell="c0", role=Role.INFERENCE, capacity=8, is_core=True))
    with pytest.raises(IllegalTransition, match="without the core"):
        evolve(state, CellAdded(cell="c1", role=Role.TRAINING, capacity=8))


@pytest.mark.parametrize(
    ("reached", "safe"),
    [(CellPhase.DRAINING, Role.INFERENCE), (CellPhase.MIGRATING, Role.INFERENCE),
     (CellPhase.RELEASING, Role.INFERENCE), (CellPhase.JOINING, Role.INFERENCE)],
)
def test_failed_switch_to_training_rolls_back_to_inference(reached: CellPhase, safe: Role) -> None:
    facts = to_training("c0")[: [CellPhase.DRAINING, CellPhase.MIGRATING, CellPhase.RELEASING,
                                 CellPhase.JOINING].index(reached) + 1]
    state = evolve_all(cluster(2), facts)
    assert state.cell("c0").phase is reached
    state = evolve(state, SwitchAborted(cell="c0", role=safe, phase=reached, reason="weights pull timed out", at=9))
    cell = state.cell("c0")
    assert cell.phase is CellPhase.INFERENCE and cell.last_failure == "weights pull timed out"


def test_failed_switch_to_inference_stays_in_training() -> None:
    state = evolve_all(cluster(2), to_training("c0") + to_inference("c0")[:2])
    assert state.cell("c0").phase is CellPhase.RESUMING
    with pytest.raises(IllegalTransition, match="must roll back to training"):
        evolve(state, SwitchAborted(cell="c0", role=Role.INFERENCE, phase=CellPhase.RESUMING, reason="oom", at=13))
    state = evolve(state, SwitchAborted(cell="c0", role=Role.TRAINING, phase=CellPhase.RESUMING, reason="oom", at=13))
    assert state.cell("c0").phase is CellPhase.TRAINING


def test_evolve_rejects_foreign_objects() -> None:
    with pytest.raises(TypeError, match="not a scheduler fact"):
        evolve(cluster(1), object())  # type: ignore[arg-type]


def test_a_failure_reported_in_a_phase_the_switch_passed_rolls_back_from_where_the_log_is() -> None:
    """The agent announced migrating, the log stored it, the ack was lost: the agent reports
    the failure in draining (the last phase it knows the log has). The fold rolls back from
    migrating; a phase the switch has not reached, or one of another path, is still refused."""
    state = evolve_all(cluster(2), to_training("c0")[:2])
    assert state.cell("c0").phase is CellPhase.MIGRATING
    back = evolve(state, SwitchAborted(cell="c0", role=Role.INFERENCE, phase=CellPhase.DRAINING, reason="ack", at=5))
    assert back.cell("c0").phase is CellPhase.INFERENCE and back.cell("c0").last_failure == "ack"
    for phase in (CellPhase.RELEASING, CellPhase.LEAVING):
        with pytest.raises(IllegalTransition, match=f"failure reported in {phase.value} but the cell is migrating"):
            evolve(state, SwitchAborted(cell="c0", role=Role.INFERENCE, phase=phase, reason="x", at=5))
    with pytest.raises(IllegalTransition, match="must roll back to inference"):
        evolve(state, SwitchAborted(cell="c0", role=Role.TRAINING, phase=CellPhase.DRAINING, reason="x", at=5))
    resuming = evolve_all(cluster(2), to_training("c0") + to_inference("c0")[:2])
    kept = evolve(resuming, SwitchAborted(cell="c0", role=Role.TRAINING, phase=CellPhase.LEAVING, reason="x", at=13))
    assert kept.cell("c0").phase is CellPhase.TRAINING
