"""The pure core: specs, result parsing, weighted scores, the combination policy, judge replies."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from libs.common.events import RolloutFinished, RolloutScored, RolloutScoringFailed, RolloutTimedOut
from services.evaluator.core.judge import JudgeReplyError, parse_judge_score
from services.evaluator.core.results import ObservedTest, TestReport, parse_junit, parse_outcome_lines
from services.evaluator.core.scoring import (
    Combined,
    SandboxRun,
    combine,
    declared_tests,
    failed_event,
    score_tests,
    scored_event,
)
from services.evaluator.core.spec import CombinePolicy, TaskEvaluatorSpec

RUN = SandboxRun(exit_code=1, killed_by=None, output_tail="", output_truncated=False, isolation="test", duration_s=1.0)


def spec(**kw) -> TaskEvaluatorSpec:
    return TaskEvaluatorSpec(task_id="t", hidden_files={"test_a.py": b""}, **kw)


def test_spec_rejects_escaping_paths_and_incoherent_policies():
    with pytest.raises(ValidationError):
        TaskEvaluatorSpec(task_id="t", hidden_files={"../evil.py": b""})
    with pytest.raises(ValidationError):
        TaskEvaluatorSpec(task_id="t", hidden_files={"/abs.py": b""})
    with pytest.raises(ValidationError, match="rubric"):
        spec(combine=CombinePolicy(mode="judge"))
    with pytest.raises(ValidationError, match="junit_path"):
        spec(command=["make", "test"])
    with pytest.raises(ValidationError):
        CombinePolicy(mode="weighted", tests_weight=0, judge_weight=0)


def test_weighted_fraction_counts_missing_running_and_skipped_tests():
    s = spec(weights={"test_a.py::one": 2.0, "test_a.py::two": 1.0, "test_a.py::gone": 1.0})
    report = TestReport(
        tests=(ObservedTest("test_a.py::one", "passed"), ObservedTest("test_a.py::two", "skipped"),
               ObservedTest("test_a.py::extra", "passed")),
        running="test_a.py::hang",
    )
    v = score_tests(s, report, RUN)
    by_name = {o.name: (o.outcome, o.weight) for o in v.outcomes}
    assert by_name == {
        "test_a.py::one": ("passed", 2.0), "test_a.py::two": ("skipped", 1.0), "test_a.py::extra": ("passed", 1.0),
        "test_a.py::hang": ("error", 1.0), "test_a.py::gone": ("missing", 1.0),
    }
    assert v.score == pytest.approx(3.0 / 6.0)


def test_collection_error_scores_zero_with_the_reason():
    report = TestReport(collection_errors=(("test_a.py", "SyntaxError: invalid syntax"),), finished=True)
    v = score_tests(spec(), report, RUN)
    assert v.score == 0.0
    assert v.reason.startswith("score 0.000, collection error: test_a.py: SyntaxError")
    # Tests the spec names inside the broken file are "missing", not one lump error.
    named = score_tests(spec(weights={"test_a.py::x": 1, "test_a.py::y": 1}), report, RUN)
    assert sorted(o.outcome for o in named.outcomes) == ["missing", "missing"]


def test_an_uncollectable_file_counts_each_test_it_defines():
    source = b"""
import pytest
from b import g

def test_one(): pass

@pytest.mark.parametrize("x", [1, 2, 3])
@pytest.mark.parametrize("y", (1, 2))
async def test_grid(x, y): pass

@pytest.mark.parametrize("x", CASES)
def test_opaque(x): pass

def helper(): pass

class TestThing:
    def test_inside(self): pass
    def other(self): pass

class Helper:
    def test_not_collected(self): pass
"""
    assert declared_tests(source) == [("test_one", 1), ("test_grid", 6), ("test_opaque", 1),
                                      ("TestThing::test_inside", 1)]
    assert declared_tests(b"def broken(:") == [] and declared_tests(None) == []
    s = TaskEvaluatorSpec(task_id="t", hidden_files={"test_b.py": source}, weights={"test_b.py::test_one": 3.0})
    report = TestReport(collection_errors=(("test_b.py", "ModuleNotFoundError: No module named 'b'"),), finished=True)
    by_name = {o.name: (o.outcome, o.weight) for o in score_tests(s, report, RUN).outcomes}
    assert by_name == {"test_b.py::test_one": ("missing", 3.0), "test_b.py::test_grid": ("error", 6.0),
                       "test_b.py::test_opaque": ("error", 1.0), "test_b.py::TestThing::test_inside": ("error", 1.0)}


def test_no_results_at_all_says_so():
    v = score_tests(spec(), TestReport(), SandboxRun(4, None, "ERROR: usage\n", False, "x", 0.1))
    assert v.score == 0.0 and "no test results (exit status 4)" in v.reason


def test_outcome_lines_survive_garbage_and_a_killed_run():
    text = "\n".join([
        '{"e": "session"}', '{"e": "item", "id": "a::one"}', '{"e": "item", "id": "a::two"}',
        '{"e": "item", "id": "a::hang"}', '{"e": "collected", "n": 3}',
        '{"e": "start", "id": "a::one"}', '{"e": "test", "id": "a::one", "outcome": "passed", "msg": ""}',
        "not json", '{"e": "test", "id": "a::two", "outcome": "bogus"}', '{"e": "start", "id": "a::hang"}',
    ])
    r = parse_outcome_lines(text)
    assert [t.name for t in r.tests] == ["a::one"]
    assert r.running == "a::hang" and not r.finished and r.notes and not r.tampering
    assert r.started and r.collected == ("a::one", "a::two", "a::hang")


def test_junit_parsing():
    xml = """<testsuites><testsuite name="s">
      <testcase classname="m.T" name="ok"/>
      <testcase classname="m.T" name="bad"><failure message="boom"/></testcase>
      <testcase classname="m.T" name="err"><error message="oops"/></testcase>
      <testcase classname="m.T" name="skip"><skipped/></testcase>
    </testsuite></testsuites>"""
    r = parse_junit(xml)
    assert [(t.name, t.outcome) for t in r.tests] == [
        ("m.T::ok", "passed"), ("m.T::bad", "failed"), ("m.T::err", "error"), ("m.T::skip", "skipped")]
    with pytest.raises(ValueError):
        parse_junit("<testsuite><testcase")


@pytest.mark.parametrize("text,expected", [
    ('{"score": 0.7, "reason": "fine"}', 0.7),
    ('```json\n{"score": "0.3"}\n```', 0.3),
    ("Reasoning first... Score: 0.2 at first, but final score: 7/10", 0.7),
    ("85%", 0.85),
    ("0.5", 0.5),
    ('{"Score": 1}', 1.0),
])
def test_judge_replies_that_parse(text, expected):
    assert parse_judge_score(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["", "banana", "Score: 8", "Score: -0.1", '{"score": NaN}', '{"score": true}',
                                  '{"score": null}', "0.5/0"])
def test_judge_replies_that_do_not(text):
    with pytest.raises(JudgeReplyError):
        parse_judge_score(text)


def _verdict(score):
    return score_tests(spec(), TestReport(tests=(ObservedTest("t", "passed" if score else "failed"),)), RUN)


def test_combination_policies():
    tests = _verdict(1.0)
    assert combine(CombinePolicy(), tests, None, None).score == 1.0
    judge_only = combine(CombinePolicy(mode="judge"), tests, 0.4, None)
    assert judge_only.score == 0.4 and judge_only.components == {"tests": 1.0, "judge": 0.4}
    weighted = combine(CombinePolicy(mode="weighted", tests_weight=3, judge_weight=1), tests, 0.2, None)
    assert weighted.score == pytest.approx(0.8)
    # A judge that failed: tests only, or a failure, as the policy says.
    fallback = combine(CombinePolicy(mode="weighted", judge_weight=1), tests, None, "timed out")
    assert isinstance(fallback, Combined) and fallback.score == 1.0 and "judge failed: timed out" in fallback.reason
    strict = CombinePolicy(mode="weighted", judge_weight=1, on_judge_error="fail")
    assert combine(strict, tests, None, "x") == "judge failed: x"
    assert isinstance(combine(CombinePolicy(mode="judge"), None, None, "x"), str)


def test_events_carry_partial_flag_and_a_deterministic_id():
    timed_out = RolloutTimedOut(run_id="r", rollout_id="ro", wall_time_s=5)
    finished = RolloutFinished(run_id="r", rollout_id="ro", wall_time_s=5)
    ev = scored_event(timed_out, Combined(0.5, {"tests": 0.5}, "why"), (), "iso")
    assert isinstance(ev, RolloutScored) and ev.partial and ev.isolation == "iso"
    assert ev.event_id == scored_event(timed_out, Combined(0.1, {}, ""), (), "iso").event_id
    assert ev.causation_id == timed_out.event_id
    fail = failed_event(finished, "unknown task 'x'")
    assert isinstance(fail, RolloutScoringFailed) and not fail.partial and fail.reason == "unknown task 'x'"


def test_long_test_ids_stay_distinct():
    """Two honest parametrized ids that share their first 500 characters are two tests,
    not one "started again" (which reads as tampering and scores 0)."""
    import json

    a, b = "t.py::test_x[" + "a" * 600 + "1]", "t.py::test_x[" + "a" * 600 + "2]"
    lines = [{"e": "session"}, {"e": "item", "id": a}, {"e": "item", "id": b}, {"e": "collected", "n": 2},
             {"e": "start", "id": a}, {"e": "test", "id": a, "outcome": "passed"},
             {"e": "start", "id": b}, {"e": "test", "id": b, "outcome": "failed"}, {"e": "finish", "status": 1}]
    report = parse_outcome_lines("\n".join(json.dumps(x) for x in lines))
    assert not report.tampering
    names = [t.name for t in report.tests]
    assert len(set(names)) == 2 and all(len(n) < 500 and n.startswith("t.py::test_x[aaa") for n in names)
    assert score_tests(spec(), report, RUN).score == 0.5


def test_junit_over_the_cap_keeps_the_test_cases_read_and_says_so(tmp_path):
    from services.evaluator.service import Evaluator
    from services.evaluator.settings import EvaluatorSettings

    cases = "".join(f'<testcase classname="t" name="test_{i}"><system-out>{"x" * 200}</system-out></testcase>'
                    for i in range(100))
    (tmp_path / "report.xml").write_text(f"<testsuite>{cases}</testsuite>")
    junit = TaskEvaluatorSpec(task_id="j", command=["true"], junit_path="report.xml",
                              weights={"t::test_99": 1.0})
    owner = type("Owner", (), {"settings": EvaluatorSettings(max_result_bytes=4096)})()
    report = Evaluator._read_report(owner, junit, tmp_path)
    read = len(report.tests)
    assert 0 < read < 100 and all(t.outcome == "passed" for t in report.tests)
    v = score_tests(junit, report, RUN)
    assert v.score == read / (read + 1)  # the named test past the cap is missing
    assert f"over the evaluator's max_result_bytes (4096): only its first {read} test case(s) were read" in v.reason
    whole = Evaluator._read_report(type("Owner", (), {"settings": EvaluatorSettings()})(), junit, tmp_path)
    assert len(whole.tests) == 100 and not whole.notes
