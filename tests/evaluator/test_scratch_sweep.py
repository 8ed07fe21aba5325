"""Scratch workspaces a killed evaluator left behind are deleted when an evaluator starts;
those of an evaluator still running on the same work_root, and anything else there, are not."""

from __future__ import annotations

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
    assert (root / f"{name}.lock").exists()
    return name


async def test_a_killed_evaluators_workspaces_are_deleted_at_start(make_harness, root: Path, caplog):
    dead = _dead_evaluator(root)
    caplog.set_level(logging.INFO, logger="services.evaluator")
    h = await make_harness(work_root=root)
    assert not (root / dead).exists() and not (root / f"{dead}.lock").exists()
    assert "deleted 1 scratch folder(s) left by evaluators no longer running" in caplog.text
    assert dead in caplog.text
    own = h.evaluator._scratch_area()
    assert sorted(p.name for p in root.iterdir()) == sorted([own.name, own.lock_path.name])

    ev = await h.score(calc_spec("sweep-calc"), tar_of({"calc.py": CALC_OK}))  # and it still scores
    assert isinstance(ev, RolloutScored) and ev.score == 1.0


async def test_a_running_evaluators_workspaces_are_left_alone(make_harness, root: Path, caplog):
    proc, alive = _other(root, "live")
    try:
        caplog.set_level(logging.INFO, logger="services.evaluator")
        h = await make_harness(work_root=root)
        assert (root / alive / "r-1234-abcdef01" / "pkg" / "calc.py").exists()
        assert (root / f"{alive}.lock").exists()
        assert "1 scratch folder(s) of other running evaluators" in caplog.text
        ev = await h.score(calc_spec("sweep-live"), tar_of({"calc.py": CALC_OK}))
        assert isinstance(ev, RolloutScored) and ev.score == 1.0
        assert (root / alive / "r-1234-abcdef01" / "pkg" / "calc.py").exists()
    finally:
        proc.kill()
        proc.wait(10)
    # once it is gone, the next evaluator to start deletes its folder
    h2 = await make_harness(work_root=root)
    assert not (root / alive).exists() and not (root / f"{alive}.lock").exists()
    assert h.evaluator._scratch_area().path.is_dir(), "the first evaluator (in this process) still runs"
    h.evaluator.close()
    h2.evaluator.close()
    assert list(root.iterdir()) == []


async def test_two_evaluators_in_one_process_keep_each_others_folders(make_harness, root: Path):
    first = await make_harness(work_root=root)
    (first.evaluator._scratch_area().path / "busy").mkdir()
    await make_harness(work_root=root)  # flock is per open file, not per process
    assert (first.evaluator._scratch_area().path / "busy").is_dir()


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
    }
    for rel, text in theirs.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    link = root / "evaluator-1-aaaaaaaaaaaa"  # our pattern, but a link: never followed
    link.symlink_to(outside, target_is_directory=True)
    dead = _dead_evaluator(root)
    await make_harness(work_root=root)
    assert not (root / dead).exists()
    for rel, text in theirs.items():
        assert (root / rel).read_text() == text, rel
    assert link.is_symlink() and (outside / "keep" / "f").read_text() == "mine"


async def test_a_folder_whose_lock_file_is_gone_is_a_leftover(make_harness, root: Path):
    name = "evaluator-4242-0123456789ab"
    (root / name / "r-1-deadbeef").mkdir(parents=True)
    (root / name / "r-1-deadbeef" / "f").write_text("x")
    (root / "evaluator-4243-0123456789ab.lock").write_text("a lock file alone")
    await make_harness(work_root=root)
    assert not (root / name).exists() and not (root / "evaluator-4243-0123456789ab.lock").exists()


async def test_a_leftover_that_cannot_be_deleted_is_logged_and_start_goes_on(make_harness, root: Path,
                                                                           monkeypatch, caplog):
    dead = _dead_evaluator(root)
    monkeypatch.setattr(fs, "remove_tree", lambda p: (_ for _ in ()).throw(PermissionError(13, "denied", str(p))))
    h = await make_harness(work_root=root)
    assert "could not delete the leftover scratch folder" in caplog.text and dead in caplog.text
    assert (root / dead).exists() and (root / f"{dead}.lock").exists(), "kept whole, for the next start"
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
    assert own.path.is_dir() and not own.lock_path.exists(), "kept, and marked as a leftover"
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
    assert not own.path.exists() and not own.lock_path.exists()


def test_a_lock_file_swept_between_open_and_flock_makes_the_owner_try_another_name(root: Path, monkeypatch):
    real_flock, calls = scratch.fcntl.flock, []

    def flock_after_a_sweep(fd, op):
        if not calls:  # the first claim's lock file: a sweep takes it and unlinks it first
            calls.append(fd)
            name = next(p for p in root.iterdir() if p.name.endswith(scratch.LOCK_SUFFIX))
            assert scratch.sweep(root).removed == []
            assert not name.exists()
        return real_flock(fd, op)

    monkeypatch.setattr(scratch.fcntl, "flock", flock_after_a_sweep)
    area = scratch.ScratchArea.claim(root)
    monkeypatch.undo()
    assert calls and area.lock_path.exists() and area.path.is_dir()
    assert sorted(p.name for p in root.iterdir()) == sorted([area.name, area.lock_path.name])
    area.release()
    assert list(root.iterdir()) == []
