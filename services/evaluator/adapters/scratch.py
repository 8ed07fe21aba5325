"""The evaluator's own corner of ``work_root``, and the sweep of corners dead processes left.

Each evaluator process (each ``Evaluator`` object, in fact) makes its scratch workspaces
under a folder of its own, and holds an exclusive ``flock`` on that folder itself (an open
descriptor of the directory) for as long as it lives::

    <work_root>/evaluator-<pid>-<12 hex>/        # 0711, flock()ed: its workspaces, one per rollout

The kernel drops a ``flock`` when the last descriptor of the open directory closes, which a
killed process (SIGKILL, OOM kill, a crashed container) does too: a folder whose lock can be
taken is a dead owner's. At start, ``sweep`` opens each sibling (never through a symbolic
link), takes its lock without waiting, and deletes it (``libs.common.fs.remove_tree``) only
while it holds that lock. A folder whose lock is held belongs to an evaluator that is running
(another run, a replica sharing the folder) and is left alone. Nothing that does not have
that name is touched.

The lock is on the folder, not on a file beside it, so nothing can take a live evaluator's
folder from it by deleting some other file (a lock file aged out of ``/tmp`` by
systemd-tmpfiles, say). Both sides check, after ``flock``, that the name still leads to the
directory they locked: an owner whose new folder a sweep took and deleted between its
``mkdir`` and its ``flock`` tries another name, and a sweep never deletes what a newer folder
of that name holds. The owner checks the same before each workspace it makes there
(``ScratchArea.intact``); the evaluator claims a new folder when its own is gone.

The previous layout put an flock()ed lock file beside each folder
(``evaluator-<pid>-<12 hex>.lock``): such a lock file is still honoured (a folder is swept
only when its lock file's lock can be taken too, so an evaluator of that version still
running keeps its folder) and deleted with the folder, or alone once its lock can be taken.

``work_root`` itself must be a real directory (not a symbolic link) owned by our effective
uid and writable by nobody else (``prepare_root``): a user who can rename entries in it could
swap our folder for a link. ``flock`` is per open file, not per process, so two evaluators
in one process (tests) do not take each other's locks either. The directory is opened
close-on-exec: sandboxed test processes never inherit it, so one that outlives a killed
evaluator does not keep its folder alive. ``work_root`` must be a local file system (flock
over NFS is not reliable).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import secrets
import stat
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from libs.common import fs

log = logging.getLogger(__name__)

PREFIX = "evaluator-"
LOCK_SUFFIX = ".lock"  # the previous version's lock files, still honoured and cleaned up
_NAME = re.compile(r"^evaluator-[0-9]{1,10}-[0-9a-f]{12}$")
_FOLDER_MODE = 0o711  # sandbox uids reach their own workspace, never list the others
_ROOT_MODE = 0o711
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class ScratchError(RuntimeError):
    """No folder of our own could be made under work_root."""


class UnsafeWorkRoot(ScratchError):
    """work_root is a link, not a directory, someone else's, or writable by others."""


@dataclass
class SweepResult:
    removed: list[str] = field(default_factory=list)  # folder names deleted (dead owners)
    bytes: int = 0  # about: the sizes of the files they held
    busy: int = 0  # folders of live evaluators, left alone
    failed: list[str] = field(default_factory=list)  # leftovers that could not be deleted (logged)


def prepare_root(root: Path) -> None:
    """Make ``root`` (0711) if missing, or check that the one there is ours alone; raises
    UnsafeWorkRoot, saying what to do, when it is not."""
    root.parent.mkdir(parents=True, exist_ok=True)
    made = False
    with contextlib.suppress(FileExistsError):
        os.mkdir(root, 0o700)
        made = True
    euid = os.geteuid()
    try:
        fd = os.open(root, _DIR_FLAGS)
    except OSError as exc:
        try:
            st = os.lstat(root)
        except OSError:
            st = None
        if st is None or stat.S_ISDIR(st.st_mode):
            raise UnsafeWorkRoot(f"evaluator: work_root {root} cannot be opened: {exc!r}") from exc
        what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise UnsafeWorkRoot(
            f"evaluator: work_root {root} is {what} (owner uid {st.st_uid}); it must be a real directory of "
            f"this evaluator's own (uid {euid}): set work_root (GYRE_EVALUATOR_WORK_ROOT) to the folder itself, "
            f"or to a path that does not exist yet") from exc
    try:
        st = os.fstat(fd)
        if st.st_uid != euid:
            raise UnsafeWorkRoot(
                f"evaluator: work_root {root} is owned by uid {st.st_uid}, not by this evaluator's uid {euid}: its "
                f"owner could swap our scratch folders for links. Delete it (as its owner or root) so the evaluator "
                f"makes its own, or set work_root (GYRE_EVALUATOR_WORK_ROOT) to a folder this uid owns")
        if not made and st.st_mode & 0o022:  # someone else may have been at work in it already
            raise UnsafeWorkRoot(
                f"evaluator: work_root {root} (owner uid {st.st_uid}) is writable by {_writers(st.st_mode)} (mode "
                f"{stat.S_IMODE(st.st_mode):04o}): whoever else can write there could swap our scratch folders for "
                f"links. If only evaluators of uid {euid} use it, `chmod 0711 {root}`; else delete it, or set "
                f"work_root (GYRE_EVALUATOR_WORK_ROOT) to a folder of this uid's own")
        os.fchmod(fd, _ROOT_MODE)  # sandbox uids must reach their folder, not list the others
        st = os.fstat(fd)
        if st.st_mode & 0o022:  # a file system that keeps its own modes
            raise UnsafeWorkRoot(
                f"evaluator: work_root {root} stays writable by others after chmod {_ROOT_MODE:04o} (mode "
                f"{stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}): put work_root on a file system that keeps "
                f"file modes")
    finally:
        os.close(fd)


class ScratchArea:
    """This evaluator's folder under ``root``, held by a lock on it until ``release``."""

    def __init__(self, root: Path, name: str, fd: int) -> None:
        self.root, self.name = root, name
        self.path = root / name
        self._fd: int | None = fd
        # an area dropped without release() (an Evaluator never closed) still frees its lock
        self._close = weakref.finalize(self, _close_quietly, fd)

    @classmethod
    def claim(cls, root: Path, *, attempts: int = 8) -> ScratchArea:
        """Make and lock a new folder of our own under ``root`` (which must exist; see
        ``prepare_root``)."""
        last: Exception | None = None
        for _ in range(attempts):
            name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
            path = root / name
            try:
                os.mkdir(path, 0o700)
            except FileExistsError as exc:  # a name drawn twice
                last = exc
                continue
            try:
                fd = os.open(path, _DIR_FLAGS)
            except OSError as exc:  # a sweep took it and deleted it already
                last = exc
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: a sweep has it now, and deletes it
                if not _names(fd, path):  # a sweep took it between mkdir and flock, and deleted it
                    raise FileNotFoundError(f"{path} swept before it was locked")
                os.fchmod(fd, _FOLDER_MODE)  # whatever the umask took off
            except OSError as exc:
                os.close(fd)
                last = exc
                continue
            return cls(root, name, fd)
        raise ScratchError(f"could not make a scratch folder of our own under {root}: {last!r}")

    @property
    def held(self) -> bool:
        return self._fd is not None

    @property
    def intact(self) -> bool:
        """Whether we hold the lock and ``path`` still names the folder we locked (it was
        not deleted, renamed or replaced meanwhile)."""
        return self._fd is not None and _names(self._fd, self.path)

    def release(self, *, remove: bool = True) -> None:
        """Drop the lock. With ``remove`` the folder goes first, if ``path`` still names it
        (best effort: a folder left behind is the next evaluator's to sweep); without it the
        folder stays, unlocked, for the next sweep."""
        if self._fd is None:
            return
        try:
            if remove and _names(self._fd, self.path):
                fs.remove_tree(self.path)
        except Exception as exc:
            log.error("evaluator: could not delete its scratch folder %s (the next evaluator to start will "
                      "try again): %r", self.path, exc)
        finally:
            self._close()  # closes the descriptor: the lock goes with it
            self._fd = None


def sweep(root: Path, *, own: ScratchArea | None = None) -> SweepResult:
    """Delete the folders (and old-style lock files) under ``root`` that evaluators which
    are no longer running left behind. Never raises for one folder; see the module's docstring."""
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
        st = os.lstat(folder)
    except FileNotFoundError:
        st = None  # an old-style lock file alone
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise RuntimeError("a symbolic link where a scratch folder should be; not followed")
    if st is not None and not stat.S_ISDIR(st.st_mode):
        return  # not a folder: not ours
    with contextlib.ExitStack() as held:
        locks: list[tuple[int, Path]] = []
        for path, flags in ((folder, _DIR_FLAGS), (lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)):
            try:
                fd = _open(path, flags)
            except FileNotFoundError:
                continue  # gone meanwhile; or no old-style lock file beside this folder
            held.callback(os.close, fd)
            locks.append((fd, path))
        if not locks:
            return
        for fd, path in locks:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                result.busy += 1  # a live evaluator's (or another sweep has it now)
                return
            if not _names(fd, path):
                return  # swept (or made anew) meanwhile: whoever did has it
        for fd, path in locks:
            if path == folder:
                size = _size(folder)
                fs.remove_tree(folder)
                result.removed.append(name)
                result.bytes += size
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(lock)


def _open(path: Path, flags: int) -> int:
    try:
        return os.open(path, flags)
    except PermissionError:  # a folder a (non-root) test run left without its owner's read bit
        if not flags & os.O_DIRECTORY:
            raise
        os.chmod(path, 0o700)  # a directory a moment ago (lstat); work_root is this uid's alone
        return os.open(path, flags)


def _names(fd: int, path: Path) -> bool:
    """Whether ``path`` (not followed if a link) still leads to the open file ``fd``."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _writers(mode: int) -> str:
    return {0o022: "its group and others", 0o020: "its group", 0o002: "others"}[mode & 0o022]


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
