"""Thin translation between the core's facts and the cells events of the catalogue.

``at`` is seconds since the Unix epoch live; the simulator passes its own clock, which
starts at ``origin`` (a fixed date, so simulated logs are reproducible).

- ``PhaseReached`` <-> ``SwitchPhaseEntered`` (a cell's progress through draining,
  migrating, releasing, joining, leaving and resuming).
- ``SwitchAborted`` <-> ``SwitchFailed``; ``phase="refused"`` (the cell agent refused the
  command: it was not in the role the scheduler thought) reads as ``phase=None``. A
  ``SwitchFailed`` the scheduler declared on a silent cell's behalf (its agent took the
  command and never answered) has ``declared_by_scheduler`` set (and a reason that starts
  with :data:`DECLARED`, for people), and reads as ``SwitchAborted(declared=True)``: the
  marker is in the log, so a replay reads it too. Its ``causation_id`` (the request of the
  switch it gives up on) reads as ``SwitchAborted.causation``; a ``SwitchRequested``'s
  ``event_id`` reads as ``SwitchStarted.request``, so the fold matches the two.
- ``SwitchFailed.unusable`` (the agent could not finish rolling back) reads as
  ``SwitchAborted.unusable``; ``CellRepaired`` (event) <-> ``CellRepaired`` (fact).
- ``WaterLevelObserved`` <-> ``WaterLevelSampled`` with the policy's ``pressure``,
  ``smoothed_level`` and ``training_backlog``, so a replay rebuilds the hysteresis state
  exactly. Events written without them read as ``steady``, the raw level and 0.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from libs.common.events.cells import CellRepaired as CellRepairedEvent
from libs.common.events.cells import (
    CellRegistered,
    SwitchCompleted,
    SwitchFailed,
    SwitchPhaseEntered,
    SwitchRequested,
    WaterLevelSampled,
)
from libs.common.events.envelope import Event

from .facts import (
    CellAdded,
    CellRepaired,
    Fact,
    PhaseReached,
    Pressure,
    SwitchAborted,
    SwitchFinished,
    SwitchStarted,
    WaterLevelObserved,
)
from .lifecycle import CellPhase, Role
from .state import SchedulerState

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
REFUSED = "refused"  # SwitchFailed.phase of a command the cell refused before any phase
DECLARED = "declared failed by the scheduler: "  # SwitchFailed.reason of a silent cell's switch


def declared_reason(reason: str) -> str:
    """The reason of a ``SwitchFailed`` the scheduler writes for a cell that went silent."""
    return reason if reason.startswith(DECLARED) else DECLARED + reason


def _other(role: Role) -> Role:
    return Role.INFERENCE if role is Role.TRAINING else Role.TRAINING


def to_event(
    fact: Fact, run_id: str, *, origin: datetime = EPOCH, state: SchedulerState | None = None
) -> Event | None:
    """The catalogue event recording ``fact`` (``None`` where the catalogue has none)."""
    env = {"run_id": run_id, "time": origin + timedelta(seconds=fact.at)}
    if isinstance(fact, CellAdded):
        return CellRegistered(cell=fact.cell, role=fact.role.value, is_core=fact.is_core,
                              capacity=fact.capacity, **env)
    if isinstance(fact, SwitchStarted):
        return SwitchRequested(cell=fact.cell, from_role=_other(fact.to_role).value,
                               to_role=fact.to_role.value, water_level=max(0.0, fact.water_level),
                               reason=fact.reason, **env)
    if isinstance(fact, SwitchFinished):
        return SwitchCompleted(cell=fact.cell, role=fact.role.value, weight_version=fact.weight_version,
                               phase_timings=dict(fact.phase_timings), **env)
    if isinstance(fact, SwitchAborted):
        return SwitchFailed(cell=fact.cell, role=fact.role.value,
                            phase=REFUSED if fact.phase is None else fact.phase.value,
                            reason=declared_reason(fact.reason) if fact.declared else fact.reason,
                            declared_by_scheduler=fact.declared, causation_id=fact.causation,
                            unusable=fact.unusable, **env)
    if isinstance(fact, CellRepaired):
        return CellRepairedEvent(cell=fact.cell, role=fact.role.value, **env)
    if isinstance(fact, WaterLevelObserved):
        by_role = state.roles_count() if state is not None else {}
        return WaterLevelSampled(level=fact.level, inference_capacity=fact.inference_capacity,
                                 queued_calls=fact.queued_calls, running_calls=fact.running_calls,
                                 unfinished_rollouts=fact.unfinished_rollouts, cells_by_role=by_role,
                                 pressure=fact.pressure.value, smoothed_level=fact.smoothed,
                                 training_backlog=fact.training_backlog, **env)
    if isinstance(fact, PhaseReached):
        return SwitchPhaseEntered(cell=fact.cell, phase=fact.phase.value, **env)
    raise TypeError(f"to_event: not a scheduler fact: {type(fact).__name__}")


def from_event(event: Event, *, origin: datetime = EPOCH) -> Fact | None:
    """The fact a catalogue event records (``None`` for events the core does not read)."""
    at = (event.time - origin).total_seconds()
    if isinstance(event, CellRegistered):
        return CellAdded(cell=event.cell, role=Role(event.role), capacity=event.capacity,
                         at=at, is_core=event.is_core)
    if isinstance(event, SwitchRequested):
        return SwitchStarted(cell=event.cell, to_role=Role(event.to_role), at=at,
                             reason=event.reason, water_level=event.water_level, request=event.event_id)
    if isinstance(event, SwitchCompleted):
        return SwitchFinished(cell=event.cell, role=Role(event.role), at=at,
                              weight_version=event.weight_version, phase_timings=dict(event.phase_timings))
    if isinstance(event, SwitchFailed):
        phase = None if event.phase == REFUSED else CellPhase(event.phase)
        return SwitchAborted(cell=event.cell, role=Role(event.role), phase=phase, reason=event.reason, at=at,
                             declared=event.declared_by_scheduler, causation=event.causation_id,
                             unusable=event.unusable)
    if isinstance(event, CellRepairedEvent):
        return CellRepaired(cell=event.cell, role=Role(event.role), at=at)
    if isinstance(event, WaterLevelSampled):
        return WaterLevelObserved(
            at=at, level=event.level, inference_capacity=event.inference_capacity,
            queued_calls=event.queued_calls, running_calls=event.running_calls,
            unfinished_rollouts=event.unfinished_rollouts,
            training_backlog=event.training_backlog or 0,
            pressure=Pressure(event.pressure) if event.pressure else Pressure.STEADY,
            smoothed=event.level if event.smoothed_level is None else event.smoothed_level,
        )
    if isinstance(event, SwitchPhaseEntered):
        return PhaseReached(cell=event.cell, phase=CellPhase(event.phase), at=at)
    return None
