"""Scenario results shared by a module: each scenario is one subprocess in a private network
namespace (see ``_netns.py``), and each test asserts one finding of it."""

from __future__ import annotations

import functools

import pytest

from tests.transfer._netns import run_scenario


@functools.cache
def library_missing(backend: str) -> str | None:
    """Why ``backend`` cannot run here (its import or start-up error), or None."""
    import subprocess
    import sys

    code = {"mooncake": "from mooncake.engine import TransferEngine; TransferEngine()",
            "ucx": "from libs.common.transfer.ucx import import_ucx; import_ucx()"}[backend]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    return None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["failed"])[-1]


def scenario(name: str, backend: str, **kwargs) -> dict:
    missing = library_missing(backend)
    if missing:
        pytest.skip(f"{backend} cannot run here: {missing}")
    return _cached(name, backend, tuple(sorted(kwargs.items())))


@functools.cache
def _cached(name: str, backend: str, kwargs: tuple) -> dict:
    return run_scenario(name, timeout_s=240, backend=backend, **dict(kwargs))


@pytest.fixture(params=["mooncake", "ucx"])
def backend(request) -> str:
    return request.param
