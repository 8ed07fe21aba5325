"""One outcome per rollout, even across redeliveries (review finding 7), and a judge that
is down is a reason to retry, not to score without it (finding 9b)."""

from __future__ import annotations

import socket

import pytest

from libs.common.bus.port import Delivery
from libs.common.events import Context, RolloutScored, RolloutScoringFailed
from services.evaluator.adapters.judge_client import JudgeClient, JudgeConfig, JudgeFailed, JudgeUnreachable
from services.evaluator.core.spec import CombinePolicy, Limits
from services.evaluator.service import TransientError

from ._fakes import FakeJudge, Reply
from ._workspaces import CALC_OK, calc_spec, tar_of


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"  # nothing listens there now


async def outcomes(h) -> list:
    return [d.event async for d in h.bus.read(Context.SCORES)]


async def test_a_redelivered_rollout_with_an_outcome_in_the_log_is_not_scored_again(make_harness):
    h = await make_harness()
    ended = await h.rollout(calc_spec(), tar_of({"calc.py": CALC_OK}))
    await h.evaluator.handle(Delivery(ended, Context.ROLLOUTS.stream, 2, ended.subject))
    [first] = await outcomes(h)
    assert isinstance(first, RolloutScored)

    async def must_not_score(*_a, **_kw):
        raise AssertionError("scored twice")

    h.evaluator.evaluate = must_not_score
    h.evaluator._claimed.clear()  # a fresh evaluator process after a crash
    await h.evaluator.handle(Delivery(ended, Context.ROLLOUTS.stream, 2, ended.subject, num_delivered=2))
    assert await outcomes(h) == [first]


async def test_a_failed_outcome_in_the_log_also_counts(make_harness):
    h = await make_harness()
    ended = await h.rollout("no-such-task", tar_of({"calc.py": CALC_OK}))
    await h.evaluator.handle(Delivery(ended, Context.ROLLOUTS.stream, 2, ended.subject))
    h.evaluator._claimed.clear()
    await h.evaluator.handle(Delivery(ended, Context.ROLLOUTS.stream, 2, ended.subject, num_delivered=2))
    assert [type(e) for e in await outcomes(h)] == [RolloutScoringFailed]


async def test_a_task_longer_than_the_ack_wait_is_scored_under_a_heartbeat(make_harness):
    """The consumer heartbeats while scoring (the bus contract test proves the claim is
    kept), so a task's wall_s and a slow judge need not fit under ack_wait_s."""
    h = await make_harness(ack_wait_s=100, judge_url=_closed_port_url())
    config = h.evaluator.consumer_config()
    assert config.heartbeat_s is not None and config.heartbeat_s < config.ack_wait_s
    ev = await h.score(calc_spec("slow", limits=Limits(wall_s=500)), tar_of({"calc.py": CALC_OK}))
    assert isinstance(ev, RolloutScored) and ev.score == 1.0


async def test_an_unreachable_judge_is_transient_while_a_redelivery_is_possible(make_harness):
    h = await make_harness(judge_url=_closed_port_url())
    spec = calc_spec("judged-down", rubric="r", combine=CombinePolicy(mode="weighted", judge_weight=1))
    ended = await h.rollout(spec, tar_of({"calc.py": CALC_OK}))
    with pytest.raises(TransientError, match="judge unreachable"):
        await h.evaluator.evaluate(ended, may_retry=True)
    ev = await h.evaluator.evaluate(ended, may_retry=False)  # the last delivery: the policy's fallback
    assert isinstance(ev, RolloutScored) and ev.score == 1.0


async def test_a_judge_that_answers_nonsense_is_not_called_unreachable():
    with FakeJudge([Reply("pretty good!")]) as judge:
        c = JudgeClient(JudgeConfig(base_url=judge.base_url, model="j", timeout_s=1, attempts=2, backoff_s=0.01))
        with pytest.raises(JudgeFailed) as err:
            await c.score([{"role": "user", "content": "grade"}])
        await c.aclose()
    assert not isinstance(err.value, JudgeUnreachable)
    c = JudgeClient(JudgeConfig(base_url=_closed_port_url(), model="j", timeout_s=1, attempts=2, backoff_s=0.01))
    with pytest.raises(JudgeUnreachable, match="after 2 attempts"):
        await c.score([{"role": "user", "content": "grade"}])
    await c.aclose()
    assert c.time_budget_s() == pytest.approx(2 * 1 + 0.01)
