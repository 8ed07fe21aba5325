"""What a test run reported, parsed from the sandbox's result files. Pure: text in, data out.

Two formats: the JSON lines of Gyre's pytest plugin (``adapters/pytest_outcomes.py``,
streamed, so a killed run still tells which tests finished) and JUnit XML (any other
test command). Both come from code the agent could have touched, so parsing never
trusts them: bad lines are skipped, sizes are capped by the caller.
"""

from __future__ import annotations

import hashlib
import json
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Literal

Outcome = Literal["passed", "failed", "error", "skipped", "missing"]
_OUTCOMES = {"passed", "failed", "error", "skipped"}
_KINDS = {"session", "item", "collect_error", "collected", "start", "test", "finish"}


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
    started: bool = True  # the test session began (Gyre's plugin wrote its ``session`` line)
    collected: tuple[str, ...] | None = None  # every test collected, once collection finished
    tampering: tuple[str, ...] = ()  # what in the results only the agent's code could have written


def parse_outcome_lines(text: str) -> TestReport:
    """The plugin's lines as a report. The first record of a test is the one kept; since the
    agent's code runs in the process that writes them, a record no honest run writes (a
    test reported twice, a test nobody started or collected, a record before the session
    or after ``finish``) is listed in ``tampering``."""
    tests: dict[str, ObservedTest] = {}
    errors: list[tuple[str, str]] = []
    items: list[str] = []
    item_set: set[str] = set()
    item_records = 0
    tampering: list[str] = []
    started: str | None = None
    collected: tuple[str, ...] | None = None
    session = finished = False
    status, bad = None, 0

    def tamper(what: str) -> None:
        if len(tampering) < 20:
            tampering.append(what[:300])

    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if not isinstance(rec, dict):
            bad += 1
            continue
        kind, node = rec.get("e"), short_id(str(rec.get("id", "")))
        if kind not in _KINDS or (kind == "test" and rec.get("outcome") not in _OUTCOMES):
            bad += 1
            continue
        if finished:
            tamper(f"a {kind!r} record after the session's end")
            continue
        if not session and kind != "session":
            tamper(f"a {kind!r} record before the session started")
            continue
        if kind == "session":
            if session:
                tamper("the session started twice")
            session = True
        elif kind in ("item", "collect_error", "collected") and collected is not None:
            tamper(f"a {kind!r} record after collection finished")
        elif kind == "item":
            item_records += 1
            if node not in item_set:
                item_set.add(node)
                items.append(node)
        elif kind == "collect_error":
            errors.append((node, str(rec.get("msg", ""))[:500]))
        elif kind == "collected":
            collected = tuple(items)
            if rec.get("n") != item_records:
                tamper(f"collection counted {rec.get('n')!r} tests but named {item_records}")
        elif kind in ("start", "test") and collected is None:
            tamper(f"{node} {'started' if kind == 'start' else 'reported'} before collection finished")
        elif kind in ("start", "test") and node not in item_set:
            tamper(f"{node} {'started' if kind == 'start' else 'reported'} but never collected")
        elif kind in ("start", "test") and node in tests:
            tamper(f"{node} {'started again' if kind == 'start' else 'reported twice'}")
        elif kind == "start":
            started = node
        elif kind == "test":
            if started != node:
                tamper(f"{node} reported while {started or 'no test'} was running")
                continue
            tests[node] = ObservedTest(node, rec["outcome"], str(rec.get("msg", ""))[:500])
            started = None
        elif kind == "finish":
            finished = True
            status = rec.get("status") if isinstance(rec.get("status"), int) else None
    notes = (f"{bad} unreadable result line(s)",) if bad else ()
    return TestReport(tuple(tests.values()), tuple(errors), finished, status, started, notes,
                      started=session, collected=collected, tampering=tuple(tampering))


def short_id(node: str, limit: int = 500) -> str:
    """A test id kept to ``limit`` characters that stays unique: a longer one keeps its
    start and ends in a digest of the whole id (two parametrized ids that share their first
    ``limit`` characters stay two tests, not one "started again")."""
    if len(node) <= limit:
        return node
    return f"{node[:limit - 20]}...{hashlib.sha256(node.encode('utf-8', 'surrogatepass')).hexdigest()[:16]}"


def parse_junit(xml_text: str, *, partial: bool = False) -> TestReport:
    """JUnit XML (``<testsuite>`` or ``<testsuites>``) as a report; raises ValueError if
    unreadable. ``partial``: the text is the start of a longer file; the test cases complete
    before it ends are read, and nothing raises."""
    parser = ET.XMLPullParser(events=("end",))
    cases: list[ET.Element] = []
    try:
        parser.feed(xml_text)
        if not partial:
            parser.close()
        cases.extend(el for _event, el in parser.read_events() if el.tag == "testcase")
    except ET.ParseError as exc:
        if not partial:
            raise ValueError(f"unreadable JUnit XML: {exc}") from exc
        cases.extend(el for _event, el in parser.read_events() if el.tag == "testcase")
    tests: dict[str, ObservedTest] = {}
    for case in cases:
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
