"""What a test run reported, parsed from the sandbox's result files. Pure: text in, data out.

Two formats: the JSON lines of Gyre's pytest plugin (``adapters/pytest_outcomes.py``,
streamed, so a killed run still tells which tests finished) and JUnit XML (any other
test command). Both come from code the agent could have touched, so parsing never
trusts them: bad lines are skipped, sizes are capped by the caller.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Literal

Outcome = Literal["passed", "failed", "error", "skipped", "missing"]
_OUTCOMES = {"passed", "failed", "error", "skipped"}


@dataclass(frozen=True)
class ObservedTest:
    __test__ = False
    name: str
    outcome: Outcome
    message: str = ""


@dataclass(frozen=True)
class TestReport:
    """Tests seen in one run, in the order they finished."""

    __test__ = False
    tests: tuple[ObservedTest, ...] = ()
    collection_errors: tuple[tuple[str, str], ...] = ()  # (node, message)
    finished: bool = False  # the runner reached its end (not killed mid-way)
    exit_status: int | None = None
    running: str | None = None  # the test in progress when the run stopped, if any
    notes: tuple[str, ...] = field(default=())


def parse_outcome_lines(text: str) -> TestReport:
    tests: dict[str, ObservedTest] = {}
    errors: list[tuple[str, str]] = []
    started: str | None = None
    finished, status, bad = False, None, 0
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if not isinstance(rec, dict):
            bad += 1
            continue
        kind, node = rec.get("e"), str(rec.get("id", ""))[:500]
        if kind == "start":
            started = node
        elif kind == "test" and rec.get("outcome") in _OUTCOMES:
            tests[node] = ObservedTest(node, rec["outcome"], str(rec.get("msg", ""))[:500])
            if started == node:
                started = None
        elif kind == "collect_error":
            errors.append((node, str(rec.get("msg", ""))[:500]))
        elif kind == "finish":
            finished = True
            status = rec.get("status") if isinstance(rec.get("status"), int) else None
        else:
            bad += 1
    notes = (f"{bad} unreadable result line(s)",) if bad else ()
    return TestReport(tuple(tests.values()), tuple(errors), finished, status, started, notes)


def parse_junit(xml_text: str) -> TestReport:
    """JUnit XML (``<testsuite>`` or ``<testsuites>``) as a report; raises ValueError if unreadable."""
    try:
        root = ET.fromstring(xml_text)
    except ET.ParseError as exc:
        raise ValueError(f"unreadable JUnit XML: {exc}") from exc
    tests: dict[str, ObservedTest] = {}
    for case in root.iter("testcase"):
        cls, name = case.get("classname", ""), case.get("name", "")
        node = f"{cls}::{name}" if cls else name
        outcome: Outcome = "passed"
        message = ""
        for child in case:
            tag = {"failure": "failed", "error": "error", "skipped": "skipped"}.get(child.tag)
            if tag:
                outcome = tag  # type: ignore[assignment]
                message = (child.get("message") or child.text or "")[:500]
                break
        tests[node] = ObservedTest(node, outcome, message)
    return TestReport(tuple(tests.values()), (), finished=True)
