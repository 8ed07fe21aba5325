"""The runner's snapshots and the shipped tasks, scored by the real evaluator: a harness
that writes the reference solution scores 1; one that times out having written half of
it gets a partial score."""

from __future__ import annotations

from libs.common.events import Context, RolloutFinished, RolloutTimedOut
from services.evaluator.main import build_evaluator
from services.evaluator.settings import EvaluatorSettings
from services.runner.harness import HarnessConfig
from services.runner.runner import RolloutRunner, RunnerConfig
from services.runner.tasks import default_tasks_dir, load_tasks

RUN = "etest"


async def test_snapshots_score_full_and_partial(bus_blobs, tmp_path) -> None:
    bus, blobs = bus_blobs
    tasks = {t.task_id: t for t in load_tasks()}
    solution = default_tasks_dir() / "{}" / "solution"
    solve = HarnessConfig("solver", ("/bin/sh", "-c", f"cp -r {solution.as_posix().format('inventory')}/. ."))
    # all of intervals but overlaps(), then it hangs until the time limit
    partial = HarnessConfig("slow", ("/bin/sh", "-c", f"sed 's/return s1 <= e2 and s2 <= e1/return False/' "
                                     f"{solution.as_posix().format('intervals')}/intervals.py > intervals.py; sleep 30"))
    evaluator = build_evaluator(EvaluatorSettings(tasks_dir=default_tasks_dir(), work_root=tmp_path / "ev",
                                                  isolation="none", workers=1), bus=bus, store=blobs)
    await evaluator.start()
    scores = {}
    for harness, task in ((solve, tasks["inventory"]), (partial, tasks["intervals"])):  # inventory: a package
        limit_scale = 1.0 if harness is solve else 1.0 / task.time_limit_s  # the slow one gets 1 s
        runner = RolloutRunner(RunnerConfig(RUN, "http://proxy:1", tmp_path / "work", harness=harness,
                                            kill_grace_s=0.2, time_limit_scale=limit_scale), bus=bus, blobs=blobs)
        [out] = await runner.run_step(0, [task], group_size=1)
        ended = [d.event async for d in bus.read(Context.ROLLOUTS)
                 if isinstance(d.event, (RolloutFinished, RolloutTimedOut)) and d.event.rollout_id == out.rollout_id]
        scores[harness.name] = await evaluator.evaluate(ended[0])
    assert scores["solver"].score == 1.0 and not scores["solver"].partial
    slow = scores["slow"]
    assert slow.partial and abs(slow.score - 6 / 7) < 1e-6, slow
