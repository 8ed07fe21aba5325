"""Scratch workspaces a killed evaluator left behind are deleted when an evaluator starts;
those of an evaluator still running on the same work_root, and anything else there, are not.
The lock that decides is on each folder itself: nothing outside it decides whether it is live.
A work_root that is not ours is refused; one of ours that others could write in is closed (0711)."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.common import fs
from libs.common.events import RolloutScored
from services.evaluator.adapters import scratch

from ._workspaces import CALC_OK, calc_spec, tar_of

REPO = Path(__file__).resolve().parents[2]

# Another evaluator process: claims its folder, fills a workspace, says its folder's name,
# then dies at once (SIGKILL: no finally, no atexit) or lives until its stdin closes.
_OTHER = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from services.evaluator.adapters.scratch import ScratchArea
    area = ScratchArea.claim(Path(sys.argv[1]))
    ws = area.path / "r-1234-abcdef01" / "pkg"
    ws.mkdir(parents=True)
    (ws / "calc.py").write_bytes(b"x" * 5000)
    os.chmod(ws, 0o500)  # left read-only by the tests: the sweep still deletes it
    print(area.name, flush=True)
    if sys.argv[2] == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.stdin.read()
""")


@pytest.fixture
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gyre-eval-sweep-"))
    os.chmod(path, 0o711)  # the sandbox uids cross it (as conftest's work_root)
    yield path
    subprocess.run(["chmod", "-R", "u+rwx", str(path)], check=False)
    shutil.rmtree(path, ignore_errors=True)


def _other(root: Path, how: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", _OTHER, str(root), how], cwd=REPO, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    name = proc.stdout.readline().strip()
    assert scratch._NAME.match(name), name
    return proc, name


def _dead_evaluator(root: Path) -> str:
    proc, name = _other(root, "die")
    assert proc.wait(10) == -signal.SIGKILL
    assert (root / name / "r-1234-abcdef01" / "pkg" / "calc.py").exists()
    return name


async def test_a_killed_evaluators_workspaces_are_deleted_at_start(make_harness, root: Path, caplog):
    dead = _dead_evaluator(root)
    caplog.set_level(logging.INFO, logger="services.evaluator")
    h = await make_harness(work_root=root)
    assert not (root / dead).exists()
    assert "deleted 1 scratch folder(s) left by evaluators no longer running" in caplog.text
    assert dead in caplog.text
    own = h.evaluator._scratch_area()
    assert sorted(p.name for p in root.iterdir()) == [own.name]

    ev = await h.score(calc_spec("sweep-calc"), tar_of({"calc.py": CALC_OK}))  # and it still scores
    assert isinstance(ev, RolloutScored) and ev.score == 1.0


async def test_a_running_evaluators_workspaces_are_left_alone(make_harness, root: Path, caplog):
    proc, alive = _other(root, "live")
    try:
        caplog.set_level(logging.INFO, logger="services.evaluator")
        h = await make_harness(work_root=root)
        assert (root / alive / "r-1234-abcdef01" / "pkg" / "calc.py").exists()
        assert "1 scratch folder(s) of other running evaluators" in caplog.text
        ev = await h.score(calc_spec("sweep-live"), tar_of({"calc.py": CALC_OK}))
        assert isinstance(ev, RolloutScored) and ev.score == 1.0
        assert (root / alive / "r-1234-abcdef01" / "pkg" / "calc.py").exists()
    finally:
        proc.kill()
        proc.wait(10)
    # once it is gone, the next evaluator to start deletes its folder
    h2 = await make_harness(work_root=root)
    assert not (root / alive).exists()
    assert h.evaluator._scratch_area().path.is_dir(), "the first evaluator (in this process) still runs"
    h.evaluator.close()
    h2.evaluator.close()
    assert list(root.iterdir()) == []


async def test_two_evaluators_in_one_process_keep_each_others_folders(make_harness, root: Path):
    first = await make_harness(work_root=root)
    (first.evaluator._scratch_area().path / "busy").mkdir()
    second = await make_harness(work_root=root)  # flock is per open file, not per process
    assert (first.evaluator._scratch_area().path / "busy").is_dir()
    first_path = first.evaluator._scratch_area().path
    second.evaluator.close()
    assert first.evaluator._scratch_area().path == first_path and (first_path / "busy").is_dir()


async def test_what_is_not_an_evaluators_scratch_folder_is_not_touched(make_harness, root: Path, tmp_path: Path):
    outside = tmp_path / "outside"
    (outside / "keep").mkdir(parents=True)
    (outside / "keep" / "f").write_text("mine")
    theirs = {
        "notes.txt": "a file",
        "r-1234-abcdef01/calc.py": "a workspace of an older evaluator (directly in work_root)",
        "probe-77/ok": "x",
        "evaluator-old/f": "not our pattern",
        "evaluator-12-abc/f": "not our pattern either",
        "evaluator-12-abcdef012345x/f": "nor this",
        "evaluator-12-ABCDEF012345/f": "upper case: not ours",
        "evaluator-13-0123456789ab": "our name, but a file: not ours",
        "evaluator-14-0123456789ab.lock": "a lock file: not ours either",
    }
    for rel, text in theirs.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    link = root / "evaluator-1-aaaaaaaaaaaa"  # our pattern, but a link: never followed
    link.symlink_to(outside, target_is_directory=True)
    dead = _dead_evaluator(root)
    (root / f"{dead}.lock").write_text("a lock file beside a leftover: neither keeps it nor goes with it")
    theirs[f"{dead}.lock"] = (root / f"{dead}.lock").read_text()
    await make_harness(work_root=root)
    assert not (root / dead).exists()
    for rel, text in theirs.items():
        assert (root / rel).read_text() == text, rel
    assert link.is_symlink() and (outside / "keep" / "f").read_text() == "mine"


async def test_a_live_evaluators_folder_survives_others_sweeps_and_one_removed_anyway_is_replaced(
        make_harness, root: Path, monkeypatch, tmp_path: Path, caplog):
    # the review's case: a live folder taken for a leftover by the next evaluator's sweep, after
    # which every later rollout failed
    h = await make_harness(work_root=root)
    own = h.evaluator._scratch_area()
    (own.path / "busy").mkdir()
    proc, alive = _other(root, "live")
    try:
        other = await make_harness(work_root=root)  # another replica starts and sweeps
        assert (own.path / "busy").is_dir() and (root / alive / "r-1234-abcdef01" / "pkg" / "calc.py").exists()
        swept = scratch.sweep(root)  # (own=None: ours is not spared by name)
        assert swept.removed == [] and swept.busy == 3 and swept.failed == []
        assert own.intact and other.evaluator._scratch_area().intact
    finally:
        proc.kill()
        proc.wait(10)

    caplog.set_level(logging.WARNING, logger="services.evaluator")
    fs.remove_tree(own.path)  # someone deletes it anyway
    ev = await h.score(calc_spec("gone-calc"), tar_of({"calc.py": CALC_OK}))
    assert isinstance(ev, RolloutScored) and ev.score == 1.0
    assert "was deleted or replaced by someone else" in caplog.text and own.name in caplog.text
    new = h.evaluator._scratch_area()
    assert new.name != own.name and new.intact and not own.held and not own.path.exists()

    # replaced by a link (by someone who may write in work_root): not followed, a new folder again
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.rename(new.path, root / "moved-away")
    new.path.symlink_to(elsewhere, target_is_directory=True)
    ev = await h.score(calc_spec("link-calc"), tar_of({"calc.py": CALC_OK}))
    assert isinstance(ev, RolloutScored) and ev.score == 1.0
    assert list(elsewhere.iterdir()) == [] and h.evaluator._scratch_area().name not in (own.name, new.name)

    # gone between the check and the workspace's mkdir: the rollout still scores
    real, vanished = h.evaluator._scratch_area, []

    def vanishing() -> scratch.ScratchArea:
        area = real()
        if not vanished:
            vanished.append(area.name)
            fs.remove_tree(area.path)
        return area

    monkeypatch.setattr(h.evaluator, "_scratch_area", vanishing)
    ev = await h.score(calc_spec("race-calc"), tar_of({"calc.py": CALC_OK}))
    assert isinstance(ev, RolloutScored) and ev.score == 1.0
    assert vanished and real().name != vanished[0]


async def test_a_work_root_of_ours_that_others_could_write_in_is_closed_with_a_warning(
        make_harness, root: Path, caplog):
    # an emptyDir /tmp a test run under isolation "none" chmod'ed (kept by a container restart),
    # a volume after its fsGroup pass, a folder made by hand under umask 002, a sticky tmpfs
    for mode, who in ((0o777, "its group and others"), (0o773, "its group and others"), (0o771, "its group"),
                      (0o703, "others"), (0o2771, "its group"), (0o1777, "its group and others")):
        os.chmod(root, mode)
        caplog.clear()
        h = await make_harness(work_root=root)  # taken, not a crash loop
        assert os.stat(root).st_mode & 0o7777 == 0o711
        assert f"work_root {root} (ours, uid {os.geteuid()}) was writable by {who} (mode {mode:04o}); set to " \
               "0711" in caplog.text
        assert [r.levelno for r in caplog.records if "was writable by" in r.message] == [logging.WARNING]
        if mode == 0o777:  # and it scores there (once: each scoring is a sandboxed pytest run)
            ev = await h.score(calc_spec(f"loose-{mode:o}"), tar_of({"calc.py": CALC_OK}))
            assert isinstance(ev, RolloutScored) and ev.score == 1.0, ev
        h.evaluator.close()
    caplog.clear()
    await make_harness(work_root=root)
    assert "was writable by" not in caplog.text, "a root that was 0711 already: no warning"


@pytest.mark.skipif(os.geteuid() != 0, reason="making entries another uid owns needs root")
async def test_entries_another_uid_left_in_a_loose_work_root_are_logged_and_left_alone(
        make_harness, root: Path, caplog):
    folder, lock = root / "evaluator-99-0123456789ab", root / "evaluator-98-0123456789ab.lock"
    (folder / "r-1-deadbeef").mkdir(parents=True)
    lock.write_text("someone else's")  # not named like a scratch folder: not ours, whoever owns it
    for p in (folder, lock):
        os.chown(p, 4321, 4321, follow_symlinks=False)
    dead = _dead_evaluator(root)
    os.chmod(root, 0o777)
    caplog.set_level(logging.INFO, logger="services.evaluator")
    h = await make_harness(work_root=root)
    assert os.stat(root).st_mode & 0o7777 == 0o711
    assert "owned by another uid, left alone" in caplog.text
    assert f"{folder.name} (uid 4321)" in caplog.text and lock.name not in caplog.text
    assert (folder / "r-1-deadbeef").is_dir() and lock.read_text() == "someone else's"
    assert not (root / dead).exists(), "our own leftovers are still swept"
    swept = scratch.sweep(root, own=h.evaluator._scratch_area())
    assert swept.foreign == [folder.name]
    assert swept.removed == [] and swept.failed == []


async def test_a_work_root_not_ours_or_a_link_is_refused(make_harness, root: Path, monkeypatch):
    # not owned by this uid (writable by all, too): refused and left as it is; a real other
    # owner as root, else this uid as seen by the evaluator changes
    os.chmod(root, 0o777)
    if os.geteuid() == 0:
        os.chown(root, 4321, 4321)
        owner, me = 4321, 0
    else:
        owner, me = os.geteuid(), os.geteuid() + 1
        monkeypatch.setattr(scratch.os, "geteuid", lambda: me)
    with pytest.raises(scratch.UnsafeWorkRoot) as err:
        await make_harness(work_root=root)
    monkeypatch.undo()
    text = str(err.value)
    assert f"work_root {root} is owned by uid {owner}, not by this evaluator's uid {me}" in text
    assert "Delete it" in text and "GYRE_EVALUATOR_WORK_ROOT" in text and list(root.iterdir()) == []
    assert os.stat(root).st_mode & 0o7777 == 0o777, "not ours: never chmod'ed"

    # a link (even to a folder of ours) is not followed
    os.chown(root, os.geteuid(), os.getegid())
    mine = root / "mine"
    mine.mkdir(mode=0o711)
    link = root / "link"
    link.symlink_to(mine, target_is_directory=True)
    with pytest.raises(scratch.UnsafeWorkRoot, match=r"work_root .*/link is a symbolic link"):
        await make_harness(work_root=link)
    assert list(mine.iterdir()) == []


async def test_work_root_is_made_0711_or_taken_if_ours_alone(make_harness, root: Path):
    umask = os.umask(0)  # what a container may run with: still 0711, never 0777
    try:
        h = await make_harness(work_root=root / "made" / "here")
    finally:
        os.umask(umask)
    assert os.stat(root / "made" / "here").st_mode & 0o7777 == 0o711
    ev = await h.score(calc_spec("made-calc"), tar_of({"calc.py": CALC_OK}))
    assert isinstance(ev, RolloutScored) and ev.score == 1.0
    os.chmod(root, 0o755)  # ours, nobody else may write: taken, and set to 0711
    await make_harness(work_root=root)
    assert os.stat(root).st_mode & 0o7777 == 0o711


async def test_a_leftover_that_cannot_be_deleted_is_logged_and_start_goes_on(make_harness, root: Path,
                                                                           monkeypatch, caplog):
    dead = _dead_evaluator(root)
    monkeypatch.setattr(fs, "remove_tree", lambda p: (_ for _ in ()).throw(PermissionError(13, "denied", str(p))))
    h = await make_harness(work_root=root)
    assert "could not delete the leftover scratch folder" in caplog.text and dead in caplog.text
    assert (root / dead / "r-1234-abcdef01" / "pkg" / "calc.py").exists(), "kept whole, for the next start"
    monkeypatch.undo()
    h.evaluator.close()
    await make_harness(work_root=root)
    assert not (root / dead).exists()


async def test_keep_workdirs_keeps_leftovers_and_its_own_folder(make_harness, root: Path):
    dead = _dead_evaluator(root)
    h = await make_harness(work_root=root, keep_workdirs=True)
    assert (root / dead).exists()
    own = h.evaluator._scratch_area()
    h.evaluator.close()
    assert own.path.is_dir() and not own.held, "kept, its lock dropped: a leftover"
    await make_harness(work_root=root)
    assert not (root / dead).exists() and not own.path.exists()


async def test_run_deletes_its_folder_when_it_stops(make_harness, root: Path):
    import asyncio

    h = await make_harness(work_root=root)
    own = h.evaluator._scratch_area()
    stop = asyncio.Event()
    task = asyncio.create_task(h.evaluator.run(stop))
    await asyncio.sleep(0.2)
    stop.set()
    await asyncio.wait_for(task, 15)
    assert not own.path.exists() and list(root.iterdir()) == []


def test_a_folder_swept_between_mkdir_and_flock_makes_the_owner_try_another_name(root: Path, monkeypatch):
    real_flock, calls = scratch.fcntl.flock, []

    def flock_after_a_sweep(fd, op):
        if not calls:  # the first claim's folder, before its owner locks it: a sweep takes it
            calls.append(fd)
            (first,) = root.iterdir()
            assert scratch.sweep(root).removed == [first.name] and not first.exists()
        return real_flock(fd, op)

    monkeypatch.setattr(scratch.fcntl, "flock", flock_after_a_sweep)
    area = scratch.ScratchArea.claim(root)
    monkeypatch.undo()
    assert calls and area.intact and area.path.is_dir()
    assert sorted(p.name for p in root.iterdir()) == [area.name]
    area.release()
    assert list(root.iterdir()) == []


def test_a_folder_a_sweep_holds_when_its_owner_locks_it_is_left_to_that_sweep(root: Path, monkeypatch):
    real_flock, held = scratch.fcntl.flock, []

    def flock_while_a_sweep_holds_it(fd, op):
        if not held:  # the first claim's folder: a sweep has just locked it
            (first,) = root.iterdir()
            held.append((first, os.open(first, os.O_RDONLY | os.O_DIRECTORY)))
            real_flock(held[0][1], fcntl.LOCK_EX | fcntl.LOCK_NB)
        return real_flock(fd, op)

    monkeypatch.setattr(scratch.fcntl, "flock", flock_while_a_sweep_holds_it)
    area = scratch.ScratchArea.claim(root)
    monkeypatch.undo()
    first, fd = held[0]
    assert area.name != first.name and area.intact
    os.close(fd)  # that sweep gave up (or died)
    scratch.sweep(root, own=area)  # (the owner removed the empty folder, or the next sweep does)
    assert sorted(p.name for p in root.iterdir()) == [area.name]
    area.release()
    assert list(root.iterdir()) == []


def test_an_unreadable_leftover_is_chmod_ed_through_itself_never_through_a_link(root: Path, tmp_path: Path,
                                                                              monkeypatch):
    # a leftover a (non-root) test run left without its owner's read bit is made readable
    # (chmod 0700) to be swept; one swapped for a link meanwhile: the link is not followed
    unreadable, swapped = root / "evaluator-5-0123456789ab", root / "evaluator-6-0123456789ab"
    for folder in (unreadable, swapped):
        (folder / "r-1-deadbeef").mkdir(parents=True)
        os.chmod(folder, 0o300)
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o755)
    os.chmod(outside, 0o755)
    real_open = os.open

    def denying(path, flags, *args, **kw):  # what a non-root uid gets (root reads any folder)
        if str(path) in (str(unreadable), str(swapped)) and flags & os.O_DIRECTORY and not flags & os.O_PATH:
            if os.lstat(path).st_mode & 0o400 == 0:
                if str(path) == str(swapped):  # swapped for a link after the sweep's lstat
                    os.rename(swapped, root / "moved")
                    swapped.symlink_to(outside, target_is_directory=True)
                raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", denying)
    swept = scratch.sweep(root)
    monkeypatch.undo()
    assert swept.removed == [unreadable.name] and not unreadable.exists()
    assert swept.failed == [swapped.name] and swapped.is_symlink()
    assert os.stat(outside).st_mode & 0o7777 == 0o755, "chmod never went through the link"
