"""Unpacking snapshots that an agent's workspace produced: the good, the corrupt, the hostile."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from services.evaluator.adapters.snapshot import UnpackLimits, UnsafeSnapshot, unpack_snapshot

from ._workspaces import member, tar_of, tar_with


def test_plain_and_gzipped_archives_unpack(tmp_path: Path):
    for gz in (False, True):
        dest = tmp_path / f"gz{gz}"
        dest.mkdir()
        got = unpack_snapshot(tar_of({"pkg/__init__.py": "", "pkg/a.py": "x = 1\n", "./README": "hi"}, gz=gz), dest)
        assert got.files == 3
        assert (dest / "pkg/a.py").read_text() == "x = 1\n" and (dest / "README").exists()


def test_links_inside_are_kept(tmp_path: Path):
    data = tar_with(
        [member("src", tarfile.DIRTYPE), member("src/a.py"), member("alias.py", tarfile.SYMTYPE, "src/a.py"),
         member("copy.py", tarfile.LNKTYPE, "src/a.py"), member("src/up", tarfile.SYMTYPE, "../src")],
        {"src/a.py": b"A = 1\n"},
    )
    unpack_snapshot(data, tmp_path)
    assert (tmp_path / "alias.py").is_symlink() and (tmp_path / "alias.py").read_text() == "A = 1\n"
    assert not (tmp_path / "copy.py").is_symlink() and (tmp_path / "copy.py").read_text() == "A = 1\n"


def test_setuid_bits_are_dropped(tmp_path: Path):
    m = member("tool")
    m.mode = 0o4777
    unpack_snapshot(tar_with([m], {"tool": b"#!/bin/sh\n"}), tmp_path)
    assert oct((tmp_path / "tool").stat().st_mode & 0o7777) == oct(0o755)


@pytest.mark.parametrize("members,why", [
    ([member("../escape.py")], "escapes"),
    ([member("a/../../escape.py")], "escapes"),
    ([member("/etc/evil")], "absolute"),
    ([member("link", tarfile.SYMTYPE, "/etc/passwd")], "outside"),
    ([member("link", tarfile.SYMTYPE, "../../outside")], "outside"),
    ([member("d", tarfile.DIRTYPE), member("d/link", tarfile.SYMTYPE, "../..")], "outside"),
    ([member("hard", tarfile.LNKTYPE, "../../etc/passwd")], "outside"),
    ([member("hard", tarfile.LNKTYPE, "nothing-here")], "no earlier file"),
    ([member("dev", tarfile.CHRTYPE)], "device"),
    ([member("fifo", tarfile.FIFOTYPE)], "device"),
    # Each link points inside on paper; together they lead out (c -> ".", a -> "c/../x").
    ([member("c", tarfile.SYMTYPE, "."), member("a", tarfile.SYMTYPE, "c/../c/../x")], "resolves outside"),
])
def test_hostile_members_are_refused(tmp_path: Path, members, why):
    dest = tmp_path / "w"
    dest.mkdir()
    with pytest.raises(UnsafeSnapshot) as err:
        unpack_snapshot(tar_with(members), dest)
    assert why in str(err.value)
    assert not (tmp_path / "escape.py").exists()


def test_size_and_count_caps(tmp_path: Path):
    big = tar_of({"blob.bin": b"\0" * 50_000})
    with pytest.raises(UnsafeSnapshot, match="archive of"):
        unpack_snapshot(big, tmp_path, UnpackLimits(max_archive_bytes=10_000))
    with pytest.raises(UnsafeSnapshot, match="unpacks to more"):
        unpack_snapshot(big, tmp_path, UnpackLimits(max_unpacked_bytes=10_000))
    many = tar_of({f"f{i}": "" for i in range(20)})
    with pytest.raises(UnsafeSnapshot, match="more than 10 members"):
        unpack_snapshot(many, tmp_path, UnpackLimits(max_members=10))


def test_a_gzip_bomb_stops_at_the_unpacked_cap(tmp_path: Path):
    bomb = tar_of({"zeros": b"\0" * (64 * 2**20)}, gz=True)  # 64 MiB of zeros, ~65 KB packed
    assert len(bomb) < 200_000
    with pytest.raises(UnsafeSnapshot, match="more than"):
        unpack_snapshot(bomb, tmp_path, UnpackLimits(max_unpacked_bytes=2**20))


@pytest.mark.parametrize("data", [b"", b"this is not a tar archive at all" * 40, tar_of({"a": "x" * 5000})[:3000]])
def test_corrupt_archives_are_refused(tmp_path: Path, data: bytes):
    with pytest.raises(UnsafeSnapshot, match="tar"):
        unpack_snapshot(data, tmp_path)
