"""The task set loader: ``tasks/`` is data, this reads it.

One folder per task::

    tasks/<task_id>/task.yaml        # prompt, time_limit_s, split (train | heldout), level, max_turns, metadata
    tasks/<task_id>/files/...        # the starting files copied into each rollout's workspace
    tasks/<task_id>/evaluator.yaml   # read by services/evaluator/adapters/catalog.py
    tasks/<task_id>/hidden/...       # the hidden tests (never copied into a workspace)

or one file, JSON Lines or Parquet, one task a record (the format: ``libs/common/tasksets.py``),
read through the same layout written once to a cache folder.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

Split = Literal["train", "heldout"]
MAX_TIME_LIMIT_S = 86400
_TASK_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_\-]{0,63}$")  # also a NATS subject token (no dots)


class TaskError(ValueError):
    """A task folder that cannot be read."""


@dataclass(frozen=True)
class Task:
    task_id: str
    prompt: str
    time_limit_s: float = 300.0
    split: Split = "train"
    files_dir: Path | None = None  # starting files; None: an empty workspace
    level: int = 1  # 1: one function ... 3: a small multi-file package
    max_turns: int | None = None  # a hint for the harness's turn budget
    metadata: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)  # free-form, from task.yaml

    def __post_init__(self) -> None:
        if not _is_number(self.time_limit_s) or not 0 < self.time_limit_s <= MAX_TIME_LIMIT_S:
            raise TaskError(f"task {self.task_id}: time_limit_s must be a number of seconds in "
                            f"(0, {MAX_TIME_LIMIT_S}], not {self.time_limit_s!r}")


def default_tasks_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "tasks"


def load_task(folder: Path) -> Task:
    task_id = folder.name
    if not _TASK_ID.match(task_id):
        raise TaskError(f"task folder name {task_id!r} is not a valid task id")
    try:
        doc = yaml.safe_load((folder / "task.yaml").read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise TaskError(f"task {task_id}: unreadable task.yaml: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("prompt"), str) or not doc["prompt"].strip():
        raise TaskError(f"task {task_id}: task.yaml needs a non-empty 'prompt'")
    split = doc.get("split", "train")
    if split not in ("train", "heldout"):
        raise TaskError(f"task {task_id}: split must be train or heldout, not {split!r}")
    files = folder / "files"
    metadata = doc.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise TaskError(f"task {task_id}: metadata must be a mapping")
    # the same rules as a JSONL/Parquet task set (libs/common/tasksets.py)
    time_limit = doc.get("time_limit_s", 300)
    if not _is_number(time_limit) or not 0 < time_limit <= MAX_TIME_LIMIT_S:
        raise TaskError(f"task {task_id}: time_limit_s must be a number of seconds in (0, {MAX_TIME_LIMIT_S}], "
                        f"not {time_limit!r}")
    level = doc.get("level", 1)
    if not _is_int(level) or level < 1:
        raise TaskError(f"task {task_id}: level must be an integer >= 1, not {level!r}")
    max_turns = doc.get("max_turns")
    if max_turns is not None and (not _is_int(max_turns) or max_turns < 1):
        raise TaskError(f"task {task_id}: max_turns must be an integer >= 1, not {max_turns!r}")
    return Task(task_id=task_id, prompt=doc["prompt"].strip() + "\n", time_limit_s=float(time_limit),
                split=split, files_dir=files if files.is_dir() else None, level=level,
                max_turns=max_turns, metadata=metadata)


def _is_number(value: Any) -> bool:  # NaN fails every comparison, so the range check rejects it
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def load_tasks(root: Path | None = None, *, split: Split | None = None) -> list[Task]:
    """Every task under ``root`` (default: the shipped ``tasks/``), sorted by id. ``root``
    may be a ``.jsonl``/``.parquet`` task set (``libs.common.tasksets.TaskSetError`` names
    each bad line and field)."""
    from libs.common.tasksets import is_task_set, materialize

    root = root or default_tasks_dir()
    if is_task_set(root):
        root = materialize(root)
    tasks = [load_task(p) for p in sorted(root.iterdir()) if (p / "task.yaml").is_file()]
    return [t for t in tasks if split is None or t.split == split]
