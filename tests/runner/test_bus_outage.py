"""A bus that refuses the runner's events for a while does not leave a group waiting
forever (review: "RolloutStarted never published -> the group hangs").

A group is complete for the trajectory service once as many of its rollouts are sealed as
their ``RolloutStarted.group_size`` states, and the trainer's step waits for the group. A
rollout whose ``RolloutStarted`` (or ended event) never reaches the log therefore holds its
group, and the step, for good; the bus is the only way to tell them anything. So the
runner keeps trying a publish for as long as it runs (backoff capped at
``io_backoff_max_s``), says so in its log and in ``waiting_for_bus``, and when it is
stopped meanwhile it stops cleanly: nothing started, workspace removed, a log line.

The bus here is a real nats-server. "Refusing" is its rollouts stream being gone, as
while JetStream is unavailable: every publish to it is answered at once with "no
responders", so many tries take little time.
"""

from __future__ import annotations

import asyncio
import logging
import re
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from libs.common.events import Context, RolloutFinished, RolloutScored, RolloutStarted
from libs.common.service import Health
from services.runner.harness import HarnessConfig
from services.runner.main import RunnerCollector, show_health
from services.runner.runner import RolloutRunner, RunnerConfig
from services.runner.tasks import Task
from services.trajectory.ledger import LedgerConfig, TrajectoryLedger

RUN = "outage"
HARNESS = HarnessConfig("sh", ("/bin/sh", "-c", "echo hi > a.txt"))
TASK = Task("demo", "hi\n", time_limit_s=10)


def make_runner(tmp_path, bus, blobs, **kw) -> RolloutRunner:
    kw.setdefault("harness", HARNESS)
    config = RunnerConfig(RUN, "http://proxy:1", tmp_path / "work", io_attempts=2, io_backoff_s=0.02,
                          io_backoff_max_s=0.1, **kw)
    return RolloutRunner(config, bus=bus, blobs=blobs)


async def take_rollouts_stream_away(bus) -> None:
    await bus.js.delete_stream(Context.ROLLOUTS.stream)


def served_view(runner: RolloutRunner) -> tuple[str, Health]:
    """What ``gyre serve runner`` shows of it: its /metrics text and its /health."""
    registry = CollectorRegistry()
    registry.register(RunnerCollector(runner))
    ctx = SimpleNamespace(health=Health("runner"))
    show_health(ctx, runner)
    return generate_latest(registry).decode(), ctx.health


async def until(predicate, timeout_s: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out waiting"
        await asyncio.sleep(0.02)


async def test_a_group_started_while_the_bus_refuses_its_events_still_completes(bus_blobs, tmp_path, caplog) -> None:
    bus, blobs = bus_blobs
    caplog.set_level(logging.WARNING, logger="services.runner.runner")
    await take_rollouts_stream_away(bus)
    runner = make_runner(tmp_path, bus, blobs)
    step = asyncio.create_task(runner.run_step(0, [TASK], 2))
    # both rollouts wait for the bus, well past io_attempts (before: RolloutLost, and a
    # group promised 2 rollouts that would never see them)
    await until(lambda: len(runner.waiting_for_bus) == 2 and runner.publish_failures >= 3 * 2)
    assert not step.done()
    assert set(runner.waiting_for_bus.values()) == {"RolloutStarted"}
    assert "not started yet: the runner keeps trying" in caplog.text and "group s0-demo" in caplog.text
    metrics, health = served_view(runner)
    assert "gyre_runner_rollouts_waiting_for_bus 2.0" in metrics and health.status == "degraded"
    assert health.detail["waiting_for_bus"] == 2
    [failures] = re.findall(r"^gyre_runner_publish_failures_total (\S+)$", metrics, re.M)
    assert float(failures) >= 6

    await bus.ensure_streams()  # the bus is back
    outcomes = await asyncio.wait_for(step, 30)
    assert [o.status for o in outcomes] == ["finished", "finished"] and runner.waiting_for_bus == {}
    assert all(o.snapshot_digest is not None for o in outcomes)
    assert "took RolloutStarted of rollout" in caplog.text
    metrics, health = served_view(runner)
    assert "gyre_runner_rollouts_waiting_for_bus 0.0" in metrics and health.status == "ok"

    events = [d.event async for d in bus.read(Context.ROLLOUTS)]
    started = [e for e in events if isinstance(e, RolloutStarted)]
    ended = [e for e in events if isinstance(e, RolloutFinished)]
    assert sorted(e.rollout_id for e in started) == sorted(e.rollout_id for e in ended) \
        == sorted(o.rollout_id for o in outcomes)

    # and the trajectory service's own group logic settles the group
    ledger = TrajectoryLedger(LedgerConfig(RUN))
    for ev in started:
        ledger.rollout_started(ev)
    settled = []
    for ev, score in zip(ended, (0.0, 1.0)):
        ledger.rollout_ended(ev.rollout_id)
        scored = RolloutScored(run_id=RUN, rollout_id=ev.rollout_id, score=score)
        ledger.rollout_judged(scored)
        settled += [e.TYPE for e in ledger.seal(ev.rollout_id, scored).events]
    assert "GroupQueued" in settled and "s0-demo" in ledger.queued_groups


async def test_an_ended_event_the_bus_refuses_is_published_once_it_is_back(bus_blobs, tmp_path, caplog) -> None:
    bus, blobs = bus_blobs
    go = tmp_path / "go"  # the harness ends only once the test says so (not after a fixed
    # sleep a loaded machine may let pass before the test sees it running)
    slow = HarnessConfig("sh", ("/bin/sh", "-c", f"while [ ! -e {go} ]; do sleep 0.02; done; echo hi > a.txt"))
    runner = make_runner(tmp_path, bus, blobs, harness=slow)
    step = asyncio.create_task(runner.run_step(0, [TASK], 1))
    await until(lambda: any(s.phase.value == "running" for s in runner.running.values()))
    # RolloutStarted was taken; the end will be refused (the stream goes with the start in
    # it: only the end is looked for below)
    await take_rollouts_stream_away(bus)
    go.touch()
    await until(lambda: runner.waiting_for_bus and runner.publish_failures >= 4)
    assert list(runner.waiting_for_bus.values()) == ["RolloutFinished"]
    assert "has ended; the runner keeps trying" in caplog.text
    await bus.ensure_streams()
    [o] = await asyncio.wait_for(step, 30)
    ended = [d.event async for d in bus.read(Context.ROLLOUTS) if isinstance(d.event, RolloutFinished)]
    assert [e.rollout_id for e in ended] == [o.rollout_id]


async def test_a_runner_stopped_while_the_bus_refuses_stops_cleanly(bus_blobs, tmp_path, caplog) -> None:
    bus, blobs = bus_blobs
    await take_rollouts_stream_away(bus)
    runner = make_runner(tmp_path, bus, blobs)
    step = asyncio.create_task(runner.run_step(0, [TASK], 1))
    await until(lambda: runner.publish_failures >= 3)
    step.cancel()  # the runner shuts down
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(step, 5)
    assert runner.waiting_for_bus == {} and runner.running == {}
    assert list((tmp_path / "work").iterdir()) == []  # workspace removed; the harness never ran
    assert "stopped while the bus refused its RolloutStarted" in caplog.text
    assert "group s0-demo will not complete unless its step is run again" in caplog.text
