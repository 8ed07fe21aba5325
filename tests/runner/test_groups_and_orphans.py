"""Group ids a step can complete, a bounded number of rollouts at once, and no harness
outliving its runner.

- A step run again (the runner stopped mid-step; its abandoned rollouts never end, and the
  trajectory ledger queues a group only once every member is sealed) gets ``re<n>-`` groups,
  which the scheduler reads as replacing the old ones; a task listed twice, or a request
  sent again while the first runs, gets ``dup<n>-`` sibling groups, all trained.
- ``max_parallel`` below 1 stops the runner at start with an error naming the variable
  (0 made every step wait for good).
- A runner killed hard (SIGKILL) takes its harnesses with it, and what they started in a
  session of their own; a next runner sweeps what a dead runner still left.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gyre.services import runner_env_options
from libs.common.blobs import MemoryBlobStore
from libs.common.bus.memory import InMemoryBus
from libs.common.events import (Context, GroupQueued, RolloutFinished, RolloutScored, RolloutStarted,
                                RolloutTimedOut)
from services.runner.adapters.process import RUNNER_VAR, kill_orphans
from services.runner.harness import HarnessConfig
from services.runner.main import create_runner, env_options, runner_config
from services.runner.runner import RolloutRunner, RunnerConfig
from services.runner.tasks import Task
from services.trajectory.ledger import LedgerConfig, TrajectoryLedger

RUN = "groups"
ROOT = Path(__file__).resolve().parents[2]


def runner(tmp_path, bus, script: str, **kw) -> RolloutRunner:
    return RolloutRunner(RunnerConfig(RUN, "http://proxy:1", tmp_path / "work", kill_grace_s=0.2,
                                      harness=HarnessConfig("sh", ("/bin/sh", "-c", script)), **kw),
                         bus=bus, blobs=MemoryBlobStore())


async def queued_groups(bus) -> list[GroupQueued]:
    """The runner's rollout events through the real trajectory ledger, each rollout scored
    as it ends (as the evaluator would)."""
    ledger = TrajectoryLedger(LedgerConfig(RUN))
    queued: list[GroupQueued] = []
    async for d in bus.read(Context.ROLLOUTS):
        ev = d.event
        if isinstance(ev, RolloutStarted):
            fx = ledger.rollout_started(ev)
        elif isinstance(ev, (RolloutFinished, RolloutTimedOut)):
            ledger.rollout_ended(ev.rollout_id)
            score = RolloutScored(run_id=RUN, rollout_id=ev.rollout_id, score=0.5)
            ledger.rollout_judged(score)
            fx = ledger.seal(ev.rollout_id, score)
        else:
            continue
        queued += [e for e in fx.events if isinstance(e, GroupQueued)]
    return queued


async def test_a_step_run_again_after_a_stop_gets_new_groups_and_trains(tmp_path) -> None:
    bus = InMemoryBus()
    demo = Task("demo", "hi\n", time_limit_s=60)
    first = asyncio.create_task(runner(tmp_path, bus, "sleep 30").run_step(3, [demo], group_size=2))
    for _ in range(200):  # the first runner is stopped mid-step, its two rollouts started
        await asyncio.sleep(0.05)
        if len([d async for d in bus.read(Context.ROLLOUTS) if isinstance(d.event, RolloutStarted)]) == 2:
            break
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)

    outcomes = await runner(tmp_path, bus, "echo done > a.txt").run_step(3, [demo], 2)  # a new runner
    assert {o.group_id for o in outcomes} == {"re1-s3-demo"}
    assert all(o.rollout_id.startswith("re1-s3-demo-") for o in outcomes)
    assert [(g.group_id, sorted(g.rollout_ids)) for g in await queued_groups(bus)] == \
        [("re1-s3-demo", sorted(o.rollout_id for o in outcomes))]
    again = await runner(tmp_path, bus, "echo done > a.txt").run_step(3, [demo], 1)
    assert {o.group_id for o in again} == {"re2-s3-demo"}


async def test_a_task_listed_twice_and_a_step_asked_twice_at_once_get_groups_of_their_own(tmp_path) -> None:
    bus = InMemoryBus()
    r = runner(tmp_path, bus, "echo hi > a.txt", max_parallel=1)
    demo = Task("demo", "hi\n", time_limit_s=10)
    both = await asyncio.gather(r.run_step(0, [demo, demo], group_size=2), r.run_step(0, [demo], group_size=2))
    groups = [sorted({o.group_id for o in outcomes}) for outcomes in both]
    assert groups == [["dup1-s0-demo", "s0-demo"], ["dup2-s0-demo"]]
    queued = await queued_groups(bus)
    assert sorted(g.group_id for g in queued) == ["dup1-s0-demo", "dup2-s0-demo", "s0-demo"]
    assert {r for g in queued for r in g.rollout_ids} == {o.rollout_id for out in both for o in out}
    # siblings, not re-runs: the scheduler's demand counts all of them (re<n>- would replace s0-demo)
    from services.scheduler.demand import Demand

    demand = Demand()
    for d in [d async for d in bus.read(Context.ROLLOUTS) if isinstance(d.event, RolloutStarted)]:
        demand.apply(d.event)
    assert demand.superseded == set() and demand.step_groups[0] == {"s0-demo", "dup1-s0-demo", "dup2-s0-demo"}
    # once they are done, the step asked for again is a re-run
    again = await r.run_step(0, [demo], group_size=1)
    assert {o.group_id for o in again} == {"re1-s0-demo"}


@pytest.mark.parametrize("value", ["0", "-1", "abc", "2.5"])
def test_max_parallel_below_one_or_unreadable_names_its_variable(tmp_path, value) -> None:
    environ = {"GYRE_PROXY_URL": "http://proxy:1", "GYRE_RUNNER_MAX_PARALLEL": value,
               "GYRE_RUNNER_WORK_ROOT": str(tmp_path / "work")}
    options = env_options(runner_env_options({}, environ), environ)  # as `gyre serve runner` builds them
    with pytest.raises(ValueError, match="GYRE_RUNNER_MAX_PARALLEL.*an integer >= 1"):
        create_runner(runner_config("r", options), bus=InMemoryBus(), blobs=MemoryBlobStore())
    with pytest.raises(ValueError, match="max_parallel must be an integer >= 1"):
        RunnerConfig("r", "http://proxy:1", tmp_path, max_parallel=0)


_RUNNER = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    from libs.common.blobs import MemoryBlobStore
    from libs.common.bus.memory import InMemoryBus
    from services.runner.harness import HarnessConfig
    from services.runner.runner import RolloutRunner, RunnerConfig
    from services.runner.tasks import Task
    work = Path(sys.argv[1])
    # the leader, and a child of its own session that a group kill does not reach
    h = HarnessConfig("sh", ("/bin/sh", "-c",
                             "echo $$ > ../harness.pid; setsid sleep 60 & echo $! > ../child.pid; "
                             "while true; do sleep 0.2; done"))
    r = RolloutRunner(RunnerConfig("r", "http://proxy:1", work, harness=h, keep_workspaces=True),
                      bus=InMemoryBus(), blobs=MemoryBlobStore())
    asyncio.run(r.run_step(0, [Task("demo", "hi\\n", time_limit_s=60)], 1))
""")


def _alive(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def test_a_harness_and_what_it_started_in_a_session_of_its_own_die_with_their_runner(tmp_path) -> None:
    """No next runner needed: the supervisor takes the group and every process that
    carries the rollout's mark (the ``setsid`` child is out of the group's reach)."""
    work = tmp_path / "work"
    proc = subprocess.Popen([sys.executable, "-c", _RUNNER, str(work)], cwd=ROOT)
    pids: list[int] = []
    try:
        for _ in range(400):
            files = [next(iter(work.glob(f"*/{n}.pid")), None) for n in ("harness", "child")]
            if all(f is not None and f.read_text().strip() for f in files):
                pids = [int(f.read_text()) for f in files]
                break
            time.sleep(0.05)
        assert len(pids) == 2, "the harness never started"
        leader, child = pids
        assert os.getsid(child) == child != os.getsid(leader)  # its own session indeed
        proc.send_signal(signal.SIGKILL)  # the runner dies hard mid-rollout
        proc.wait()
        t0 = time.monotonic()
        while (_alive(leader) or _alive(child)) and time.monotonic() - t0 < 5:
            time.sleep(0.05)
        assert not _alive(leader), "the harness outlived its runner"
        assert not _alive(child), "what the harness started in a session of its own outlived its runner"
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()


def test_a_new_runner_sweeps_what_a_dead_runner_left(tmp_path) -> None:
    """What no supervisor took (one killed hard with its runner, say): a process marked
    with a runner's pid that is no longer alive goes at the next runner's start."""
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid no runner has any more
    stray = subprocess.Popen(["sleep", "30"], env={**os.environ, RUNNER_VAR: str(gone.pid)})
    try:
        assert kill_orphans() >= 1
        assert stray.wait(timeout=5) == -signal.SIGKILL
    finally:
        if stray.poll() is None:
            stray.kill()
            stray.wait()


def test_the_sweep_leaves_a_live_runners_harnesses_alone(tmp_path) -> None:
    child = subprocess.Popen(["sleep", "30"], env={**os.environ, RUNNER_VAR: str(os.getpid())})
    try:
        kill_orphans()
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()


_RUNNER_OF_A_GROUP = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    from libs.common.blobs import MemoryBlobStore
    from libs.common.bus.memory import InMemoryBus
    from services.runner.harness import HarnessConfig
    from services.runner.runner import RolloutRunner, RunnerConfig
    from services.runner.tasks import Task
    work = Path(sys.argv[1])
    # the harness's shell, a child of the group, and one that ignores SIGTERM (SIGKILL it takes)
    h = HarnessConfig("sh", ("/bin/sh", "-c",
                             "sleep 300 & sh -c 'trap \\"\\" TERM; sleep 300' & "
                             "echo $$ > ../harness.pid; sleep 300"))
    r = RolloutRunner(RunnerConfig("r", "http://proxy:1", work, harness=h, keep_workspaces=True),
                      bus=InMemoryBus(), blobs=MemoryBlobStore())
    asyncio.run(r.run_step(0, [Task("demo", "hi\\n", time_limit_s=120)], 1))
""")


def _group_members(pgid: int) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry.name}/stat").read_bytes().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != b"Z":
            found.append(int(entry.name))
    return found


def test_the_whole_harness_group_dies_with_its_runner_without_a_next_runner(tmp_path) -> None:
    work = tmp_path / "work"
    proc = subprocess.Popen([sys.executable, "-c", _RUNNER_OF_A_GROUP, str(work)], cwd=ROOT)
    pgid, members = 0, []
    try:
        for _ in range(400):  # the shell and its three children (two sleeps, one subshell)
            f = next(iter(work.glob("*/harness.pid")), None)
            if f is not None and f.read_text().strip():
                pgid = os.getpgid(int(f.read_text()))
                members = _group_members(pgid)
                if len(members) >= 5:  # and the supervisor leading the group
                    break
            time.sleep(0.05)
        assert len(members) >= 5, f"the harness never started its children: {members}"
        assert pgid in members and pgid != int(f.read_text())  # the supervisor leads the group
        proc.send_signal(signal.SIGKILL)  # the runner dies hard mid-rollout (no next runner sweeps)
        proc.wait()
        t0 = time.monotonic()
        while _group_members(pgid) and time.monotonic() - t0 < 5:
            time.sleep(0.05)
        assert _group_members(pgid) == [], "processes of the harness's group outlived their runner"
        assert time.monotonic() - t0 < 3
    finally:
        for pid in _group_members(pgid) if pgid else []:
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
