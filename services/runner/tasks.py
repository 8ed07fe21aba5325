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
    return Task(task_id=task_id, prompt=doc["prompt"].strip() + "\n", time_limit_s=float(doc.get("time_limit_s", 300)),
                split=split, files_dir=files if files.is_dir() else None, level=int(doc.get("level", 1)),
                max_turns=int(doc["max_turns"]) if doc.get("max_turns") else None, metadata=metadata)


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
