"""A rollout of a task from a JSON Lines task set is scored with the set's hidden tests."""

from __future__ import annotations

import json

from libs.common.events import RolloutScored
from services.evaluator.adapters.catalog import DirectoryTaskCatalog

from ._workspaces import CALC_OK, CALC_PARTIAL, CALC_TESTS, tar_of


async def test_scores_a_task_from_a_jsonl_set(make_harness, tmp_path, monkeypatch):
    monkeypatch.setenv("GYRE_CACHE_DIR", str(tmp_path / "cache"))
    record = {"task_id": "calc", "prompt": "Write calc.py.", "hidden_tests": {"test_calc.py": CALC_TESTS},
              "evaluator": {"weights": {"test_calc.py::test_add": 1, "test_calc.py::test_mul": 1,
                                        "test_calc.py::test_div": 2}, "limits": {"wall_s": 30, "cpu_s": 30}}}
    path = tmp_path / "calc.jsonl"
    path.write_text(json.dumps(record) + "\n")
    h = await make_harness()
    h.evaluator.catalog = DirectoryTaskCatalog(path)
    ok = await h.rollout("calc", tar_of({"calc.py": CALC_OK}))
    partial = await h.rollout("calc", tar_of({"calc.py": CALC_PARTIAL}))
    scored = [await h.evaluator.evaluate(ended) for ended in (ok, partial)]
    assert all(isinstance(ev, RolloutScored) for ev in scored), scored
    assert [ev.score for ev in scored] == [1.0, 0.25]
