"""The evaluator's own corner of ``work_root``, and the sweep of corners dead processes left.

Each evaluator process (each ``Evaluator`` object, in fact) makes its scratch workspaces
under a folder of its own, and holds an exclusive ``flock`` on that folder itself (an open
descriptor of the directory) for as long as it lives::

    <work_root>/evaluator-<pid>-<12 hex>/        # 0711, flock()ed: its workspaces, one per rollout

The kernel drops a ``flock`` when the last descriptor of the open directory closes, which a
killed process (SIGKILL, OOM kill, a crashed container) does too: a folder whose lock can be
taken is a dead owner's. At start, ``sweep`` opens each sibling (never through a symbolic
link), takes its lock without waiting, and deletes it (``libs.common.fs.remove_tree``) only
while it holds it. A folder whose lock is held belongs to an evaluator that is running
(another run, a replica sharing the folder) and is left alone. Nothing that does not have
that name is touched, nor anything of that name owned by another uid.

The lock is on the folder itself, so nothing outside it (a file deleted from ``/tmp``) can
make a live folder look like a leftover. Both sides check, after ``flock``, that the name
still leads to what they locked: an owner whose new folder a sweep took and deleted first
tries another name, and a sweep never deletes what a newer folder of that name holds. The
owner checks the same before each workspace it makes there (``ScratchArea.intact``), and
each workspace, by a descriptor of its own, once its rollout is scored
(``Workspace.intact``): a score computed in a workspace that vanished meanwhile is never
published.

``work_root`` itself must be a real directory (not a symbolic link) owned by our effective
uid (``prepare_root``); one that its group or others may write in is set to 0711, with a
warning (a user who can rename entries in it could swap our folder for a link), and entries
named like ours that another uid owns are logged and left alone. ``flock`` is per open file,
not per process, so two evaluators in one process (tests) do not take each other's locks
either. Everything is opened close-on-exec: sandboxed test processes never inherit it, so
one that outlives a killed evaluator does not keep its folder alive. ``work_root`` must be a
local file system (flock over NFS is not reliable).
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
_NAME = re.compile(r"^evaluator-[0-9]{1,10}-[0-9a-f]{12}$")
_FOLDER_MODE = 0o711  # sandbox uids reach their own workspace, never list the others
_ROOT_MODE = 0o711
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class ScratchError(RuntimeError):
    """No folder of our own could be made under work_root."""


class UnsafeWorkRoot(ScratchError):
    """work_root is a link, not a directory, someone else's, or stays writable by others."""


@dataclass
class SweepResult:
    removed: list[str] = field(default_factory=list)  # folder names deleted (dead owners)
    bytes: int = 0  # about: the sizes of the files they held
    busy: int = 0  # folders of live evaluators, left alone
    failed: list[str] = field(default_factory=list)  # leftovers that could not be deleted (logged)
    foreign: list[str] = field(default_factory=list)  # entries of our names another uid owns: left alone


def prepare_root(root: Path) -> None:
    """Make ``root`` (0711) if missing, or take the one there if it is a real directory of
    our own, setting it to 0711; raises UnsafeWorkRoot, saying what to do, when it is not.

    A root of ours that its group or others could write in (a ``/tmp`` emptyDir that a test
    run under isolation "none" chmod'ed and a container restart kept, a volume's fsGroup
    pass, a folder made by hand under umask 002) is set to 0711 with a warning, and entries
    named like our folders that another uid owns (made while it was open) are logged: the
    sweep leaves them alone, and no evaluator uses them (it only ever makes new names)."""
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
        loose = not made and st.st_mode & 0o022
        if loose:  # ours, but others may have been at work in it: closed, then looked through
            log.warning(
                "evaluator: work_root %s (ours, uid %d) was writable by %s (mode %04o); set to %04o. Whoever could "
                "write there could have left entries in it: those named like scratch folders that another uid owns "
                "are listed next (if any) and left alone", root, euid, _writers(st.st_mode),
                stat.S_IMODE(st.st_mode), _ROOT_MODE)
        os.fchmod(fd, _ROOT_MODE)  # sandbox uids must reach their folder, not list the others
        st = os.fstat(fd)
        if st.st_uid != euid or st.st_mode & 0o022:  # a file system that keeps its own modes
            raise UnsafeWorkRoot(
                f"evaluator: work_root {root} stays writable by others after chmod {_ROOT_MODE:04o} (mode "
                f"{stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}): put work_root on a file system that keeps "
                f"file modes")
        if loose:
            foreign = _foreign(root, euid)
            if foreign:
                log.warning("evaluator: work_root %s holds %d entr%s named like scratch folders but owned by another "
                            "uid, left alone (never swept, never used; delete them by hand): %s", root, len(foreign),
                            "y" if len(foreign) == 1 else "ies", ", ".join(foreign))
    finally:
        os.close(fd)


def _foreign(root: Path, euid: int) -> list[str]:
    """Entries of ``root`` named like a scratch folder, not owned by ``euid`` ("name (uid N)")."""
    found = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            if _NAME.match(entry.name):
                with contextlib.suppress(OSError):
                    uid = entry.stat(follow_symlinks=False).st_uid
                    if uid != euid:
                        found.append(f"{entry.name} (uid {uid})")
    return sorted(found)


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
            except OSError as exc:  # a name drawn twice; or no room
                last = exc
                continue
            fd = None
            try:
                fd = os.open(path, _DIR_FLAGS)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: a sweep took it for a leftover
                if not _names(fd, path):  # a sweep took it (unlocked yet) between mkdir and flock
                    raise FileNotFoundError(f"{path} deleted before it was locked")
                os.fchmod(fd, _FOLDER_MODE)  # whatever the umask took off
            except OSError as exc:
                last = exc
                if fd is not None:
                    with contextlib.suppress(OSError):
                        if _names(fd, path):
                            os.rmdir(path)  # empty: ours, made a moment ago
                    os.close(fd)
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

    def workspace(self, name: str) -> Workspace:
        """A new, empty workspace ``name`` in our folder, held open. Raises FileNotFoundError
        when the folder is gone (``intact`` says so then)."""
        if self._fd is None:
            raise FileNotFoundError(f"{self.path} released")
        path = self.path / name
        path.mkdir(mode=0o755)
        return Workspace(self, path, os.open(path, _DIR_FLAGS))

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


class Workspace:
    """One rollout's workspace in a ScratchArea, held open: ``intact`` says whether the path
    still names it (and the area is still ours), i.e. whether what was computed there counts."""

    def __init__(self, area: ScratchArea, path: Path, fd: int) -> None:
        self.area, self.path = area, path
        self._fd: int | None = fd
        self._close = weakref.finalize(self, _close_quietly, fd)

    @property
    def there(self) -> bool:
        """Whether ``path`` still names this workspace (so deleting ``path`` deletes it)."""
        return self._fd is not None and _names(self._fd, self.path)

    @property
    def intact(self) -> bool:
        return self.there and self.area.intact

    def close(self) -> None:
        self._close()
        self._fd = None


def sweep(root: Path, *, own: ScratchArea | None = None) -> SweepResult:
    """Delete the folders under ``root`` that evaluators which are no longer running left
    behind. Never raises for one folder; see the module's docstring."""
    result = SweepResult()
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return result
    for name in sorted(e.name for e in entries if _NAME.match(e.name) and (own is None or e.name != own.name)):
        try:
            _sweep_one(root / name, result)
        except Exception as exc:
            result.failed.append(name)
            log.error("evaluator: could not delete the leftover scratch folder %s (delete it by hand once no "
                      "evaluator uses it): %r", root / name, exc)
    return result


def _sweep_one(folder: Path, result: SweepResult) -> None:
    euid = os.geteuid()
    st = _lstat(folder)
    if st is None:
        return  # gone meanwhile
    if st.st_uid != euid:
        result.foreign.append(folder.name)  # another uid's: never ours to delete (root could)
        return
    if stat.S_ISLNK(st.st_mode):
        raise RuntimeError("a symbolic link where a scratch folder should be; not followed")
    if not stat.S_ISDIR(st.st_mode):
        return  # not a folder: not ours
    try:
        fd = _open_dir(folder)
    except FileNotFoundError:
        return  # gone meanwhile
    try:
        if os.fstat(fd).st_uid != euid:
            result.foreign.append(folder.name)
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            result.busy += 1  # a live evaluator's (or another sweep has it now)
            return
        if not _names(fd, folder):
            return  # swept (or made anew) meanwhile: whoever did has it
        size = _size(folder)
        fs.remove_tree(folder)
        result.removed.append(folder.name)
        result.bytes += size
    finally:
        os.close(fd)


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _open_dir(path: Path) -> int:
    with contextlib.suppress(PermissionError):  # one a (non-root) test run left without its owner's read bit
        return os.open(path, _DIR_FLAGS)
    # chmod it through a descriptor of that very directory, never through a link put in its
    # place meanwhile (chmod follows links, and O_PATH descriptors take no fchmod: the
    # descriptor's /proc entry names the directory itself)
    pfd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if os.fstat(pfd).st_uid != os.geteuid():
            raise PermissionError(f"{path} is not ours to chmod")
        os.chmod(f"/proc/self/fd/{pfd}", 0o700)
        return os.open(f"/proc/self/fd/{pfd}", _DIR_FLAGS & ~os.O_NOFOLLOW)
    finally:
        os.close(pfd)


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


def _close_quietly(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
