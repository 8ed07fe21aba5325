"""The elastic policy's first rule (a step's update pulls the core into training at once)
holds only where the core applies an update only while it trains
(``Tick.update_needs_training``: the seed's core and the simulator's model). Gyre's live
trainer applies it in any role, so the live scheduler does not drain the core for it."""

from __future__ import annotations

from libs.common.bus.memory import InMemoryBus
from libs.common.events import CellRegistered, GroupQueued, MicroStepDone, MicroStepQueued, RolloutStarted
from services.scheduler.core import (
    CellPhase,
    ElasticPolicy,
    PhaseReached,
    Role,
    SwitchFinished,
    SwitchStarted,
    Tick,
    decide,
    evolve_all,
)
from services.scheduler.live import LiveScheduler

from ._helpers import cluster

RUN = "update"
H = "0" * 64


def _core_just_back():
    """The core trained and came back to inference 5 s ago (the reviewer's r2 case)."""
    return evolve_all(cluster(3), [
        SwitchStarted("c0", Role.TRAINING, 100, "x"), PhaseReached("c0", CellPhase.MIGRATING, 101),
        PhaseReached("c0", CellPhase.RELEASING, 102), PhaseReached("c0", CellPhase.JOINING, 103),
        SwitchFinished("c0", Role.TRAINING, 104),
        SwitchStarted("c0", Role.INFERENCE, 1000, "x"), PhaseReached("c0", CellPhase.RESUMING, 1001),
        SwitchFinished("c0", Role.INFERENCE, 1005)])


def _started(facts) -> list[tuple[str, Role]]:
    return [(f.cell, f.to_role) for f in facts if isinstance(f, SwitchStarted)]


def test_an_update_the_core_applies_in_any_role_does_not_move_it() -> None:
    state = _core_just_back()
    tick = Tick(at=1010, running_calls=30, update_pending=True, update_needs_training=False)
    assert _started(decide(state, tick, ElasticPolicy())) == []
    assert not tick.training_wanted
    seed_like = Tick(at=1010, running_calls=30, update_pending=True)  # the default: the simulator's model
    assert _started(decide(state, seed_like, ElasticPolicy())) == [("c0", Role.TRAINING)]


def test_an_update_the_core_applies_in_any_role_does_not_hold_it_in_training_under_reclaim() -> None:
    state = cluster(3, training=1)  # the core trains alone; calls pile up
    policy = ElasticPolicy(hold_s=0, min_dwell_s=0, smoothing_s=0)
    tick = Tick(at=10.0, queued_calls=100, update_pending=True, update_needs_training=False)
    assert _started(decide(state, tick, policy)) == [("c0", Role.INFERENCE)]
    seed_like = Tick(at=10.0, queued_calls=100, update_pending=True)
    assert _started(decide(state, seed_like, policy)) == []  # the seed's core stays to apply it


async def _live(update_needs_training: bool | None) -> tuple[LiveScheduler, list]:
    bus, sent = InMemoryBus(), []
    for i in range(3):
        await bus.publish(CellRegistered(run_id=RUN, cell=f"c{i}", role="inference", is_core=i == 0, capacity=8))
    await bus.publish(RolloutStarted(run_id=RUN, rollout_id="r1", task_id="t", group_id="g", step=0, harness="h",
                                     weight_version=0, api_key_digest=H))
    await bus.publish(MicroStepQueued(run_id=RUN, step=0, micro_step="g-m0", group_id="g", sample_digests=["a" * 64],
                                      advantages=[1.0], n_tokens=1, group_micro_steps=1))
    await bus.publish(GroupQueued(run_id=RUN, step=0, group_id="g", micro_steps=1, rollout_ids=["r1"], samples=1))
    await bus.publish(MicroStepDone(run_id=RUN, step=0, micro_step="g-m0", cell="c1", weight_version=0, n_tokens=1,
                                    loss=0.0, gradient={}))

    async def proxy_stats() -> dict:
        return {"cells": [{"name": f"c{i}", "in_flight": 10} for i in range(3)]}

    async def send_switch(cell: str, to_role: str, causation: str) -> dict:
        sent.append((cell, to_role))
        return {"ok": True}

    kwargs = {} if update_needs_training is None else {"update_needs_training": update_needs_training}
    live = LiveScheduler(run_id=RUN, bus=bus, policy=ElasticPolicy(), proxy_stats=proxy_stats,
                         send_switch=send_switch, groups_per_step=1, clock=lambda: 1000.0, **kwargs)
    await live.catch_up_demand()
    await live.catch_up_cells()
    return live, sent


async def test_the_live_scheduler_leaves_the_core_serving_for_an_update() -> None:
    live, _ = await _live(None)
    assert live.demand.update_pending
    assert _started(await live.tick()) == [] and not live.last_tick.update_needs_training
    live, _ = await _live(True)  # GYRE_SCHEDULER_UPDATE_NEEDS_TRAINING=1: a trainer that applies only in training
    assert _started(await live.tick()) == [("c0", Role.TRAINING)]
