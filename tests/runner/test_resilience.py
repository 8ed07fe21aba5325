"""A failing blob store or bus does not leave a rollout without an end (review finding 5):
the snapshot put and every publish are retried; a snapshot that cannot be stored ends the
rollout without one (the reason in its log); a bus that refuses the ended event past
``io_attempts`` is a clear error in the log and is tried again until it takes it (a group
waits for every end; see test_bus_outage.py against a real nats-server), and retries of it
are de-duplicated by its fixed event id."""

from __future__ import annotations

from dataclasses import dataclass

import asyncio
import logging

import pytest

from libs.common.blobs import MemoryBlobStore
from libs.common.bus.memory import InMemoryBus
from libs.common.events import Context, RolloutFinished
from services.runner.harness import HarnessConfig
from services.runner.runner import RolloutRunner, RunnerConfig
from services.runner.tasks import Task

HARNESS = HarnessConfig("sh", ("/bin/sh", "-c", "echo hi > a.txt"))


class FlakyBlobs(MemoryBlobStore):
    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures, self.calls = failures, 0

    async def put(self, data: bytes) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise ConnectionError("object store timeout")
        return await super().put(data)


@dataclass
class FlakyBus(InMemoryBus):
    fail_type: str = "RolloutFinished"
    failures: int = 0
    attempts: int = 0

    async def publish(self, event, **kw):
        if event.TYPE == self.fail_type:
            self.attempts += 1
            if self.attempts <= self.failures:
                if self.attempts == 1:
                    await super().publish(event, **kw)  # stored, but the ack was lost: the retry is a duplicate
                raise ConnectionError("nats: timeout")
        return await super().publish(event, **kw)


def runner(tmp_path, bus, blobs, **kw) -> RolloutRunner:
    config = RunnerConfig("r", "http://proxy:1", tmp_path / "work", harness=HARNESS, io_backoff_s=0.0, **kw)
    return RolloutRunner(config, bus=bus, blobs=blobs)


async def ended_events(bus) -> list:
    return [d.event async for d in bus.read(Context.ROLLOUTS) if isinstance(d.event, RolloutFinished)]


async def test_a_blob_store_that_recovers_gets_the_snapshot(tmp_path) -> None:
    bus, blobs = InMemoryBus(), FlakyBlobs(failures=2)
    [o] = await runner(tmp_path, bus, blobs).run_step(0, [Task("demo", "hi\n", time_limit_s=10)], 1)
    assert o.snapshot_digest is not None and blobs.calls == 3
    [ended] = await ended_events(bus)
    assert ended.snapshot_digest == o.snapshot_digest


async def test_a_blob_store_that_stays_down_still_ends_the_rollout_with_a_reason(tmp_path) -> None:
    bus, blobs = InMemoryBus(), FlakyBlobs(failures=100)
    outcomes = await runner(tmp_path, bus, blobs, io_attempts=3).run_step(
        0, [Task("demo", "hi\n", time_limit_s=10)], 2)
    assert [o.snapshot_digest for o in outcomes] == [None, None] and blobs.calls == 6
    assert all("no workspace snapshot: the blob store refused it 3 times" in o.log_tail for o in outcomes)
    ended = await ended_events(bus)
    assert sorted(e.rollout_id for e in ended) == sorted(o.rollout_id for o in outcomes)
    assert all(e.snapshot_digest is None for e in ended)


async def test_the_ended_event_is_retried_and_stored_once(tmp_path) -> None:
    bus = FlakyBus(failures=2)
    [o] = await runner(tmp_path, bus, MemoryBlobStore()).run_step(0, [Task("demo", "hi\n", time_limit_s=10)], 1)
    [ended] = await ended_events(bus)
    assert bus.attempts == 3 and ended.event_id == f"{o.rollout_id}-ended"


async def test_an_ended_event_refused_past_io_attempts_is_a_clear_error_and_still_published(tmp_path, caplog) -> None:
    bus = FlakyBus(failures=7)
    r = runner(tmp_path, bus, MemoryBlobStore(), io_attempts=3, io_backoff_max_s=0.01)
    [o] = await r.run_step(0, [Task("demo", "hi\n", time_limit_s=10)], 1)
    errors = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith(f"publishing RolloutFinished of rollout {o.rollout_id} failed "
                                                     "3 times (ConnectionError('nats: timeout')); ")
    assert f"since its group {o.group_id} waits for its end" in errors[0]
    [ended] = await ended_events(bus)
    assert bus.attempts == 8 and ended.rollout_id == o.rollout_id and r.publish_failures == 7
    assert r.waiting_for_bus == {}


def test_retry_settings_are_checked(tmp_path) -> None:
    with pytest.raises(ValueError, match="io_attempts must be >= 1"):
        RunnerConfig("r", "http://proxy:1", tmp_path, io_attempts=0)
    with pytest.raises(ValueError, match="io_backoff_max_s must be a finite number > 0"):
        RunnerConfig("r", "http://proxy:1", tmp_path, io_backoff_max_s=0)


async def test_installed_dependencies_are_left_out_and_an_oversized_workspace_says_why(tmp_path) -> None:
    import io
    import tarfile

    script = ("mkdir -p .venv/lib node_modules/x sub/node_modules .git && head -c 5000 /dev/zero > .venv/lib/big "
              "&& head -c 5000 /dev/zero > node_modules/x/big && echo y > sub/node_modules/y && echo ref > .git/HEAD "
              "&& echo hi > a.txt")
    bus, blobs = InMemoryBus(), MemoryBlobStore()
    config = RunnerConfig("r", "http://proxy:1", tmp_path / "w1", snapshot_max_bytes=4000,
                          harness=HarnessConfig("sh", ("/bin/sh", "-c", script)))
    r = RolloutRunner(config, bus=bus, blobs=blobs)
    [o] = await r.run_step(0, [Task("demo", "hi\n", time_limit_s=10)], 1)
    with tarfile.open(fileobj=io.BytesIO(await blobs.get(o.snapshot_digest))) as tar:
        names = tar.getnames()
    assert "a.txt" in names and ".git/HEAD" in names and "sub" in names
    assert not [n for n in names if ".venv" in n or "node_modules" in n]

    big = HarnessConfig("sh", ("/bin/sh", "-c", "head -c 5000 /dev/zero > big"))
    r = RolloutRunner(RunnerConfig("r", "http://proxy:1", tmp_path / "w2", harness=big, snapshot_max_bytes=4000),
                      bus=bus, blobs=blobs)
    [o] = await r.run_step(0, [Task("demo", "hi\n", time_limit_s=10)], 1)
    # the agent's doing: a stand-in snapshot says why (the evaluator scores it 0), see test_refused_snapshot.py
    assert o.snapshot_digest is not None
    assert "workspace not archived: workspace has more than 4000 bytes of files (the runner's snapshot_max_bytes)" \
        in o.log_tail


def test_the_reference_agent_gets_the_checkout_on_its_path_only_when_gyre_is_not_installed(monkeypatch) -> None:
    from services.runner import harness

    monkeypatch.setattr(harness, "_gyre_installed", lambda: True)
    assert "PYTHONPATH" not in harness.gyre_agent().env
    monkeypatch.setattr(harness, "_gyre_installed", lambda: False)
    assert harness.gyre_agent().env["PYTHONPATH"] == "{repo}"


def test_a_virtualenv_of_any_name_is_left_out_of_the_snapshot(tmp_path) -> None:
    import io
    import tarfile

    from services.runner.adapters.snapshot import snapshot_workspace

    (tmp_path / "venv/bin").mkdir(parents=True)
    (tmp_path / "venv/pyvenv.cfg").write_text("home = /usr/bin\n")
    (tmp_path / "venv/bin/python").symlink_to("/usr/bin/python3")
    (tmp_path / "src/env").mkdir(parents=True)  # a folder that is not a virtualenv is kept
    (tmp_path / "src/env/a.py").write_text("x = 1\n")
    with tarfile.open(fileobj=io.BytesIO(snapshot_workspace(tmp_path))) as tar:
        assert sorted(tar.getnames()) == ["src", "src/env", "src/env/a.py"]


def test_an_oversized_file_is_refused_by_its_size_before_it_is_read(tmp_path, monkeypatch) -> None:
    from services.runner.adapters import snapshot

    with open(tmp_path / "big.bin", "wb") as f:
        f.truncate(8 * 2**30)  # sparse: 8 GiB on paper, nothing on disk
    (tmp_path / "a.txt").write_text("hi\n")
    opened: list[str] = []
    real_open = open
    monkeypatch.setattr(snapshot, "open", lambda p, *a, **kw: opened.append(str(p)) or real_open(p, *a, **kw),
                        raising=False)
    with pytest.raises(snapshot.SnapshotTooLarge, match="more than 1048576 bytes"):
        snapshot.snapshot_workspace(tmp_path, max_bytes=2**20)
    assert not [p for p in opened if p.endswith("big.bin")]


async def test_a_snapshot_that_fails_unexpectedly_still_ends_the_rollout(tmp_path, monkeypatch) -> None:
    from services.runner import runner as runner_module

    def out_of_memory(*_a, **_kw):
        raise MemoryError("8 GiB file")

    monkeypatch.setattr(runner_module, "snapshot_workspace", out_of_memory)
    bus = InMemoryBus()
    [o] = await runner(tmp_path, bus, MemoryBlobStore()).run_step(0, [Task("demo", "hi\n", time_limit_s=10)], 1)
    assert o.snapshot_digest is None and "no workspace snapshot: could not take it: MemoryError" in o.log_tail
    [ended] = await ended_events(bus)
    assert ended.rollout_id == o.rollout_id and ended.snapshot_digest is None
    assert list((tmp_path / "work").iterdir()) == []


async def test_a_rollout_stopped_while_the_bus_refuses_its_end_does_not_leave_its_workspace(tmp_path) -> None:
    r = runner(tmp_path, FlakyBus(failures=10**6), MemoryBlobStore(), io_attempts=1, io_backoff_max_s=0.01)
    step = asyncio.create_task(r.run_step(0, [Task("demo", "hi\n", time_limit_s=10)], 1))
    while r.publish_failures < 3:
        await asyncio.sleep(0.01)
    step.cancel()
    with pytest.raises(asyncio.CancelledError):
        await step
    assert list((tmp_path / "work").iterdir()) == [] and r.waiting_for_bus == {}


def _needs_writable_parent(real):
    """``os.unlink``/``os.rmdir`` refusing, as for a user other than root, to remove an
    entry from a folder without write permission."""
    import os
    import stat

    def guarded(name, *, dir_fd=None):
        parent = os.fstat(dir_fd) if dir_fd is not None else os.stat(os.path.dirname(os.path.abspath(name)))
        if not parent.st_mode & stat.S_IWUSR:
            raise PermissionError(13, "Permission denied", name)
        return real(name, dir_fd=dir_fd)

    return guarded


def test_a_read_only_tree_is_removed_whole(tmp_path, monkeypatch) -> None:
    import os

    from services.runner.adapters import workspace

    if os.geteuid() == 0:  # root ignores folder permissions: enforce them as for a non-root runner
        monkeypatch.setattr(os, "unlink", _needs_writable_parent(os.unlink))
        monkeypatch.setattr(os, "rmdir", _needs_writable_parent(os.rmdir))
    dirs = workspace.prepare(tmp_path, "r1", None, "p")
    mod = dirs.home / "go/pkg/mod/example.com/m@v1"
    mod.mkdir(parents=True)
    (mod / "a.go").write_text("x")
    os.chmod(mod, 0o555)  # what Go's module cache does
    assert workspace.remove(dirs) is True
    assert list(tmp_path.iterdir()) == []


def test_a_tree_that_cannot_be_removed_is_reported(tmp_path, monkeypatch, caplog) -> None:
    from services.runner.adapters import workspace

    dirs = workspace.prepare(tmp_path, "r1", None, "p")

    def refuse(path):
        raise PermissionError(13, "Permission denied", str(path / "home/locked"))

    monkeypatch.setattr(workspace, "remove_tree", refuse)
    assert workspace.remove(dirs) is False
    assert "could not delete" in caplog.text and "home/locked" in caplog.text and "prompt.md" in caplog.text
