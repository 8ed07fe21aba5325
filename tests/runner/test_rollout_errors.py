"""A rollout the runner itself fails on still registers and ends, and one failing rollout
does not orphan the others of its step (review: "workspace.prepare failing leaves the
group waiting forever"; "run_step's gather leaves the siblings unattended").

A group settles once as many of its rollouts are sealed as ``RolloutStarted.group_size``
states, and its training step waits for it. So a rollout whose workspace cannot be
prepared (disk full, a task's files unreadable), or on which an unexpected error escapes
the lifecycle, is registered (if it was not yet) and ended like a harness that cannot be
launched: finished, exit status 127 unless the harness's own is known, no snapshot (the
evaluator fails its scoring and the group settles without it), with an error line naming
the rollout, its group and the cause. No event is published twice with different content:
what the bus took is not sent again, and an event handed to it is only ever sent as it was.

The bus is a real nats-server (JetStream); the failures are injected with monkeypatch.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections import defaultdict

import pytest

from libs.common.events import Context, RolloutFinished, RolloutScoringFailed, RolloutScored, RolloutStarted
from services.evaluator.main import build_evaluator
from services.evaluator.settings import EvaluatorSettings
from services.runner import runner as runner_module
from services.runner.adapters import process, workspace
from services.runner.harness import HarnessConfig
from services.runner.runner import RolloutRunner, RunnerConfig
from services.runner.tasks import Task, default_tasks_dir, load_tasks
from services.trajectory.ledger import LedgerConfig, TrajectoryLedger

RUN = "errs"
SLOW = HarnessConfig("sh", ("/bin/sh", "-c", "sleep 0.4; echo hi > a.txt"))


class RecordingBus:
    """The real bus, every publish call recorded (JetStream de-duplicates a second publish
    of an event id within its window, so the stream alone would not show one)."""

    def __init__(self, bus) -> None:
        self.bus = bus
        self.sent: dict[str, list[str]] = defaultdict(list)

    async def publish(self, event, **kw):
        self.sent[event.event_id].append(event.to_json())
        return await self.bus.publish(event, **kw)


def make_runner(tmp_path, bus, blobs, **kw) -> RolloutRunner:
    kw.setdefault("harness", SLOW)
    config = RunnerConfig(RUN, "http://proxy:1", tmp_path / "work", kill_grace_s=0.2, io_backoff_s=0.01, **kw)
    return RolloutRunner(config, bus=RecordingBus(bus), blobs=blobs)


async def rollout_events(bus) -> list:
    return [d.event async for d in bus.read(Context.ROLLOUTS)]


def the_one(rollout_id: str) -> bool:  # the rollout of index 1 of the group (ids: s<step>-<task>-<index>-<hex>)
    return rollout_id.rsplit("-", 2)[-2] == "1"


def assert_each_event_sent_in_one_version(bus: RecordingBus, rollout_ids) -> None:
    for rid in rollout_ids:
        for kind in ("started", "ended"):
            versions = bus.sent[f"{rid}-{kind}"]
            assert versions and len(set(versions)) == 1, (rid, kind, versions)


def assert_group_settles(started, ended, failed_id: str) -> None:
    """The trajectory service's own group logic: the group settles, without the failed one."""
    ledger = TrajectoryLedger(LedgerConfig(RUN))
    for ev in started:
        ledger.rollout_started(ev)
    settled: list[str] = []
    for i, ev in enumerate(ended):
        ledger.rollout_ended(ev.rollout_id)
        judged = (RolloutScoringFailed(run_id=RUN, rollout_id=ev.rollout_id, reason="no workspace snapshot")
                  if ev.rollout_id == failed_id else RolloutScored(run_id=RUN, rollout_id=ev.rollout_id, score=i % 2))
        ledger.rollout_judged(judged)
        settled += [e.TYPE for e in ledger.seal(ev.rollout_id, judged).events]
    assert "GroupQueued" in settled and started[0].group_id in ledger.queued_groups, settled


async def test_a_workspace_that_cannot_be_prepared_is_registered_and_ended(bus_blobs, tmp_path, monkeypatch,
                                                                            caplog) -> None:
    bus, blobs = bus_blobs
    caplog.set_level(logging.INFO, logger="services.runner")
    real_prepare = workspace.prepare

    def prepare(work_root, rollout_id, files_dir, prompt):
        if the_one(rollout_id):
            (work_root / rollout_id).mkdir(parents=True)  # half made, as when the disk fills mid-copy
            raise OSError(errno.ENOSPC, "No space left on device", str(work_root / rollout_id / "workspace"))
        return real_prepare(work_root, rollout_id, files_dir, prompt)

    monkeypatch.setattr(workspace, "prepare", prepare)
    runner = make_runner(tmp_path, bus, blobs)
    # before: the OSError came out of run_step at once, the failed rollout never registered
    # (its group of 3 waiting for good) and the other two running with nobody collecting them
    outcomes = await asyncio.wait_for(runner.run_step(0, [Task("demo", "hi\n", time_limit_s=10)], 3), 30)
    [failed] = [o for o in outcomes if the_one(o.rollout_id)]
    fine = [o for o in outcomes if o is not failed]
    assert (failed.status, failed.exit_status, failed.snapshot_digest) == ("finished", 127, None)
    assert "could not be prepared: OSError: [Errno 28] No space left on device: '" in failed.log_tail
    assert len(fine) == 2 and all(o.exit_status == 0 and o.snapshot_digest for o in fine)

    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    [line] = [e for e in errors if failed.rollout_id in e]
    assert "group s0-demo" in line and "could not be prepared: OSError: [Errno 28] No space left on device" in line
    assert f"{failed.rollout_id}/workspace" in line  # the path, which repr() of an OSError leaves out
    assert "exit status 127" in line and "settles without it" in line

    events = await rollout_events(bus)
    started = [e for e in events if isinstance(e, RolloutStarted)]
    ended = [e for e in events if isinstance(e, RolloutFinished)]
    assert sorted(e.rollout_id for e in started) == sorted(e.rollout_id for e in ended) \
        == sorted(o.rollout_id for o in outcomes)
    assert {(e.group_id, e.group_size) for e in started} == {("s0-demo", 3)}
    [end] = [e for e in ended if e.rollout_id == failed.rollout_id]
    assert (end.exit_status, end.snapshot_digest, end.wall_time_s) == (127, None, 0.0)
    assert_each_event_sent_in_one_version(runner.bus, [o.rollout_id for o in outcomes])
    assert runner.running == {} and runner.waiting_for_bus == {}
    assert list((tmp_path / "work").iterdir()) == []  # the half-made folder too
    assert_group_settles(started, ended, failed.rollout_id)


async def test_the_evaluator_fails_the_scoring_of_a_rollout_whose_workspace_was_not_prepared(
        bus_blobs, tmp_path, monkeypatch) -> None:
    bus, blobs = bus_blobs

    def no_files(work_root, rollout_id, files_dir, prompt):
        raise PermissionError(errno.EACCES, "Permission denied", str(files_dir / "inventory.py"))

    monkeypatch.setattr(workspace, "prepare", no_files)
    task = {t.task_id: t for t in load_tasks()}["inventory"]
    [o] = await make_runner(tmp_path, bus, blobs).run_step(0, [task], 1)
    [ended] = [e for e in await rollout_events(bus) if isinstance(e, RolloutFinished)]
    evaluator = build_evaluator(EvaluatorSettings(tasks_dir=default_tasks_dir(), work_root=tmp_path / "ev",
                                                  isolation="none", workers=1), bus=bus, store=blobs)
    await evaluator.start()
    outcome = await evaluator.evaluate(ended)
    assert isinstance(outcome, RolloutScoringFailed) and outcome.rollout_id == o.rollout_id
    assert "no workspace snapshot" in outcome.reason


def _fail_launch(monkeypatch) -> None:
    real = runner_module.launch

    async def launch(argv, *, cwd, env, log_file):
        if the_one(env[process.MARK_VAR]):
            raise RuntimeError("a bug in the launcher")  # not one of the launch errors it handles
        return await real(argv, cwd=cwd, env=env, log_file=log_file)

    monkeypatch.setattr(runner_module, "launch", launch)


def _fail_after_exit(monkeypatch) -> None:
    real = runner_module.kill_marked

    def kill_marked(mark, **kw):
        if the_one(mark):
            raise RuntimeError("a bug after the harness exited")
        return real(mark, **kw)

    monkeypatch.setattr(runner_module, "kill_marked", kill_marked)


def _fail_while_running(monkeypatch) -> None:
    real_launch, real_wait, the_ones = runner_module.launch, process.HarnessProcess.wait, set()

    async def launch(argv, *, cwd, env, log_file):
        proc = await real_launch(argv, cwd=cwd, env=env, log_file=log_file)
        if the_one(env[process.MARK_VAR]):
            the_ones.add(id(proc))  # a dataclass: not hashable
        return proc

    async def wait(self, timeout_s):
        if id(self) in the_ones:  # its first wait (for the harness's exit); the kill's waits go through
            the_ones.discard(id(self))
            raise RuntimeError("a bug while the harness ran")
        return await real_wait(self, timeout_s)

    monkeypatch.setattr(runner_module, "launch", launch)
    monkeypatch.setattr(process.HarnessProcess, "wait", wait)


@pytest.mark.parametrize("where, fail, exit_status", [
    ("registered", _fail_launch, 127),  # RolloutStarted taken, the harness never started
    ("running", _fail_while_running, 127),  # the harness running (and then stopped), its status not seen
    ("snapshotting", _fail_after_exit, 0),  # the harness exited 0, no snapshot taken
])
async def test_an_error_escaping_the_lifecycle_still_ends_the_rollout(bus_blobs, tmp_path, monkeypatch, caplog,
                                                                       where, fail, exit_status) -> None:
    bus, blobs = bus_blobs
    fail(monkeypatch)
    # in the "running" case the failed rollout's harness would run for a minute: it is stopped
    script = "case $GYRE_ROLLOUT_ID in *-1-*) sleep 60;; esac; " if where == "running" else ""
    harness = HarnessConfig("sh", ("/bin/sh", "-c", script + "sleep 0.3; echo hi > a.txt"))
    runner = make_runner(tmp_path, bus, blobs, harness=harness)
    # before: the RuntimeError came out of run_step; the rollout's end was never published
    outcomes = await asyncio.wait_for(runner.run_step(0, [Task("demo", "hi\n", time_limit_s=30)], 2), 30)
    [failed] = [o for o in outcomes if the_one(o.rollout_id)]
    assert (failed.status, failed.exit_status, failed.snapshot_digest) == ("finished", exit_status, None)
    assert "the runner failed" in failed.log_tail and "RuntimeError" in failed.log_tail

    [rec] = [r for r in caplog.records if r.levelno == logging.ERROR and failed.rollout_id in r.getMessage()]
    line = rec.getMessage()
    assert "group s0-demo" in line and f"while it was {where}" in line and "RuntimeError: a bug" in line
    assert rec.exc_info is not None  # the traceback of what escaped

    events = await rollout_events(bus)
    ids = sorted(o.rollout_id for o in outcomes)
    assert sorted(e.rollout_id for e in events if isinstance(e, RolloutStarted)) == ids
    [end] = [e for e in events if isinstance(e, RolloutFinished) and e.rollout_id == failed.rollout_id]
    assert (end.exit_status, end.snapshot_digest) == (exit_status, None)
    assert_each_event_sent_in_one_version(runner.bus, ids)
    assert len(runner.bus.sent[f"{failed.rollout_id}-started"]) == 1  # taken once, not sent again
    assert runner.running == {} and list((tmp_path / "work").iterdir()) == []
    assert not _marked_processes(failed.rollout_id)  # no harness left running


def _marked_processes(rollout_id: str) -> list[int]:
    needle = f"{process.MARK_VAR}={rollout_id}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        found.append(int(entry.name))
            except OSError:
                continue
    return found


async def test_one_rollout_raising_does_not_orphan_the_others_of_its_step(bus_blobs, tmp_path, monkeypatch,
                                                                          caplog) -> None:
    bus, blobs = bus_blobs
    real_remove = workspace.remove

    def remove(dirs):
        if the_one(dirs.root.name):
            raise RuntimeError("a bug in the cleanup")  # after the rollout ended: it escapes run_rollout
        return real_remove(dirs)

    monkeypatch.setattr(workspace, "remove", remove)
    slow = HarnessConfig("sh", ("/bin/sh", "-c", "case $GYRE_ROLLOUT_ID in *-1-*) ;; *) sleep 1;; esac; echo hi > a"))
    runner = make_runner(tmp_path, bus, blobs, harness=slow)
    with pytest.raises(Exception) as info:
        await asyncio.wait_for(runner.run_step(0, [Task("demo", "hi\n", time_limit_s=10)], 3), 30)
    # before: the RuntimeError came out at once, the two slower rollouts still running
    assert runner.running == {}, "run_step raised while rollouts of its step were still running"
    assert isinstance(info.value, runner_module.StepFailed), info.value
    err = info.value
    assert len(err.outcomes) == 2 and all(o.snapshot_digest for o in err.outcomes)
    assert len(err.errors) == 1 and isinstance(err.errors[0], RuntimeError)
    [rid] = [r for r in runner.bus.sent if r.endswith("-started") and the_one(r[: -len("-started")])]
    failed_id = rid[: -len("-started")]
    assert "1 of 3 rollouts" in str(err) and failed_id in str(err) and "a bug in the cleanup" in str(err)
    assert any(failed_id in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)
    ended = [e for e in await rollout_events(bus) if isinstance(e, RolloutFinished)]
    assert len(ended) == 3  # every rollout ended, the failed one included (its failure came after)


async def test_an_end_in_flight_when_the_error_came_is_sent_again_as_it_was(bus_blobs, tmp_path, caplog) -> None:
    """The bus took the ended event, but an error came before the runner knew: the same
    event goes again (the bus de-duplicates it by id), never a second version of it."""
    bus, blobs = bus_blobs

    class AckLost(RolloutRunner):
        async def _retry(self, what, attempt, **kw):
            result = await super()._retry(what, attempt, **kw)
            if what.startswith("publishing RolloutFinished") and not getattr(self, "lost", False):
                self.lost = True
                raise RuntimeError("a bug between the bus's ack and the runner")
            return result

    config = RunnerConfig(RUN, "http://proxy:1", tmp_path / "work", harness=SLOW, io_backoff_s=0.01)
    runner = AckLost(config, bus=RecordingBus(bus), blobs=blobs)
    [o] = await asyncio.wait_for(runner.run_step(0, [Task("demo", "hi\n", time_limit_s=10)], 1), 30)
    versions = runner.bus.sent[f"{o.rollout_id}-ended"]
    assert len(versions) == 2 and len(set(versions)) == 1  # sent again, the same
    [end] = [e for e in await rollout_events(bus) if isinstance(e, RolloutFinished)]
    # the end decided before the error stands, in the log and in the outcome
    assert (end.exit_status, end.snapshot_digest) == (o.exit_status, o.snapshot_digest) and o.exit_status == 0
    assert o.snapshot_digest is not None
    assert "its end as decided before is kept" in caplog.text and "while it was ended" in caplog.text
