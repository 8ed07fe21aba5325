"""Facts <-> catalogue events: what the lead's live scheduler will publish and replay."""

from __future__ import annotations

from datetime import UTC, datetime

from libs.common.events import CellRegistered, SwitchFailed, SwitchRequested, WaterLevelSampled, decode
from services.scheduler.core import (
    CellAdded,
    CellPhase,
    PhaseReached,
    Pressure,
    Role,
    SwitchAborted,
    SwitchFinished,
    SwitchStarted,
    WaterLevelObserved,
)
from services.scheduler.core.translate import from_event, to_event

ORIGIN = datetime(2026, 11, 29, tzinfo=UTC)


def test_round_trip_through_the_wire() -> None:
    facts = [
        CellAdded(cell="c0", role=Role.INFERENCE, capacity=8, at=0.0, is_core=True),
        SwitchStarted(cell="c0", to_role=Role.TRAINING, at=12.5, reason="water level low", water_level=3.0),
        SwitchFinished(cell="c0", role=Role.TRAINING, at=21.0, weight_version=4,
                       phase_timings={"draining": 0.5, "joining": 3.52}),
        SwitchAborted(cell="c0", role=Role.INFERENCE, phase=CellPhase.JOINING, reason="pull failed", at=30.0),
    ]
    for fact in facts:
        event = to_event(fact, "run-1", origin=ORIGIN)
        assert event is not None
        wire = decode(event.to_json())
        assert from_event(wire, origin=ORIGIN) == fact


def test_events_carry_the_catalogue_fields() -> None:
    start = to_event(SwitchStarted(cell="c3", to_role=Role.INFERENCE, at=1.0, reason="demand up"), "r")
    assert isinstance(start, SwitchRequested)
    assert (start.from_role, start.to_role) == ("training", "inference")
    assert start.subject == "gyre.r.cells.SwitchRequested.c3"
    reg = to_event(CellAdded(cell="c1", role=Role.TRAINING, capacity=4), "r")
    assert isinstance(reg, CellRegistered) and reg.role == "training" and not reg.is_core
    fail = to_event(SwitchAborted(cell="c1", role=Role.TRAINING, phase=CellPhase.LEAVING, reason="x", at=2), "r")
    assert isinstance(fail, SwitchFailed) and fail.phase == "leaving"


def test_water_level_and_phase_progress_map_both_ways() -> None:
    obs = WaterLevelObserved(at=5.0, level=12.0, inference_capacity=16, queued_calls=2, running_calls=10,
                             unfinished_rollouts=30, training_backlog=3, pressure=Pressure.RELEASE, smoothed=11.0)
    event = to_event(obs, "r")
    assert isinstance(event, WaterLevelSampled) and event.level == 12.0 and event.unfinished_rollouts == 30
    back = from_event(event)
    assert back is not None and back.level == 12.0
    assert (back.pressure, back.smoothed, back.training_backlog) == (Pressure.RELEASE, 11.0, 3)
    phase = PhaseReached(cell="c0", phase=CellPhase.MIGRATING, at=1.0)
    assert from_event(to_event(phase, "r")) == phase
