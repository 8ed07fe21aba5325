"""Real pytest runs in the real sandbox on small generated workspaces, one rollout each."""

from __future__ import annotations

from libs.common.events import RolloutScored, RolloutScoringFailed
from services.evaluator.core.spec import Limits

from ._workspaces import CALC_BROKEN, CALC_OK, CALC_PARTIAL, calc_spec, dedent_bytes, tar_of


def outcomes(ev: RolloutScored) -> dict[str, str]:
    return {t.name: t.outcome for t in ev.tests}


async def test_all_pass(make_harness):
    h = await make_harness()
    ev = await h.score(calc_spec(), tar_of({"calc.py": CALC_OK}))
    assert isinstance(ev, RolloutScored), ev
    assert ev.score == 1.0 and not ev.partial
    assert outcomes(ev) == {f"test_calc.py::test_{n}": "passed" for n in ("add", "mul", "div")}
    assert ev.isolation == h.evaluator.sandbox.description and ev.isolation


async def test_some_pass_weighted_and_partial_flag_for_a_timed_out_rollout(make_harness):
    h = await make_harness()
    ev = await h.score(calc_spec(), tar_of({"calc.py": CALC_PARTIAL}), timed_out=True)
    assert isinstance(ev, RolloutScored), ev
    assert outcomes(ev) == {"test_calc.py::test_add": "passed", "test_calc.py::test_mul": "failed",
                            "test_calc.py::test_div": "failed"}
    assert ev.score == 0.25  # add (1) of add 1 + mul 1 + div 2
    assert ev.partial and ev.components == {"tests": 0.25}


async def test_none_pass_when_the_workspace_is_empty_of_code(make_harness):
    h = await make_harness()
    ev = await h.score(calc_spec(weights={}), tar_of({"notes.txt": "I ran out of time"}))
    assert isinstance(ev, RolloutScored) and ev.score == 0.0
    # the file could not be collected: each test it defines is an error
    assert outcomes(ev) == {f"test_calc.py::test_{n}": "error" for n in ("add", "mul", "div")}


async def test_collection_error_is_scored_zero_with_the_reason(make_harness):
    h = await make_harness()
    ev = await h.score(calc_spec(), tar_of({"calc.py": CALC_BROKEN}))
    assert isinstance(ev, RolloutScored) and ev.score == 0.0
    assert set(outcomes(ev).values()) == {"missing"}
    if "reason" in RolloutScored.model_fields:
        assert "collection error: test_calc.py" in ev.reason and "SyntaxError" in ev.reason


async def test_a_hanging_test_keeps_the_outcomes_before_it(make_harness):
    h = await make_harness()
    hidden = dedent_bytes("""
        import time
        from calc import add
        def test_a_first():
            assert add(1, 1) == 2
        def test_b_hangs():
            time.sleep(600)
        def test_c_never_reached():
            assert True
    """)
    spec = calc_spec("hang", hidden_files={"test_h.py": hidden}, limits=Limits(wall_s=4), weights={
        "test_h.py::test_a_first": 1, "test_h.py::test_b_hangs": 1, "test_h.py::test_c_never_reached": 2})
    ev = await h.score(spec, tar_of({"calc.py": CALC_OK}))
    assert isinstance(ev, RolloutScored), ev
    assert outcomes(ev) == {"test_h.py::test_a_first": "passed", "test_h.py::test_b_hangs": "error",
                            "test_h.py::test_c_never_reached": "missing"}
    assert ev.score == 0.25
    if "reason" in RolloutScored.model_fields:
        assert "wall-clock limit (4s) during test_h.py::test_b_hangs" in ev.reason


async def test_a_custom_command_with_junit_results(make_harness):
    h = await make_harness()
    runner = """
import sys
sys.path.insert(0, ".")
from calc import add, mul
cases = [("calc.add", add(2, 2) == 4), ("calc.mul", mul(2, 3) == 6)]
xml = "<testsuite>" + "".join(
    f'<testcase classname="{c}" name="t">' + ("" if ok else '<failure message="wrong"/>') + "</testcase>"
    for c, ok in cases) + "</testsuite>"
open("report.xml", "w").write(xml)
"""
    spec = calc_spec("junit", hidden_files={"run.py": runner.encode()}, weights={},
                     command=["{python}", "_gyre_hidden/run.py"], junit_path="report.xml")
    ev = await h.score(spec, tar_of({"calc.py": CALC_PARTIAL}))
    assert isinstance(ev, RolloutScored), ev
    assert outcomes(ev) == {"calc.add::t": "passed", "calc.mul::t": "failed"} and ev.score == 0.5


async def test_bad_input_is_a_reasoned_failure(make_harness):
    h = await make_harness()
    spec = calc_spec()
    cases = {
        "missing from the blob store": await h.rollout(spec, None, digest="a" * 64),
        "no workspace snapshot": await h.rollout(spec, None),
        "not a readable tar archive": await h.rollout(spec, b"garbage" * 100),
        "escapes the workspace": await h.rollout(spec, tar_of({"../../evil.py": "x"})),
        "unknown task 'nope'": await h.rollout("nope", tar_of({"calc.py": CALC_OK})),
        "unknown rollout": await h.rollout(spec, tar_of({"calc.py": CALC_OK}), started=False),
    }
    for why, ended in cases.items():
        ev = await h.evaluator.evaluate(ended)
        assert isinstance(ev, RolloutScoringFailed), (why, ev)
        assert why in ev.reason and ev.rollout_id == ended.rollout_id and ev.causation_id == ended.event_id
        assert "internal error" not in ev.reason
    assert not list(h.evaluator._scratch_area().path.glob("r-*")), "scratch folders are removed"


async def test_a_per_test_limit_fails_the_hung_test_and_goes_on(make_harness):
    h = await make_harness()
    hidden = dedent_bytes("""
        import time
        def test_a_hangs():
            time.sleep(600)
        def test_b_after():
            assert True
    """)
    spec = calc_spec("per-test", hidden_files={"test_p.py": hidden}, weights={},
                     limits=Limits(wall_s=30, per_test_s=1))
    ev = await h.score(spec, tar_of({"x.py": ""}))
    assert isinstance(ev, RolloutScored), ev
    assert outcomes(ev) == {"test_p.py::test_a_hangs": "failed", "test_p.py::test_b_after": "passed"}
    assert ev.score == 0.5


async def test_a_test_file_that_cannot_import_does_not_zero_the_others(make_harness):
    """One hidden file imports a module the agent never wrote: the other file still runs
    (pytest --continue-on-collection-errors), so the score is 0.5, not 0."""
    h = await make_harness()
    good = dedent_bytes("""
        from calc import add
        def test_add():
            assert add(2, 3) == 5
    """)
    bad = dedent_bytes("""
        from io_util import load
        def test_load():
            assert load() == 1
    """)
    spec = calc_spec("two-files", hidden_files={"test_a.py": good, "test_b.py": bad},
                     weights={"test_a.py::test_add": 1, "test_b.py::test_load": 1})
    ev = await h.score(spec, tar_of({"calc.py": CALC_OK}))
    assert isinstance(ev, RolloutScored), ev
    assert ev.score == 0.5
    assert outcomes(ev)["test_a.py::test_add"] == "passed"
    assert "collection error: test_b.py" in ev.reason


async def test_a_module_skipped_while_collecting_counts_its_tests_as_not_passed(make_harness):
    """pytest.importorskip of a module the agent never wrote, or agent code calling
    pytest.skip at import, must not make a hidden file's tests vanish from the total (half
    the work would score 1.0); and not writing a module never beats writing it badly."""
    h = await make_harness()
    a = dedent_bytes("""
        from calc import add
        def test_add():
            assert add(2, 3) == 5
    """)
    optional = dedent_bytes("""
        import pytest
        b = pytest.importorskip("b")
        def test_g1():
            assert b.g() == 2
        def test_g2():
            assert b.g() == 2
    """)
    spec = calc_spec("skips", hidden_files={"test_a.py": a, "test_b.py": optional}, weights={})
    ev = await h.score(spec, tar_of({"calc.py": CALC_OK}), timed_out=True)
    assert isinstance(ev, RolloutScored), ev
    assert outcomes(ev) == {"test_a.py::test_add": "passed", "test_b.py::test_g1": "error",
                            "test_b.py::test_g2": "error"}
    assert ev.score == 1 / 3 and "test_b.py: skipped while collecting" in ev.reason
    skipping = tar_of({"calc.py": CALC_OK, "b.py": "import pytest\npytest.skip('no', allow_module_level=True)\n"})
    ev = await h.score(spec, skipping)
    assert isinstance(ev, RolloutScored) and ev.score == 1 / 3, ev
    four = dedent_bytes("""
        from b import g
        import pytest
        def test_1(): assert g(1) == 1
        @pytest.mark.parametrize("x", [2, 3, 4])
        def test_more(x): assert g(x) == x * x
    """)
    spec = calc_spec("unwritten", hidden_files={"test_a.py": a, "test_b.py": four}, weights={})
    missing = await h.score(spec, tar_of({"calc.py": CALC_OK}), timed_out=True)
    wrong = await h.score(spec, tar_of({"calc.py": CALC_OK, "b.py": "def g(x):\n    return x\n"}))
    assert missing.score == 1 / 5 and wrong.score == 2 / 5, (missing.reason, wrong.reason)


async def test_a_command_the_host_lacks_never_ran_it_is_not_a_zero(make_harness):
    """In namespaces/uid mode the wrapper would start and exit 127: no JUnit XML, a 0 for
    the agent. The evaluator's host missing the program is the tests not running."""
    h = await make_harness()
    spec = calc_spec("npm", weights={}, command=["gyre-no-such-program", "test"], junit_path="r.xml")
    ev = await h.score(spec, tar_of({"calc.py": CALC_OK}))
    assert isinstance(ev, RolloutScoringFailed), ev
    assert "'gyre-no-such-program' is not installed on the evaluator's host" in ev.reason
