"""What an operator meets: rewards the report and a resumed run count as the step loop did,
a summary that says when the stack stopped before the steps were done, mistakes refused
before anything starts (with one line), a replay that leaves the live log alone, and tools
that read a running embedded run through its own server."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

import gyre.up as up
from gyre.report import RunFacts, figures
from libs.common.events import RolloutScored, RolloutScoringFailed, RolloutStarted, StepApplied
from libs.common.runconfig import load_run_config
from libs.common.settings import GyreSettings
from services.runner.runner import RolloutRunner

from .test_cli import gyre

D = "0" * 64


def _started(rid: str, step: int) -> RolloutStarted:
    return RolloutStarted(run_id="r", rollout_id=rid, task_id="t", group_id=f"s{step}-t", harness="h",
                          weight_version=0, api_key_digest=D, step=step)


SCORING = [
    _started("a0", 0), _started("b0", 0),
    RolloutScored(run_id="r", rollout_id="a0", score=1.0),
    RolloutScoringFailed(run_id="r", rollout_id="b0", reason="sandbox crashed"),
    _started("a1", 1), _started("b1", 1),
    RolloutScoringFailed(run_id="r", rollout_id="a1", reason="x"),
    RolloutScoringFailed(run_id="r", rollout_id="b1", reason="x"),
    _started("a2", 2), RolloutScored(run_id="r", rollout_id="a2", score=0.5),
]
LIVE = [0.5, 0.0, 0.5]  # gyre/run.py counts a failed scoring as reward 0


def test_the_report_counts_a_failed_scoring_as_the_step_loop_did() -> None:
    facts = RunFacts("r")
    for ev in SCORING:
        facts.add(ev)
    fig = figures(facts)
    assert (fig["steps_with_rewards"], fig["reward_per_step"], fig["scoring_failed"]) == (3, LIVE, 3)


def test_a_resumed_run_keeps_the_recorded_rewards() -> None:
    from gyre.run import resume_point
    from libs.common.bus.memory import InMemoryBus

    async def go():
        bus = InMemoryBus()
        for ev in SCORING:
            await bus.publish(ev)
        for s in range(3):
            await bus.publish(StepApplied(run_id="r", step=s, weight_version=s + 1))
        return await resume_point(bus, "r")

    point = asyncio.run(go())
    assert (point.first_step, point.rewards) == (3, LIVE)


def test_a_stack_that_stopped_before_the_steps_were_done_says_so(nats_server, tmp_path, monkeypatch) -> None:
    async def hang(self, step, tasks, group_size, **kw):
        await asyncio.sleep(3600)

    monkeypatch.setattr(RolloutRunner, "run_step", hang)

    def watch(settings, plan, children, env, console, *, check, duration, stopping, job=None):
        job.start()
        for _ in range(100):
            if job.progress.status == "rollouts":
                break
            time.sleep(0.2)
        return 1  # as _watch does once a service has exited for good

    monkeypatch.setattr(up, "_watch", watch)
    cfg = load_run_config(None, [f"run.dir={tmp_path}", "run.id=dead", "run.steps=2", "tasks.per_step=1",
                                 "group_size=1", "cells.count=0", "tasks.include=[starter_scale*]",
                                 "metrics.tensorboard=false"])
    settings = GyreSettings(run_id="dead", run_dir=tmp_path / "dead", nats_url=nats_server.url)
    assert up.run_up(settings, cfg) == 1
    summary = json.loads((settings.run_dir / "summary.json").read_text())
    assert summary["steps"] < 2 and summary["interrupted"] is True
    assert any("a service exited for good" in e for e in summary["errors"]), summary["errors"]


@pytest.mark.parametrize("override, json_summary, says", [
    ("harness.name=gyre_agnet", None, "harness.name: unknown harness 'gyre_agnet'"),
    ("tasks.dir=/no/such/tasks", None, "tasks.dir: /no/such/tasks is not a folder"),
    (None, "no/such/summary.json", "the folder"),
])
def test_what_cannot_work_is_refused_before_anything_starts(nats_server, tmp_path, monkeypatch, capsys,
                                                            override, json_summary, says) -> None:
    ran = []
    monkeypatch.setattr(up, "_watch", lambda *a, **kw: ran.append(1) or 0)
    cfg = load_run_config(None, [f"run.dir={tmp_path}", "run.id=pre", "cells.count=0", "warmstart.enabled=false",
                                 *([override] if override else [])])
    settings = GyreSettings(run_id="pre", run_dir=tmp_path / "pre", nats_url=nats_server.url)
    code = up.run_up(settings, cfg, json_summary=tmp_path / json_summary if json_summary else None)
    assert (code, ran) == (2, [])
    assert says in capsys.readouterr().err


def test_cli_input_mistakes_are_one_line(tmp_path) -> None:
    res = gyre("up", "--check", "-c", str(tmp_path), "--run-dir", str(tmp_path / "r"), timeout=60)
    assert res.returncode == 2 and "is a folder, not a YAML file" in res.stderr and "Traceback" not in res.stderr
    res = gyre("bench", "bus", "--json", "--n", "-5", timeout=60)  # it waited for good for -5 events
    assert res.returncode == 2


def test_replay_leaves_the_live_dead_letter_stream_alone(nats_server) -> None:
    from libs.common.bus.jetstream import DEADLETTER_STREAM, JetStreamBus
    from libs.common.events import RunStarted

    async def dead_letters() -> int:
        bus = await JetStreamBus.connect(nats_server.url)
        try:
            return (await bus.js.stream_info(DEADLETTER_STREAM)).state.messages
        finally:
            await bus.close()

    async def put():
        bus = await JetStreamBus.connect(nats_server.url)
        await bus.publish(RunStarted(run_id="demo"))
        await bus.publish_raw("gyre.demo.runs.RunStarted", b"not json", {})  # a foreign writer's
        await bus.close()

    asyncio.run(put())
    before = asyncio.run(dead_letters())
    res = gyre("replay", env={"GYRE_NATS_URL": nats_server.url})
    assert res.returncode == 3 and json.loads(res.stdout)["dead_lettered"] == 1  # said, and exit 3
    assert "cannot be applied" in res.stderr
    assert asyncio.run(dead_letters()) == before


def test_the_tools_read_a_running_embedded_run_through_its_own_server(nats_server, tmp_path) -> None:
    from gyre.events_cmd import run_nats_url
    from libs.common.natsserver import clear_live_url, live_url, live_url_file, write_live_url

    settings = GyreSettings(run_id="live", run_dir=tmp_path / "live")
    store = settings.nats_store_dir
    store.mkdir(parents=True)
    write_live_url(store, nats_server.url)  # what gyre up writes while it runs
    assert live_url_file(store) == settings.run_dir / "nats.url"
    with run_nats_url(settings) as url:
        assert url == nats_server.url  # not a second server on the same store
    # a second gyre up on the same run dir is refused
    cfg = load_run_config(None, [f"run.dir={tmp_path}", "run.id=live", "cells.count=0"])
    assert up.run_up(settings, cfg) == 2
    # a gyre up that died (its pid gone) leaves the store free
    live_url_file(store).write_text(json.dumps({"url": nats_server.url, "pid": 2 ** 22 + 1}))
    assert live_url(store) is None
    clear_live_url(store)
    assert not live_url_file(store).exists() and live_url(store) is None
    assert os.path.isdir(store)
