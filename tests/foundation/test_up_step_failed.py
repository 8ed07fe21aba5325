"""A step the runner fails on (``StepFailed``: some rollouts raised past the runner's own
recovery) ends ``gyre up``/``gyre run`` with one clear line naming the failed rollouts and
their groups, the summary still written (the line in its "errors"), and exit status 1;
not a traceback.

The stack is cut down to what the step loop needs: a real nats-server, no services; the
runner's ``run_step`` is replaced by one that raises ``StepFailed``."""

from __future__ import annotations

import io
import json

from rich.console import Console

from gyre.up import MainJob
from libs.common.runconfig import load_run_config
from libs.common.settings import GyreSettings
from services.runner.runner import RolloutOutcome, RolloutRunner, StepFailed


def _failing_run_step(calls: list[int]):
    async def run_step(self, step, tasks, group_size, **kw) -> list[RolloutOutcome]:
        calls.append(step)
        task = tasks[0].task_id
        ok = RolloutOutcome(f"s{step}-{task}-0-aaaa", task, f"s{step}-{task}", "finished", 0, 0.1, "d")
        err = ConnectionError("the bus connection is closed\n(second line)")
        err.add_note(f"rollout s{step}-{task}-1-bbbb of group s{step}-{task}")
        raise StepFailed(step, 2, [ok], [err]) from err

    return run_step


def test_a_failed_step_is_one_clear_line_and_the_summary_is_still_written(nats_server, tmp_path, monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(RolloutRunner, "run_step", _failing_run_step(calls))
    cfg = load_run_config(None, [f"run.dir={tmp_path}", "run.id=sf", "run.steps=2", "tasks.per_step=1",
                                 "group_size=2", "cells.count=0", "tasks.include=[starter_scale*]"])
    settings = GyreSettings(run_id="sf", run_dir=tmp_path / "sf", nats_url=nats_server.url)
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    job = MainJob(cfg, nats_server.url, "http://127.0.0.1:9")
    job.start()
    assert job.thread is not None
    job.thread.join(60)
    assert job.done and calls == [0]  # the run stops at the failed step

    out = io.StringIO()
    summary_path = tmp_path / "summary.json"
    code = job.finish(settings, summary_path, Console(file=out, width=400))
    assert code == 1
    text = out.getvalue()
    assert "Traceback" not in text
    [line] = [x for x in text.splitlines() if x.startswith("gyre: run failed:")]
    assert "step 0: 1 of 2 rollouts failed in the runner" in line
    assert "rollout s0-" in line and "of group s0-" in line and "the bus connection is closed" in line
    assert "StepFailed(" not in line and "\\n" not in line
    summary = json.loads(summary_path.read_text())
    assert summary == json.loads((settings.run_dir / "summary.json").read_text())  # beside the report
    [error] = summary["errors"]
    assert error.startswith("step 0: 1 of 2 rollouts failed in the runner") and "of group s0-" in error
    assert job.progress.status == f"failed: {error}"
