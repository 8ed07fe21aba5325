"""Running a test command on an unpacked workspace, contained.

Isolation modes, strongest first (``probe`` picks the strongest that works here, and the
chosen mode's description goes into every score event):

``namespaces`` (needs root): new network, mount, PID, IPC and UTS namespaces
    (``unshare``), so no network (the namespace's loopback is down), and every process
    dies with the sandbox's first process; in the mount namespace the world-writable
    places (``/tmp``, ``/var/tmp``, ``/dev/shm``, ...) are read-only and only the
    workspace is writable; the command runs under its own unprivileged uid (one per
    concurrent sandbox, so the process limit is per sandbox), with no capabilities and
    ``no_new_privs`` (``setpriv``).
``uid`` (root, but namespaces refused): the own-uid part only; the network and
    world-writable folders stay reachable. With no PID namespace to end them, every
    process of the slot's uid is killed before and after each run (a daemon that left
    the process group would otherwise live on into the slot's next rollout).
``none`` (not root): the resource limits and the process group only.

Every mode: its own session and process group (killed as a whole at the end), a
wall-clock limit, rlimits on CPU time, address space, processes, file size and core
dumps, a cap on the output kept, a watch on the workspace's disk use, a clean environment.
Folders named ``readonly`` (the hidden tests) are not handed to the sandbox's uid and, in
``namespaces`` mode, are bound read-only onto themselves (a mount point cannot be renamed
either). With ``results_var`` the command inherits the write end of a pipe (its number in
that variable) and what it writes there comes back in ``SandboxRun.results``.
Not bounded without cgroups: the memory of all the sandbox's processes together (each
has its own address-space limit) and disk use between two checks (about a second).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import resource
import select
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..core.scoring import SandboxRun
from ..core.spec import Limits

log = logging.getLogger(__name__)
Mode = Literal["namespaces", "uid", "none"]
_MODES: tuple[Mode, ...] = ("namespaces", "uid", "none")

# Run as root inside the new namespaces, before dropping to the sandbox uid. Any failed
# step aborts with status 97, so a half-built sandbox never runs the command. The shell
# stays as the namespace's PID 1 (not exec): the kernel spares PID 1 from signals it has
# no handler for, so a command running as PID 1 would shrug off SIGXCPU.
#
# After the workspace, each folder named after it (n of them, relative to the workspace:
# the hidden tests) is bound read-only onto itself: a mount point cannot be written to,
# renamed or removed, so the tests' own files stay as the evaluator wrote them.
_INIT_SH = r"""
w="$1"; n="$2"; shift 2
for d in /tmp /var/tmp /dev/shm /run/lock /dev/mqueue; do
  if [ -d "$d" ] && [ ! -L "$d" ]; then
    mount --bind "$d" "$d" && mount -o remount,bind,ro "$d" || { echo "gyre-sandbox: cannot protect $d" >&2; exit 97; }
  fi
done
mount --bind "$w" "$w" && mount -o remount,bind,rw "$w" || { echo "gyre-sandbox: cannot mount $w" >&2; exit 97; }
while [ "$n" -gt 0 ]; do
  p="$w/$1"; shift; n=$((n - 1))
  [ -d "$p" ] && [ ! -L "$p" ] || { echo "gyre-sandbox: $p is not a folder" >&2; exit 97; }
  mount --bind "$p" "$p" && mount -o remount,bind,ro "$p" || { echo "gyre-sandbox: cannot protect $p" >&2; exit 97; }
done
cd "$w" || exit 97
"$@"
exit $?
"""
SETUP_FAILED = 97

_DESCRIPTIONS: dict[Mode, str] = {
    "namespaces": "namespaces(net,mount,pid,ipc,uts)+own-uid+no-caps+ro-shared-tmp+rlimits+disk-watch+pgroup",
    "uid": "own-uid+no-caps+rlimits+disk-watch+pgroup (no namespaces: network and /tmp reachable)",
    "none": "rlimits(no process cap)+disk-watch+pgroup only (no network or filesystem isolation)",
}


class SandboxUnavailable(RuntimeError):
    """The requested isolation cannot be had on this machine."""


@dataclass(frozen=True)
class SandboxConfig:
    isolation: Literal["auto", "namespaces", "uid", "none"] = "auto"
    uid_base: int = 61000  # sandbox n runs as uid_base + n (namespaces and uid modes)
    slots: int = 16  # most sandboxes at once
    # Where each slot's uid is claimed host-wide (namespaces and uid modes, run as root): two
    # evaluators (or replicas) on one machine never run as one uid, which would share its
    # process limit and, in uid mode, kill each other's processes.
    lock_dir: Path = Path("/run/gyre-sandbox")
    output_kill_factor: int = 100  # output beyond this many caps stops the run


class Sandbox:
    def __init__(self, config: SandboxConfig = SandboxConfig()) -> None:
        self.config = config
        self.mode: Mode | None = None
        self._free = list(range(config.slots))
        self._slot_free = asyncio.Condition()
        self._held: dict[int, int] = {}  # slot -> the descriptor of its host-wide claim

    @property
    def description(self) -> str:
        return _DESCRIPTIONS[self.mode or "none"]

    async def probe(self, work_root: Path, python: str = sys.executable) -> str:
        """Pick the strongest mode that really works here: ``python`` (the interpreter the
        tests will use) must run as the sandbox uid and write in a folder under ``work_root``."""
        wanted = _MODES if self.config.isolation == "auto" else (self.config.isolation,)
        errors = []
        for mode in wanted:
            if mode != "none" and os.geteuid() != 0:
                errors.append(f"{mode}: needs root")
                continue
            why = await self._trial(mode, work_root, python)
            if why is None:
                self.mode = mode
                if errors:
                    log.warning("sandbox: stronger isolation unavailable (%s); using %s", "; ".join(errors), mode)
                return self.description
            errors.append(f"{mode}: {why}")
        raise SandboxUnavailable("no sandbox works here: " + "; ".join(errors))

    async def _trial(self, mode: Mode, work_root: Path, python: str) -> str | None:
        work_root.mkdir(parents=True, exist_ok=True)
        trial = Path(os.path.realpath(work_root)) / f"probe-{os.getpid()}"
        shutil.rmtree(trial, ignore_errors=True)
        trial.mkdir(mode=0o755)
        self.mode = mode
        try:
            # the tests' interpreter as they run it (isolated mode): pytest must be importable
            script = "import os, pytest; open('ok', 'w').write(str(os.getuid()))"
            try:
                run = await self.run([python, "-I", "-c", script], workdir=trial, env={}, limits=Limits(wall_s=20))
            except SandboxUnavailable as exc:  # e.g. the uid claims' folder cannot be written
                return str(exc)
            if run.exit_code != 0 or not (trial / "ok").exists():
                return f"trial run failed (exit {run.exit_code}): {run.output_tail[-300:]}"
            return None
        finally:
            self.mode = None
            shutil.rmtree(trial, ignore_errors=True)

    async def run(self, argv: Sequence[str], *, workdir: Path, env: dict[str, str], limits: Limits,
                  readonly: Sequence[str] = (), results_var: str | None = None,
                  results_cap: int = 8 * 2**20) -> SandboxRun:
        """Run ``argv`` in ``workdir`` under ``limits``; the folder is handed to the sandbox's uid.

        ``readonly``: folders in ``workdir`` (relative names) that stay the evaluator's,
        readable but not writable by the sandbox (in ``namespaces`` mode also bound
        read-only, in ``uid`` mode in a workspace root the sandbox may not rename them in,
        so they cannot be renamed or replaced either). ``results_var``: the
        command gets the write end of a pipe, its descriptor number in that environment
        variable; what it writes there (the first ``results_cap`` bytes) comes back in
        ``SandboxRun.results``."""
        if self.mode is None:
            raise SandboxUnavailable("call probe() first")
        workdir = Path(os.path.realpath(workdir))
        slot = await self._acquire()
        try:
            uid = self.config.uid_base + slot
            full = self._command(list(argv), workdir, uid, readonly=tuple(readonly))
            return await asyncio.to_thread(self._execute, full, workdir, uid, _clean_env(env), limits,
                                           tuple(readonly), results_var, results_cap)
        finally:
            await self._release(slot)

    def _command(self, argv: list[str], workdir: Path, uid: int, readonly: tuple[str, ...] = ()) -> list[str]:
        if self.mode == "none":
            return argv
        drop = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs",
                "--inh-caps=-all", "--bounding-set=-all", "--"]
        if self.mode == "uid":
            return drop + argv
        unshare = ["unshare", "--net", "--mount", "--pid", "--ipc", "--uts", "--fork", "--kill-child",
                   "--mount-proc", "--"]
        return (unshare + ["/bin/sh", "-c", _INIT_SH, "gyre-sandbox", str(workdir), str(len(readonly)), *readonly]
                + drop + argv)

    def _execute(self, argv: list[str], workdir: Path, uid: int, env: dict[str, str], limits: Limits,
                 readonly: tuple[str, ...] = (), results_var: str | None = None,
                 results_cap: int = 8 * 2**20) -> SandboxRun:
        """Blocking (run in a thread): asyncio's wait() would also wait for the pipe,
        which a process that escaped the group could hold open for ever."""
        if self.mode == "uid":
            _kill_uid(uid)  # leftovers of an earlier evaluator that did not end cleanly
            try:
                return self._execute_once(argv, workdir, uid, env, limits, readonly, results_var, results_cap)
            finally:
                _kill_uid(uid)
        return self._execute_once(argv, workdir, uid, env, limits, readonly, results_var, results_cap)

    def _execute_once(self, argv: list[str], workdir: Path, uid: int, env: dict[str, str], limits: Limits,
                      readonly: tuple[str, ...], results_var: str | None, results_cap: int) -> SandboxRun:
        if self.mode != "none":
            _give_tree(workdir, uid, readonly, keep_root=self.mode == "uid" and bool(readonly))
        started = time.monotonic()  # after the hand-over: a workspace of many files costs no test time
        read_fd = write_fd = None
        if results_var:
            read_fd, write_fd = os.pipe()  # both ends close-on-exec; the child gets the write end only
            env = {**env, results_var: str(write_fd)}
        try:
            proc = subprocess.Popen(
                argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=_rlimits(limits, nproc=self.mode != "none"),
                pass_fds=(write_fd,) if write_fd is not None else (),
            )
        except BaseException:
            if read_fd is not None:
                os.close(read_fd)
            raise
        finally:
            if write_fd is not None:
                os.close(write_fd)  # the child's copy is the only one left: EOF once it is gone
        out = _CappedOutput(limits.output_bytes, limits.output_bytes * self.config.output_kill_factor)
        reader = threading.Thread(target=out.drain, args=(proc.stdout,), daemon=True)
        reader.start()
        results: _CappedOutput | None = None
        results_reader: threading.Thread | None = None
        if read_fd is not None:
            results = _CappedOutput(results_cap, 2**62)  # over the cap: drained and dropped, never a stall
            results_reader = threading.Thread(target=results.drain, args=(read_fd,), daemon=True)
            results_reader.start()
        killed_by: str | None = None
        next_disk_check = started + 1.0
        while True:
            try:
                code = proc.wait(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                if out.over_kill_limit:
                    killed_by = "output limit"
                elif now - started >= limits.wall_s:
                    killed_by = f"wall-clock limit ({limits.wall_s:g}s)"
                elif now >= next_disk_check:
                    next_disk_check = now + 1.0
                    if _disk_usage(workdir) > limits.max_disk_mb * 2**20:
                        killed_by = f"disk limit ({limits.max_disk_mb} MB)"
                if killed_by:
                    _kill_group(proc.pid)
                    code = proc.wait()
                    break
        _kill_group(proc.pid)  # leftovers of the group, if any
        readers = [(reader, out)] + ([(results_reader, results)] if results_reader and results else [])
        until = time.monotonic() + 2.0
        for thread, _ in readers:
            thread.join(max(0.0, until - time.monotonic()))
        for thread, capped in readers:
            capped.stop = True  # an escaped process may still hold the pipe: stop reading anyway
            thread.join(1.0)
        if not reader.is_alive() and proc.stdout:
            proc.stdout.close()
        if results_reader is not None and not results_reader.is_alive() and read_fd is not None:
            os.close(read_fd)
        if self.mode == "namespaces" and code is not None and code > 128:
            code = -(code - 128)  # the init shell reports "killed by signal n" as 128 + n
        if killed_by is None:
            killed_by = _signal_cause(code)
        if code == SETUP_FAILED and self.mode == "namespaces" and b"gyre-sandbox:" in out.tail:
            killed_by = "sandbox set-up failure"
        return SandboxRun(
            exit_code=code, killed_by=killed_by, output_tail=out.text_tail(), output_truncated=out.truncated,
            isolation=self.description, duration_s=time.monotonic() - started,
            results=bytes(results.head) if results else b"", results_truncated=bool(results and results.truncated),
        )

    async def _acquire(self) -> int:
        """A slot free here whose uid no other process on this host holds (in the modes that
        run as a uid); waits while every one of ours is taken, by this process or another."""
        waited = False
        while True:
            async with self._slot_free:
                await self._slot_free.wait_for(lambda: bool(self._free))
                for slot in list(self._free):
                    if self._claim(slot):
                        self._free.remove(slot)
                        if waited:
                            log.info("sandbox: uid %d free again; the run goes on", self.config.uid_base + slot)
                        return slot
            if not waited:
                waited = True
                log.warning("sandbox: the uids of every free slot (%d from %d) are held by other processes on this "
                            "host (another evaluator with the same uid_base?); waits for one", len(self._free),
                            self.config.uid_base)
            await asyncio.sleep(0.2)

    def _claim(self, slot: int) -> bool:
        if self.mode not in ("namespaces", "uid"):
            return True  # no uid of its own: nothing shared with other processes
        path = self.config.lock_dir / f"{self.config.uid_base + slot}.lock"
        try:
            self.config.lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            info = os.lstat(self.config.lock_dir)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
                raise SandboxUnavailable(f"{self.config.lock_dir} must be a folder of uid {os.geteuid()} that "
                                         "others cannot write (it holds the sandbox uids' claims)")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise SandboxUnavailable(f"cannot claim sandbox uid {self.config.uid_base + slot} in "
                                     f"{self.config.lock_dir}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except OSError as exc:
            os.close(fd)
            raise SandboxUnavailable(f"cannot claim sandbox uid {self.config.uid_base + slot}: {exc}") from exc
        self._held[slot] = fd
        return True

    async def _release(self, slot: int) -> None:
        async with self._slot_free:
            fd = self._held.pop(slot, None)
            if fd is not None:
                os.close(fd)  # the claim ends with its descriptor
            self._free.append(slot)
            self._slot_free.notify()


class _CappedOutput:
    """Keeps the first ``cap`` bytes and the last 4 KiB; counts and drops the rest."""

    def __init__(self, cap: int, kill_after: int) -> None:
        self.cap, self.kill_after = cap, kill_after
        self.head = bytearray()
        self.tail = b""
        self.total = 0
        self.stop = False

    def drain(self, stream) -> None:
        fd = stream if isinstance(stream, int) else stream.fileno()
        while not self.stop:
            ready, _, _ = select.select([fd], [], [], 0.2)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return
            self.total += len(chunk)
            if len(self.head) < self.cap:
                self.head += chunk[: self.cap - len(self.head)]
            self.tail = (self.tail + chunk)[-4096:]

    @property
    def truncated(self) -> bool:
        return self.total > self.cap

    @property
    def over_kill_limit(self) -> bool:
        return self.total > self.kill_after

    def text_tail(self) -> str:
        return self.tail.decode("utf-8", "replace")


def _rlimits(limits: Limits, *, nproc: bool):
    mem = limits.memory_mb * 2**20
    fsize = limits.max_file_mb * 2**20

    def apply() -> None:  # runs in the child between fork and exec: no allocations of note
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 5))
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        if nproc:  # counted per uid: only meaningful when the sandbox has a uid of its own
            resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    return apply


def _signal_cause(code: int | None) -> str | None:
    if code is None or code >= 0:
        return None
    sig = -code
    return {
        signal.SIGXCPU: "CPU-time limit",
        signal.SIGXFSZ: "file-size limit",
        signal.SIGKILL: "kernel (killed: memory or CPU hard limit)",
        signal.SIGSEGV: "crash (SIGSEGV, often the memory limit)",
    }.get(sig) or f"signal {_signal_name(sig)}"


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)


def _disk_usage(root: Path) -> int:
    """Bytes allocated under ``root`` (links not followed; files vanishing meanwhile are skipped)."""
    total, stack = 0, [str(root)]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            total += st.st_blocks * 512
            if entry.is_dir(follow_symlinks=False):
                stack.append(entry.path)
    return total


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


# Run as the sandbox uid: kill(-1) reaches every process of that uid (never the caller),
# and fails once none is left; repeated, since a process may fork until its signal lands.
_KILL_ALL_SH = "i=0; while kill -9 -1 2>/dev/null && [ $i -lt 100 ]; do i=$((i+1)); done; exit 0"


KILL_UID_WAIT_S = 5.0  # how long _kill_uid waits for the killed processes to be gone


def _kill_uid(uid: int) -> None:
    """SIGKILL every process running as ``uid`` (a sandbox slot's own uid, never shared),
    and wait until none is left: SIGKILL lands when the process is next scheduled, so on a
    busy machine one just signalled may still run a while (the slot's next run, or the
    caller's check, would meet it)."""
    drop = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
    deadline = time.monotonic() + KILL_UID_WAIT_S
    while True:
        try:
            subprocess.run([*drop, "/bin/sh", "-c", _KILL_ALL_SH], stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_clean_env({}), timeout=10,
                           check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.error("sandbox: could not kill the processes of uid %d: %r", uid, exc)
            return
        left = _live_processes_of(uid)
        if not left:
            return
        if time.monotonic() >= deadline:
            log.error("sandbox: processes of uid %d still alive %.0f s after SIGKILL: %s", uid, KILL_UID_WAIT_S,
                      left[:10])
            return
        time.sleep(0.02)


def _live_processes_of(uid: int) -> list[int]:
    """Pids running as ``uid`` that are not zombies (Linux /proc; elsewhere none found)."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for name in entries:
        if not name.isdigit():
            continue
        try:
            status = Path(f"/proc/{name}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        uids = fields.get("Uid", "").split()
        # kill(-1) as uid reaches a process whose real or saved uid is it
        if len(uids) >= 3 and str(uid) in (uids[0], uids[2]) and not fields.get("State", "").strip().startswith("Z"):
            found.append(int(name))
    return found


def _give_tree(root: Path, uid: int, keep: Sequence[str] = (), *, keep_root: bool = False) -> None:
    """Hand ``root`` and what it holds to ``uid``, except the folders ``keep`` names
    (relative to ``root``): those stay the evaluator's, readable by all (``_open_up``).

    ``keep_root`` (``uid`` mode, where no read-only bind protects the kept folders): ``root``
    itself stays the evaluator's, its group the sandbox's (``setpriv --regid=uid``), mode
    1770. The sandbox uid creates, changes and deletes its own entries there as before, but
    the sticky bit keeps it from renaming or deleting entries it does not own: the kept
    folders cannot be moved aside and replaced by folders of its own."""
    kept = {os.path.join(root, k) for k in keep}
    if keep_root:
        os.lchown(root, os.geteuid(), uid)
        os.chmod(root, 0o1770)
    else:
        os.lchown(root, uid, uid)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if os.path.join(dirpath, d) not in kept]
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            if path not in kept:
                os.lchown(path, uid, uid)
    _open_up(root, keep)


def _open_up(root: Path, keep: Sequence[str]) -> None:
    """Make the kept folders readable by the sandbox's uid whatever the evaluator's umask:
    folders 0755, files 0644 (0755 if executable); links are left as they are."""
    for rel in keep:
        top = os.path.join(root, rel)
        if os.path.islink(top) or not os.path.isdir(top):
            continue
        os.chmod(top, 0o755)
        for dirpath, dirnames, filenames in os.walk(top):
            for name in dirnames + filenames:
                path = os.path.join(dirpath, name)
                st = os.lstat(path)
                if stat.S_ISDIR(st.st_mode):
                    os.chmod(path, 0o755)
                elif stat.S_ISREG(st.st_mode):
                    os.chmod(path, 0o755 if st.st_mode & 0o100 else 0o644)


SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"  # a sandboxed run's PATH unless its environment names one


def _clean_env(extra: dict[str, str]) -> dict[str, str]:
    env = {"PATH": SANDBOX_PATH, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    env.update(extra)
    return env
