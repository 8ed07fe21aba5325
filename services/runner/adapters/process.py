"""Harness processes: each in its own session (so its process group can be killed as a
whole, children included), output to a log file, waited on with a deadline.

A harness does not outlive its runner: it runs under a supervisor (``libs.common.procs``)
that leads its group, gets SIGTERM when the runner dies (``PR_SET_PDEATHSIG``, even on the
runner's own SIGKILL) and then kills the whole group, SIGTERM first, and every process
that carries the harness's rollout mark (``GYRE_ROLLOUT_ID``: what it started in a session
of its own); to the runner it reads as the harness (exit status, start errors). A runner
starting sweeps what a dead runner's harnesses may still have left (``kill_orphans``:
every process of ours marked with the pid of a runner no longer alive; e.g. when the
supervisor itself was killed hard)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from libs.common.procs import die_with_parent, signal_marked, supervised, supervised_error


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
ORPHAN_GRACE_S = 1.0  # a dead runner's harness group: SIGTERM, then SIGKILL this much later (at most)

log = logging.getLogger(__name__)

# the supervisor gets SIGTERM (it handles it: the group goes) when the runner dies
_die_with_runner = die_with_parent(signal.SIGTERM)


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
    killed = 0
    for _ in range(passes):  # again while it finds some: a process may fork while we look
        found = signal_marked(needle, signal.SIGKILL)
        killed += found
        if not found:
            break
    return killed


async def _read_report(fd: int) -> bytes:
    """What the supervisor writes on ``fd`` up to EOF, read without blocking the loop."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    chunks: list[bytes] = []

    def readable() -> None:
        try:
            data = os.read(fd, 256)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            chunks.append(data)
        elif not done.done():
            done.set_result(None)

    os.set_blocking(fd, False)
    loop.add_reader(fd, readable)
    try:
        await done
    finally:
        loop.remove_reader(fd)
    return b"".join(chunks)


async def launch(argv: list[str], *, cwd: Path, env: dict[str, str], log_file: Path) -> HarnessProcess:
    """Start a harness under a supervisor (``libs.common.procs``) that leads its process
    group and takes the whole group down if the runner dies; raises OSError when the
    program cannot be started (the error a direct start raises)."""
    if not argv:
        raise OSError(errno.EINVAL, "a harness needs a command")
    ready_r, ready_w = os.pipe()
    try:
        with log_file.open("ab") as log:
            proc = await asyncio.create_subprocess_exec(
                *supervised(argv, ready_fd=ready_w, parent_pid=os.getpid(), grace_s=ORPHAN_GRACE_S,
                            mark=f"{MARK_VAR}={env[MARK_VAR]}" if env.get(MARK_VAR) else None),
                cwd=str(cwd), env=env, stdin=asyncio.subprocess.DEVNULL, stdout=log,
                stderr=asyncio.subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_runner,
                pass_fds=(ready_w,))
    except BaseException:
        os.close(ready_r)
        raise
    finally:
        os.close(ready_w)
    harness = HarnessProcess(proc)
    try:
        report = await _read_report(ready_r)
    except BaseException:  # cancelled while it started: leave nothing running
        harness.signal_group(signal.SIGKILL)
        raise
    finally:
        os.close(ready_r)
    error = supervised_error(report, argv[0])
    if error is not None:  # the supervisor exits 127 at once: nothing of the group runs
        try:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(proc.wait(), 10)
        finally:
            if proc.returncode is None:
                harness.signal_group(signal.SIGKILL)
        raise error
    return harness
