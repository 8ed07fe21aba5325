"""A bus connection that is closed (not merely refusing) under running rollouts: the
runner does not try its publishes for good (a closed nats-py connection never comes back),
it stops with a clear error saying the rollout's group will not complete, and the step
ends in ``StepFailed`` naming the rollouts.

The bus is a real nats-server; "closed" is the runner's connection to it closed (what
``JetStreamBus.close()`` or nats-py giving up on reconnecting leaves)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from services.runner.harness import HarnessConfig
from services.runner.runner import RolloutRunner, RunnerConfig, StepFailed
from services.runner.tasks import Task

RUN = "closed"
TASK = Task("demo", "hi\n", time_limit_s=10)


def make_runner(tmp_path, bus, blobs, harness: HarnessConfig) -> RolloutRunner:
    # a backoff cap of 30 s: before the fix a publish on a closed bus waited that long
    # between tries, for good
    config = RunnerConfig(RUN, "http://proxy:1", tmp_path / "work", harness=harness, io_attempts=2,
                          io_backoff_s=0.02, io_backoff_max_s=30.0)
    return RolloutRunner(config, bus=bus, blobs=blobs)


async def until(predicate, timeout_s: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out waiting"
        await asyncio.sleep(0.02)


async def test_an_end_on_a_closed_bus_is_given_up_with_a_clear_error(bus_blobs, tmp_path, caplog) -> None:
    bus, blobs = bus_blobs
    caplog.set_level(logging.WARNING, logger="services.runner.runner")
    go = tmp_path / "go"  # the harnesses end only once the test says so (a loaded machine
    # may start the second later than a fixed sleep lets the first run)
    slow = HarnessConfig("sh", ("/bin/sh", "-c", f"while [ ! -e {go} ]; do sleep 0.02; done; echo hi > a.txt"))
    runner = make_runner(tmp_path, bus, blobs, slow)
    step = asyncio.create_task(runner.run_step(0, [TASK], 2))
    await until(lambda: sum(s.phase.value == "running" for s in runner.running.values()) == 2)
    await bus.nc.close()  # RolloutStarted was taken; the ends meet a closed connection
    go.touch()
    with pytest.raises(StepFailed) as failed:
        await asyncio.wait_for(step, 15)
    assert len(failed.value.errors) == 2 and failed.value.outcomes == []
    text = str(failed.value)
    assert "of group s0-demo" in text and "closed" in text
    assert runner.waiting_for_bus == {} and runner.running == {}
    assert list((tmp_path / "work").iterdir()) == []
    assert "the bus connection is closed" in caplog.text
    assert "group s0-demo will not complete" in caplog.text
    assert "keeps trying" not in caplog.text


async def test_a_start_on_a_closed_bus_is_given_up_at_once(bus_blobs, tmp_path, caplog) -> None:
    bus, blobs = bus_blobs
    caplog.set_level(logging.WARNING, logger="services.runner.runner")
    runner = make_runner(tmp_path, bus, blobs, HarnessConfig("sh", ("/bin/sh", "-c", "echo hi > a.txt")))
    await bus.close()
    with pytest.raises(StepFailed) as failed:
        await asyncio.wait_for(runner.run_step(0, [TASK], 1), 15)
    [err] = failed.value.errors
    assert "RolloutStarted" in str(err) and "closed" in str(err)
    assert "rollout s0-demo-0-" in "".join(err.__notes__)
    assert runner.waiting_for_bus == {} and runner.running == {}
    assert "keeps trying" not in caplog.text
