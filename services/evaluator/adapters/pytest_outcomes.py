"""A pytest plugin that streams each test's outcome as one JSON line, as it happens.

It runs *inside* the sandbox (copied next to the hidden tests and loaded with
``-p gyre_outcomes``), so it imports nothing from Gyre. Streaming, unlike JUnit XML
written at the end, keeps the outcomes of the tests that finished when a later test hangs
or the run is killed; the ``start`` line names the test that was running then.

With ``GYRE_PER_TEST_S`` set, each test's call phase has that many seconds (SIGALRM):
a test that hangs in Python code fails with ``TestTimeout`` and the run goes on.

Lines (file named by ``GYRE_OUTCOMES_PATH``)::

    {"e": "start", "id": "test_calc.py::test_add"}
    {"e": "test", "id": "test_calc.py::test_add", "outcome": "passed", "msg": ""}
    {"e": "collect_error", "id": "test_io.py", "msg": "ModuleNotFoundError: ..."}
    {"e": "finish", "status": 1}
"""

from __future__ import annotations

import json
import os
import signal

import pytest

_MSG_CHARS = 400
_PER_TEST_S = float(os.environ.get("GYRE_PER_TEST_S") or 0)
_state: dict[str, str] = {}
_msgs: dict[str, str] = {}
_out = None


def _write(record: dict) -> None:
    global _out
    if _out is None:
        path = os.environ.get("GYRE_OUTCOMES_PATH")
        if not path:
            return
        _out = open(path, "a", encoding="utf-8")  # noqa: SIM115  (kept open for the session)
    _out.write(json.dumps(record) + "\n")
    _out.flush()


def _short(report) -> str:
    text = getattr(report, "longreprtext", "") or str(getattr(report, "longrepr", "") or "")
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    # pytest marks the exception lines with "E"; the last of them say what went wrong.
    marked = [ln[1:].strip() for ln in lines if ln.startswith("E ") and ln[1:].strip(" ^~")]
    return " | ".join(marked[-2:] or lines[-3:])[-_MSG_CHARS:]


class TestTimeout(Exception):
    """A single test ran past its own time limit (the run goes on with the next test)."""

    __test__ = False


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
    if report.failed:
        _write({"e": "collect_error", "id": report.nodeid or "<session>", "msg": _short(report)})


def pytest_sessionfinish(session, exitstatus):
    _write({"e": "finish", "status": int(exitstatus)})
