"""Scenario results shared by the tests: each scenario is one subprocess in a private
network namespace (see ``_netns.py``), and each test asserts one finding of it.

Test modules list the scenarios they read in ``SCENARIOS``; once collection is done the
selected modules' scenarios start, a few at a time, so their waits (timeouts, start-up)
overlap, and each test then waits only for its own.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from tests.transfer._netns import run_scenario

_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="scenario")
_started: dict[str, Future] = {}


@functools.cache
def library_missing(backend: str) -> str | None:
    """Why ``backend`` cannot run here (its import or start-up error), or None."""
    code = {"mooncake": "from mooncake.engine import TransferEngine; TransferEngine()",
            "ucx": "from libs.common.transfer.ucx import import_ucx; import_ucx()"}[backend]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    return None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["failed"])[-1]


def _key(name: str, backend: str, kwargs: dict) -> str:
    return json.dumps([name, backend, sorted(kwargs.items())])


def _start(name: str, backend: str, **kwargs) -> None:
    key = _key(name, backend, kwargs)
    if key not in _started and not library_missing(backend):
        _started[key] = _pool.submit(run_scenario, name, timeout_s=300, backend=backend, **kwargs)


def scenario(name: str, backend: str, **kwargs) -> dict:
    missing = library_missing(backend)
    if missing:
        pytest.skip(f"{backend} cannot run here: {missing}")
    _start(name, backend, **kwargs)
    return _started[_key(name, backend, kwargs)].result()


def pytest_collection_modifyitems(items) -> None:
    modules = {item.module for item in items if item.module.__name__.startswith("tests.transfer.")}
    for module in sorted(modules, key=lambda m: m.__name__):
        for name, backend in getattr(module, "SCENARIOS", ()):
            _start(name, backend)


@pytest.fixture(params=["mooncake", "ucx"])
def backend(request) -> str:
    return request.param
