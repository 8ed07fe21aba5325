"""Scoring, pure: a test report and a judge's answer in, the rollout's score event out.

Score of the tests = (sum of the weights of passed tests) / (sum of all weights), where
"all" is every test seen, every test collected or named by the spec that the run never
reported (``missing``), the test that was running when the run was stopped (``error``),
and each file that could not be collected or was skipped while collecting (each test
function the hidden file defines is then an ``error``, weighted by its literal
``parametrize`` cases, so leaving a module unwritten never scores above writing it
badly; tests the spec names in it are ``missing``; a file with no test function found
counts as one ``error``). Skipped tests count as not passed: agent code could skip them.
Results the agent's code tampered with score 0 (``TestsVerdict.tampered``).
"""

from __future__ import annotations

import ast
import json
import math
from collections import Counter
from dataclasses import dataclass

from libs.common.events import RolloutFinished, RolloutScored, RolloutScoringFailed, RolloutTimedOut, TestOutcome

from .results import TestReport
from .spec import CombinePolicy, TaskEvaluatorSpec

RolloutEnded = RolloutFinished | RolloutTimedOut


@dataclass(frozen=True)
class SandboxRun:
    """How one sandboxed run went (the seam between the sandbox adapter and the core)."""

    exit_code: int | None
    killed_by: str | None  # e.g. "wall-clock limit (60s)"; None when it ended by itself
    output_tail: str
    output_truncated: bool
    isolation: str
    duration_s: float
    results: bytes = b""  # what the test process wrote to its results pipe (capped), if it had one
    results_truncated: bool = False


@dataclass(frozen=True)
class TestsVerdict:
    __test__ = False
    score: float
    outcomes: tuple[TestOutcome, ...]
    reason: str
    tampered: bool = False  # the results were forged: the whole rollout scores 0


@dataclass(frozen=True)
class Combined:
    score: float
    components: dict[str, float]
    reason: str


def weight_of(spec: TaskEvaluatorSpec, name: str) -> float:
    return spec.weights.get(name, spec.default_weight)


def score_tests(spec: TaskEvaluatorSpec, report: TestReport, run: SandboxRun) -> TestsVerdict:
    outcomes = [TestOutcome(name=t.name, outcome=t.outcome, weight=weight_of(spec, t.name)) for t in report.tests]
    seen = {t.name for t in report.tests}
    if report.running and report.running not in seen:
        outcomes.append(TestOutcome(name=report.running, outcome="error", weight=weight_of(spec, report.running)))
        seen.add(report.running)
    # Collected but never reported (the run ended or was stopped first): not passed, so a
    # test that ends the process cannot make the tests after it vanish from the total.
    for name in report.collected or ():
        if name not in seen:
            outcomes.append(TestOutcome(name=name, outcome="missing", weight=weight_of(spec, name)))
            seen.add(name)
    for name, w in spec.weights.items():
        if name not in seen:
            outcomes.append(TestOutcome(name=name, outcome="missing", weight=w))
            seen.add(name)
    for node, _msg in report.collection_errors:
        named_inside = any(k.startswith(node + "::") for k in spec.weights)
        defined = declared_tests(spec.hidden_files.get(node))
        for name, cases in defined:
            full = f"{node}::{name}"
            if full in seen or any(k == full or k.startswith(full + "[") or k.startswith(full + "::")
                                   for k in spec.weights):
                continue  # reported, or named by the spec (then already missing above)
            outcomes.append(TestOutcome(name=full, outcome="error", weight=spec.default_weight * cases,
                                        message=f"{node} was not collected" + (f" ({cases} cases)" if cases > 1 else "")))
            seen.add(full)
        if not defined and node not in seen and not named_inside:
            outcomes.append(TestOutcome(name=node, outcome="error", weight=spec.default_weight))
            seen.add(node)
    if report.tampering:
        # Only code in the test process (the agent's) writes such records: nothing it
        # reported counts, and the rollout scores 0 (service: no judge, no plugins).
        outcomes = [o.model_copy(update={"outcome": "error", "message": "results tampered with"})
                    if o.outcome == "passed" else o for o in outcomes]
        extra = len(report.tampering) - 3
        why = "; ".join(report.tampering[:3]) + (f" (+{extra} more)" if extra > 0 else "")
        return TestsVerdict(0.0, tuple(outcomes), f"score 0.000, test results tampered with by code in the test "
                                                  f"process: {why}", tampered=True)
    total = sum(o.weight for o in outcomes)
    passed = sum(o.weight for o in outcomes if o.outcome == "passed")
    score = passed / total if total > 0 else 0.0
    return TestsVerdict(score, tuple(outcomes), _tests_reason(report, run, outcomes, score))


def declared_tests(source: bytes | None) -> list[tuple[str, int]]:
    """The test functions a hidden test file defines, read without running it: (pytest's
    name inside the file, number of cases) for each ``test*`` function at module level and
    in ``Test*`` classes; a function's cases are the product of its ``parametrize``
    decorators whose values are a literal list or tuple (1 otherwise). [] for no source or
    a file that does not parse."""
    if not source:
        return []
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    found: list[tuple[str, int]] = []

    def functions(body, prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                found.append((prefix + node.name, _cases(node)))
            elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                functions(node.body, f"{prefix}{node.name}::")

    functions(tree.body, "")
    return found


def _cases(func: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    cases = 1
    for deco in func.decorator_list:
        if (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute) and deco.func.attr == "parametrize"
                and len(deco.args) >= 2 and isinstance(deco.args[1], (ast.List, ast.Tuple))):
            cases *= max(1, len(deco.args[1].elts))
    return cases


def _tests_reason(report: TestReport, run: SandboxRun, outcomes: list[TestOutcome], score: float) -> str:
    parts: list[str] = []
    if report.collection_errors:
        node, msg = report.collection_errors[0]
        more = len(report.collection_errors) - 1
        parts.append(f"collection error: {node}: {msg}" + (f" (+{more} more)" if more else ""))
    n_passed = sum(1 for o in outcomes if o.outcome == "passed")
    if outcomes:
        parts.append(f"{n_passed}/{len(outcomes)} tests passed")
    elif not report.collection_errors:
        tail = run.output_tail.strip().splitlines()[-3:]
        parts.append(f"no test results (exit status {run.exit_code}): " + " | ".join(tail)[-300:])
    if run.killed_by:
        parts.append(f"stopped by the {run.killed_by}" + (f" during {report.running}" if report.running else ""))
    if run.output_truncated:
        parts.append("output over the cap was dropped")
    parts.extend(report.notes)
    return f"score {score:.3f}, " + "; ".join(parts)


def combine(
    policy: CombinePolicy, tests: TestsVerdict | None, judge: float | None, judge_error: str | None
) -> Combined | str:
    """The rollout's score from its parts, or the reason it cannot be scored."""
    components: dict[str, float] = {}
    if tests is not None:
        components["tests"] = tests.score
    if judge is not None:
        components["judge"] = judge
    reasons = [tests.reason] if tests is not None else []
    if policy.mode == "tests":
        assert tests is not None, "tests policy without a test verdict"
        return Combined(tests.score, components, "; ".join(reasons))
    if judge is None:
        why = f"judge failed: {judge_error or 'no answer'}"
        if policy.mode == "judge" or policy.on_judge_error == "fail" or tests is None:
            return why
        return Combined(tests.score, components, "; ".join([*reasons, why + " (tests only)"]))
    if policy.mode == "judge":
        return Combined(judge, components, "; ".join([*reasons, f"judge {judge:.3f}"]))
    wt, wj = policy.tests_weight, policy.judge_weight
    tests_score = tests.score if tests is not None else 0.0
    score = (wt * tests_score + wj * judge) / (wt + wj)
    return Combined(_clamp(score), components, "; ".join([*reasons, f"judge {judge:.3f}"]))


def with_plugin_scores(result: Combined, plugins: dict[str, tuple[float, float]]) -> Combined:
    """``result`` with scorer-plugin components: ``plugins`` maps name -> (score, weight);
    the score becomes (base + sum weight * plugin score) / (1 + sum weight), so weight 0
    records a component without moving the reward. Components are named ``plugin:<name>``."""
    if not plugins:
        return result
    total = 1.0 + sum(w for _, w in plugins.values())
    score = (result.score + sum(s * w for s, w in plugins.values())) / total
    components = {**result.components, **{f"plugin:{n}": s for n, (s, _) in plugins.items()}}
    extra = ", ".join(f"{n} {s:.3f} (weight {w:g})" for n, (s, w) in plugins.items())
    return Combined(_clamp(score), components, f"{result.reason}; plugins: {extra}" if result.reason else extra)


def _clamp(x: float) -> float:
    if math.isnan(x):
        return 0.0
    return min(1.0, max(0.0, x))


# How much of a score event the per-test list may take (NATS refuses messages over 1 MB).
INLINE_TESTS_BYTES = 256_000
INLINE_TESTS_MAX = 2_000


def fits_inline(outcomes: tuple[TestOutcome, ...] | list[TestOutcome]) -> bool:
    """Whether the whole per-test list goes in the score event."""
    if len(outcomes) > INLINE_TESTS_MAX:
        return False
    return sum(_json_bytes(o) for o in outcomes) <= INLINE_TESTS_BYTES


def inline_tests(outcomes: tuple[TestOutcome, ...] | list[TestOutcome]) -> list[TestOutcome]:
    """The per-test list the score event carries: all of it when it fits, else the tests
    that did not pass (in order) up to the caps; passed ones are then only counted."""
    if fits_inline(outcomes):
        return list(outcomes)
    kept: list[TestOutcome] = []
    size = 0
    for o in outcomes:
        if o.outcome == "passed":
            continue
        n = _json_bytes(o)
        if size + n > INLINE_TESTS_BYTES:
            continue  # a very long name; shorter ones may still fit
        kept.append(o)
        size += n
        if len(kept) >= INLINE_TESTS_MAX:
            break
    return kept


def _json_bytes(o: TestOutcome) -> int:
    """An outcome's size in the event's JSON (the fixed part rounded up)."""
    return len(json.dumps(o.name)) + len(json.dumps(o.message)) + 64


def outcome_event_id(ended: RolloutEnded) -> str:
    """One id per ended rollout, so a redelivered evaluation is de-duplicated by the bus."""
    return f"eval-{ended.event_id}"[:128]


def scored_event(
    ended: RolloutEnded, result: Combined, outcomes: tuple[TestOutcome, ...], isolation: str, *,
    tests_digest: str | None = None,
) -> RolloutScored:
    """The score event; ``outcomes`` is the whole per-test list (capped here, see
    ``inline_tests``) and ``tests_digest`` where the whole list was stored, if it was."""
    tests = inline_tests(outcomes)
    truncated = len(tests) < len(outcomes)
    fields = ended.caused(
        event_id=outcome_event_id(ended),
        rollout_id=ended.rollout_id,
        score=_clamp(result.score),
        components={k: _clamp(v) for k, v in result.components.items()},
        tests=tests,
        partial=isinstance(ended, RolloutTimedOut),
        isolation=isolation,
        test_counts=dict(Counter(o.outcome for o in outcomes)),
        tests_truncated=truncated,
        tests_digest=tests_digest if truncated else None,
    )
    if "reason" in RolloutScored.model_fields:  # field requested from the catalogue owner
        fields["reason"] = result.reason
    return RolloutScored(**fields)


def zero_event(ended: RolloutEnded, reason: str, *, outcomes: tuple[TestOutcome, ...] = (),
               isolation: str = "none (no tests run)", tests_digest: str | None = None) -> RolloutScored:
    """A score of 0 for what the agent did to its own rollout (results tampered with, a
    workspace over the limits): scored, so its group still learns from it, never a
    failure that would drop it. No judge or scorer plugin adds to it."""
    components = {"tests": 0.0} if outcomes else {}
    return scored_event(ended, Combined(0.0, components, reason), outcomes, isolation, tests_digest=tests_digest)


def failed_event(ended: RolloutEnded, reason: str) -> RolloutScoringFailed:
    return RolloutScoringFailed(
        **ended.caused(
            event_id=outcome_event_id(ended),
            rollout_id=ended.rollout_id,
            reason=(reason or "unknown failure")[:2000],
            partial=isinstance(ended, RolloutTimedOut),
        )
    )
