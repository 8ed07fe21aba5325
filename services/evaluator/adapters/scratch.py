"""The evaluator's own corner of ``work_root``, and the sweep of corners dead processes left.

Each evaluator process (each ``Evaluator`` object, in fact) makes its scratch workspaces
under a folder of its own, with a lock file beside it::

    <work_root>/evaluator-<pid>-<12 hex>/        # 0711: its workspaces, one per rollout
    <work_root>/evaluator-<pid>-<12 hex>.lock    # 0600: flock()ed (exclusive) while it lives

The kernel drops a ``flock`` when the last descriptor of the lock file closes, which a
killed process (SIGKILL, OOM kill, a crashed container) does too: a lock that can be taken
is a dead owner's. At start, ``sweep`` takes each sibling's lock without waiting; if it
can, the folder is deleted (``libs.common.fs.remove_tree``), then the lock file. A folder
whose lock is held belongs to an evaluator that is running (another run, a replica sharing
the folder) and is left alone. Nothing that does not have those names is touched.

Why the lock file sits beside the folder, and is made first: a folder with our name
exists only once its owner holds the lock, so a folder whose lock file is missing is a
leftover (its owner or a sweep stopped half-way) and is deleted too. Both sides check,
after ``flock``, that the name still leads to the file they locked: an owner whose new
lock file a sweep took and unlinked between its ``open`` and its ``flock`` tries another
name, and a sweep never deletes what a newer file of that name guards.

``flock`` is per open file, not per process, so two evaluators in one process (tests) do
not take each other's locks either. The lock file is opened close-on-exec: sandboxed test
processes never inherit it, so one that outlives a killed evaluator does not keep its
folder alive. ``work_root`` must be a local file system (flock over NFS is not reliable).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import secrets
import socket
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from libs.common import fs

log = logging.getLogger(__name__)

PREFIX = "evaluator-"
LOCK_SUFFIX = ".lock"
_NAME = re.compile(r"^evaluator-[0-9]{1,10}-[0-9a-f]{12}$")
_FOLDER_MODE = 0o711  # sandbox uids reach their own workspace, never list the others


class ScratchError(RuntimeError):
    """No folder of our own could be made under work_root."""


@dataclass
class SweepResult:
    removed: list[str] = field(default_factory=list)  # folder names deleted (dead owners)
    bytes: int = 0  # about: the sizes of the files they held
    busy: int = 0  # folders of live evaluators, left alone
    failed: list[str] = field(default_factory=list)  # leftovers that could not be deleted (logged)


class ScratchArea:
    """This evaluator's folder under ``root``, held by a lock until ``release``."""

    def __init__(self, root: Path, name: str, fd: int) -> None:
        self.root, self.name = root, name
        self.path = root / name
        self.lock_path = root / f"{name}{LOCK_SUFFIX}"
        self._fd: int | None = fd
        # an area dropped without release() (an Evaluator never closed) still frees its lock
        self._close = weakref.finalize(self, _close_quietly, fd)

    @classmethod
    def claim(cls, root: Path, *, attempts: int = 8) -> ScratchArea:
        """Make and lock a new folder of our own under ``root`` (which must exist)."""
        last: Exception | None = None
        for _ in range(attempts):
            name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
            lock = root / f"{name}{LOCK_SUFFIX}"
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except FileExistsError as exc:  # a name drawn twice
                last = exc
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if not _names(fd, lock):  # a sweep took it between open and flock, and unlinked it
                    raise BlockingIOError(errno.ESTALE, "lock file replaced")
            except OSError as exc:
                os.close(fd)
                last = exc
                continue
            try:
                os.write(fd, f"pid {os.getpid()} host {socket.gethostname()} since {time.time():.0f}\n".encode())
                os.mkdir(root / name, _FOLDER_MODE)
                os.chmod(root / name, _FOLDER_MODE)  # whatever the umask took off
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(lock)
                os.close(fd)
                raise
            return cls(root, name, fd)
        raise ScratchError(f"could not make a scratch folder of our own under {root}: {last!r}")

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self, *, remove: bool = True) -> None:
        """Drop the lock. With ``remove`` the folder goes first (best effort: a folder left
        behind is the next evaluator's to sweep); without it the folder stays, and the lock
        file goes, which marks the folder as a leftover for the next sweep."""
        if self._fd is None:
            return
        try:
            if remove and self.path.exists():
                fs.remove_tree(self.path)
        except Exception as exc:
            log.error("evaluator: could not delete its scratch folder %s (the next evaluator to start will "
                      "try again): %r", self.path, exc)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.lock_path)
        finally:
            self._close()  # closes the descriptor: the lock goes with it
            self._fd = None


def sweep(root: Path, *, own: ScratchArea | None = None) -> SweepResult:
    """Delete the folders (and lock files) under ``root`` that evaluators which are no
    longer running left behind. Never raises for one folder; see the module's docstring."""
    result = SweepResult()
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return result
    names: set[str] = set()
    for entry in entries:
        name = entry.name[: -len(LOCK_SUFFIX)] if entry.name.endswith(LOCK_SUFFIX) else entry.name
        if _NAME.match(name) and (own is None or name != own.name):
            names.add(name)
    for name in sorted(names):
        try:
            _sweep_one(root, name, result)
        except Exception as exc:
            result.failed.append(name)
            log.error("evaluator: could not delete the leftover scratch folder %s (delete it by hand once no "
                      "evaluator uses it): %r", root / name, exc)
    return result


def _sweep_one(root: Path, name: str, result: SweepResult) -> None:
    folder, lock = root / name, root / f"{name}{LOCK_SUFFIX}"
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        fd = None  # a folder without its lock: its owner or a sweep stopped half-way
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                result.busy += 1  # a live evaluator's (or another sweep has it now)
                return
            if not _names(fd, lock):
                return  # swept meanwhile
        if folder.is_symlink():
            raise RuntimeError("a symbolic link where a scratch folder should be; not followed")
        if folder.is_dir():
            size = _size(folder)
            fs.remove_tree(folder)
            result.removed.append(name)
            result.bytes += size
        if fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock)
    finally:
        if fd is not None:
            os.close(fd)


def _names(fd: int, path: Path) -> bool:
    """Whether ``path`` still leads to the open file ``fd``."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _size(root: Path) -> int:
    """Bytes in the files under ``root`` (links not followed; unreadable parts skipped)."""
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
