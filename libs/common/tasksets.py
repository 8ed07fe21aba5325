"""Task sets as one file: JSON Lines (``.jsonl``) or Parquet (``.parquet``), one task a
record. ``tasks.dir`` in the run config may name such a file instead of a folder.

A record (unknown keys are errors; ``files``/``hidden_tests``/``evaluator``/``metadata``
may be JSON text in a Parquet string column, or structs/maps)::

    {"task_id": "add_two",                       # required: letters, digits, _ and -, max 64
     "prompt": "Write calc.py with add(a, b).",  # required: the task statement the agent sees
     "split": "train",                           # train (default) | heldout
     "time_limit_s": 300,                        # wall-clock budget of one rollout
     "level": 1, "max_turns": 8,                 # optional hints
     "files": {"README.md": "..."},              # starting files inline (relative path -> text) ...
     "files_dir": "add_two/files",               # ... and/or a folder of them (relative to the set's file)
     "hidden_tests": {"test_calc.py": "..."},    # the hidden tests inline ...
     "hidden_dir": "add_two/hidden",             # ... and/or a folder of them
     "evaluator": {"weights": {"test_calc.py::test_add": 1}, "limits": {"wall_s": 60}},
                                                 # evaluator.yaml's fields (services/evaluator/README.md)
     "metadata": {"source": "my-benchmark"}}     # anything; kept in task.yaml

The services read a set through its *materialised* folder: the same layout as ``tasks/``
(``task.yaml``, ``files/``, ``evaluator.yaml``, ``hidden/`` per task), written once under
``$GYRE_CACHE_DIR/tasksets/<name>-<digest>`` (digest of the file and the folders it names),
so the runner and the evaluator, in their own processes, read the same tasks.

``validate`` checks every record and returns its problems, each naming the line (JSONL) or
row (Parquet) and the field; ``gyre tasks validate PATH`` adds the evaluator's check of
each record's ``evaluator`` spec.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

SUFFIXES = (".jsonl", ".parquet")
TASK_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_\-]{0,63}$")  # also a NATS subject token (no dots)
FIELDS = {"task_id", "prompt", "split", "time_limit_s", "level", "max_turns", "files", "files_dir",
          "hidden_tests", "hidden_dir", "evaluator", "metadata"}
MAPPINGS = ("files", "hidden_tests", "evaluator", "metadata")


class TaskSetError(ValueError):
    """A task set with problems; ``problems`` lists each (line or row, field, message)."""

    def __init__(self, path: Path, problems: list[Problem]) -> None:
        self.path, self.problems = path, problems
        shown = "\n".join(f"  {p}" for p in problems[:50])
        more = f"\n  ... and {len(problems) - 50} more" if len(problems) > 50 else ""
        super().__init__(f"task set {path}: {len(problems)} problem(s):\n{shown}{more}")


@dataclass(frozen=True)
class Problem:
    where: str  # "line 3" | "row 3" | "file"
    field: str | None
    message: str

    def __str__(self) -> str:
        return f"{self.where}" + (f", field {self.field!r}" if self.field else "") + f": {self.message}"


@dataclass
class TaskRecord:
    task_id: str
    prompt: str
    where: str
    split: str = "train"
    time_limit_s: float = 300.0
    level: int = 1
    max_turns: int | None = None
    files: dict[str, str] = field(default_factory=dict)
    files_dir: Path | None = None
    hidden_tests: dict[str, str] = field(default_factory=dict)
    hidden_dir: Path | None = None
    evaluator: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)


def is_task_set(path: Path) -> bool:
    return path.suffix.lower() in SUFFIXES and path.is_file()


def read_rows(path: Path) -> list[tuple[str, Any]]:
    """(where, raw record) for each record of the file; unreadable lines come back as a
    ``Problem`` in place of the record."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows: list[tuple[str, Any]] = []
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append((f"line {n}", json.loads(line)))
                except json.JSONDecodeError as exc:
                    rows.append((f"line {n}", Problem(f"line {n}", None, f"not valid JSON: {exc.msg} "
                                                                        f"(column {exc.colno})")))
        return rows
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:  # pinned in requirements/metrics.txt
            raise TaskSetError(path, [Problem("file", None, "reading Parquet needs pyarrow")]) from exc
        try:
            table = pq.read_table(path)
        except Exception as exc:
            raise TaskSetError(path, [Problem("file", None, f"not a readable Parquet file: {exc}")]) from exc
        return [(f"row {i}", rec) for i, rec in enumerate(table.to_pylist())]
    raise TaskSetError(path, [Problem("file", None, f"expected a {' or '.join(SUFFIXES)} file")])


def parse_record(raw: Any, where: str, base: Path) -> tuple[TaskRecord | None, list[Problem]]:
    """One record, checked; folders are resolved against ``base`` (the set's folder)."""
    if isinstance(raw, Problem):
        return None, [raw]
    if not isinstance(raw, dict):
        return None, [Problem(where, None, f"a record must be a JSON object, not {type(raw).__name__}")]
    raw = {k: v for k, v in raw.items() if v is not None}  # Parquet fills absent columns with null
    problems: list[Problem] = []

    def bad(name: str | None, message: str) -> None:
        problems.append(Problem(where, name, message))

    for key in sorted(set(raw) - FIELDS):
        bad(key, f"unknown field (known: {', '.join(sorted(FIELDS))})")
    task_id = raw.get("task_id")
    if not isinstance(task_id, str) or not TASK_ID.match(task_id):
        bad("task_id", "required: 1-64 letters, digits, '_' or '-', not starting with '-'"
            + (f" (got {task_id!r})" if task_id is not None else ""))
    prompt = raw.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        bad("prompt", "required: a non-empty string")
    split = raw.get("split", "train")
    if split not in ("train", "heldout"):
        bad("split", f"train or heldout, not {split!r}")
    time_limit = raw.get("time_limit_s", 300)
    if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)) or not 0 < time_limit <= 86400:
        bad("time_limit_s", f"a number of seconds in (0, 86400], not {time_limit!r}")
    level = raw.get("level", 1)
    if isinstance(level, bool) or not isinstance(level, int) or level < 1:
        bad("level", f"an integer >= 1, not {level!r}")
    max_turns = raw.get("max_turns")
    if max_turns is not None and (isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1):
        bad("max_turns", f"an integer >= 1, not {max_turns!r}")
    maps: dict[str, dict[str, Any]] = {}
    for key in MAPPINGS:
        value, err = _mapping(raw.get(key, {}))
        if err:
            bad(key, err)
        maps[key] = value or {}
    for key in ("files", "hidden_tests"):
        for name, content in maps[key].items():
            if not _relative(name):
                bad(key, f"path {name!r} must be relative and stay inside the workspace")
            elif not isinstance(content, str):
                bad(key, f"{name}: file content must be text, not {type(content).__name__}")
    folders: dict[str, Path | None] = {}
    for key in ("files_dir", "hidden_dir"):
        value = raw.get(key)
        folders[key] = None
        if value is None:
            continue
        if not isinstance(value, str) or not value:
            bad(key, f"a folder path, not {value!r}")
            continue
        folder = (base / value) if not Path(value).is_absolute() else Path(value)
        if not folder.is_dir():
            bad(key, f"folder {folder} does not exist")
        folders[key] = folder
    if problems:
        return None, problems
    return TaskRecord(task_id=task_id, prompt=prompt, where=where, split=split, time_limit_s=float(time_limit),
                      level=level, max_turns=max_turns, files=maps["files"], files_dir=folders["files_dir"],
                      hidden_tests=maps["hidden_tests"], hidden_dir=folders["hidden_dir"],
                      evaluator=maps["evaluator"], metadata=maps["metadata"]), []


def _mapping(value: Any) -> tuple[dict[str, Any] | None, str | None]:
    if isinstance(value, str):  # JSON text (a Parquet string column)
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as exc:
            return None, f"JSON text that does not parse: {exc.msg}"
    if isinstance(value, list) and all(isinstance(p, (tuple, list)) and len(p) == 2 for p in value):
        value = {k: v for k, v in value}  # a Parquet map column
    if not isinstance(value, dict):
        return None, f"an object (mapping), not {type(value).__name__}"
    return value, None


def _relative(name: Any) -> bool:
    if not isinstance(name, str) or not name or "\\" in name or "\x00" in name:
        return False
    p = PurePosixPath(name)
    return not p.is_absolute() and ".." not in p.parts


SpecCheck = Callable[[TaskRecord], list[Problem]]


def validate(path: Path, *, check: SpecCheck | None = None) -> tuple[list[TaskRecord], list[Problem]]:
    """Every record of a task set and every problem found (duplicate ids included).
    ``check`` adds the evaluator's own check of each record's spec
    (``services.evaluator.adapters.catalog.record_problems``)."""
    records: list[TaskRecord] = []
    problems: list[Problem] = []
    first_seen: dict[str, str] = {}
    try:
        rows = read_rows(path)
    except TaskSetError as exc:
        return [], exc.problems
    except (OSError, UnicodeDecodeError) as exc:
        return [], [Problem("file", None, f"unreadable: {exc}")]
    if not rows:
        problems.append(Problem("file", None, "no tasks in it"))
    for where, raw in rows:
        rec, found = parse_record(raw, where, path.parent)
        problems.extend(found)
        if rec is None:
            continue
        if rec.task_id in first_seen:
            problems.append(Problem(where, "task_id", f"{rec.task_id!r} already used on {first_seen[rec.task_id]}"))
            continue
        first_seen[rec.task_id] = where
        found = check(rec) if check is not None else []
        problems.extend(found)
        if not found:
            records.append(rec)
    return records, problems


def default_cache_root() -> Path:
    root = os.environ.get("GYRE_CACHE_DIR") or os.path.join(Path.home(), ".cache", "gyre")
    return Path(root) / "tasksets"


def _digest(path: Path, records: list[TaskRecord]) -> str:
    h = hashlib.sha256(path.read_bytes())
    for rec in records:
        for folder in (rec.files_dir, rec.hidden_dir):
            if folder is None:
                continue
            for p in sorted(folder.rglob("*")):
                if p.is_file():
                    h.update(p.relative_to(folder).as_posix().encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def materialize(path: Path, cache_root: Path | None = None, *, check: SpecCheck | None = None) -> Path:
    """The set's tasks as a ``tasks/``-style folder (written once, reused while the file
    and the folders it names are unchanged). Raises TaskSetError listing every problem."""
    path = path.resolve()
    records, problems = validate(path, check=check)
    if problems:
        raise TaskSetError(path, problems)
    root = cache_root or default_cache_root()
    target = root / f"{path.stem}-{_digest(path, records)}"
    if (target / ".complete").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
    try:
        for rec in records:
            _write_task(staging / rec.task_id, rec)
        (staging / ".complete").write_text(str(path) + "\n")
        try:
            os.replace(staging, target)
        except OSError:  # another process wrote it first: theirs is the same content
            if not (target / ".complete").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _write_task(folder: Path, rec: TaskRecord) -> None:
    folder.mkdir(parents=True)
    doc: dict[str, Any] = {"prompt": rec.prompt, "time_limit_s": rec.time_limit_s, "split": rec.split,
                           "level": rec.level}
    if rec.max_turns:
        doc["max_turns"] = rec.max_turns
    if rec.metadata:
        doc["metadata"] = rec.metadata
    (folder / "task.yaml").write_text(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True), encoding="utf-8")
    for sub, source, inline in (("files", rec.files_dir, rec.files), ("hidden", rec.hidden_dir, rec.hidden_tests)):
        if source is None and not inline:
            continue
        dest = folder / sub
        if source is not None:
            shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__"))
        dest.mkdir(exist_ok=True)
        for name, content in inline.items():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_text(content, encoding="utf-8")
    evaluator = {k: v for k, v in rec.evaluator.items() if k not in ("task_id", "hidden_files")}
    evaluator.setdefault("prompt", rec.prompt)
    (folder / "evaluator.yaml").write_text(yaml.safe_dump(evaluator, sort_keys=False, allow_unicode=True),
                                           encoding="utf-8")
