"""Harness processes: each in its own session (so its process group can be killed as a
whole, children included), output to a log file, waited on with a deadline."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from dataclasses import dataclass
from pathlib import Path


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
                try:
                    with open(f"/proc/{entry.name}/environ", "rb") as f:
                        env = f.read().split(b"\0")
                except OSError:  # gone, or not ours to read
                    continue
                if needle in env:
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
                                                    start_new_session=True)
    return HarnessProcess(proc)
