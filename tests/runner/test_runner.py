"""The runner against a real nats-server and the JetStream blob store, with small shell
harnesses: events in order, workspace snapshots, the time limit (partial, not failure;
the whole process group killed), a harness that cannot start, and the key in env only."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import time
from pathlib import Path

from libs.common.events import Context, RolloutFinished, RolloutStarted, RolloutTimedOut
from services.runner.harness import HarnessConfig
from services.runner.runner import RolloutRunner, RunnerConfig
from services.runner.tasks import Task

RUN = "rtest"


def shell(script: str, name: str = "sh") -> HarnessConfig:
    return HarnessConfig(name=name, command=("/bin/sh", "-c", script))


async def events(bus) -> list:
    return [d.event async for d in bus.read(Context.ROLLOUTS)]


def files_of(snapshot: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(snapshot), mode="r:*") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}


def task(tmp_path: Path, limit: float = 30.0) -> Task:
    start = tmp_path / "start"
    start.mkdir(exist_ok=True)
    (start / "given.txt").write_text("given\n")
    return Task("demo", "Say hi.\n", time_limit_s=limit, files_dir=start)


async def test_a_step_runs_every_rollout_and_snapshots_its_workspace(bus_blobs, tmp_path) -> None:
    bus, blobs = bus_blobs
    # the harness proves it got its own URL and key (in env, not argv), and cwd = workspace
    script = ('printf "%s\\n%s\\n" "$GYRE_BASE_URL" "$(printf %s "$GYRE_API_KEY" | sha256sum | cut -d" " -f1)" '
              '> out.txt; cat {prompt_file} >> out.txt; mkdir -p __pycache__; touch __pycache__/x.pyc; exit 3')
    runner = RolloutRunner(RunnerConfig(RUN, "http://proxy:1", tmp_path / "work", harness=shell(script)),
                           bus=bus, blobs=blobs)
    outcomes = await runner.run_step(7, [task(tmp_path)], group_size=2, weight_version=4)
    assert [o.status for o in outcomes] == ["finished", "finished"] and {o.exit_status for o in outcomes} == {3}
    evs = await events(bus)
    started = [e for e in evs if isinstance(e, RolloutStarted)]
    ended = [e for e in evs if isinstance(e, RolloutFinished)]
    assert len(started) == 2 and len(ended) == 2
    for o in outcomes:
        s = next(e for e in started if e.rollout_id == o.rollout_id)
        assert (s.step, s.group_id, s.group_size, s.weight_version, s.harness) == (7, "s7-demo", 2, 4, "sh")
        assert evs.index(s) < evs.index(next(e for e in ended if e.rollout_id == o.rollout_id))
        files = files_of(await blobs.get(o.snapshot_digest))
        assert set(files) == {"given.txt", "out.txt"}  # caches left out
        url, digest, prompt = files["out.txt"].decode().split("\n", 2)
        assert url == f"http://proxy:1/r/{o.rollout_id}" and digest == s.api_key_digest and prompt == "Say hi.\n"
    assert len({s.api_key_digest for s in started}) == 2
    assert not (tmp_path / "work" / outcomes[0].rollout_id).exists()  # cleaned up


async def test_timeout_kills_the_process_group_and_keeps_partial_work(bus_blobs, tmp_path) -> None:
    bus, blobs = bus_blobs
    script = "echo partial > out.txt; sleep 60 & echo $! > ../child.pid; sleep 60"
    runner = RolloutRunner(RunnerConfig(RUN, "http://proxy:1", tmp_path / "work", harness=shell(script),
                                        kill_grace_s=0.5, keep_workspaces=True), bus=bus, blobs=blobs)
    t0 = time.monotonic()
    [outcome] = await runner.run_step(0, [task(tmp_path, limit=1.0)], group_size=1)
    assert time.monotonic() - t0 < 10
    assert outcome.status == "timed_out" and outcome.exit_status is not None and outcome.exit_status < 0
    assert 1.0 <= outcome.wall_time_s < 3.0
    [ended] = [e for e in await events(bus) if isinstance(e, RolloutTimedOut)]
    assert ended.snapshot_digest == outcome.snapshot_digest and ended.task_id == "demo"
    assert files_of(await blobs.get(ended.snapshot_digest))["out.txt"] == b"partial\n"
    child = int((tmp_path / "work" / outcome.rollout_id / "child.pid").read_text())
    time.sleep(0.2)
    assert not _alive(child), "the harness's background child survived the timeout"


async def test_a_harness_that_cannot_start_still_ends_its_rollout(bus_blobs, tmp_path) -> None:
    bus, blobs = bus_blobs
    missing = HarnessConfig(name="missing", command=("/nonexistent/harness",))
    runner = RolloutRunner(RunnerConfig(RUN, "http://proxy:1", tmp_path / "work", harness=missing),
                           bus=bus, blobs=blobs)
    [outcome] = await runner.run_step(0, [task(tmp_path)], group_size=1)
    assert outcome.status == "finished" and outcome.exit_status == 127 and "did not start" in outcome.log_tail
    kinds = [type(e).__name__ for e in await events(bus)]
    assert kinds == ["RolloutStarted", "RolloutFinished"]
    assert hashlib.sha256(b"x").hexdigest() != outcome.snapshot_digest and outcome.snapshot_digest


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (not yet reaped by init) counts as dead
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_service_options() -> None:
    import pytest

    from services.runner.main import SPEC, runner_config

    assert SPEC.name == "runner"
    config = runner_config("r1", {"proxy_url": "http://p:1", "harness": "claude_code", "max_parallel": "2",
                                  "work_root": "/tmp/x"})
    assert (config.harness.name, config.max_parallel, str(config.work_root)) == ("claude_code", 2, "/tmp/x")
    for bad in ({}, {"proxy_url": "http://p:1", "harness": "nope"}):
        with pytest.raises(ValueError):
            runner_config("r1", bad)
