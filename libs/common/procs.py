"""Child processes that do not outlive their parent, on Linux (``PR_SET_PDEATHSIG``).

``die_with_parent(sig)`` is a ``preexec_fn``: the child gets ``sig`` when the thread that
started it ends, the parent's own SIGKILL included. libc is resolved here, at import, not
in the forked child (no dynamic loading between fork and exec in a process with threads).
Where there is no such call (not Linux), the child is started as ever.

That signal reaches one process. For a process *group* to die with its parent, the parent
starts this file as a supervisor (``supervised(argv, ...)``: a short argv to run with
``start_new_session=True`` and ``preexec_fn=die_with_parent(signal.SIGTERM)``). The
supervisor leads the group and runs ``argv`` as its child in the same group, with the
environment, cwd, stdio, signal mask and dispositions it was itself given (what the
parent gave), and:

- reports on ``ready_fd`` whether the program started: ``ok``, or the errno its exec
  failed with (``supervised_error`` turns that into the ``OSError`` a direct start raises);
- exits as the child did: its exit code, or it kills itself with the child's signal (so a
  ``-N`` status reads the same);
- passes on to the child a signal sent to it by a process other than the parent and not of
  the group (a ``kill`` of its pid); one from the parent (whose kills are ``killpg``) or
  from within the group (``kill 0``) reached the child already and is not sent twice. The
  supervisor itself does not die of a signal (but SIGKILL): it waits for the child;
- when its parent dies (the death signal, or its parent pid changed; also checked twice a
  second), sends SIGTERM to the whole group, SIGKILL after ``grace_s`` (or as soon as the
  group is empty), itself included (when it leads no group of its own, the child alone).
  With a ``mark`` (an environment entry such as ``GYRE_ROLLOUT_ID=r1`` that the program's
  processes inherit), every process of the user's that carries it goes the same way: what
  the program started in a session or group of its own (``setsid``, a daemon) is out of
  the group's reach. The child gets SIGKILL should the supervisor itself be killed hard.

It imports only the standard library (run as ``python -I -S procs.py``: a few tens of ms).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable

try:
    _prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except (OSError, AttributeError):
    _prctl = None
_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None]:
    def preexec() -> None:  # runs in the child between fork and exec
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, int(sig))

    return preexec


_SUPERVISE = "--supervise"


def supervised(argv: list[str], *, ready_fd: int, parent_pid: int, grace_s: float,
               mark: str | None = None, python: str = sys.executable) -> list[str]:
    """The argv that runs ``argv`` under a supervisor (see the module's doc); ``ready_fd``
    must be passed to it (``pass_fds``). ``mark``: ``NAME=value``, an entry of the
    environment the supervisor is started with (so of every process the program starts)."""
    if mark is not None and (not mark or "=" not in mark or "\0" in mark or mark.startswith("=")):
        raise ValueError(f"a supervisor's mark is an environment entry NAME=value, not {mark!r}")
    return [python, "-I", "-S", os.path.abspath(__file__), _SUPERVISE, str(ready_fd), str(parent_pid),
            repr(float(grace_s)), mark or "", "--", *argv]


def signal_marked(entry: bytes, sig: int, *, skip: tuple[int, ...] = ()) -> int:
    """Sends ``sig`` to every process of ours whose environment holds ``entry`` (``NAME=value``),
    but this one and ``skip``; how many it reached. Linux only (reads /proc: elsewhere 0);
    a process that cleared its environment, runs as another user, or is a zombie is not
    found."""
    skip = (os.getpid(), *skip)
    reached = 0
    try:
        entries = os.listdir("/proc")
    except OSError:
        return 0
    for name in entries:
        if not name.isdigit() or int(name) in skip:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:  # gone, or not ours to read
            continue
        if entry in env:
            try:
                os.kill(int(name), sig)
                reached += 1
            except OSError:
                pass
    return reached


def supervised_error(report: bytes, program: str) -> OSError | None:
    """None when the supervisor's report says the program started; else the error a direct
    start would have raised (e.g. ``FileNotFoundError`` naming the program)."""
    if report == b"ok":
        return None
    if report.isdigit():
        err = int(report)
        return OSError(err, os.strerror(err), program)
    return OSError(f"the supervisor of {program!r} ended before starting it")


def _signals() -> set[int]:
    rt = range(32, getattr(signal, "SIGRTMIN", 32))  # libc's own (NPTL), not to be blocked
    return {s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP) and s not in rt}


def _environ() -> list[bytes]:
    """The environment as this process was given it: Python's start may add to os.environ
    (LC_CTYPE=C.UTF-8 under the C locale), which the child must not see."""
    try:
        with open("/proc/self/environ", "rb") as f:
            return [e for e in f.read().split(b"\0") if b"=" in e]
    except OSError:
        return [k + b"=" + v for k, v in os.environb.items()]


def _spawn(argv: list[str], mask: set[int]) -> tuple[int, int]:
    """Fork and exec ``argv``: (child pid, 0), or (pid of the child that failed, errno)."""
    env = dict(e.split(b"=", 1) for e in _environ())
    me = os.getpid()
    r, w = os.pipe()  # close-on-exec: EOF means the exec happened
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            for s in ("SIGPIPE", "SIGXFSZ", "SIGXFZ"):  # what Python ignores; a direct start resets them too
                if hasattr(signal, s):
                    signal.signal(getattr(signal, s), signal.SIG_DFL)
            if _prctl is not None:
                _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
            if os.getppid() != me:  # the supervisor is already gone
                os._exit(1)
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            try:
                os.execvpe(argv[0], argv, env)
            except OSError as e:
                os.write(w, str(e.errno or 0).encode())
            os._exit(127)
        finally:
            os._exit(127)
    os.close(w)
    data = b""
    while chunk := os.read(r, 64):
        data += chunk
    os.close(r)
    return pid, int(data) if data.isdigit() else 0


def _exit_as(status: int) -> None:
    code = os.waitstatus_to_exitcode(status)
    if code >= 0:
        os._exit(code)
    sig = -code
    if _prctl is not None:
        _prctl(_PR_SET_DUMPABLE, 0)  # the child dumped its core, if any; not this one
    if sig != signal.SIGKILL:  # (its handler cannot be set, nor is it blocked)
        signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
    os._exit(128 + sig)  # a signal that does not end a process (cannot happen: it ended the child)


def _others_in_group(pgid: int) -> bool | None:
    """Whether a live process other than this one is in the group (None: cannot tell)."""
    me = os.getpid()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    for name in entries:
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False


def _orphaned(child: int | None, grace_s: float, mark: bytes = b"") -> None:
    """The parent died: the group goes, and what carries ``mark``; SIGTERM first, this
    process last."""
    pgid = os.getpgrp()
    leader = pgid == os.getpid()  # else the group is not ours to kill: the child alone goes

    def kill(sig: int) -> None:
        try:
            if leader:
                os.killpg(pgid, sig)  # this process too: SIGTERM is blocked here, SIGKILL ends it
            elif child is not None:
                os.kill(child, sig)
        except OSError:
            pass

    kill(signal.SIGTERM)
    marked = bool(mark) and signal_marked(mark, signal.SIGTERM) > 0
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if child is not None:
            try:
                if os.waitpid(child, os.WNOHANG)[0]:
                    child = None
            except ChildProcessError:
                child = None
        if marked:  # still some? (signal 0 only asks)
            marked = signal_marked(mark, 0) > 0
        if not marked and ((_others_in_group(pgid) is False) if leader else child is None):
            break
        signal.sigtimedwait({signal.SIGCHLD}, 0.05)
    if mark:
        for _ in range(5):  # again while it finds some: a process may fork while we look
            if not signal_marked(mark, signal.SIGKILL):
                break
    kill(signal.SIGKILL)
    os._exit(1)


def _from_outside(info: signal.struct_siginfo, parent: int) -> bool:
    """A signal sent by a process (not the kernel), neither the parent (which signals the
    whole group) nor one of the group (a ``kill 0`` reaches the child too)."""
    if info.si_code > 0 or info.si_pid in (0, parent):
        return False
    try:
        return os.getpgid(info.si_pid) != os.getpgrp()
    except OSError:  # gone already (a `kill` command): passed on
        return True


def _supervise(args: list[str]) -> None:
    ready_fd, parent, grace_s, mark = int(args[0]), int(args[1]), float(args[2]), os.fsencode(args[3])
    argv = args[5:]
    watched = _signals()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, watched)  # the parent's: the child gets it back
    os.set_inheritable(ready_fd, False)
    if os.getppid() != parent:  # the parent died before the death signal was set
        _orphaned(None, 0.0, mark)
    if not argv:
        os.write(ready_fd, str(22).encode())  # EINVAL
        os._exit(127)
    try:
        child, err = _spawn(argv, mask)
    except OSError as e:  # fork failed
        os.write(ready_fd, str(e.errno or 0).encode())
        os._exit(127)
    try:
        os.write(ready_fd, str(err).encode() if err else b"ok")
        os.close(ready_fd)
    except OSError:
        pass
    while True:
        info = signal.sigtimedwait(watched, 0.5)
        if os.getppid() != parent:
            _orphaned(child, grace_s, mark)
        pid, status = os.waitpid(child, os.WNOHANG)
        if pid:
            _exit_as(status)
        if info is not None and info.si_signo != signal.SIGCHLD and _from_outside(info, parent):
            try:
                os.kill(child, info.si_signo)
            except OSError:
                pass


if __name__ == "__main__" and sys.argv[1:2] == [_SUPERVISE]:
    _supervise(sys.argv[2:])
