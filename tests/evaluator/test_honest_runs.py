"""Honest runs the tamper checks must not mistake: a hidden conftest.py that imports the
agent's module at its top, async hidden tests (their plugin is named, autoload being off),
and a test that forks a child which leaves through sys.exit (pytest in the child must not
write to the results pipe)."""

from __future__ import annotations

import pytest

from libs.common.events import RolloutScored

from ._workspaces import CALC_OK, CALC_TESTS, calc_spec, tar_of


@pytest.mark.parametrize("mode", ["namespaces", "uid", "none"])
async def test_a_hidden_conftest_may_import_the_solution(make_harness, mode):
    h = await make_harness(isolation=mode)
    conftest = b"from calc import add\nimport pytest\n@pytest.fixture\ndef adder():\n    return add\n"
    spec = calc_spec(hidden_files={"conftest.py": conftest, "test_calc.py": CALC_TESTS.encode()})
    ev = await h.score(spec, tar_of({"calc.py": CALC_OK}))
    assert isinstance(ev, RolloutScored) and ev.score == 1.0, ev.reason


async def test_async_hidden_tests_run(make_harness):
    pytest.importorskip("pytest_asyncio")
    h = await make_harness(isolation="namespaces")
    tests = CALC_TESTS + "\nimport pytest\n@pytest.mark.asyncio\nasync def test_async():\n    assert add(1, 1) == 2\n"
    ev = await h.score(calc_spec(hidden_files={"test_calc.py": tests.encode()}, weights={}),
                       tar_of({"calc.py": CALC_OK}))
    assert isinstance(ev, RolloutScored) and ev.score == 1.0, ev.reason


async def test_a_test_whose_forked_child_exits_is_no_tampering(make_harness):
    h = await make_harness(isolation="namespaces")
    tests = CALC_TESTS + ("\nimport os, sys\ndef test_fork():\n    pid = os.fork()\n    if pid == 0:\n"
                          "        sys.exit(0)\n    os.waitpid(pid, 0)\n")
    ev = await h.score(calc_spec(hidden_files={"test_calc.py": tests.encode()}, weights={}),
                       tar_of({"calc.py": CALC_OK}))
    assert isinstance(ev, RolloutScored) and ev.score == 1.0, ev.reason
