"""The shipped task set: loadable by the runner and by the evaluator's catalog, a
held-out split, and hidden tests that the reference solution passes and the starting
files do not."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from services.evaluator.adapters.catalog import DirectoryTaskCatalog
from services.runner.tasks import TaskError, default_tasks_dir, load_task, load_tasks

TASKS = load_tasks()


def test_task_set_shape() -> None:
    coding = [t for t in TASKS if not t.task_id.startswith("starter_")]  # the starter family has its own test
    assert 6 <= len(coding) <= 12
    heldout = load_tasks(split="heldout")
    assert len(heldout) / len(TASKS) >= 0.2 and {t.split for t in TASKS} == {"train", "heldout"}
    assert sum(t.split == "heldout" for t in coding) / len(coding) >= 0.2
    assert {t.level for t in TASKS} >= {1, 2, 3}
    catalog = DirectoryTaskCatalog(default_tasks_dir())
    for task in TASKS:
        spec = catalog.get(task.task_id)
        assert spec is not None and spec.hidden_files and spec.weights, task.task_id
        assert task.time_limit_s > 0 and task.prompt.strip()


def _pytest(folders) -> dict[str, tuple[set[str], set[str]]]:
    """One pytest run over many task folders (their module names differ): per task, the
    node ids (relative to its folder) that passed and those that did not."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", "--continue-on-collection-errors",
                           *map(str, folders)], cwd=folders[0].parent, capture_output=True, text=True, timeout=120)
    out: dict[str, tuple[set[str], set[str]]] = {f.name: (set(), set()) for f in folders}
    for line in proc.stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("PASSED", "FAILED", "ERROR") and "/" in rest:
            path, _, name = rest.split(" - ")[0].strip().partition("::")
            parts = path.split("/")
            task, test = (parts[-2], f"{parts[-1]}::{name}") if len(parts) >= 2 else ("", "")
            if task in out:
                out[task][word != "PASSED"].add(test)
    return out


CODING = [t for t in TASKS if not t.task_id.startswith("starter_")]


def test_solutions_pass_every_weighted_test_and_starting_files_do_not(tmp_path) -> None:
    """The coding tasks, in one pytest run (their module names differ; the starter family all
    write ``solution.py`` and is checked task by task in test_starter_tasks.py)."""
    catalog = DirectoryTaskCatalog(default_tasks_dir())
    for variant in ("solved", "start"):
        for task in CODING:
            root, ws = default_tasks_dir() / task.task_id, tmp_path / variant / task.task_id
            shutil.copytree(root / "files", ws)
            if variant == "solved":
                shutil.copytree(root / "solution", ws, dirs_exist_ok=True)
            shutil.copytree(root / "hidden", ws, dirs_exist_ok=True)
    solved = _pytest(sorted((tmp_path / "solved").iterdir()))
    start = _pytest(sorted((tmp_path / "start").iterdir()))
    for task in CODING:
        passed, failed = solved[task.task_id]
        assert not failed and passed == set(catalog.get(task.task_id).weights), task.task_id
        assert start[task.task_id][1], f"{task.task_id}: the starting files already pass"


def test_bad_task_folder(tmp_path) -> None:
    (tmp_path / "t1").mkdir()
    (tmp_path / "t1" / "task.yaml").write_text("split: train\n")
    with pytest.raises(TaskError):
        load_task(tmp_path / "t1")


@pytest.mark.parametrize("line, message", [
    ("time_limit_s: abc", "time_limit_s must be a number of seconds in (0, 86400], not 'abc'"),
    ("time_limit_s: .inf", "time_limit_s must be a number of seconds in (0, 86400], not inf"),
    ("time_limit_s: .nan", "time_limit_s must be a number of seconds in (0, 86400], not nan"),
    ("time_limit_s: 0", "time_limit_s must be a number of seconds in (0, 86400], not 0"),
    ("time_limit_s: -5", "time_limit_s must be a number of seconds in (0, 86400], not -5"),
    ("time_limit_s: 86401", "not 86401"),
    ("time_limit_s: true", "not True"),
    ("level: x", "level must be an integer >= 1, not 'x'"),
    ("level: 0", "level must be an integer >= 1, not 0"),
    ("max_turns: many", "max_turns must be an integer >= 1, not 'many'"),
    ("max_turns: 0", "max_turns must be an integer >= 1, not 0"),
    ("max_turns: 2.5", "max_turns must be an integer >= 1, not 2.5"),
])
def test_bad_numbers_in_task_yaml_name_the_task_and_field(tmp_path, line, message) -> None:
    folder = tmp_path / "t1"
    folder.mkdir()
    (folder / "task.yaml").write_text(f"prompt: hi\n{line}\n")
    with pytest.raises(TaskError) as err:
        load_task(folder)
    assert str(err.value).startswith("task t1: ") and message in str(err.value)


def test_good_numbers_in_task_yaml(tmp_path) -> None:
    folder = tmp_path / "t1"
    folder.mkdir()
    (folder / "task.yaml").write_text("prompt: hi\ntime_limit_s: 2.5\nlevel: 3\nmax_turns: 7\n")
    t = load_task(folder)
    assert (t.time_limit_s, t.level, t.max_turns) == (2.5, 3, 7)


@pytest.mark.parametrize("limit", [float("inf"), float("nan"), 0.0, -1.0])
def test_a_task_built_in_code_needs_a_real_time_limit(limit) -> None:
    from services.runner.tasks import Task

    with pytest.raises(TaskError, match="task demo: time_limit_s must be"):
        Task("demo", "hi\n", time_limit_s=limit)
