"""Task sets as JSON Lines or Parquet: the runner's loader and the evaluator's catalog read
them (through one materialised folder), and ``gyre tasks validate`` names each problem's
line or row and field."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from gyre.cli import app
from libs.common.tasksets import TaskSetError, materialize, validate
from services.evaluator.adapters.catalog import DirectoryTaskCatalog, record_problems
from services.runner.tasks import load_tasks

TESTS = "from calc import add\n\ndef test_add():\n    assert add(2, 3) == 5\n"


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GYRE_CACHE_DIR", str(tmp_path / "cache"))


def good_records(tmp_path):
    hidden = tmp_path / "sets" / "mul" / "hidden"
    hidden.mkdir(parents=True)
    (hidden / "test_mul.py").write_text("from calc import mul\n\ndef test_mul():\n    assert mul(2, 3) == 6\n")
    start = tmp_path / "sets" / "mul" / "files"
    start.mkdir()
    (start / "calc.py").write_text("def mul(a, b):\n    raise NotImplementedError\n")
    return [
        {"task_id": "add", "prompt": "Write calc.py with add(a, b).", "split": "train", "time_limit_s": 120,
         "files": {"README.md": "# calc\n"}, "hidden_tests": {"test_calc.py": TESTS},
         "evaluator": {"weights": {"test_calc.py::test_add": 2}, "limits": {"wall_s": 30}},
         "metadata": {"source": "unit", "difficulty": 1}},
        {"task_id": "mul", "prompt": "Finish mul in calc.py.", "split": "heldout", "level": 2, "max_turns": 6,
         "files_dir": "mul/files", "hidden_dir": "mul/hidden"},
    ]


def write_jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_a_jsonl_set_loads_for_the_runner_and_the_evaluator(tmp_path):
    path = write_jsonl(tmp_path / "sets" / "calc.jsonl", good_records(tmp_path))
    tasks = {t.task_id: t for t in load_tasks(path)}
    assert set(tasks) == {"add", "mul"}
    add, mul = tasks["add"], tasks["mul"]
    assert add.prompt == "Write calc.py with add(a, b).\n" and add.time_limit_s == 120 and add.split == "train"
    assert add.metadata == {"source": "unit", "difficulty": 1}
    assert (add.files_dir / "README.md").read_text() == "# calc\n"
    assert not (add.files_dir.parent / "files" / "test_calc.py").exists()  # hidden tests stay hidden
    assert mul.split == "heldout" and mul.level == 2 and mul.max_turns == 6
    assert "NotImplementedError" in (mul.files_dir / "calc.py").read_text()
    assert [t.task_id for t in load_tasks(path, split="heldout")] == ["mul"]

    catalog = DirectoryTaskCatalog(path)
    spec = catalog.get("add")
    assert spec.hidden_files == {"test_calc.py": TESTS.encode()}
    assert spec.weights == {"test_calc.py::test_add": 2} and spec.limits.wall_s == 30
    assert spec.prompt == "Write calc.py with add(a, b)."
    assert set(catalog.get("mul").hidden_files) == {"test_mul.py"}
    assert materialize(path) == catalog.root  # one folder, reused while the inputs are unchanged
    (tmp_path / "sets" / "mul" / "hidden" / "test_mul.py").write_text("def test_changed():\n    pass\n")
    assert materialize(path) != catalog.root  # a named folder changed: a new digest


def test_validate_names_each_line_and_field(tmp_path):
    records = good_records(tmp_path)
    bad = [
        records[0],
        '{"task_id": "broken", "prompt": ',
        {"task_id": "no-prompt", "promt": "typo"},
        {"task_id": "add", "prompt": "again"},
        {"task_id": "s", "prompt": "p", "split": "test", "time_limit_s": -1, "hidden_tests": {"t.py": TESTS}},
        {"task_id": "w", "prompt": "p", "hidden_tests": {"test_a.py": TESTS},
         "evaluator": {"weights": {"test_b.py::test_x": 1}}},
        {"task_id": "esc", "prompt": "p", "hidden_tests": {"../evil.py": "x"}, "files_dir": "nowhere"},
        {"task_id": "lim", "prompt": "p", "hidden_tests": {"t.py": TESTS}, "evaluator": {"limits": {"wall_s": "x"}}},
        {"task_id": "none", "prompt": "no hidden tests, no command"},
    ]
    path = write_jsonl(tmp_path / "sets" / "bad.jsonl", bad)
    result = CliRunner().invoke(app, ["tasks", "validate", str(path)])
    assert result.exit_code == 1
    out = result.output
    expected = [
        "line 2: not valid JSON",
        "line 3, field 'promt': unknown field",
        "line 3, field 'prompt': required: a non-empty string",
        "line 4, field 'task_id': 'add' already used on line 1",
        "line 5, field 'split': train or heldout, not 'test'",
        "line 5, field 'time_limit_s': a number of seconds in (0, 86400], not -1",
        "line 6, field 'evaluator.weights': 'test_b.py::test_x' names test_b.py, "
        "not one of the hidden tests (test_a.py)",
        "line 7, field 'hidden_tests': path '../evil.py' must be relative",
        "line 7, field 'files_dir': folder",
        "line 8, field 'evaluator.limits.wall_s'",
        "line 9, field 'evaluator': Value error, a tests policy needs hidden_files or a command",
        "1 valid task(s) (train 1)",
    ]
    for text in expected:
        assert text in out, f"{text!r} not in:\n{out}"
    with pytest.raises(TaskSetError, match="line 3, field 'prompt'"):
        load_tasks(path)


def test_a_parquet_set_with_map_and_json_text_columns(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({
        "task_id": ["add", "sub"],
        "prompt": ["Write calc.py with add(a, b).", "Write calc.py with sub(a, b)."],
        "split": ["train", None],
        "time_limit_s": [60.0, None],
        "files": pa.array([[("README.md", "# add\n")], []], type=pa.map_(pa.string(), pa.string())),
        "hidden_tests": [json.dumps({"test_calc.py": TESTS}), json.dumps({"test_calc.py": TESTS})],
        "metadata": [json.dumps({"origin": "parquet"}), None],
    })
    path = tmp_path / "calc.parquet"
    pq.write_table(table, path)
    result = CliRunner().invoke(app, ["tasks", "validate", str(path), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == {"tasks": 2, "splits": {"train": 2}, "problems": []}
    tasks = {t.task_id: t for t in load_tasks(path)}
    assert tasks["add"].time_limit_s == 60 and tasks["sub"].time_limit_s == 300
    assert tasks["add"].metadata == {"origin": "parquet"} and tasks["sub"].files_dir is None
    assert DirectoryTaskCatalog(path).get("sub").hidden_files == {"test_calc.py": TESTS.encode()}

    pq.write_table(pa.table({"task_id": ["x y"], "prompt": ["p"]}), tmp_path / "bad.parquet")
    records, problems = validate(tmp_path / "bad.parquet", check=record_problems)
    assert not records and str(problems[0]).startswith("row 0, field 'task_id': required")


def test_the_shipped_task_folder_validates_and_a_missing_file_is_named(tmp_path):
    ok = CliRunner().invoke(app, ["tasks", "validate", "tasks"])
    assert ok.exit_code == 0 and ok.output.startswith("ok: ")
    missing = CliRunner().invoke(app, ["tasks", "validate", str(tmp_path / "nope.jsonl")])
    assert missing.exit_code == 1 and "does not exist" in missing.output
