"""What a rollout leaves behind must not decide its score or cost its outcome: a result
file pre-seeded where a custom command writes its JUnit XML, and a workspace the tests
made impossible to delete (review findings 1 and 6)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from libs.common.events import Context, RolloutScored, RolloutScoringFailed
from services.evaluator.adapters import workspace
from services.evaluator.core.spec import Limits

from ._workspaces import CALC_OK, CALC_TESTS, calc_spec, tar_of

ALL_PASS = ('<testsuite><testcase classname="test_calc" name="test_add"/>'
            '<testcase classname="test_calc" name="test_mul"/><testcase classname="test_calc" name="test_div"/>'
            '</testsuite>')
HANGS = "import time\ndef add(a, b):\n    time.sleep(1000)\nmul = div = add\n"


def _junit_spec(task_id: str, wall_s: float = 30):
    return calc_spec(
        task_id, command=["{python}", "-m", "pytest", "-q", "-p", "no:cacheprovider", "_gyre_hidden",
                          "--junitxml=reports/junit.xml"],
        junit_path="reports/junit.xml", hidden_files={"test_calc.py": CALC_TESTS.encode()},
        weights={},
        limits=Limits(wall_s=wall_s, cpu_s=30))


async def test_a_junit_file_left_by_the_agent_is_not_scored_when_the_command_writes_none(make_harness):
    h = await make_harness()
    ev = await h.score(_junit_spec("junit-stale", wall_s=3),
                       tar_of({"calc.py": HANGS, "reports/junit.xml": ALL_PASS}))
    assert isinstance(ev, RolloutScored)
    assert ev.score == 0.0 and "wall-clock" in ev.reason, ev.reason


async def test_a_junit_path_the_agent_turned_into_links_is_cleared(make_harness, tmp_path: Path):
    outside = tmp_path / "outside.xml"
    outside.write_text(ALL_PASS)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "junit.xml").write_text(ALL_PASS)
    root = tmp_path / "ws"
    (root / "reports").mkdir(parents=True)
    (root / "reports" / "junit.xml").symlink_to(outside)
    workspace.clear_result_path(root, "reports/junit.xml")
    assert not os.path.lexists(root / "reports" / "junit.xml") and outside.read_text() == ALL_PASS

    (root / "reports" / "junit.xml").mkdir()  # a folder at the path: removed too
    (root / "reports" / "junit.xml" / "x").write_text("x")
    workspace.clear_result_path(root, "reports/junit.xml")
    assert not os.path.lexists(root / "reports" / "junit.xml")

    workspace.remove_tree(root / "reports")
    (root / "reports").symlink_to(tmp_path / "elsewhere")  # a linked folder: replaced, not followed
    workspace.clear_result_path(root, "reports/junit.xml")
    assert (root / "reports").is_dir() and not (root / "reports").is_symlink()
    assert (tmp_path / "elsewhere" / "junit.xml").read_text() == ALL_PASS

    for bad in ("../outside.xml", "/etc/passwd", "a/../../x"):
        with pytest.raises(ValueError, match="stay inside the workspace"):
            workspace.clear_result_path(root, bad)


async def test_the_command_still_writes_its_junit_after_the_clearing(make_harness):
    h = await make_harness()
    ev = await h.score(_junit_spec("junit-fresh"),
                       tar_of({"calc.py": CALC_OK, "reports/junit.xml": "<testsuite/>"}))
    assert isinstance(ev, RolloutScored) and ev.score == 1.0, ev.reason


def _lock_tree(root: Path) -> None:
    (root / "d" / "e").mkdir(parents=True)
    (root / "d" / "e" / "f").write_text("x")
    (root / "ro").mkdir()
    (root / "ro" / "g").write_text("x")
    os.chmod(root / "ro", 0o500)
    os.chmod(root / "d" / "e", 0o000)


def test_remove_tree_deletes_folders_left_unreadable_or_read_only():
    base = Path(tempfile.mkdtemp(prefix="gyre-rm-test-"))
    try:
        os.chmod(base, 0o777)
        victim = base / "w"
        victim.mkdir()
        _lock_tree(victim)
        if os.geteuid() == 0:  # root ignores modes: remove as an ordinary user, as the evaluator would
            for dirpath, dirnames, filenames in os.walk(victim):
                for name in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)]:
                    os.lchown(name, 65534, 65534)
            pid = os.fork()
            if pid == 0:  # the child drops to nobody and removes; no exec, so nothing else to reach
                status = 1
                try:
                    os.setgroups([])
                    os.setresgid(65534, 65534, 65534)
                    os.setresuid(65534, 65534, 65534)
                    workspace.remove_tree(victim)
                    status = 0
                except BaseException as exc:
                    os.write(2, f"remove_tree as nobody: {exc!r}\n".encode())
                finally:
                    os._exit(status)
            assert os.waitpid(pid, 0)[1] == 0
        else:
            workspace.remove_tree(victim)
        assert not victim.exists()
    finally:
        subprocess.run(["chmod", "-R", "u+rwx", str(base)], check=False)
        workspace.remove_tree(base)


async def test_a_workspace_that_cannot_be_deleted_does_not_lose_the_outcome(make_harness, monkeypatch, caplog):
    h = await make_harness()

    def failing_remove(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(workspace, "remove_tree", failing_remove)
    ev = await h.score(calc_spec("undeletable"), tar_of({"calc.py": CALC_OK}))
    assert isinstance(ev, RolloutScored) and ev.score == 1.0
    assert "could not delete the scratch workspace" in caplog.text


async def test_the_pool_publishes_the_outcome_when_cleanup_fails(make_harness, monkeypatch):
    h = await make_harness()
    monkeypatch.setattr(workspace, "remove_tree", lambda p: (_ for _ in ()).throw(TypeError("onerror")))
    ended = await h.rollout(calc_spec("undeletable-pool"), tar_of({"calc.py": CALC_OK}))
    stop = asyncio.Event()
    task = asyncio.create_task(h.evaluator.run(stop))
    for _ in range(300):
        outcomes = [d.event async for d in h.bus.read(Context.SCORES)
                    if isinstance(d.event, (RolloutScored, RolloutScoringFailed))]
        if outcomes:
            break
        await asyncio.sleep(0.05)
    stop.set()
    await task
    assert [type(e).__name__ for e in outcomes] == ["RolloutScored"] and outcomes[0].rollout_id == ended.rollout_id
    assert not h.bus.dead_letters

