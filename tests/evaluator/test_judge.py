"""The LLM judge against a real local HTTP endpoint that plays one (see ``_fakes.py``)."""

from __future__ import annotations

import time

import pytest

from libs.common.events import RolloutScored, RolloutScoringFailed
from services.evaluator.adapters.judge_client import JudgeClient, JudgeConfig, JudgeFailed
from services.evaluator.core.spec import CombinePolicy

from ._fakes import FakeJudge, Reply
from ._workspaces import CALC_OK, CALC_PARTIAL, calc_spec, tar_of

MESSAGES = [{"role": "user", "content": "grade this"}]


def client(judge: FakeJudge, **kw) -> JudgeClient:
    fields = {"base_url": judge.base_url, "model": "judge-1", "api_key": "k", "timeout_s": 1.0,
              "attempts": 3, "backoff_s": 0.01, **kw}
    return JudgeClient(JudgeConfig(**fields))


async def test_a_plain_answer_is_read_and_the_request_is_openai_shaped():
    with FakeJudge([Reply('{"score": 0.8, "reason": "solid"}')]) as judge:
        c = client(judge)
        assert await c.score(MESSAGES) == 0.8
        await c.aclose()
    body = judge.requests[0]
    assert body["model"] == "judge-1" and body["messages"] == MESSAGES and body["temperature"] == 0.0


async def test_server_errors_malformed_bodies_and_nonsense_are_retried():
    replies = [Reply(status=503), Reply(raw_body="<html>oops</html>"), Reply("Score: 0.4")]
    with FakeJudge(replies) as judge:
        c = client(judge)
        assert await c.score(MESSAGES) == 0.4
        await c.aclose()
    assert len(judge.requests) == 3


async def test_a_judge_that_only_talks_nonsense_fails_after_its_attempts():
    with FakeJudge([Reply("I think it is pretty good!")]) as judge:
        c = client(judge)
        with pytest.raises(JudgeFailed, match="nonsense.*after 3 attempts"):
            await c.score(MESSAGES)
        await c.aclose()
    assert len(judge.requests) == 3


async def test_a_silent_judge_times_out_per_attempt():
    with FakeJudge([Reply('{"score": 1}', delay_s=3)]) as judge:
        c = client(judge, timeout_s=0.3, attempts=2)
        t0 = time.monotonic()
        with pytest.raises(JudgeFailed, match="timed out"):
            await c.score(MESSAGES)
        assert time.monotonic() - t0 < 2.5
        await c.aclose()


async def test_a_refusal_is_not_retried():
    with FakeJudge([Reply(status=401, raw_body='{"error": "bad key"}')]) as judge:
        c = client(judge)
        with pytest.raises(JudgeFailed, match="HTTP 401"):
            await c.score(MESSAGES)
        await c.aclose()
    assert len(judge.requests) == 1


async def test_nobody_listening_is_a_clear_failure():
    c = JudgeClient(JudgeConfig(base_url="http://127.0.0.1:9/v1", model="m", attempts=2, backoff_s=0.01))
    with pytest.raises(JudgeFailed, match="unreachable"):
        await c.score(MESSAGES)
    await c.aclose()


async def test_weighted_policy_combines_tests_and_judge(make_harness):
    with FakeJudge([Reply('{"score": 0.5}')]) as judge:
        h = await make_harness(judge_url=judge.base_url)
        spec = calc_spec("judged", rubric="Is the code clear?", prompt="Write calc.py",
                         combine=CombinePolicy(mode="weighted", tests_weight=3, judge_weight=1))
        ev = await h.score(spec, tar_of({"calc.py": CALC_PARTIAL}))
        await h.evaluator.judge.aclose()
    assert isinstance(ev, RolloutScored), ev
    assert ev.components == {"tests": 0.25, "judge": 0.5}
    assert ev.score == pytest.approx((3 * 0.25 + 0.5) / 4)
    prompt = judge.requests[0]["messages"][1]["content"]
    assert "Is the code clear?" in prompt and "Write calc.py" in prompt and "def mul(a, b)" in prompt
    assert "1/3 tests passed" in prompt


async def test_judge_failure_falls_back_or_fails_as_the_policy_says(make_harness):
    with FakeJudge([Reply("no idea")]) as judge:
        h = await make_harness(judge_url=judge.base_url)
        lenient = calc_spec("lenient", rubric="r", combine=CombinePolicy(mode="weighted", judge_weight=1))
        strict = calc_spec("strict", rubric="r", hidden_files={}, weights={}, combine=CombinePolicy(mode="judge"))
        ev1 = await h.score(lenient, tar_of({"calc.py": CALC_OK}))
        ev2 = await h.score(strict, tar_of({"calc.py": CALC_OK}))
        await h.evaluator.judge.aclose()
    assert isinstance(ev1, RolloutScored) and ev1.score == 1.0 and ev1.components == {"tests": 1.0}
    assert isinstance(ev2, RolloutScoringFailed) and "judge failed" in ev2.reason and "nonsense" in ev2.reason
