"""The workspace as a tar archive (gzip), made reproducibly: members sorted, times,
owners and permissions beyond the executable bit normalised, so the same files give the
same digest. Caches (``__pycache__``, ``.pytest_cache``, ...) and installed dependencies
(``.venv``, ``node_modules``, and any folder holding a ``pyvenv.cfg``, i.e. a virtualenv
of whatever name: large, and rebuilt from the project's files) are left out at any depth,
``.git`` is kept; devices, FIFOs and sockets cannot be archived and are skipped. Links are
stored as links; the evaluator checks where they point when it unpacks (and skips those
that lead outside). Sizes are checked from ``lstat`` before a file is read, so a huge (or
sparse) file stops the snapshot with ``SnapshotTooLarge`` without being read."""

from __future__ import annotations

import gzip
import io
import os
import stat
import tarfile
from pathlib import Path

SKIP_DIRS = frozenset({"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".venv", "node_modules"})


class SnapshotTooLarge(ValueError):
    pass


def _skipped_dir(base: Path, name: str) -> bool:
    if name in SKIP_DIRS:
        return True
    path = base / name
    # a virtualenv under any name (``python -m venv venv``); a link to one is kept as a link
    return not path.is_symlink() and os.path.lexists(path / "pyvenv.cfg")


def _members(workspace: Path) -> list[Path]:
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(workspace, followlinks=False):
        base = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if not _skipped_dir(base, d))
        out.extend(base / d for d in dirnames)
        out.extend(base / f for f in sorted(filenames))
    return out


def _info(path: Path, name: str, st: os.stat_result) -> tuple[tarfile.TarInfo, bytes | None] | None:
    info = tarfile.TarInfo(name)
    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
    if stat.S_ISLNK(st.st_mode):
        info.type, info.linkname, info.mode = tarfile.SYMTYPE, os.readlink(path), 0o777
        return info, None
    if stat.S_ISDIR(st.st_mode):
        info.type, info.mode = tarfile.DIRTYPE, 0o755
        return info, None
    if stat.S_ISREG(st.st_mode):
        with open(path, "rb") as f:  # at most what lstat said: a file still growing is cut there
            data = f.read(st.st_size)
        info.size, info.mode = len(data), 0o755 if st.st_mode & 0o111 else 0o644
        return info, data
    return None  # device, FIFO, socket


def snapshot_workspace(workspace: Path, *, max_bytes: int = 256 * 2**20) -> bytes:
    """The workspace's files as a .tar.gz (raises SnapshotTooLarge past ``max_bytes`` of
    content; each file's size is checked from ``lstat`` before it is read)."""
    raw = io.BytesIO()
    total = 0
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in _members(workspace):
            try:
                st = path.lstat()
                if stat.S_ISREG(st.st_mode) and total + st.st_size > max_bytes:
                    raise SnapshotTooLarge(f"workspace has more than {max_bytes} bytes of files")
                made = _info(path, path.relative_to(workspace).as_posix(), st)
            except OSError:
                continue  # vanished or unreadable: the harness was killed mid-write
            if made is None:
                continue
            info, data = made
            total += info.size
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return gzip.compress(raw.getvalue(), mtime=0)
