"""The generated starter tasks (scripts/gen_starter_tasks.py): loadable by the runner and
the evaluator's catalog, reproducible from the script, a held-out split of new value
combinations, and hidden tests that the reference solution passes in full and a
half-right answer passes in part."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from services.evaluator.adapters.catalog import DirectoryTaskCatalog
from services.runner.tasks import default_tasks_dir, load_tasks

ROOT = default_tasks_dir()
SCRIPT = ROOT.parent / "scripts" / "gen_starter_tasks.py"
STARTERS = [t for t in load_tasks() if t.task_id.startswith("starter_")]

sys.path.insert(0, str(SCRIPT.parent))
import gen_starter_tasks as gen  # noqa: E402

sys.path.remove(str(SCRIPT.parent))

# runs every test function of the hidden files in one process per workspace; prints {test id: passed}
_RUNNER = r"""
import importlib.util, json, sys
ws, files = sys.argv[1], sys.argv[2:]
sys.path.insert(0, ws)
out = {}
for f in files:
    try:
        spec = importlib.util.spec_from_file_location(f[:-3], ws + "/" + f)
        mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    except BaseException:
        continue
    for t in [n for n in dir(mod) if n.startswith("test_")]:
        try:
            getattr(mod, t)(); out[f + "::" + t] = True
        except BaseException:
            out[f + "::" + t] = False
print(json.dumps(out))
"""


def test_task_set_shape() -> None:
    assert 24 <= len(STARTERS) <= 32
    held = [t for t in STARTERS if t.split == "heldout"]
    assert len(held) / len(STARTERS) >= 0.25
    assert all(t.level == 1 and t.time_limit_s > 0 and t.max_turns for t in STARTERS)
    catalog = DirectoryTaskCatalog(ROOT)
    for task in STARTERS:
        spec = catalog.get(task.task_id)
        assert spec is not None and len(spec.hidden_files) == 1 and len(spec.weights) == 5, task.task_id
        assert spec.prompt and spec.prompt.strip() == task.prompt.strip()


def test_heldout_are_new_combinations_of_seen_values() -> None:
    train, held = gen.choose()
    assert len(set(train) | set(held)) == len(train) + len(held)  # no triple in both
    for i in range(3):
        assert {c[i] for c in held} <= {c[i] for c in train}
    ids = {t.task_id: t.split for t in STARTERS}
    assert ids == {**{gen.task_id(*c): "train" for c in train}, **{gen.task_id(*c): "heldout" for c in held}}


def test_generator_is_deterministic_and_matches_the_shipped_tasks(tmp_path) -> None:
    gen.generate(tmp_path)
    for task in STARTERS:
        shipped, fresh = ROOT / task.task_id, tmp_path / task.task_id
        files = sorted(p.relative_to(shipped) for p in shipped.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
        assert files == sorted(p.relative_to(fresh) for p in fresh.rglob("*") if p.is_file()), task.task_id
        for rel in files:
            assert (shipped / rel).read_bytes() == (fresh / rel).read_bytes(), (task.task_id, rel)


def _run_hidden(ws: Path, task_id: str) -> dict[str, bool]:
    hidden = ROOT / task_id / "hidden"
    names = [p.name for p in sorted(hidden.glob("test_*.py"))]
    for n in names:
        shutil.copy2(hidden / n, ws / n)
    proc = subprocess.run([sys.executable, "-c", _RUNNER, str(ws), *names], capture_output=True, text=True,
                          timeout=60, cwd=ws)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _weights(task_id: str) -> dict[str, float]:
    return DirectoryTaskCatalog(ROOT).get(task_id).weights


@pytest.mark.parametrize("task", STARTERS, ids=lambda t: t.task_id)
def test_reference_solution_passes_every_weighted_test(task, tmp_path) -> None:
    shutil.copytree(ROOT / task.task_id / "files", tmp_path, dirs_exist_ok=True)
    shutil.copytree(ROOT / task.task_id / "solution", tmp_path, dirs_exist_ok=True)
    results = _run_hidden(tmp_path, task.task_id)
    assert set(results) == set(_weights(task.task_id)) and all(results.values()), results


def test_partial_credit(tmp_path) -> None:
    """Right name, wrong constant: some tests pass, not all; wrong name: none."""
    task = next(t for t in STARTERS if t.task_id.endswith("add3") or t.task_id.endswith("sub3"))
    name = task.task_id.split("_")[1]
    op = "+" if "add" in task.task_id else "-"
    cases = {"wrong_k": (f"def {name}(x):\n    return x {op} 9\n", 3), "wrong_op": (f"def {name}(x):\n    return x * 3\n", 2),
             "wrong_name": ("def other(x):\n    return x + 3\n", 0), "start": (None, 0)}
    for label, (code, want) in cases.items():
        ws = tmp_path / label
        shutil.copytree(ROOT / task.task_id / "files", ws)
        if code is not None:
            (ws / "solution.py").write_text(code)
        results = _run_hidden(ws, task.task_id)
        assert sum(results.values()) == want, (label, results)
