"""What an evaluator does when its scratch folder is taken from it, or cannot be had: a score
computed in a workspace that vanished is never published (the rollout is redelivered), a
folder that cannot be claimed costs a redelivery, not the rollout; a live folder is busy to
any sweep; the default work_root is per user."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import tempfile
from pathlib import Path

import pytest

from libs.common import fs
from libs.common.events import RolloutScored, RolloutScoringFailed
from services.evaluator.adapters import scratch
from services.evaluator.service import TransientError
from services.evaluator.settings import EvaluatorSettings

from ._workspaces import CALC_OK, calc_spec, dedent_bytes, tar_of

# Says it started (a file in the workspace: the hidden folder is read-only), then waits (up
# to 20 s) for its workspace to be deleted under it; the module it then imports is gone:
# under the old code a 0.0 score.
_WAITS_FOR_DELETION = dedent_bytes("""
    import time
    from pathlib import Path
    def test_add():
        here = Path("started")
        here.write_text("x")
        deadline = time.monotonic() + 20
        while here.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        from calc import add
        assert add(2, 3) == 5
""")


async def _delete_area_once_tests_run(area: scratch.ScratchArea) -> None:
    for _ in range(1000):
        if any(area.path.rglob("started")):
            fs.remove_tree(area.path)  # someone deletes it (by hand, say)
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the hidden test never started")


@pytest.mark.parametrize("may_retry", [True, False])
async def test_a_workspace_deleted_while_scored_is_never_scored(make_harness, may_retry: bool, caplog):
    h = await make_harness()
    spec = calc_spec(f"mid-{may_retry}", hidden_files={"test_calc.py": _WAITS_FOR_DELETION},
                     weights={"test_calc.py::test_add": 1.0})
    ended = await h.rollout(spec, tar_of({"calc.py": CALC_OK}))
    area = h.evaluator._scratch_area()
    deleter = asyncio.create_task(_delete_area_once_tests_run(area))
    if may_retry:
        with pytest.raises(TransientError, match="deleted or replaced while scoring"):
            await h.evaluator.evaluate(ended, may_retry=True)
    else:  # the last delivery: a failure that says why, never a 0.0
        ev = await h.evaluator.evaluate(ended, may_retry=False)
        assert isinstance(ev, RolloutScoringFailed)
        assert "scratch workspace was deleted or replaced while the rollout was scored" in ev.reason
    await deleter
    assert [r.levelno for r in caplog.records if "deleted or replaced while it was scored" in r.message] == \
        [logging.ERROR]

    # the redelivery is scored in a new folder
    h.catalog.add(calc_spec(f"mid-{may_retry}"))
    ev = await h.evaluator.evaluate(ended, may_retry=may_retry)
    assert isinstance(ev, RolloutScored) and ev.score == 1.0
    assert h.evaluator._scratch_area().name != area.name
    h.evaluator.close()


async def test_a_workspace_replaced_while_scored_is_not_deleted_nor_scored(make_harness, monkeypatch):
    # a workspace swapped (by someone who may write there) for another folder of that name: the
    # other folder is neither scored nor deleted, and the rollout is redelivered
    h = await make_harness()
    real = h.evaluator._run_tests

    async def run_then_swap(spec, workdir):
        got = await real(spec, workdir)
        os.rename(workdir, workdir.with_name("moved-away"))
        workdir.mkdir()
        (workdir / "theirs").write_text("keep")
        return got

    monkeypatch.setattr(h.evaluator, "_run_tests", run_then_swap)
    ended = await h.rollout(calc_spec("swap"), tar_of({"calc.py": CALC_OK}))
    with pytest.raises(TransientError):
        await h.evaluator.evaluate(ended, may_retry=True)
    (workdir,) = (p for p in h.evaluator._scratch_area().path.iterdir() if p.name.startswith("r-"))
    assert (workdir / "theirs").read_text() == "keep"
    h.evaluator.close()


async def test_a_live_folder_is_busy_to_any_sweep(make_harness, work_root: Path):
    h = await make_harness()
    area = h.evaluator._scratch_area()
    (area.path / "busy").mkdir()
    assert fcntl.fcntl(area._fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC, "never inherited by the tests it runs"
    swept = scratch.sweep(work_root)  # (own=None: ours is not spared by name) its lock is held: busy
    assert area.name not in swept.removed and swept.busy >= 1 and area.intact and (area.path / "busy").is_dir()
    h.evaluator.close()
    assert not area.path.exists()


@pytest.mark.parametrize("why", ["claim", "unsafe"])
async def test_no_folder_to_be_had_is_a_redelivery_not_a_lost_rollout(make_harness, monkeypatch, why, caplog):
    h = await make_harness()
    fs.remove_tree(h.evaluator._scratch_area().path)  # its folder gone ...
    if why == "claim":  # ... and no new one can be made
        def cannot(root, **_kw):
            raise scratch.ScratchError(f"could not make a scratch folder of our own under {root}: ENOSPC")
        monkeypatch.setattr(scratch.ScratchArea, "claim", cannot)
    else:  # ... and work_root no longer passes (here: no longer ours)
        me = os.geteuid() + 1
        monkeypatch.setattr(scratch.os, "geteuid", lambda: me)
    ended = await h.rollout(calc_spec(f"noroom-{why}"), tar_of({"calc.py": CALC_OK}))
    with pytest.raises(TransientError, match="no scratch folder"):
        await h.evaluator.evaluate(ended, may_retry=True)
    errors = [r for r in caplog.records if "no scratch folder of its own to score it in" in r.message]
    assert [r.levelno for r in errors] == [logging.ERROR] and "a later delivery" in errors[0].message
    ev = await h.evaluator.evaluate(ended, may_retry=False)  # the last delivery: a failure that says why
    assert isinstance(ev, RolloutScoringFailed) and "no scratch folder to score it in" in ev.reason
    assert "internal error" not in ev.reason
    monkeypatch.undo()
    ev = await h.evaluator.evaluate(ended, may_retry=True)  # fixed: scored
    assert isinstance(ev, RolloutScored) and ev.score == 1.0
    h.evaluator.close()


def test_the_default_work_root_is_per_user(monkeypatch):
    monkeypatch.delenv("GYRE_EVALUATOR_WORK_ROOT", raising=False)
    assert EvaluatorSettings().work_root == Path(tempfile.gettempdir()) / f"gyre-evaluator-{os.geteuid()}"
    monkeypatch.setenv("GYRE_EVALUATOR_WORK_ROOT", "/srv/scratch")
    assert EvaluatorSettings().work_root == Path("/srv/scratch")
