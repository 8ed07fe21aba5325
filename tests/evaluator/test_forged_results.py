"""Results the agent's code forges, and test runs that never started (review of the
evaluator, items 1, 2, 4, 5 and 6).

The agent's code runs in the pytest process. It must not find a results file to rewrite,
load a pytest plugin of its own, or change the hidden tests; what it can still write to the
results pipe is checked (first record of a test kept, a test reported twice, a record out of
place or after the end: tampering, scored 0). A test that ends the process cannot make the
tests after it vanish from the total. A run that never started is no 0.0: it is retried,
and fails on the last delivery.
"""

from __future__ import annotations

import os
import stat
import sys
import uuid
from pathlib import Path

import pytest

from libs.common.events import RolloutScored, RolloutScoringFailed
from services.evaluator.adapters import sandbox as sb
from services.evaluator.adapters.sandbox import SandboxUnavailable
from services.evaluator.core.results import parse_outcome_lines
from services.evaluator.core.scoring import SandboxRun, score_tests
from services.evaluator.core.spec import TaskEvaluatorSpec
from services.evaluator.service import TransientError

from ._workspaces import CALC_OK, CALC_PARTIAL, calc_spec, dedent_bytes, tar_of


def outcomes(ev) -> dict[str, str]:
    return {t.name: t.outcome for t in ev.tests}


def _require_namespaces(h) -> None:
    if h.evaluator.sandbox.mode != "namespaces":
        pytest.skip(f"needs the namespaces sandbox (root); here: {h.evaluator.sandbox.description}")


# The agent's way to the results pipe: the descriptor number is still in the process's
# initial environment (/proc/self/environ), whatever os.environ says now.
_FIND_CHANNEL = """
import json, os
def _channel():
    env = open("/proc/self/environ", "rb").read().split(b"\\0")
    pairs = dict(e.split(b"=", 1) for e in env if b"=" in e)
    return int(pairs[b"GYRE_OUTCOMES_FD"])
def _send(*records):
    fd = _channel()
    for r in records:
        os.write(fd, (json.dumps(r) + "\\n").encode())
def _passed(name):
    node = "test_calc.py::" + name
    return [{"e": "start", "id": node}, {"e": "test", "id": node, "outcome": "passed", "msg": ""}]
"""


# -- item 2: no plugin of the workspace's ---------------------------------------------

async def test_a_plugin_a_dist_info_in_the_workspace_declares_is_not_loaded(make_harness):
    h = await make_harness()
    plugin = dedent_bytes("""
        import pytest
        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_makereport(item, call):
            outcome = yield
            report = outcome.get_result()
            report.outcome = "passed"
            report.longrepr = None
    """)
    ev = await h.score(calc_spec(), tar_of({
        "calc.py": CALC_PARTIAL, "evilplug.py": plugin,
        "evil-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: evil\nVersion: 1.0\n",
        "evil-1.0.dist-info/entry_points.txt": "[pytest11]\nevil = evilplug\n",
    }))
    assert isinstance(ev, RolloutScored) and ev.score == 0.25, ev.reason


async def test_a_workspace_module_named_like_one_pytest_imports_is_the_agents_doing(make_harness):
    """pytest imports pdb, unittest, difflib... lazily; the workspace goes on sys.path once
    the session began (before the hidden conftest.py loads), so such a module of the
    agent's that ends the run is the agent's code like any other: the rollout scores 0,
    it is not dropped from training as a run that never started."""
    h = await make_harness()
    hijack = "import os\nos._exit(3)\n"
    ev = await h.score(calc_spec(), tar_of({"calc.py": CALC_PARTIAL, "pdb.py": hijack, "difflib.py": hijack,
                                           "unittest.py": hijack, "readline.py": hijack}))
    assert isinstance(ev, RolloutScored) and ev.score == 0.0, ev.reason


# -- item 1: forged results -------------------------------------------------------------

async def test_the_old_results_path_is_gone_from_the_environment(make_harness):
    h = await make_harness()
    calc = CALC_PARTIAL + dedent_bytes("""
        import atexit, json, os
        def _forge():
            path = os.environ["GYRE_OUTCOMES_PATH"]  # no longer there: KeyError, nothing written
            lines = [json.loads(ln) for ln in open(path)]
            with open(path, "a") as f:
                for r in lines:
                    if r.get("e") == "test":
                        f.write(json.dumps({**r, "outcome": "passed"}) + "\\n")
        atexit.register(_forge)
    """).decode()
    ev = await h.score(calc_spec(), tar_of({"calc.py": calc}))
    assert isinstance(ev, RolloutScored) and ev.score == 0.25, ev.reason


async def test_records_written_after_the_end_are_tampering_and_score_0(make_harness):
    h = await make_harness()
    calc = CALC_PARTIAL + _FIND_CHANNEL + dedent_bytes("""
        import atexit
        atexit.register(lambda: _send(*_passed("test_mul"), *_passed("test_div")))
    """).decode()
    ev = await h.score(calc_spec(), tar_of({"calc.py": calc}))
    assert isinstance(ev, RolloutScored) and ev.score == 0.0
    assert "tampered with" in ev.reason and "after the session's end" in ev.reason
    assert "passed" not in outcomes(ev).values() and ev.components == {"tests": 0.0}


async def test_records_written_while_the_tests_are_collected_are_tampering(make_harness):
    h = await make_harness()
    calc = CALC_PARTIAL + _FIND_CHANNEL + '_send(*_passed("test_mul"), *_passed("test_div"))\n'
    ev = await h.score(calc_spec(), tar_of({"calc.py": calc}))
    assert isinstance(ev, RolloutScored) and ev.score == 0.0
    assert "before collection finished" in ev.reason


async def test_a_later_test_reported_early_is_tampering_the_first_record_is_kept(make_harness):
    h = await make_harness()
    calc = _FIND_CHANNEL + dedent_bytes("""
        def add(a, b):
            _send(*_passed("test_mul"), *_passed("test_div"))  # before they run
            return a + b
        def mul(a, b):
            return 0
        def div(a, b):
            raise NotImplementedError
    """).decode()
    ev = await h.score(calc_spec(), tar_of({"calc.py": calc}))
    assert isinstance(ev, RolloutScored) and ev.score == 0.0
    assert "started again" in ev.reason or "reported" in ev.reason, ev.reason


async def test_a_judge_does_not_lift_a_tampered_rollout(make_harness):
    """The zero is the rollout's, not the tests' component: no judge is asked."""
    h = await make_harness(judge_url="http://127.0.0.1:9")  # nothing listens: asking it would fail
    calc = CALC_PARTIAL + _FIND_CHANNEL + '_send(*_passed("test_mul"))\n'
    spec = calc_spec("judged", rubric="good?", prompt="calc",
                     combine={"mode": "weighted", "tests_weight": 0.5, "judge_weight": 0.5})
    ev = await h.score(spec, tar_of({"calc.py": calc}))
    assert isinstance(ev, RolloutScored) and ev.score == 0.0 and "judge" not in ev.components


@pytest.mark.parametrize("mode", ["namespaces", "uid"])
async def test_the_hidden_tests_cannot_be_rewritten_or_swapped_before_they_are_collected(make_harness, mode):
    """namespaces: bound read-only; uid: the evaluator's, in a sticky workspace root."""
    if os.geteuid() != 0:
        pytest.skip(f"{mode} mode needs root")
    h = await make_harness(isolation=mode)
    if mode == "namespaces":
        _require_namespaces(h)
    hidden = {
        "test_a.py": b"from calc import add\ndef test_add():\n    assert add(2, 3) == 5\n",
        "test_b.py": b"from calc import mul, div\ndef test_mul():\n    assert mul(2, 3) == 6\n"
                     b"def test_div():\n    assert div(6, 3) == 2\n",
    }
    fake = "def test_mul():\\n    pass\\ndef test_div():\\n    pass\\n"
    calc = CALC_PARTIAL + dedent_bytes(f"""
        import os
        for attempt in (
            lambda: open("_gyre_hidden/test_b.py", "w").write("{fake}"),
            lambda: os.remove("_gyre_hidden/test_b.py"),
            lambda: os.chmod("_gyre_hidden", 0o777),
            lambda: os.rename("_gyre_hidden", "old_hidden"),
        ):
            try:
                attempt()
            except OSError:
                pass
        if not os.path.exists("_gyre_hidden/test_a.py"):  # swapped: a folder of its own
            os.makedirs("_gyre_hidden", exist_ok=True)
            open("_gyre_hidden/test_b.py", "w").write("{fake}")
    """).decode()
    spec = calc_spec("swap", hidden_files=hidden, weights={
        "test_a.py::test_add": 1.0, "test_b.py::test_mul": 1.0, "test_b.py::test_div": 2.0})
    ev = await h.score(spec, tar_of({"calc.py": calc}))
    assert isinstance(ev, RolloutScored) and ev.score == 0.25, ev.reason
    assert outcomes(ev) == {"test_a.py::test_add": "passed", "test_b.py::test_mul": "failed",
                            "test_b.py::test_div": "failed"}


async def test_hidden_tests_changed_where_nothing_protects_them_score_0(make_harness):
    """``none`` mode (not root: the tests run as the evaluator's user) cannot keep the code
    from rewriting a hidden test file before pytest collects it; the check after the run
    sees it and the rollout scores 0, passing tests and all."""
    h = await make_harness(isolation="none")
    hidden = {
        "test_a.py": b"from calc import add\ndef test_add():\n    assert add(2, 3) == 5\n",
        "test_b.py": b"from calc import mul\ndef test_mul():\n    assert mul(2, 3) == 6\n",
    }
    calc = CALC_PARTIAL + dedent_bytes("""
        import os
        if os.path.exists("_gyre_hidden/test_b.py"):
            open("_gyre_hidden/test_b.py", "w").write("def test_mul():\\n    pass\\n")
    """).decode()
    spec = calc_spec("rewrite", hidden_files=hidden, weights={"test_a.py::test_add": 1.0, "test_b.py::test_mul": 1.0})
    ev = await h.score(spec, tar_of({"calc.py": calc}))
    assert isinstance(ev, RolloutScored) and ev.score == 0.0, ev.reason
    assert "_gyre_hidden/test_b.py was changed" in ev.reason, ev.reason
    honest = await h.score(spec, tar_of({"calc.py": CALC_PARTIAL}))
    assert isinstance(honest, RolloutScored) and honest.score == 0.5, honest.reason


def test_the_parser_keeps_the_first_record_and_names_what_no_honest_run_writes():
    head = ['{"e": "session"}', '{"e": "item", "id": "t::a"}', '{"e": "item", "id": "t::b"}',
            '{"e": "collected", "n": 2}']
    a_fails = ['{"e": "start", "id": "t::a"}', '{"e": "test", "id": "t::a", "outcome": "failed", "msg": "x"}']
    a_passes = ['{"e": "start", "id": "t::a"}', '{"e": "test", "id": "t::a", "outcome": "passed", "msg": ""}']
    finish = ['{"e": "finish", "status": 1}']
    honest = parse_outcome_lines("\n".join(head + a_fails + finish))
    assert honest.started and honest.finished and not honest.tampering
    assert honest.collected == ("t::a", "t::b")

    twice = parse_outcome_lines("\n".join(head + a_fails + a_passes + finish))
    assert [t.outcome for t in twice.tests] == ["failed"] and twice.tampering
    after = parse_outcome_lines("\n".join(head + a_fails + finish + a_passes))
    assert [t.outcome for t in after.tests] == ["failed"] and "after the session's end" in after.tampering[0]
    before = parse_outcome_lines("\n".join(a_passes + head + a_fails))
    assert "before the session started" in before.tampering[0]
    unknown = parse_outcome_lines("\n".join(head + ['{"e": "start", "id": "t::z"}']))
    assert "never collected" in unknown.tampering[0]
    unstarted = parse_outcome_lines("\n".join(head + ['{"e": "test", "id": "t::b", "outcome": "passed"}']))
    assert "while no test was running" in unstarted.tampering[0] and not unstarted.tests
    short = parse_outcome_lines("\n".join(head[:2] + ['{"e": "collected", "n": 2}']))
    assert "counted 2 tests but named 1" in short.tampering[0]
    assert not parse_outcome_lines("").started


def test_a_tampered_report_scores_0_and_a_collected_test_never_reported_is_missing():
    spec = TaskEvaluatorSpec(task_id="t", hidden_files={"t.py": b""})
    run = SandboxRun(0, None, "", False, "test", 1.0)
    lines = ['{"e": "session"}', '{"e": "item", "id": "t::a"}', '{"e": "item", "id": "t::b"}',
             '{"e": "item", "id": "t::c"}', '{"e": "collected", "n": 3}',
             '{"e": "start", "id": "t::a"}', '{"e": "test", "id": "t::a", "outcome": "passed", "msg": ""}',
             '{"e": "start", "id": "t::b"}']
    v = score_tests(spec, parse_outcome_lines("\n".join(lines)), run)
    assert {o.name: o.outcome for o in v.outcomes} == {"t::a": "passed", "t::b": "error", "t::c": "missing"}
    assert v.score == pytest.approx(1 / 3) and not v.tampered
    forged = lines + ['{"e": "test", "id": "t::a", "outcome": "passed", "msg": ""}']
    v = score_tests(spec, parse_outcome_lines("\n".join(forged)), run)
    assert v.tampered and v.score == 0.0 and "tampered with" in v.reason
    assert "passed" not in {o.outcome for o in v.outcomes}


# -- item 6: a test that ends the process ------------------------------------------------

async def test_ending_the_process_in_a_test_does_not_hide_the_tests_after_it(make_harness):
    h = await make_harness()
    spec = calc_spec("calc_noweights", weights={})  # the denominator comes from what was collected
    honest = await h.score(spec, tar_of({"calc.py": CALC_PARTIAL}))
    bail = await h.score(spec, tar_of({"calc.py": CALC_PARTIAL.replace("return a + b  # wrong",
                                                                      "import os; os._exit(0)")}))
    assert honest.score == pytest.approx(1 / 3)
    assert isinstance(bail, RolloutScored) and bail.score == pytest.approx(1 / 3), bail.reason
    assert outcomes(bail) == {"test_calc.py::test_add": "passed", "test_calc.py::test_mul": "error",
                              "test_calc.py::test_div": "missing"}


# -- items 4 and 5: runs that never started ---------------------------------------------

# (A usage error in Gyre's own pytest options comes after the session line, which is written
# before the hidden conftest.py loads, as the agent's code may run from there: such a Gyre bug
# scores the rollouts 0, visibly, rather than being told apart from the agent's doing.)
@pytest.mark.parametrize("how", ["unshare fails", "set-up failure", "no such program"])
async def test_a_run_that_never_started_is_retried_and_fails_on_the_last_delivery(make_harness, monkeypatch, how):
    h = await make_harness()
    real_command = sb.Sandbox._command
    fail = {"unshare fails": ["/bin/sh", "-c", "echo 'unshare: unshare failed: No space left on device' >&2; "
                                               "exit 1"],
            "set-up failure": ["/bin/sh", "-c", "echo 'gyre-sandbox: cannot protect /tmp' >&2; exit 97"],
            "no such program": ["/nonexistent/gyre-no-such-program"]}[how]

    def failing(self, argv, workdir, uid, **kw):
        return fail if "pytest" in " ".join(argv) else real_command(self, argv, workdir, uid, **kw)

    monkeypatch.setattr(sb.Sandbox, "_command", failing)
    ended = await h.rollout(calc_spec(), tar_of({"calc.py": CALC_OK}))
    with pytest.raises(TransientError, match="the tests never ran"):
        await h.evaluator.evaluate(ended, may_retry=True)
    ev = await h.evaluator.evaluate(ended, may_retry=False)
    assert isinstance(ev, RolloutScoringFailed) and "the tests never ran" in ev.reason, ev


def _python_without_pytest(work_root: Path) -> str:
    folder = work_root / f"nopytest-{uuid.uuid4().hex[:6]}"
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)
    wrapper = folder / "python"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")  # -S: no site-packages, no pytest
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH | stat.S_IRGRP | stat.S_IROTH)
    return str(wrapper)


async def test_an_interpreter_without_pytest_is_refused_at_start_and_never_scores_0(make_harness, work_root):
    python = _python_without_pytest(work_root)
    with pytest.raises(SandboxUnavailable, match="No module named 'pytest'"):
        await make_harness(python=python)
    # one that loses pytest later (a changed image): the run never starts, no 0.0
    h = await make_harness()
    h.evaluator.settings = h.evaluator.settings.model_copy(update={"python": python})
    ended = await h.rollout(calc_spec(), tar_of({"calc.py": CALC_OK}))
    with pytest.raises(TransientError, match="session never began"):
        await h.evaluator.evaluate(ended, may_retry=True)


async def test_a_workspace_over_the_disk_limit_before_the_session_scores_0(make_harness, monkeypatch):
    """The one way a run that never started is the agent's doing: its own files."""
    h = await make_harness()

    async def full_disk(argv, **kw):
        return SandboxRun(None, "disk limit (1 MB)", "", False, h.evaluator.sandbox.description, 1.0)

    monkeypatch.setattr(h.evaluator.sandbox, "run", full_disk)
    ev = await h.score(calc_spec(), tar_of({"calc.py": CALC_OK}))
    assert isinstance(ev, RolloutScored) and ev.score == 0.0 and "disk limit" in ev.reason
