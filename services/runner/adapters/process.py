"""Harness processes: each in its own session (so its process group can be killed as a
whole, children included), output to a log file, waited on with a deadline.

A harness does not outlive its runner: its leader gets SIGKILL when the runner dies
(``PR_SET_PDEATHSIG``, even on the runner's own SIGKILL), and a runner starting sweeps
what a dead runner's harnesses left (``kill_orphans``: every process of ours marked with
the pid of a runner no longer alive)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from libs.common.procs import die_with_parent


@dataclass
class HarnessProcess:
    proc: asyncio.subprocess.Process

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def wait(self, timeout_s: float) -> int | None:
        """The exit status, or None if it is still running after ``timeout_s``."""
        try:
            return await asyncio.wait_for(self.proc.wait(), max(0.0, timeout_s))
        except asyncio.TimeoutError:
            return None

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    async def kill_group(self, grace_s: float) -> int:
        """SIGTERM to the whole group, SIGKILL after ``grace_s``; returns the exit status."""
        self.signal_group(signal.SIGTERM)
        status = await self.wait(grace_s)
        self.signal_group(signal.SIGKILL)
        if status is None:
            status = await self.proc.wait()
        return status

    def reap_group(self) -> None:
        """After a normal exit: leftovers (background servers the agent started) go too."""
        self.signal_group(signal.SIGKILL)


MARK_VAR = "GYRE_ROLLOUT_ID"  # set in every harness's environment; inherited by what it starts
RUNNER_VAR = "GYRE_RUNNER_PID"  # ... and the pid of the runner that started it

log = logging.getLogger(__name__)

_die_with_runner = die_with_parent(signal.SIGKILL)


def _environ_of(pid: str) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().split(b"\0")
    except OSError:  # gone, or not ours to read
        return None


def kill_orphans() -> int:
    """SIGKILL every process of ours whose ``GYRE_RUNNER_PID`` names a runner that is not
    alive: what a runner that died hard (OOM, kill -9) left running with no time limit.
    Processes of a live runner (another one on this machine) are left alone. Returns how
    many were killed."""
    prefix = f"{RUNNER_VAR}=".encode()
    dead: dict[int, bool] = {}
    killed = 0
    try:
        entries = list(os.scandir("/proc"))
    except OSError:  # no /proc (not Linux): nothing to sweep
        return 0
    for entry in entries:
        if not entry.name.isdigit():
            continue
        env = _environ_of(entry.name)
        mark = next((v for v in env or () if v.startswith(prefix)), None)
        if mark is None:
            continue
        try:
            runner = int(mark[len(prefix):])
        except ValueError:
            continue
        if runner not in dead:
            dead[runner] = not os.path.exists(f"/proc/{runner}")
        if dead[runner]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
    if killed:
        log.warning("runner: killed %d process(es) left running by harnesses of a runner that died", killed)
    return killed


def kill_marked(mark: str, *, passes: int = 5) -> int:
    """SIGKILL every process of ours whose environment carries ``GYRE_ROLLOUT_ID=<mark>``:
    what a harness started in a session or group of its own (a tool's shell, a server it
    forgot) and so outlived the group kill. Linux only (reads /proc); a process that
    cleared its environment, or runs as another user, is not found. Returns how many."""
    needle = f"{MARK_VAR}={mark}".encode()
    me, killed = os.getpid(), 0
    for _ in range(passes):  # again while it finds some: a process may fork while we look
        found = 0
        with contextlib.suppress(OSError):
            for entry in os.scandir("/proc"):
                if not entry.name.isdigit() or int(entry.name) == me:
                    continue
                env = _environ_of(entry.name)
                if env is not None and needle in env:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(int(entry.name), signal.SIGKILL)
                        found += 1
        killed += found
        if not found:
            break
    return killed


async def launch(argv: list[str], *, cwd: Path, env: dict[str, str], log_file: Path) -> HarnessProcess:
    """Start a harness; raises OSError when the program cannot be started."""
    with log_file.open("ab") as log:
        proc = await asyncio.create_subprocess_exec(*argv, cwd=str(cwd), env=env, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=log, stderr=asyncio.subprocess.STDOUT,
                                                    start_new_session=True, preexec_fn=_die_with_runner)
    return HarnessProcess(proc)
