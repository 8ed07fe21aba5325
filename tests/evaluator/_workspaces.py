"""Small generated workspaces (tar snapshots) and task specs for the evaluator tests."""

from __future__ import annotations

import io
import tarfile
import textwrap

from services.evaluator.core.spec import Limits, TaskEvaluatorSpec

CALC_OK = """
def add(a, b):
    return a + b

def mul(a, b):
    return a * b

def div(a, b):
    return a / b
"""

CALC_PARTIAL = """
def add(a, b):
    return a + b

def mul(a, b):
    return a + b  # wrong

def div(a, b):
    raise NotImplementedError
"""

CALC_BROKEN = "def add(a, b)\n    return a + b\n"  # syntax error: the tests cannot import it

CALC_TESTS = """
from calc import add, mul, div

def test_add():
    assert add(2, 3) == 5

def test_mul():
    assert mul(2, 3) == 6

def test_div():
    assert div(6, 3) == 2
"""


def tar_of(files: dict[str, str | bytes], *, gz: bool = False) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w") as tar:
        for name, content in files.items():
            data = content.encode() if isinstance(content, str) else content
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def tar_with(members: list[tarfile.TarInfo], data: dict[str, bytes] | None = None) -> bytes:
    """An archive of hand-made members (links, devices, odd names)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for m in members:
            payload = (data or {}).get(m.name)
            if payload is not None:
                m.size = len(payload)
            tar.addfile(m, io.BytesIO(payload) if payload is not None else None)
    return buf.getvalue()


def member(name: str, kind: bytes = tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
    return info


def calc_spec(task_id: str = "calc", **overrides) -> TaskEvaluatorSpec:
    fields = {
        "task_id": task_id,
        "hidden_files": {"test_calc.py": CALC_TESTS.encode()},
        "weights": {"test_calc.py::test_add": 1.0, "test_calc.py::test_mul": 1.0, "test_calc.py::test_div": 2.0},
        "limits": Limits(wall_s=30, cpu_s=30),
    }
    fields.update(overrides)
    return TaskEvaluatorSpec(**fields)


def dedent_bytes(source: str) -> bytes:
    return textwrap.dedent(source).encode()
