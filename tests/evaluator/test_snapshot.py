"""Unpacking snapshots that an agent's workspace produced: the good, the corrupt, the hostile."""

from __future__ import annotations

import os
import sys
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
    ([member("hard", tarfile.LNKTYPE, "../../etc/passwd")], "outside"),
    ([member("hard", tarfile.LNKTYPE, "nothing-here")], "no earlier file"),
    ([member("dev", tarfile.CHRTYPE)], "device"),
    ([member("fifo", tarfile.FIFOTYPE)], "device"),
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


def test_symlinks_leading_outside_are_skipped_not_made_and_listed(tmp_path: Path):
    """A link out (``python -m venv`` makes ``venv/bin/python -> /usr/bin/python3``) no
    longer makes the whole snapshot unusable: it is left out, the rest unpacks."""
    dest = tmp_path / "w"
    dest.mkdir()
    got = unpack_snapshot(tar_with(
        [member("calc.py"), member("venv", tarfile.DIRTYPE), member("venv/bin", tarfile.DIRTYPE),
         member("venv/bin/python", tarfile.SYMTYPE, "/usr/bin/python3"),
         member("venv/bin/python3", tarfile.SYMTYPE, "python"),  # inside: kept (dangling now)
         member("up", tarfile.SYMTYPE, "../../outside"),
         member("d", tarfile.DIRTYPE), member("d/link", tarfile.SYMTYPE, "../.."),
         # Each link points inside on paper; together they lead out (c -> ".", a -> "c/../x").
         member("c", tarfile.SYMTYPE, "."), member("a", tarfile.SYMTYPE, "c/../c/../x")],
        {"calc.py": b"x = 1\n"}), dest)
    assert (dest / "calc.py").read_text() == "x = 1\n"
    assert sorted(got.skipped_links) == ["a -> c/../c/../x", "d/link -> ../..", "up -> ../../outside",
                                         "venv/bin/python -> /usr/bin/python3"]
    for name in ("venv/bin/python", "up", "d/link", "a"):
        assert not os.path.lexists(dest / name), name
    assert (dest / "venv/bin/python3").is_symlink() and (dest / "c").is_symlink() and got.links == 2


def test_a_real_virtualenv_in_a_workspace_unpacks(tmp_path: Path):
    """End to end with the runner's archive: its snapshot leaves a virtualenv out, and a
    link out that is still there (here a lone one) is skipped by the evaluator."""
    from services.runner.adapters.snapshot import snapshot_workspace

    ws = tmp_path / "ws"
    (ws / "venv/bin").mkdir(parents=True)
    (ws / "venv/pyvenv.cfg").write_text("home = /usr/bin\n")
    (ws / "venv/bin/python").symlink_to("/usr/bin/python3")
    (ws / "calc.py").write_text("x = 1\n")
    (ws / "py").symlink_to(sys.executable)
    dest = tmp_path / "dest"
    dest.mkdir()
    got = unpack_snapshot(snapshot_workspace(ws), dest)
    assert sorted(p.name for p in dest.iterdir()) == ["calc.py"]
    assert got.skipped_links == (f"py -> {sys.executable}",)


async def test_the_score_says_which_links_were_skipped(make_harness):
    from libs.common.events import RolloutScored

    from ._workspaces import CALC_OK, calc_spec

    h = await make_harness()
    snap = tar_with([member("calc.py"), member("venv", tarfile.DIRTYPE), member("venv/bin", tarfile.DIRTYPE),
                     member("venv/bin/python", tarfile.SYMTYPE, "/usr/bin/python3")],
                    {"calc.py": CALC_OK.encode()})
    ev = await h.score(calc_spec(), snap)
    assert isinstance(ev, RolloutScored) and ev.score == 1.0
    assert "1 symlink(s) leading outside the workspace skipped: venv/bin/python -> /usr/bin/python3" in ev.reason
