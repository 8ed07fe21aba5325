"""The policies, driven tick by tick with instant cell agents: who switches, when, and why."""

from __future__ import annotations

import random

import pytest

from services.scheduler.core import (
    AsyncPolicy,
    CellPhase,
    ColocatePolicy,
    ElasticPolicy,
    PhaseReached,
    Pressure,
    Role,
    SwitchAborted,
    SwitchFinished,
    SwitchStarted,
    Tick,
    WaterLevelObserved,
    decide,
    evolve,
    evolve_all,
    water_level,
)

from ._helpers import cluster, phases, step

QUICK = ElasticPolicy(hold_s=60, min_dwell_s=0, between_calls_weight=0.5, smoothing_s=0)


def test_water_level_counts_rollouts_busy_in_tools() -> None:
    assert water_level(Tick(at=0, queued_calls=2, running_calls=10), 0.5) == 12
    # 40 unfinished rollouts that spend half their time calling: 20 calls expected
    assert water_level(Tick(at=0, running_calls=4, rollouts_between_calls=36), 0.5) == 20


def test_decide_records_the_observation_first() -> None:
    facts = decide(cluster(3), Tick(at=5, running_calls=20), QUICK)
    assert isinstance(facts[0], WaterLevelObserved)
    assert facts[0].pressure is Pressure.STEADY and facts[0].inference_capacity == 24


def test_release_waits_for_hold_then_moves_the_core_first() -> None:
    state = cluster(3)  # 24 slots; demand 6 fits in 2 cells easily
    low = dict(running_calls=6, training_backlog=4)
    state, log = step(state, Tick(at=0, **low), QUICK)
    assert not [f for f in log if isinstance(f, SwitchStarted)]
    state, log = step(state, Tick(at=30, **low), QUICK)
    assert not [f for f in log if isinstance(f, SwitchStarted)]  # held 30 s < 60 s
    state, log = step(state, Tick(at=60, **low), QUICK)
    started = [f for f in log if isinstance(f, SwitchStarted)]
    assert [(f.cell, f.to_role) for f in started] == [("c0", Role.TRAINING)]
    assert "training work waiting" in started[0].reason
    # the next release needs the pressure held again: one cell per hold period
    state, log = step(state, Tick(at=90, **low), QUICK)
    assert not [f for f in log if isinstance(f, SwitchStarted)]
    state, log = step(state, Tick(at=150, cell_calls={"c1": 5, "c2": 1}, **low), QUICK)
    assert [f.cell for f in log if isinstance(f, SwitchStarted)] == ["c2"]  # the most idle


def test_no_release_without_training_work_or_when_demand_needs_the_cells() -> None:
    state = cluster(3)
    for at in range(0, 600, 30):
        state, log = step(state, Tick(at=at, running_calls=6, training_backlog=0), QUICK)
        assert not [f for f in log if isinstance(f, SwitchStarted)]
    state = cluster(3)
    for at in range(600, 1200, 30):  # 20 calls do not fit in 2 cells (16 slots) at 95 %
        state, log = step(state, Tick(at=at, running_calls=20, training_backlog=5), QUICK)
        assert not [f for f in log if isinstance(f, SwitchStarted)]


def test_reclaim_brings_satellites_back_idle_first_core_last() -> None:
    state = cluster(4, training=3)  # c0 (core), c1, c2 train; c3 serves 8 slots
    busy = frozenset({"c0", "c1"})
    high = dict(running_calls=8, queued_calls=12, training_backlog=3, busy_trainers=busy)
    state, _ = step(state, Tick(at=0, **high), QUICK)
    state, log = step(state, Tick(at=60, **high), QUICK)
    started = [f for f in log if isinstance(f, SwitchStarted)]
    assert [f.cell for f in started] == ["c2", "c1"]  # 20 calls need ~2 more cells; idle c2 first
    assert all(f.to_role is Role.INFERENCE for f in started)
    assert phases(state)["c0"] is CellPhase.TRAINING  # training work waits: the core stays


def test_update_pending_pulls_the_core_in_at_once() -> None:
    state = cluster(3)
    state, log = step(state, Tick(at=0, running_calls=30, update_pending=True), QUICK)
    started = [(f.cell, f.reason) for f in log if isinstance(f, SwitchStarted)]
    assert started == [("c0", "core applies the step's update")]


def test_the_update_waits_while_no_other_cell_serves() -> None:
    # c1 is on its way back from training, the core is back already: the core leaving for
    # the update now would leave nobody serving until c1 resumes
    state = evolve_all(cluster(2, training=2), [
        SwitchStarted(cell="c1", to_role=Role.INFERENCE, at=1, reason="t"),
        SwitchStarted(cell="c0", to_role=Role.INFERENCE, at=2, reason="t"),
        PhaseReached(cell="c0", phase=CellPhase.RESUMING, at=3),
        SwitchFinished(cell="c0", role=Role.INFERENCE, at=4)])
    assert phases(state) == {"c0": CellPhase.INFERENCE, "c1": CellPhase.LEAVING}
    tick = Tick(at=8, running_calls=6, update_pending=True)
    assert not [f for f in decide(state, tick, QUICK) if isinstance(f, SwitchStarted)]
    state = evolve_all(state, [PhaseReached(cell="c1", phase=CellPhase.RESUMING, at=9),
                               SwitchFinished(cell="c1", role=Role.INFERENCE, at=10)])
    started = [f.cell for f in decide(state, Tick(at=11, running_calls=6, update_pending=True), QUICK)
               if isinstance(f, SwitchStarted)]
    assert started == ["c0"]


def test_a_cell_whose_switch_failed_is_left_alone_for_a_while() -> None:
    state = evolve_all(cluster(3), [SwitchStarted(cell="c0", to_role=Role.TRAINING, at=0, reason="t"),
                                    SwitchAborted(cell="c0", role=Role.INFERENCE, phase=CellPhase.DRAINING,
                                                  reason="joining failed", at=1)])
    tick = dict(running_calls=0, update_pending=True)
    assert not [f for f in decide(state, Tick(at=30, **tick), QUICK) if isinstance(f, SwitchStarted)]
    later = [f.cell for f in decide(state, Tick(at=61, **tick), QUICK) if isinstance(f, SwitchStarted)]
    assert later == ["c0"]


def test_idle_trainers_return_when_there_is_no_training_work() -> None:
    state = cluster(3, training=2)
    tick = dict(running_calls=10, training_backlog=0)
    state, _ = step(state, Tick(at=0, **tick), QUICK)
    state, log = step(state, Tick(at=60, **tick), QUICK)
    assert [f.cell for f in log if isinstance(f, SwitchStarted)] == ["c1"]  # satellites before the core
    state, _ = step(state, Tick(at=90, **tick), QUICK)
    state, log = step(state, Tick(at=150, **tick), QUICK)
    assert [f.cell for f in log if isinstance(f, SwitchStarted)] == ["c0"]


def _count_switches(policy: ElasticPolicy, seed: int, minutes: int = 240) -> int:
    """Noisy demand hovering around the release threshold of a 6-cell cluster."""
    rng = random.Random(seed)
    state, switches = cluster(6), 0
    for k in range(minutes * 2):
        calls = max(0, round(rng.gauss(30, 6)))  # 48 slots; the threshold sits right in the noise
        tick = Tick(at=k * 30.0, running_calls=calls, training_backlog=3, busy_trainers=frozenset())
        state, log = step(state, tick, policy)
        switches += sum(isinstance(f, SwitchStarted) for f in log)
    return switches


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_flapping_under_noisy_water_levels(seed: int) -> None:
    damped = _count_switches(ElasticPolicy(between_calls_weight=0.5), seed)
    assert damped <= 8, f"{damped} switches in 4 h of noise"
    # the same noise without hysteresis flaps: the test can tell the difference
    bare = ElasticPolicy(low_watermark=0.999, high_watermark=1.0, hold_s=0, min_dwell_s=0,
                         max_switches_in_flight=6, between_calls_weight=0.5, smoothing_s=0)
    assert _count_switches(bare, seed) > 3 * max(damped, 4)


def test_elastic_rejects_an_inverted_band() -> None:
    with pytest.raises(ValueError, match="low_watermark < high_watermark"):
        ElasticPolicy(low_watermark=1.0, high_watermark=0.9)


def test_colocate_moves_everyone_and_back() -> None:
    policy = ColocatePolicy()
    state = cluster(3)
    state, log = step(state, Tick(at=0, running_calls=10, batch_ready=True, training_backlog=8), policy)
    assert [f.cell for f in log if isinstance(f, SwitchStarted)] == ["c0", "c1", "c2"]  # core first
    assert set(phases(state).values()) == {CellPhase.TRAINING}
    state, log = step(state, Tick(at=30, running_calls=0, training_backlog=0), policy)
    assert [f.cell for f in log if isinstance(f, SwitchStarted)] == ["c1", "c2", "c0"]  # core last
    assert set(phases(state).values()) == {CellPhase.INFERENCE}


def test_async_keeps_its_split_and_restores_it_after_a_failed_switch() -> None:
    policy = AsyncPolicy(training_cells=2)
    assert [policy.initial_role(i, i == 0) for i in range(4)] == [Role.TRAINING, Role.TRAINING,
                                                                 Role.INFERENCE, Role.INFERENCE]
    state = cluster(4, training=2)
    for at in (0, 30, 60):
        state, log = step(state, Tick(at=at, running_calls=100, training_backlog=9), policy)
        assert not [f for f in log if isinstance(f, SwitchStarted)]
    # an operator moved c1 out and its switch back failed: the policy restores the split
    state = evolve_all(state, [SwitchStarted(cell="c1", to_role=Role.INFERENCE, at=70, reason="manual"),
                               SwitchAborted(cell="c1", role=Role.TRAINING, phase=CellPhase.LEAVING,
                                             reason="stuck", at=71)])
    state = evolve(state, SwitchStarted(cell="c1", to_role=Role.INFERENCE, at=80, reason="manual"))
    state, log = step(state, Tick(at=90), policy)
    assert [f.cell for f in log if isinstance(f, SwitchStarted)] == ["c2"]
