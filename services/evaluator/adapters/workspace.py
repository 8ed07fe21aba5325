"""Laying out an unpacked workspace for a test run, and showing it to the judge."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from libs.common.events.envelope import encodable_text
from libs.common.fs import remove_tree  # noqa: F401 (also the service's: workspace.remove_tree)

from ..core.spec import HIDDEN_DIR, TaskEvaluatorSpec

CONTROL_DIR = ".gyre_eval"  # Gyre's plugin, the tests' HOME and TMPDIR (recreated for every run)
PLUGIN_MODULE = "gyre_outcomes"
# The plugin's outcome lines go to a pipe (never a file in the workspace); its write end's
# descriptor number is in this variable, which the plugin deletes from os.environ at import.
RESULTS_VAR = "GYRE_OUTCOMES_FD"
# Folders of the workspace the sandbox may read but not change (nor rename, in namespaces mode).
READONLY = (HIDDEN_DIR,)
_PLUGIN_SOURCE = Path(__file__).with_name("pytest_outcomes.py")
_SKIP = {HIDDEN_DIR, CONTROL_DIR, ".git", "__pycache__", ".pytest_cache", "node_modules", ".venv"}


def prepare(workdir: Path, spec: TaskEvaluatorSpec) -> Path:
    """Add the hidden tests and a fresh control folder; returns the control folder.

    Whatever the agent left under these names, or at a custom command's ``junit_path``, is
    removed first, so it cannot pre-seed results.
    """
    if spec.junit_path:
        clear_result_path(workdir, spec.junit_path)
    hidden, control = workdir / HIDDEN_DIR, workdir / CONTROL_DIR
    for folder in (hidden, control):
        if folder.is_symlink() or folder.is_file():
            folder.unlink()
        elif folder.exists():
            remove_tree(folder)
        folder.mkdir(mode=0o755)
    for name, data in spec.hidden_files.items():
        path = hidden / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    if spec.uses_pytest and "pytest.ini" not in spec.hidden_files:
        (hidden / "pytest.ini").write_text("[pytest]\n")
    shutil.copyfile(_PLUGIN_SOURCE, control / f"{PLUGIN_MODULE}.py")
    for sub in ("home", "tmp"):
        (control / sub).mkdir()
    return control


def hidden_identity(workdir: Path) -> tuple[int, int]:
    """The hidden folder as the file system knows it (device, inode), taken after ``prepare``."""
    st = os.lstat(workdir / HIDDEN_DIR)
    return st.st_dev, st.st_ino


def hidden_changes(workdir: Path, spec: TaskEvaluatorSpec, identity: tuple[int, int]) -> list[str]:
    """What became of the hidden tests during the run, empty when nothing: the folder moved
    or replaced, a file of the task's changed, gone, or turned into a link or folder.

    A check after the fact (``none`` mode protects nothing while the tests run; the other
    modes keep the folder from being changed or moved): a folder moved aside and put back
    with its files as they were is not seen. Nothing is followed: links are read as links.
    """
    hidden = workdir / HIDDEN_DIR
    try:
        st = os.lstat(hidden)
    except OSError:
        return [f"{HIDDEN_DIR}/ is gone"]
    if not stat.S_ISDIR(st.st_mode) or (st.st_dev, st.st_ino) != identity:
        return [f"{HIDDEN_DIR}/ was moved or replaced"]
    changed: list[str] = []
    expected = dict(spec.hidden_files)
    if spec.uses_pytest and "pytest.ini" not in expected:
        expected["pytest.ini"] = b"[pytest]\n"
    for name, data in sorted(expected.items()):
        if _raw(hidden, name, len(data) + 1) != data:
            changed.append(f"{HIDDEN_DIR}/{name} was changed")
        if len(changed) >= 5:
            break
    return changed


def _raw(root: Path, rel: str, cap: int) -> bytes | None:
    """``rel``'s first ``cap`` bytes, no link followed on the way (None if not a plain file)."""
    fd = None
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        for part in Path(rel).parts[:-1]:
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nxt
        file_fd = os.open(Path(rel).name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    except OSError:
        return None
    finally:
        if fd is not None:
            os.close(fd)
    with os.fdopen(file_fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        return f.read(cap)


def clear_result_path(root: Path, rel: str) -> None:
    """Remove whatever the agent left at ``rel`` (a result file the test command is to write).

    No link is followed: each folder on the way is opened with ``O_NOFOLLOW``; a link or a
    file standing where a folder should be is replaced by an empty folder, and whatever
    sits at ``rel`` itself (file, link, FIFO or folder) is deleted. Refuses (ValueError) a
    path that would leave ``root``.
    """
    parts = [p for p in Path(rel).parts if p not in ("", ".")]
    if not parts or ".." in parts or Path(rel).is_absolute():
        raise ValueError(f"result path {rel!r} must be relative and stay inside the workspace")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for i, part in enumerate(parts[:-1]):
            try:
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                break  # nothing below: nothing left to clear
            except OSError:  # a link, a file or a FIFO where a folder should be
                _remove_entry(fd, part, root.joinpath(*parts[: i + 1]))
                os.mkdir(part, 0o755, dir_fd=fd)
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nxt
        else:
            _remove_entry(fd, parts[-1], root.joinpath(*parts))
    finally:
        os.close(fd)


def _remove_entry(dir_fd: int, name: str, path: Path) -> None:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        remove_tree(path)  # every folder on the way was opened without following links
    else:
        os.unlink(name, dir_fd=dir_fd)


# pytest is imported in isolated mode (-I: no PYTHONPATH, no current folder) before the
# control folder goes on sys.path, and Gyre's plugin from there (with -p for the allowed
# third-party plugins it finds installed); the workspace goes on sys.path only once pytest
# has parsed its options, before the hidden conftest.py loads (the plugin puts it first
# then), after the plugin's "session" line. So a pytest.py, _pytest/ or a module named like
# one pytest imports while it parses (argparse, ...) in the workspace is never used by the
# runner, and none of the agent's code runs before the session began.
_BOOT = ("import sys, pytest; sys.path.insert(0, sys.argv[1]); import " + PLUGIN_MODULE + " as p; "
         "p.set_workspace(sys.argv[2]); sys.exit(pytest.main(p.plugin_args() + sys.argv[3:]))")


def pytest_argv(python: str, workdir: Path) -> list[str]:
    hidden = str(workdir / HIDDEN_DIR)
    # rootdir and confcutdir at the hidden folder: test names are relative to it, and a
    # conftest.py or ini file the agent wrote in its workspace is not loaded. A hidden test
    # file that fails to import (a module the agent never wrote) must not stop the others
    # from running: its tests count as failed, the rest still score. Plugins are not
    # auto-loaded (PYTEST_DISABLE_PLUGIN_AUTOLOAD in sandbox_env: a .dist-info in the
    # workspace, on sys.path, could declare one); Gyre's own is named here.
    return [
        python, "-I", "-B", "-u", "-c", _BOOT, str(workdir / CONTROL_DIR), str(workdir),
        "-q", "-p", PLUGIN_MODULE, "-p", "no:cacheprovider", "--continue-on-collection-errors",
        "--rootdir", hidden, "-c", os.path.join(hidden, "pytest.ini"), "--confcutdir", hidden, hidden,
    ]


def sandbox_env(workdir: Path, control: Path) -> dict[str, str]:
    return {
        "HOME": str(control / "home"),
        "TMPDIR": str(control / "tmp"),
        "PYTHONPATH": os.pathsep.join([str(control), str(workdir)]),
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        # Numeric libraries size per-thread buffers by core count; under an address-space
        # limit, one thread each keeps an import from failing on a many-core machine.
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        # No pytest11 entry point is loaded, not even one a .dist-info folder in the
        # workspace declares; the plugins a run needs are named with -p.
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }


def read_capped(root: Path, rel: str, cap: int) -> tuple[str, int] | None:
    """A result file's text (at most ``cap`` bytes) and its whole size in bytes, None if
    absent or not a plain file.

    The sandbox owned the folder, so no part of the path is trusted: every component is
    opened without following links, and a FIFO cannot make the read block.
    """
    parts = [p for p in Path(rel).parts if p not in ("", ".")]
    if not parts or ".." in parts:
        return None
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        for part in parts[:-1]:
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nxt
        file_fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    except OSError:
        return None
    finally:
        os.close(fd)
    with os.fdopen(file_fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            return None
        return f.read(cap).decode("utf-8", "replace"), info.st_size


def describe(workdir: Path, *, budget: int = 24_000, max_files: int = 200) -> str:
    """A listing of the workspace and the start of its small text files, for the judge."""
    listing: list[str] = []
    bodies: list[str] = []
    left = budget
    for dirpath, dirnames, filenames in os.walk(workdir):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP)
        for name in sorted(filenames):
            path = Path(dirpath) / name
            rel = encodable_text(path.relative_to(workdir).as_posix())  # a non-UTF-8 name: escaped
            if len(listing) >= max_files or path.is_symlink():
                continue
            size = path.stat().st_size
            listing.append(f"{rel} ({size} bytes)")
            if left > 200 and size <= 64_000:
                text = path.read_bytes()[: min(left, 8_000)]
                if b"\x00" not in text:
                    body = text.decode("utf-8", "replace")
                    bodies.append(f"--- {rel}\n{body}")
                    left -= len(body)
    return "Files:\n" + "\n".join(listing) + "\n\n" + "\n\n".join(bodies)
