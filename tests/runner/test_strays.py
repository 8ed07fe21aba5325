"""Nothing a harness started outlives its rollout (review finding 3): the reference
agent's ``run`` tool gives each command a session of its own, which the runner's group
kill misses; the agent kills those groups on SIGTERM and at exit, and the runner kills
whatever still carries the rollout's mark before it takes the snapshot."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from libs.common.blobs import MemoryBlobStore
from libs.common.bus.memory import InMemoryBus
from services.runner.agent.tools import Workspace, kill_commands
from services.runner.harness import HarnessConfig
from services.runner.runner import RolloutRunner, RunnerConfig
from services.runner.tasks import Task

REPO = Path(__file__).resolve().parents[2]


def alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status  # a zombie has stopped running


def wait_dead(pid: int, within_s: float = 2.0) -> bool:
    end = time.monotonic() + within_s
    while alive(pid):
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def runner(tmp_path: Path, harness: HarnessConfig) -> RolloutRunner:
    config = RunnerConfig("r", "http://proxy:1", tmp_path / "work", harness=harness, kill_grace_s=0.3,
                          keep_workspaces=True)
    return RolloutRunner(config, bus=InMemoryBus(), blobs=MemoryBlobStore())


async def test_a_tool_command_in_its_own_session_is_killed_at_the_deadline(tmp_path) -> None:
    # the reference agent's tool, as the reviewer's reproduction drives it
    agent = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]);"
             "from services.runner.agent.tools import Workspace;"
             "Workspace(Path('.')).run({'command': 'echo $$ > tool.pid; sleep 1.5; echo late > late.txt; sleep 60',"
             " 'timeout_s': 120})")
    (tmp_path / "agent.py").write_text(agent)  # a file: the harness command is a format template
    r = runner(tmp_path, HarnessConfig("toolish", (sys.executable, str(tmp_path / "agent.py"), str(REPO))))
    [o] = await r.run_step(0, [Task("demo", "hi\n", time_limit_s=0.8)], 1)
    ws = tmp_path / "work" / o.rollout_id / "workspace"
    pid = int((ws / "tool.pid").read_text())
    assert o.status == "timed_out" and wait_dead(pid, 0.5)
    time.sleep(1.0)  # past the moment the tool would have written
    assert not (ws / "late.txt").exists()


async def test_a_detached_process_is_killed_after_a_normal_exit(tmp_path) -> None:
    script = "setsid sh -c 'echo $$ > bg.pid; exec sleep 60' > /dev/null 2>&1 & sleep 0.2; exit 0"
    r = runner(tmp_path, HarnessConfig("sh", ("/bin/sh", "-c", script)))
    [o] = await r.run_step(0, [Task("demo", "hi\n", time_limit_s=10)], 1)
    pid = int((tmp_path / "work" / o.rollout_id / "workspace" / "bg.pid").read_text())
    assert o.status == "finished" and wait_dead(pid, 0.5)


def test_the_run_tool_keeps_its_timeout_and_kill_commands_ends_background_jobs(tmp_path) -> None:
    ws = Workspace(tmp_path)
    started = time.monotonic()
    out = ws.run({"command": "sleep 30", "timeout_s": 1})
    assert out.startswith("killed after 1 s") and time.monotonic() - started < 5
    out = ws.run({"command": "sleep 60 > /dev/null 2>&1 & echo $!"})
    pid = int(out.splitlines()[1])
    assert out.startswith("exit status 0") and alive(pid)
    kill_commands()
    assert wait_dead(pid)


def test_the_agent_kills_its_commands_when_terminated(tmp_path) -> None:
    code = ("import sys, time; from pathlib import Path; sys.path.insert(0, sys.argv[1]);"
            "from services.runner.agent.main import _stop_commands_with_the_agent;"
            "from services.runner.agent.tools import Workspace;"
            "_stop_commands_with_the_agent();"
            "print(Workspace(Path('.')).run({'command': 'sleep 60 > /dev/null 2>&1 & echo $!'}).splitlines()[1],"
            " flush=True);"
            "Workspace(Path('.')).run({'command': 'sleep 60', 'timeout_s': 60})")
    agent = subprocess.Popen([sys.executable, "-c", code, str(REPO)], cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        background = int(agent.stdout.readline())
        time.sleep(0.3)  # the second command is running in its own group
        groups = {int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                  and _ppid(int(p.name)) == agent.pid}
        assert alive(background) and groups
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(5) == 128 + signal.SIGTERM
        assert wait_dead(background) and all(wait_dead(pid) for pid in groups)
    finally:
        if agent.poll() is None:
            agent.kill()
        agent.stdout.close()


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def test_the_run_tool_keeps_its_timeout_when_a_detached_child_holds_its_output(tmp_path) -> None:
    """``setsid cmd &`` leaves a process outside the command's group holding the output
    pipe: after the timeout the tool stops reading instead of waiting for it."""
    ws = Workspace(tmp_path)
    started = time.monotonic()
    out = ws.run({"command": "echo before; setsid sleep 30 & echo $! > bg.pid", "timeout_s": 1})
    took = time.monotonic() - started
    pid = int((tmp_path / "bg.pid").read_text())
    try:
        assert took < 4, took
        assert out.startswith("exit status 0 (output cut after 1 s") and "before" in out
    finally:
        subprocess.run(["kill", "-9", str(pid)], check=False)
