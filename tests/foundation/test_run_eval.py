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


async def test_resume_point_starts_after_the_last_contiguous_applied_step():
    from gyre.run import resume_point
    from libs.common.bus.memory import InMemoryBus
    from libs.common.events import HeldoutEvaluated, RolloutScored, RolloutStarted, RunStarted, StepApplied

    bus = InMemoryBus()
    assert (await resume_point(bus, "r")).first_step == 0  # a new run starts at step 0
    await bus.publish(RunStarted(run_id="r"))
    await bus.publish(HeldoutEvaluated(run_id="r", phase="before", tasks=2, success=0.5, mean_score=0.6))
    for step, score in ((0, 0.2), (1, 0.4), (2, 0.9)):
        await bus.publish(RolloutStarted(run_id="r", rollout_id=f"x{step}", task_id="t", group_id=f"g{step}",
                                         harness="h", weight_version=step, api_key_digest="a" * 64, step=step))
        await bus.publish(RolloutScored(run_id="r", rollout_id=f"x{step}", score=score))
    await bus.publish(StepApplied(run_id="r", step=0, weight_version=1))
    await bus.publish(StepApplied(run_id="r", step=1, weight_version=2))
    await bus.publish(RunStarted(run_id="r"))  # the restart
    point = await resume_point(bus, "r")
    assert point.first_step == 2 and point.weight_version == 2 and point.attempt == 1
    assert point.rewards == [0.2, 0.4] and point.started_steps == {0, 1, 2}
    assert point.evals["before"]["success"] == 0.5


async def test_a_resumed_step_re_runs_only_the_tasks_whose_groups_were_not_settled():
    """Groups of a step that settled before a restart (GroupQueued) count toward it; the
    re-run leaves their tasks out, so the step gets each task once and no re-run group is
    left over after the trainer has closed the step."""
    from gyre.run import resume_point
    from libs.common.bus.memory import InMemoryBus
    from libs.common.events import GroupQueued, RolloutStarted, RunStarted

    bus = InMemoryBus()
    await bus.publish(RunStarted(run_id="r"))
    for task in ("calc", "x_calc", "slug"):
        await bus.publish(RolloutStarted(run_id="r", rollout_id=f"s0-{task}-0", task_id=task, group_id=f"s0-{task}",
                                         harness="h", weight_version=0, api_key_digest="a" * 64, step=0))
    await bus.publish(GroupQueued(run_id="r", step=0, group_id="s0-x_calc", micro_steps=1, samples=2))
    await bus.publish(GroupQueued(run_id="r", step=0, group_id="re0-s0-slug", micro_steps=1, samples=2))
    await bus.publish(RunStarted(run_id="r"))
    point = await resume_point(bus, "r")
    assert point.started_steps == {0} and point.attempt == 1
    assert point.settled_tasks(0) == {"x_calc", "slug"} and point.settled_tasks(1) == set()
