"""An agent must not make its own rollout unscorable (review of the evaluator, item 3): a
RolloutScoringFailed drops the rollout from training instead of giving it its negative
advantage. What its workspace alone decides (a file name the evaluator does not make, more
files or bytes than the caps, a workspace the runner would not archive) is a score: 0 with a
reason, or the rest scored with a note. A snapshot missing for the runner's or the blob
store's sake still fails (or is retried)."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from libs.common.blobs import MemoryBlobStore
from libs.common.bus.memory import InMemoryBus
from libs.common.events import Context, RolloutFinished, RolloutScored, RolloutScoringFailed, RolloutTimedOut
from services.evaluator.adapters.snapshot import SnapshotOverLimits, UnpackLimits, unpack_snapshot
from services.evaluator.main import build_evaluator
from services.evaluator.settings import EvaluatorSettings
from services.runner.harness import HarnessConfig
from services.runner.runner import RolloutRunner, RunnerConfig, refused_snapshot
from services.runner.tasks import default_tasks_dir, load_tasks

from ._workspaces import CALC_OK, CALC_PARTIAL, calc_spec, member, tar_of, tar_with


async def test_a_backslash_in_a_file_name_is_skipped_and_named_the_rest_scored(make_harness):
    h = await make_harness()
    snap = tar_with([member("calc.py"), member("a\\b"), member("dir\\x", tarfile.DIRTYPE), member("dir\\x/f")],
                    {"calc.py": CALC_PARTIAL.encode(), "a\\b": b"x", "dir\\x/f": b"y"})
    ev = await h.score(calc_spec(), snap)
    assert isinstance(ev, RolloutScored) and ev.score == 0.25
    assert "3 file(s) with names the evaluator does not make skipped: 'a\\\\b'" in ev.reason, ev.reason


def test_a_path_too_long_to_make_here_is_skipped(tmp_path: Path):
    deep = "/".join(["d" * 200] * 21) + "/f.py"  # 4 KB: fine where the runner took it, not under our folder
    data = tar_of({"ok.py": "x = 1\n", deep: "y = 2\n"})
    got = unpack_snapshot(data, tmp_path)
    assert (tmp_path / "ok.py").exists() and len(got.skipped_names) == 1 and "path too long" in got.skipped_names[0]


@pytest.mark.parametrize("overrides,why", [
    ({"max_members": 5}, "more than 5 members"),
    ({"max_unpacked_bytes": 2048}, "unpacks to more than 2048 bytes"),
    ({"max_snapshot_bytes": 2048}, "over the 2048-byte cap"),
])
async def test_a_workspace_over_the_evaluators_caps_scores_0(make_harness, overrides, why):
    h = await make_harness(**overrides)
    files = {"calc.py": CALC_OK, **{f"f{i}.txt": "z" * 600 for i in range(8)}}
    ev = await h.score(calc_spec(), tar_of(files))
    assert isinstance(ev, RolloutScored) and ev.score == 0.0, ev
    assert "the workspace is over the evaluator's limits" in ev.reason and why in ev.reason
    assert ev.tests == [] and ev.isolation.startswith("none")


def test_the_caps_are_told_apart_from_a_damaged_archive(tmp_path: Path):
    with pytest.raises(SnapshotOverLimits):
        unpack_snapshot(tar_of({f"f{i}": "" for i in range(20)}), tmp_path, UnpackLimits(max_members=10))


async def test_the_runners_stand_in_for_a_workspace_too_large_scores_0(make_harness):
    h = await make_harness()
    ev = await h.score(calc_spec(), refused_snapshot("workspace has more than 268435456 bytes of files"))
    assert isinstance(ev, RolloutScored) and ev.score == 0.0
    assert "the runner did not archive the workspace: workspace has more than 268435456 bytes" in ev.reason


async def test_no_snapshot_at_all_still_fails_its_scoring(make_harness):
    h = await make_harness()
    ev = await h.score(calc_spec(), None)
    assert isinstance(ev, RolloutScoringFailed) and "no workspace snapshot" in ev.reason


async def test_runner_and_evaluator_together_score_what_the_agent_did(tmp_path, work_root):
    bus, blobs = InMemoryBus(), MemoryBlobStore()
    task = {t.task_id: t for t in load_tasks()}["starter_fold_add3"]
    ev = build_evaluator(EvaluatorSettings(tasks_dir=default_tasks_dir(), work_root=work_root, workers=1),
                         bus=bus, store=blobs)
    await ev.start()
    wrong = "printf 'def fold(x):\\n    return 0\\n' > solution.py"
    cases = {"honest": wrong, "backslash": wrong + "; touch 'a\\b'",
             "sparse": wrong + "; truncate -s 300M junk.bin"}
    got = {}
    try:
        for name, script in cases.items():
            runner = RolloutRunner(RunnerConfig("rr", "http://proxy:1", tmp_path / "work",
                                                harness=HarnessConfig(name, ("/bin/sh", "-c", script))),
                                   bus=bus, blobs=blobs)
            [out] = await runner.run_step(0, [task], group_size=1)
            [ended] = [d.event async for d in bus.read(Context.ROLLOUTS) if isinstance(
                d.event, (RolloutFinished, RolloutTimedOut)) and d.event.rollout_id == out.rollout_id]
            got[name] = await ev.evaluate(ended)
    finally:
        ev.close()
    assert all(isinstance(e, RolloutScored) for e in got.values()), got
    assert got["backslash"].score == got["honest"].score > 0.0 and "a\\\\b" in got["backslash"].reason
    assert got["sparse"].score == 0.0 and "the runner did not archive the workspace" in got["sparse"].reason
