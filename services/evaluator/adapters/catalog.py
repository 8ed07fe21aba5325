"""Where task evaluator specs come from.

``DirectoryTaskCatalog`` reads one folder per task::

    <root>/<task_id>/evaluator.yaml   # the spec's fields, except task_id and hidden_files
    <root>/<task_id>/hidden/...       # the hidden test files, any depth

``root`` may also be a task-set file (``.jsonl``/``.parquet``, ``libs/common/tasksets.py``):
it is read through its materialised folder. ``record_problems`` is the evaluator's check
of one task-set record (``gyre tasks validate``).

``InMemoryTaskCatalog`` holds specs built in code (tests, tools).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Protocol

import yaml
from pydantic import ValidationError

from libs.common.tasksets import Problem, TaskRecord, is_task_set, materialize

from ..core.spec import TaskEvaluatorSpec

_TASK_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")


class TaskSpecError(ValueError):
    """A task exists but its evaluator spec cannot be read."""


class TaskCatalog(Protocol):
    def get(self, task_id: str) -> TaskEvaluatorSpec | None:
        """The task's spec, None for an unknown task; raises TaskSpecError for a broken one."""


class InMemoryTaskCatalog:
    def __init__(self, specs: list[TaskEvaluatorSpec] | None = None) -> None:
        self.specs = {s.task_id: s for s in specs or []}

    def add(self, spec: TaskEvaluatorSpec) -> None:
        self.specs[spec.task_id] = spec

    def get(self, task_id: str) -> TaskEvaluatorSpec | None:
        return self.specs.get(task_id)


class DirectoryTaskCatalog:
    def __init__(self, root: Path, *, max_hidden_bytes: int = 64 * 2**20) -> None:
        self.root = materialize(root, check=record_problems) if is_task_set(root) else root
        self.max_hidden_bytes = max_hidden_bytes
        self._cache: dict[str, TaskEvaluatorSpec] = {}

    def get(self, task_id: str) -> TaskEvaluatorSpec | None:
        if task_id in self._cache:
            return self._cache[task_id]
        if not _TASK_ID.match(task_id) or task_id in (".", ".."):
            return None
        folder = self.root / task_id
        spec_file = folder / "evaluator.yaml"
        if not spec_file.is_file():
            return None
        spec = self._load(task_id, folder, spec_file)
        self._cache[task_id] = spec
        return spec

    def _load(self, task_id: str, folder: Path, spec_file: Path) -> TaskEvaluatorSpec:
        try:
            fields = yaml.safe_load(spec_file.read_text(encoding="utf-8")) or {}
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            raise TaskSpecError(f"task {task_id}: unreadable evaluator.yaml: {exc}") from exc
        if not isinstance(fields, dict):
            raise TaskSpecError(f"task {task_id}: evaluator.yaml must be a mapping")
        try:
            return TaskEvaluatorSpec(task_id=task_id, hidden_files=self._hidden(folder / "hidden"), **fields)
        except (ValidationError, TypeError) as exc:
            raise TaskSpecError(f"task {task_id}: invalid evaluator spec: {exc}") from exc

    def _hidden(self, hidden: Path) -> dict[str, bytes]:
        files: dict[str, bytes] = {}
        total = 0
        if not hidden.is_dir():
            return files
        for path in sorted(hidden.rglob("*")):
            if path.is_symlink() or not path.is_file() or "__pycache__" in path.parts:
                continue
            data = path.read_bytes()
            total += len(data)
            if total > self.max_hidden_bytes:
                raise TaskSpecError(f"hidden files of {hidden.parent.name} exceed {self.max_hidden_bytes} bytes")
            files[path.relative_to(hidden).as_posix()] = data
        return files


def record_problems(rec: TaskRecord) -> list[Problem]:
    """What the evaluator would refuse in a task-set record's spec: the fields of its
    ``evaluator`` mapping with its hidden tests, and weights naming tests that do not exist."""
    hidden = {k: v.encode() for k, v in rec.hidden_tests.items()}
    if rec.hidden_dir is not None:
        hidden.update({p.relative_to(rec.hidden_dir).as_posix(): b"" for p in rec.hidden_dir.rglob("*") if p.is_file()})
    fields = {k: v for k, v in rec.evaluator.items() if k not in ("task_id", "hidden_files")}
    fields.setdefault("prompt", rec.prompt)
    try:
        TaskEvaluatorSpec(task_id=rec.task_id, hidden_files=hidden, **fields)
    except ValidationError as exc:
        return [Problem(rec.where, ".".join(["evaluator", *(str(x) for x in err["loc"])]), err["msg"])
                for err in exc.errors()]
    except TypeError as exc:
        return [Problem(rec.where, "evaluator", str(exc))]
    weights = fields.get("weights") or {}
    for name in weights if isinstance(weights, dict) else ():
        test_file = str(name).split("::", 1)[0]
        if test_file not in hidden and not fields.get("command"):
            return [Problem(rec.where, "evaluator.weights", f"{name!r} names {test_file}, not one of the hidden tests "
                                                            f"({', '.join(sorted(hidden)) or 'none'})")]
    return []
