"""The simulator drives the real policy: determinism, invariants, and rolled-back failures."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.scheduler.core import (
    CellPhase,
    ElasticPolicy,
    Role,
    SchedulerState,
    SwitchAborted,
    SwitchFinished,
    SwitchStarted,
    evolve,
)
from services.scheduler.sim.config import preset
from services.scheduler.sim.modes import simulate
from services.scheduler.sim.report import schedule_digest

TINY = preset("tiny")


def test_same_seed_same_schedule_by_digest() -> None:
    a = simulate(TINY, "elastic")
    b = simulate(TINY, "elastic")
    assert a.digest == b.digest == schedule_digest(b.facts)
    assert a.switches > 0  # a schedule with something in it
    assert simulate(replace(TINY, seed=1), "elastic").digest != a.digest


def test_replaying_the_facts_rebuilds_the_final_state() -> None:
    result = simulate(TINY, "elastic")
    state = SchedulerState()
    for fact in result.facts:
        state = evolve(state, fact)
    assert state.core is not None and state.core.name == "c00"
    assert len(state.cells) == TINY.cells


@pytest.mark.parametrize("mode", ["elastic", "colocate"])
def test_core_cell_never_leaves_training_ownership(mode: str) -> None:
    """At every fact: the core owns the optimizer, and no satellite is in or heading to
    training unless the core is too (the training group is rooted at the core)."""
    result = simulate(replace(TINY, steps=6), mode)
    state = SchedulerState()
    core_phases = set()
    for fact in result.facts:
        state = evolve(state, fact)
        core = state.core
        assert core is not None and core.owns_optimizer
        core_phases.add(core.phase)
        assert [c.name for c in state.cells if c.owns_optimizer] == [core.name]
        satellites_training = [c for c in state.heading_to(Role.TRAINING) if not c.is_core]
        if satellites_training:
            assert core.heading_to is Role.TRAINING, f"at {fact.at}: {satellites_training[0].name} trains without core"
    # and the core really does both: it served inference while demand was high, and trained
    assert {CellPhase.INFERENCE, CellPhase.TRAINING} <= core_phases


def test_failed_switches_roll_back_and_the_run_still_finishes() -> None:
    config = replace(TINY, switch_failure_rate=0.3, steps=4)
    result = simulate(config, "elastic")
    aborted = [f for f in result.facts if isinstance(f, SwitchAborted)]
    assert aborted, "expected injected failures"
    assert all(f.reason.startswith("simulated failure") for f in aborted)
    assert len(result.step_end_h) == 4  # every step applied; no call was lost to a switch
    for f in aborted:
        assert (f.role is Role.INFERENCE) == (f.phase in (CellPhase.DRAINING, CellPhase.MIGRATING,
                                                          CellPhase.RELEASING, CellPhase.JOINING))


def test_switch_timings_are_the_seed_figures() -> None:
    result = simulate(TINY, "elastic")
    finished = [f for f in result.facts if isinstance(f, SwitchFinished)]
    to_training = [f for f in finished if f.role is Role.TRAINING]
    assert to_training
    for f in to_training:
        assert sum(f.phase_timings.values()) == pytest.approx(8.52, abs=1e-3)
    starts = [f for f in result.facts if isinstance(f, SwitchStarted) and f.to_role is Role.INFERENCE]
    assert starts  # reclaims happened (leaving waits for a micro-step, so no fixed total)


def test_async_never_switches_and_colocate_moves_all_cells_together() -> None:
    assert simulate(TINY, "async", training_cells=2).switches == 0
    colocate = simulate(TINY, "colocate")
    starts = [f for f in colocate.facts if isinstance(f, SwitchStarted)]
    assert len(starts) % TINY.cells == 0


def test_work_is_the_same_in_every_mode() -> None:
    """The time limit counts the agent's own time, so every mode runs the same rollouts."""
    runs = [simulate(TINY, "elastic"), simulate(TINY, "colocate"), simulate(TINY, "async", training_cells=2)]
    assert len({round(r.timed_out_share, 6) for r in runs}) == 1


def test_unknown_options_and_modes_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown simulation option"):
        preset("tiny", cellz=3)
    with pytest.raises(ValueError, match="unknown preset"):
        preset("nope")
    with pytest.raises(ValueError, match="unknown mode"):
        simulate(TINY, "hybrid")
    with pytest.raises(ValueError, match="training_cells"):
        simulate(TINY, "async")


def test_session_memory_model_keeps_sessions_within_capacity() -> None:
    """Optional KV-memory model: sessions stay on their cell, move on drain, never overflow."""
    config = replace(TINY, sessions_per_cell=3, steps=4, switch_failure_rate=0.1)
    from services.scheduler.sim.engine import ClusterSim
    from services.scheduler.sim.modes import make_policy
    from services.scheduler.sim.sessions import SessionPool

    for mode in ("elastic", "colocate"):
        sim = ClusterSim(config, make_policy(mode, config))
        pool = sim.pool
        assert isinstance(pool, SessionPool)
        original = pool.dispatch

        def checked(now: float, _orig=original, _pool=pool) -> list:
            started = _orig(now)
            assert all(len(s) <= _pool.sessions for s in _pool.resident.values())
            assert all(_pool.home[c.rollout] == c.cell for c in started)
            return started

        pool.dispatch = checked  # type: ignore[method-assign]
        result = sim.run()
        assert len(result.step_end_h) == 4
        assert result.migrated_calls > 0 or pool.evictions > 0
    assert simulate(config, "elastic").digest == simulate(config, "elastic").digest


def test_conventional_trainer_waits_for_the_whole_batch() -> None:
    """Without streaming, no micro-step of a step is claimable before its batch is complete."""
    from services.scheduler.sim.training import MicroStep, StepQueue

    queue = StepQueue(batch=4, steps=2, streaming=False)
    for i in range(3):
        queue.add(MicroStep(i, 1.0))
    assert not queue.claimable and not queue.batch_ready
    queue.add(MicroStep(3, 1.0))
    assert len(queue.claimable) == 4 and queue.batch_ready
    queue.add(MicroStep(4, 1.0))  # finished early: waits for the next step's batch
    streaming = StepQueue(batch=4, steps=2)
    streaming.add(MicroStep(0, 1.0))
    assert len(streaming.claimable) == 1


def test_only_the_baselines_lose_streaming() -> None:
    """``baseline_streaming`` changes async and colocate, never elastic (Gyre's trainer streams)."""
    on = replace(TINY, baseline_streaming=True)
    assert simulate(on, "elastic").digest == simulate(TINY, "elastic").digest
    assert simulate(on, "async", training_cells=2).hours != simulate(TINY, "async", training_cells=2).hours


def test_batch_dependent_latency_keeps_work_and_speeds_lone_calls() -> None:
    """``full_batch_slowdown``: a lone call runs ``slowdown`` times faster than on a full cell,
    the work served (full-cell seconds) is the same, and 1.0 is the load-independent model."""
    from services.scheduler.sim.inference import Call, InferencePool

    pool = InferencePool(4, full_batch_slowdown=2.0)
    pool.add_cell("c0", 0.0)
    pool.submit(Call(1, 1, 10.0))
    (lone,) = pool.dispatch(0.0)
    assert lone.ends_at == pytest.approx(5.0)  # alone: twice as fast as on a full cell
    for i in range(2, 5):
        pool.submit(Call(i, i, 10.0))
    pool.dispatch(1.0)  # now four calls share the cell: each at full-cell speed
    ends = {c.id: c.ends_at for c in pool.take_retimed()}
    assert ends[1] == pytest.approx(1.0 + 8.0) and ends[2] == pytest.approx(11.0)
    assert pool.finish("c0", 1, 9.0) is not None
    assert pool.executed_s == pytest.approx(10.0 + 3 * 8.0)

    slow = replace(TINY, full_batch_slowdown=2.0)
    runs = [simulate(slow, "elastic"), simulate(TINY, "elastic")]
    assert runs[0].inference_work_cell_h == pytest.approx(runs[1].inference_work_cell_h)
    assert runs[0].digest != runs[1].digest
    assert simulate(replace(TINY, full_batch_slowdown=1.0), "elastic").digest == runs[1].digest
    with pytest.raises(ValueError, match="full_batch_slowdown"):
        replace(TINY, full_batch_slowdown=0.5)


def test_the_elastic_policys_thresholds_are_sim_settings_and_flags():
    from services.scheduler.sim.cli import build_parser
    from services.scheduler.sim.config import SimConfig
    from services.scheduler.sim.modes import make_policy

    policy = make_policy("elastic", SimConfig(hold_s=5.0, low_watermark=0.8, high_watermark=1.5, min_dwell_s=60.0,
                                              smoothing_s=10.0, max_switches_in_flight=3))
    assert (policy.hold_s, policy.low_watermark, policy.high_watermark, policy.min_dwell_s, policy.smoothing_s,
            policy.max_switches_in_flight) == (5.0, 0.8, 1.5, 60.0, 10.0, 3)
    assert make_policy("elastic", SimConfig()).hold_s == 30.0  # the policy's own default
    args = build_parser().parse_args(["--hold-s", "7", "--high-watermark", "1.4"])
    assert (args.opt_hold_s, args.opt_high_watermark) == (7.0, 1.4)
    with pytest.raises(ValueError, match="low_watermark < high_watermark"):
        make_policy("elastic", SimConfig(low_watermark=1.3, high_watermark=1.2))


def test_the_run_configs_thresholds_reach_the_live_scheduler(monkeypatch):
    from gyre.up import plan_stack
    from libs.common.runconfig import RunConfigError, load_run_config
    from services.scheduler.main import policy_from_env

    cfg = load_run_config(None, ["cells.count=1", "cells.hold_s=4", "cells.low_watermark=0.9",
                                 "cells.high_watermark=1.6", "cells.max_switches_in_flight=3",
                                 "cells.min_inference_cells=2"])
    (launch,) = [x for x in plan_stack(cfg, "tok") if x.service == "scheduler"]
    for key, value in launch.env.items():
        if key.startswith("GYRE_SCHEDULER_"):
            monkeypatch.setenv(key, value)
    policy = policy_from_env()
    assert (policy.hold_s, policy.low_watermark, policy.high_watermark, policy.max_switches_in_flight,
            policy.min_inference_cells) == (4.0, 0.9, 1.6, 3, 2)
    monkeypatch.setenv("GYRE_SCHEDULER_POLICY", "async")
    monkeypatch.setenv("GYRE_SCHEDULER_TRAINING_CELLS", "2")
    assert policy_from_env().training_cells == 2
    with pytest.raises(RunConfigError, match="low_watermark must be below high_watermark"):
        load_run_config(None, ["cells.low_watermark=1.5"])
    with pytest.raises(RunConfigError, match="min_inference_cells"):  # a call must always find a cell
        load_run_config(None, ["cells.min_inference_cells=0"])
    with pytest.raises(ValueError, match="min_inference_cells"):
        ElasticPolicy(min_inference_cells=0)
