"""``gyre tasks validate``: a task set's problems, each naming where and which field."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any


def validate_task_set(path: Path) -> dict[str, Any]:
    """{"tasks": valid count, "splits": {split: count}, "problems": [text, ...]}."""
    if path.is_dir():
        return _validate_folder(path)
    from libs.common.tasksets import validate
    from services.evaluator.adapters.catalog import record_problems

    if not path.exists():
        return {"tasks": 0, "splits": {}, "problems": [f"file: {path} does not exist"]}
    records, problems = validate(path, check=record_problems)
    return {"tasks": len(records), "splits": dict(Counter(r.split for r in records)),
            "problems": [str(p) for p in problems]}


def _validate_folder(root: Path) -> dict[str, Any]:
    """A folder like ``tasks/``: each task folder's task.yaml and evaluator spec."""
    from services.evaluator.adapters.catalog import DirectoryTaskCatalog, TaskSpecError
    from services.runner.tasks import TaskError, load_task

    catalog = DirectoryTaskCatalog(root)
    splits: Counter[str] = Counter()
    problems: list[str] = []
    folders = [p for p in sorted(root.iterdir()) if p.is_dir() and not p.name.startswith(".")]
    for folder in folders:
        if not (folder / "task.yaml").is_file():
            problems.append(f"{folder.name}: no task.yaml")
            continue
        try:
            task = load_task(folder)
            if catalog.get(task.task_id) is None:
                raise TaskSpecError(f"task {task.task_id}: no evaluator.yaml")
        except (TaskError, TaskSpecError) as exc:
            problems.append(f"{folder.name}: {exc}")
            continue
        splits[task.split] += 1
    if not folders:
        problems.append(f"{root}: no task folders in it")
    return {"tasks": sum(splits.values()), "splits": dict(splits), "problems": problems}
