"""The in-run held-out evaluation's arithmetic and the run's task selection."""

from __future__ import annotations

from types import SimpleNamespace

from gyre.run import eval_result, select_tasks
from libs.common.runconfig import load_run_config


def test_success_counts_fully_passing_tasks_and_mean_score_every_test():
    outcomes = [SimpleNamespace(rollout_id=f"r{i}", task_id=f"t{i}") for i in range(4)]
    rewards = {"r0": 1.0, "r1": 0.5, "r2": 0.0}  # r3 never scored: counts as 0
    result = eval_result(outcomes, rewards, weight_version=3)
    assert result["tasks"] == 4 and result["scored"] == 3
    assert result["success"] == 0.25 and result["mean_score"] == 0.375
    assert result["per_task"] == {"t0": 1.0, "t1": 0.5, "t2": 0.0, "t3": 0.0} and result["weight_version"] == 3


def test_include_globs_narrow_the_task_set_and_splits_stay_apart():
    everything = select_tasks(load_run_config(None, []), None)
    cfg = load_run_config(None, ["tasks.include=[slug*, lru]"])
    chosen = select_tasks(cfg, None)
    assert {t.task_id for t in chosen} == {"slugify", "lru"} and len(everything) > len(chosen)
    heldout = select_tasks(load_run_config(None, []), "heldout")
    train = select_tasks(load_run_config(None, []), "train")
    assert heldout and train and not {t.task_id for t in heldout} & {t.task_id for t in train}
