"""The core and the simulator stay pure: no NATS, HTTP, SQL or torch imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "services" / "scheduler"
FORBIDDEN = {"nats", "httpx", "fastapi", "starlette", "uvicorn", "sqlalchemy", "alembic", "psycopg", "torch",
             "asyncio", "requests", "socket"}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("path", sorted([*ROOT.glob("core/*.py"), *ROOT.glob("sim/*.py")]), ids=lambda p: p.name)
def test_no_io_imports(path: Path) -> None:
    assert not (_imports(path) & FORBIDDEN), f"{path.name} imports {_imports(path) & FORBIDDEN}"


def test_modules_stay_small() -> None:
    for path in [*ROOT.glob("core/*.py"), *ROOT.glob("sim/*.py")]:
        assert len(path.read_text().splitlines()) < 500, path.name


def test_worked_examples_in_docstrings_run() -> None:
    import doctest

    from services.scheduler.core import policy

    failures, tried = doctest.testmod(policy, verbose=False)
    assert tried > 0 and failures == 0
