"""A projector killed mid-stream applies every event exactly once after restart, and a
log exported then replayed into an empty database gives identical rows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from libs.common.bus.jetstream import JetStreamBus
from libs.common.db.engine import make_engine, upgrade
from libs.common.db.models import EventCount, EventRow, RolloutRow
from libs.common.db.projection import ProjectionRunner, offsets
from libs.common.db.readmodels import readmodels
from libs.common.eventlog import readmodel_digest
from libs.common.events import CallRecorded, Context, RolloutFinished, RolloutStarted, RunStarted
from libs.common.natsserver import free_port

D = "12" * 32
RUN = "crash"


def workload(n_rollouts: int, run: str = RUN) -> list:
    evs: list = [RunStarted(run_id=run, config={"n": n_rollouts})]
    for i in range(n_rollouts):
        rid = f"{run}-ro-{i}"
        evs.append(RolloutStarted(run_id=run, rollout_id=rid, task_id=f"t{i % 7}", group_id=f"g{i % 5}",
                                  harness="gyre", weight_version=0, api_key_digest=D))
        evs.append(CallRecorded(run_id=run, call_id=f"{run}-c{i}", rollout_id=rid, session_id=rid, api="openai_chat",
                                new_input_digest=D, n_new_input_tokens=i % 50, output_digest=D,
                                logprobs_digest=D, n_output_tokens=1 + i % 9))
        evs.append(RolloutFinished(run_id=run, rollout_id=rid, wall_time_s=float(i), exit_status=0))
    return evs


def start_projector(nats_url: str, db_url: str, tmp_path, batch: int = 25) -> subprocess.Popen:
    env = {**os.environ, "GYRE_NATS_URL": nats_url, "GYRE_DATABASE_URL": db_url, "GYRE_RUN_DIR": str(tmp_path)}
    log = open(tmp_path / "projector.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "gyre", "serve", "projector", "--batch", str(batch),
                             "--port", str(free_port())], env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def applied(db_url: str) -> dict[str, int]:
    eng = make_engine(db_url)
    try:
        return offsets(eng, "readmodels")
    except Exception:  # tables not created yet
        return {}
    finally:
        eng.dispose()


async def test_projector_killed_mid_stream_applies_each_event_exactly_once(nats_server, db_url, tmp_path) -> None:
    bus = await JetStreamBus.connect(nats_server.url)
    events = workload(2000)
    await bus.publish_many(events)
    total_rollouts = await bus.last_seq(Context.ROLLOUTS)

    proc = start_projector(nats_server.url, db_url, tmp_path)
    try:
        wait_for(lambda: applied(db_url).get("GYRE_ROLLOUTS", 0) >= 400, 60, "the projector to get going")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    at_kill = applied(db_url).get("GYRE_ROLLOUTS", 0)
    assert 400 <= at_kill < total_rollouts, "the kill must land mid-stream"

    late = workload(50, run="late")  # written while no projector runs
    await bus.publish_many(late)
    want = {c.stream: await bus.last_seq(c) for c in (Context.RUNS, Context.ROLLOUTS, Context.CALLS)}
    await bus.close()

    proc = start_projector(nats_server.url, db_url, tmp_path)
    try:
        wait_for(lambda: all(applied(db_url).get(k, 0) == v for k, v in want.items()), 90, "catch-up")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0

    eng = make_engine(db_url)
    with Session(eng) as s:
        assert s.scalar(select(func.count()).select_from(EventRow)) == len(events) + len(late)
        counts = {(r.run_id, r.type): r.count for r in s.scalars(select(EventCount))}
        assert counts[(RUN, "RolloutStarted")] == 2000 and counts[(RUN, "CallRecorded")] == 2000
        assert counts[("late", "RolloutFinished")] == 50
        assert s.scalar(select(func.count()).select_from(RolloutRow)) == 2050
        assert s.scalar(select(func.sum(RolloutRow.n_calls))) == 2050  # a counter: exactly once
    eng.dispose()


def gyre(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gyre", *args], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=120)


async def test_exported_log_replays_into_an_empty_database_with_identical_rows(nats_server, db_url, tmp_path) -> None:
    bus = await JetStreamBus.connect(nats_server.url)
    await bus.publish_many(workload(120))
    # a poison message must be dead-lettered the same way live and in replay
    await bus.publish_raw("gyre.crash.rollouts.RolloutStarted.x", b'{"type":"RolloutStarted"}', {"Nats-Msg-Id": "p"})
    await bus.publish_many(workload(30, run="second"))
    upgrade(db_url)
    live = make_engine(db_url)
    runner = ProjectionRunner(live, bus, readmodels)
    await runner.catch_up()
    assert runner.dead_lettered == 1
    live_digest = readmodel_digest(live)
    live.dispose()
    await bus.close()

    env = {"GYRE_NATS_URL": nats_server.url}
    out = tmp_path / "events.jsonl"
    res = gyre("events", "export", "--out", str(out), env=env)
    assert res.returncode == 0, res.stderr
    assert len(out.read_text().splitlines()) == 1 + 120 * 3 + 1 + 1 + 30 * 3

    target = f"sqlite:///{tmp_path / 'replayed.db'}"
    res = gyre("replay", "--from", str(out), "--database-url", target, env=env)
    assert res.returncode == 3, res.stderr  # 3: something was dead-lettered, as live
    result = json.loads(res.stdout.strip().splitlines()[-1])
    assert result["tables"] == {k: v for k, v in live_digest.items() if k != "*"}
    assert result["digest"] == live_digest["*"]

    # and straight from the live log, one run only
    res = gyre("replay", "--run", "second", "--database-url", f"sqlite:///{tmp_path / 'second.db'}", env=env)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1])["applied"] == 1 + 30 * 3
    # a database that already holds read models (here the whole log's) is refused: its
    # offsets would skip the run's events below them, and the digest would not be the run's
    res = gyre("replay", "--run", "second", "--database-url", target, env=env)
    assert res.returncode == 2 and "replay rebuilds into an empty database" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("bad", ['{"stream": 1}', "not json"])
def test_replay_rejects_a_file_that_is_not_an_export(tmp_path, bad: str) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text(bad + "\n")
    res = gyre("replay", "--from", str(f), "--database-url", f"sqlite:///{tmp_path / 'x.db'}", env={})
    assert res.returncode != 0
    assert "not an exported event line" in res.stderr
