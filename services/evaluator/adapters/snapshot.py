"""Unpacking a rollout's workspace snapshot (a tar archive) without trusting it.

The archive came from an agent's workspace, so it is checked member by member before
anything is written: no absolute names or ``..``, no device files or FIFOs, no hard links
to anything outside, a cap on the archive's size, on the unpacked size and on the member
count. Regular files and folders are written first (never through a link, since none
exists yet); hard links become copies of an earlier member; symbolic links are made last.

A symbolic link that points outside the workspace (an absolute target, too many ``..``;
e.g. ``venv/bin/python -> /usr/bin/python3`` after ``python -m venv venv``) is skipped:
never made, never followed, and named in ``Unpacked.skipped_links``, so the rest of the
workspace can still be scored. After the links are made, each one's real target is
checked; one that leads out through other links is removed again (and listed) the same way.
A member whose name the agent could give a file but the evaluator will not make (a
backslash in it, a path too long to make under the scratch folder) is skipped the same way
(``Unpacked.skipped_names``).

What the agent's workspace alone decides is told apart from a damaged archive: a snapshot
over the caps (``SnapshotOverLimits``), or the runner's stand-in for a workspace it would
not archive (``SnapshotRefused``, see ``REFUSED_HEADER``), score the rollout 0; any other
``UnsafeSnapshot`` (corrupt, names no runner writes) fails its scoring.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

log = logging.getLogger(__name__)


class UnsafeSnapshot(ValueError):
    """The archive is corrupt, too big, or tries to reach outside its folder."""


class SnapshotOverLimits(UnsafeSnapshot):
    """Too big or too many files: the workspace's own doing (the rollout scores 0)."""


class SnapshotRefused(UnsafeSnapshot):
    """The runner stored a stand-in: it would not archive the workspace (the message says why)."""


# The runner's stand-in for a workspace it would not archive (over its snapshot_max_bytes)
# carries the reason in this PAX global header (services/runner/runner.py writes it; the
# agent names files, never headers, so it cannot forge one).
REFUSED_HEADER = "GYRE.snapshot_refused"
# Longest path (bytes) made under the scratch folder; the kernel refuses 4096 and more.
_MAX_PATH_BYTES = 4000


@dataclass(frozen=True)
class UnpackLimits:
    max_archive_bytes: int = 512 * 2**20
    max_unpacked_bytes: int = 2 * 2**30
    max_members: int = 100_000


@dataclass(frozen=True)
class Unpacked:
    files: int
    bytes: int
    links: int  # symbolic links made
    skipped_links: tuple[str, ...] = ()  # "name -> target" of links left out: they lead outside
    skipped_names: tuple[str, ...] = ()  # members left out for their names (a backslash, too long)


def unpack_snapshot(data: bytes, dest: Path, limits: UnpackLimits = UnpackLimits()) -> Unpacked:
    """Write the archive's contents under ``dest`` (an empty folder), or raise UnsafeSnapshot."""
    if len(data) > limits.max_archive_bytes:
        raise SnapshotOverLimits(f"archive of {len(data)} bytes is over the {limits.max_archive_bytes}-byte cap")
    try:
        tar = tarfile.open(fileobj=io.BytesIO(data), mode="r:*")  # noqa: SIM115  (closed below)
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise UnsafeSnapshot("not a readable tar archive: " + " ".join(str(exc).split())) from exc
    try:
        with tar:
            refused = tar.pax_headers.get(REFUSED_HEADER)
            if refused is not None:
                raise SnapshotRefused(str(refused)[:500] or "no reason given")
            root = dest.resolve()
            members, skipped, bad_names = _checked_members(tar, limits, root)
            return _extract(tar, members, root, limits, skipped, bad_names)
    except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
        if isinstance(exc, UnsafeSnapshot):
            raise
        raise UnsafeSnapshot(f"corrupt tar archive: {exc}") from exc


def _checked_members(
    tar: tarfile.TarFile, limits: UnpackLimits, root: Path
) -> tuple[list[tuple[tarfile.TarInfo, PurePosixPath]], list[str], list[str]]:
    """The members to write, the symbolic links left out because they lead outside, and
    the members left out for their names."""
    out: list[tuple[tarfile.TarInfo, PurePosixPath]] = []
    skipped: list[str] = []
    bad_names: list[str] = []
    declared = 0
    root_bytes = len(os.fsencode(str(root)))
    for count, m in enumerate(tar, start=1):
        if count > limits.max_members:
            raise SnapshotOverLimits(f"more than {limits.max_members} members (files and folders)")
        if "\\" in m.name and "\x00" not in m.name:  # a legal file name; not one we make
            bad_names.append(f"{m.name[:200]!r} (a backslash in the name)")
            continue
        rel = _safe_name(m.name)
        if rel is None:
            continue  # the archive's root "." itself
        if root_bytes + 1 + len(os.fsencode(str(rel))) > _MAX_PATH_BYTES:
            bad_names.append(f"{m.name[:100]!r}... (path too long)")
            continue
        if m.ischr() or m.isblk() or m.isfifo() or m.isdev():
            raise UnsafeSnapshot(f"member {m.name!r} is a device or FIFO")
        if m.issym():
            if not _link_stays_inside(rel, m.linkname):
                skipped.append(_describe_link(rel, m.linkname))
                continue
        elif m.islnk():
            try:
                inside = _safe_name(m.linkname) is not None
            except UnsafeSnapshot:
                inside = False
            if not inside:
                raise UnsafeSnapshot(f"hard link {m.name!r} points outside the workspace ({m.linkname!r})")
        elif not (m.isfile() or m.isdir()):
            raise UnsafeSnapshot(f"member {m.name!r} has an unsupported type {m.type!r}")
        if m.isfile():
            declared += m.size
            if declared > limits.max_unpacked_bytes:
                raise SnapshotOverLimits(f"unpacks to more than {limits.max_unpacked_bytes} bytes")
        out.append((m, rel))
    return out, skipped, bad_names


def _safe_name(name: str) -> PurePosixPath | None:
    if "\x00" in name or "\\" in name:
        raise UnsafeSnapshot(f"member name {name!r} has forbidden characters")
    p = PurePosixPath(name)
    if p.is_absolute():
        raise UnsafeSnapshot(f"member {name!r} has an absolute path")
    parts = [part for part in p.parts if part not in ("", ".")]
    if ".." in parts:
        raise UnsafeSnapshot(f"member {name!r} escapes the workspace (..)")
    return PurePosixPath(*parts) if parts else None


def _link_stays_inside(rel: PurePosixPath, target: str) -> bool:
    """Whether a link's target, read as written (no link followed), stays in the workspace."""
    if not target or target.startswith("/") or "\x00" in target:
        return False
    depth = len(rel.parts) - 1  # folders above the link, inside the workspace
    for part in PurePosixPath(target).parts:
        depth += -1 if part == ".." else (0 if part == "." else 1)
        if depth < 0:
            return False
    return True


def _describe_link(rel: PurePosixPath, target: str) -> str:
    return f"{rel} -> {target[:200]}"


def _extract(
    tar: tarfile.TarFile, members: list[tuple[tarfile.TarInfo, PurePosixPath]], root: Path, limits: UnpackLimits,
    skipped: list[str], bad_names: list[str],
) -> Unpacked:
    written = files = 0
    links: list[tuple[PurePosixPath, str]] = []
    for m, rel in members:
        path = root.joinpath(*rel.parts)
        _ensure_parent(root, path)
        if m.isdir():
            if path.exists() and not path.is_dir():
                raise UnsafeSnapshot(f"member {m.name!r} is a folder over a file")
            path.mkdir(exist_ok=True)
            os.chmod(path, 0o755)
        elif m.isfile() or m.islnk():
            written += _write_file(tar, m, rel, root, path, limits.max_unpacked_bytes - written)
            files += 1
        elif m.issym():
            links.append((rel, m.linkname))
    links = list(dict(links).items())  # a name given twice: the later link wins
    for rel, target in links:
        path = root.joinpath(*rel.parts)
        _ensure_parent(root, path)
        if path.is_symlink() or path.exists():
            _remove(path)
        os.symlink(target, path)
    links = _drop_links_leading_out(root, links, skipped)
    if skipped:
        log.info("snapshot: %d symbolic link(s) leading outside the workspace not made: %s",
                 len(skipped), ", ".join(skipped[:10]) + (" ..." if len(skipped) > 10 else ""))
    if bad_names:
        log.info("snapshot: %d member(s) left out for their names: %s", len(bad_names),
                 ", ".join(bad_names[:10]) + (" ..." if len(bad_names) > 10 else ""))
    return Unpacked(files, written, len(links), tuple(skipped), tuple(bad_names))


def _drop_links_leading_out(
    root: Path, links: list[tuple[PurePosixPath, str]], skipped: list[str]
) -> list[tuple[PurePosixPath, str]]:
    """Physical check: a chain of links that each point inside may still lead out. Such a
    link is removed (unlinked, never followed) and listed; removing one can change where
    another resolves, so the check repeats until every remaining link stays inside."""
    while True:
        out = [(rel, target) for rel, target in links if not _resolves_inside(root, rel)]
        if not out:
            return links
        for rel, target in out:
            os.unlink(root.joinpath(*rel.parts))
            skipped.append(_describe_link(rel, target))
        links = [link for link in links if link not in out]


def _resolves_inside(root: Path, rel: PurePosixPath) -> bool:
    real = Path(os.path.realpath(root.joinpath(*rel.parts)))
    return real == root or root in real.parents


def _ensure_parent(root: Path, path: Path) -> None:
    parent = path.parent
    cur = root
    for part in parent.relative_to(root).parts:
        cur = cur / part
        if cur.is_symlink():  # cannot happen before links are made; guards the link pass
            raise UnsafeSnapshot(f"path {str(path.relative_to(root))!r} goes through a link")
        if not cur.exists():
            cur.mkdir(mode=0o755)
        elif not cur.is_dir():
            raise UnsafeSnapshot(f"path {str(path.relative_to(root))!r} goes through a file")


def _write_file(
    tar: tarfile.TarFile, m: tarfile.TarInfo, rel: PurePosixPath, root: Path, path: Path, budget: int
) -> int:
    if path.is_dir() and not path.is_symlink():
        raise UnsafeSnapshot(f"member {m.name!r} is a file over a folder")
    if m.islnk():
        source_rel = _safe_name(m.linkname)
        source = root.joinpath(*source_rel.parts) if source_rel else root
        if source.is_symlink() or not source.is_file():
            raise UnsafeSnapshot(f"hard link {m.name!r} names no earlier file ({m.linkname!r})")
        size = source.stat().st_size
        if size > budget:
            raise SnapshotOverLimits("unpacked size over the cap")
        shutil.copyfile(source, path, follow_symlinks=False)
        mode = stat.S_IMODE(source.stat().st_mode)
    else:
        src = tar.extractfile(m)
        if src is None:
            raise UnsafeSnapshot(f"member {m.name!r} has no data")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
        size = 0
        with src, os.fdopen(os.open(path, flags, 0o644), "wb") as out:
            while chunk := src.read(1 << 20):
                size += len(chunk)
                if size > budget:
                    raise SnapshotOverLimits("unpacked size over the cap")
                out.write(chunk)
        mode = m.mode
    # Keep the execute bits, drop setuid/setgid/sticky and write access for others.
    os.chmod(path, (mode & 0o755) | 0o600)
    return size


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
