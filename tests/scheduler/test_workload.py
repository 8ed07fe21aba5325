"""The workload is fixed from the seed's figures, not fitted."""

from __future__ import annotations

import random

import pytest

from services.scheduler.sim.workload import HOUR, WorkloadModel, draw_rollout


def test_lognormal_reproduces_the_seed_shares() -> None:
    model = WorkloadModel()
    assert model.share_over(4.0) == pytest.approx(0.611, abs=1e-9)
    assert model.share_over(model.time_limit_h) == pytest.approx(0.382, abs=1e-9)


def test_drawn_rollouts_match_the_shares_and_respect_the_limit() -> None:
    model, rng = WorkloadModel(), random.Random(7)
    plans = [draw_rollout(model, rng) for _ in range(4000)]
    own = [sum(p.calls) + sum(p.tools) for p in plans]
    assert max(own) <= model.time_limit_h * HOUR + 1.0
    assert sum(p.truncated for p in plans) / len(plans) == pytest.approx(0.382, abs=0.03)
    assert sum(t > 4 * HOUR for t in own) / len(own) == pytest.approx(0.611, abs=0.03)
    whole = [p for p in plans if not p.truncated]  # cut ones keep only their call-heavy start
    call_share = sum(sum(p.calls) for p in whole) / sum(sum(p.calls) + sum(p.tools) for p in whole)
    assert call_share == pytest.approx(model.call_share, abs=0.03)
    assert sum(own) / len(own) / HOUR == pytest.approx(model.mean_duration_h(), rel=0.03)


def test_front_loading_moves_calls_early() -> None:
    rng = random.Random(3)
    plan = draw_rollout(WorkloadModel(front_load=1.0, time_limit_h=12.0), rng)
    half = len(plan.calls) // 2
    assert sum(plan.calls[:half]) > 2 * sum(plan.calls[half:])


def test_workload_refuses_figures_that_contradict_the_seed() -> None:
    with pytest.raises(ValueError, match="must exceed 4 h"):
        WorkloadModel(time_limit_h=3.5)
    with pytest.raises(ValueError, match="share_timed_out < share_over_4h"):
        WorkloadModel(share_timed_out=0.7)
