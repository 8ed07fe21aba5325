"""A pytest plugin that streams each test's outcome as one JSON line, as it happens.

It runs *inside* the sandbox (copied next to the hidden tests, imported by the boot line
of ``workspace.pytest_argv`` before the workspace is on ``sys.path`` and registered with
``-p gyre_outcomes``), so it imports nothing from Gyre. Streaming, unlike JUnit XML
written at the end, keeps the outcomes of the tests that finished when a later test hangs
or the run is killed; the ``start`` line names the test that was running then.

The lines go to an inherited pipe (its descriptor number in ``GYRE_OUTCOMES_FD``), whose
other end the evaluator reads: no file a later process could rewrite, and nothing to find
in the workspace. At import the plugin takes the variable out of ``os.environ`` and makes
the descriptor non-inheritable, so what the tests start does not get it. The agent's code
runs in this process, though, and can still find and write to it: the evaluator's parser
(``core/results.py``) keeps the first record of each test and treats a test reported
twice, a record out of its place or anything after ``finish`` as tampering.

The workspace goes on ``sys.path`` once pytest has read its options, just before it loads
the hidden folder's ``conftest.py`` (which may import the agent's modules), after the
``session`` line: nothing of the agent's is imported before it, and the modules pytest
imports while it parses its arguments come from the standard library. Auto-loaded plugins
are off; the few third-party ones hidden tests may rely on (async tests) are named with
``-p`` by ``plugin_args`` when installed. Only this process writes (a test that forks
leaves the descriptor to its child unused).

With ``GYRE_PER_TEST_S`` set, each test's call phase has that many seconds (SIGALRM):
a test that hangs in Python code fails with ``TestTimeout`` and the run goes on.

Lines, in this order::

    {"e": "session"}                                   # pytest_sessionstart
    {"e": "collect_error", "id": "test_io.py", "msg": "ModuleNotFoundError: ..."}
    {"e": "item", "id": "test_calc.py::test_add"}      # one per collected test
    {"e": "collected", "n": 3}                         # pytest_collection_finish
    {"e": "start", "id": "test_calc.py::test_add"}
    {"e": "test", "id": "test_calc.py::test_add", "outcome": "passed", "msg": ""}
    {"e": "finish", "status": 1}
"""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest

_MSG_CHARS = 400
_PER_TEST_S = float(os.environ.get("GYRE_PER_TEST_S") or 0)
_state: dict[str, str] = {}
_msgs: dict[str, str] = {}
_workspace: str | None = None
_finished = False
_begun = False
# a forked child (a test's own fork) inherits the descriptor: only this process writes
_PID = os.getpid()
ALLOWED_PLUGINS = ("pytest_asyncio.plugin", "anyio.pytest_plugin")


def _take_channel() -> int | None:
    text = os.environ.pop("GYRE_OUTCOMES_FD", None)
    if not text:
        return None
    try:
        fd = int(text)
        os.set_inheritable(fd, False)
    except (ValueError, OSError):
        return None
    return fd


_fd = _take_channel()


def set_workspace(path: str) -> None:
    """The folder put first on ``sys.path`` once collection starts (called by the boot line)."""
    global _workspace
    _workspace = path


def _write(record: dict) -> None:
    if _fd is None or _finished or os.getpid() != _PID:
        return
    data = (json.dumps(record) + "\n").encode()
    try:
        while data:
            data = data[os.write(_fd, data):]
    except OSError:
        pass  # the evaluator sees the record missing


def _short(report) -> str:
    text = getattr(report, "longreprtext", "") or str(getattr(report, "longrepr", "") or "")
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    # pytest marks the exception lines with "E"; the last of them say what went wrong.
    marked = [ln[1:].strip() for ln in lines if ln.startswith("E ") and ln[1:].strip(" ^~")]
    return " | ".join(marked[-2:] or lines[-3:])[-_MSG_CHARS:]


class TestTimeout(Exception):
    """A single test ran past its own time limit (the run goes on with the next test)."""

    __test__ = False


def _begin() -> None:
    """The ``session`` line, then the workspace on ``sys.path`` (once)."""
    global _begun
    if _begun:
        return
    _begun = True
    _write({"e": "session"})
    if _workspace and _workspace not in sys.path:
        sys.path.insert(0, _workspace)


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    # before the hidden folder's conftest.py is loaded (it may import the agent's modules)
    _begin()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    _begin()


@pytest.hookimpl(tryfirst=True)
def pytest_collection(session):
    _begin()


def plugin_args() -> list[str]:
    """``-p`` options for the third-party plugins hidden tests may rely on (async tests),
    those importable here: auto-loading is off, so a workspace cannot bring its own.
    Called by the boot line before the workspace is on ``sys.path``."""
    import importlib

    args: list[str] = []
    for name in ALLOWED_PLUGINS:
        try:
            importlib.import_module(name)
        except Exception:  # not installed (or broken): tests that need it fail as they would
            continue
        args += ["-p", name]
    return args


def pytest_collection_finish(session):
    for item in session.items:
        _write({"e": "item", "id": item.nodeid})
    _write({"e": "collected", "n": len(session.items)})


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    if _PER_TEST_S <= 0:
        return (yield)

    def on_alarm(signum, frame):
        raise TestTimeout(f"test ran past its {_PER_TEST_S:g}s limit")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, _PER_TEST_S)
    try:
        return (yield)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def pytest_runtest_logstart(nodeid, location):
    _write({"e": "start", "id": nodeid})


def pytest_runtest_logreport(report):
    nodeid = report.nodeid
    if report.when == "setup":
        if report.failed:
            _state[nodeid], _msgs[nodeid] = "error", _short(report)
        elif report.skipped:
            _state[nodeid], _msgs[nodeid] = "skipped", _short(report)
    elif report.when == "call":
        if report.passed:
            _state[nodeid] = "passed"
        elif report.skipped:  # includes xfail
            _state[nodeid], _msgs[nodeid] = "skipped", _short(report)
        else:
            _state[nodeid], _msgs[nodeid] = "failed", _short(report)
    elif report.when == "teardown" and report.failed and _state.get(nodeid) == "passed":
        _state[nodeid], _msgs[nodeid] = "error", "teardown: " + _short(report)


def pytest_runtest_logfinish(nodeid, location):
    _write({"e": "test", "id": nodeid, "outcome": _state.get(nodeid, "error"), "msg": _msgs.get(nodeid, "")})


def pytest_collectreport(report):
    # a module skipped while it is collected (pytest.importorskip of a module the agent never
    # wrote, or agent code calling pytest.skip at import) would otherwise vanish from the total
    if report.failed or (report.skipped and report.nodeid):
        longrepr = getattr(report, "longrepr", None)
        msg = str(longrepr[2]) if report.skipped and isinstance(longrepr, tuple) and len(longrepr) == 3 \
            else _short(report)
        _write({"e": "collect_error", "id": report.nodeid or "<session>",
                "msg": msg if report.failed else "skipped while collecting: " + msg})


def pytest_sessionfinish(session, exitstatus):
    global _finished
    _write({"e": "finish", "status": int(exitstatus)})
    _finished = True
