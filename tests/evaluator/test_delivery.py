"""How the evaluator sits on the bus: a durable consumer of its own per run, retries that
outlast a few minutes of judge or store outage, and score events that fit a NATS message
however many tests the task has."""

from __future__ import annotations

import asyncio
import json
import re

from libs.common.events import Context, RolloutFinished, RolloutScored, TestOutcome
from services.evaluator.core.scoring import Combined, TestsVerdict, scored_event
from services.evaluator.core.spec import CombinePolicy
from services.evaluator.service import durable_name
from services.evaluator.settings import EvaluatorSettings

from ._fakes import FakeJudge, Reply
from ._workspaces import CALC_OK, calc_spec, tar_of

NATS_NAME = re.compile(r"^[A-Za-z0-9_\-]{1,100}$")


def test_the_durable_consumer_is_named_per_run_and_nats_safe():
    names = {run: durable_name("evaluator", run) for run in ("runA", "runB", "run.a", "run_a", "a b*>/c", None)}
    assert names["runA"] == "evaluator-runA" and names["runB"] == "evaluator-runB"
    assert names[None] == "evaluator-all-runs"
    assert len(set(names.values())) == len(names)  # "run.a" and "run_a" do not share one
    assert all(NATS_NAME.match(n) for n in names.values()), names
    assert NATS_NAME.match(durable_name("evaluator", "x" * 128))


async def test_a_new_run_on_the_same_nats_server_gets_its_own_consumer(js_bus):
    """Run A's evaluator leaves its durable on the server; run B's must not bind to it
    (the bus reuses a durable of the same name with its old filter)."""
    from services.evaluator.service import Evaluator

    got: list[str] = []

    async def handler(d) -> None:
        got.append(d.event.run_id)

    for run in ("runA", "runB"):
        await js_bus.publish(RolloutFinished(run_id=run, rollout_id="r1", task_id="t", wall_time_s=1))
        config = Evaluator.consumer_config(_with_settings(EvaluatorSettings(run_id=run)))
        stop = asyncio.Event()
        task = asyncio.create_task(js_bus.run_consumer(config, handler, stop=stop))
        for _ in range(100):
            if run in got:
                break
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(task, 5)
    assert got == ["runA", "runB"]


def _with_settings(settings: EvaluatorSettings):
    return type("E", (), {"settings": settings})()


def test_retries_outlast_an_outage_of_a_few_minutes():
    from services.evaluator.service import Evaluator

    config = Evaluator.consumer_config(_with_settings(EvaluatorSettings(run_id="r")))
    assert (config.max_deliver - 1) * config.retry_delay_s >= 180
    assert config.retry_delay_s >= 10  # not a retry storm against a judge that is down


async def test_a_judge_down_for_several_deliveries_is_waited_for(make_harness):
    """The judge answers 503 (transient) to the first deliveries; the rollout is scored
    with the judge on a later one, not failed after the third."""
    replies = [Reply(status=503)] * 9 + [Reply('{"score": 0.5}')]
    with FakeJudge(replies) as judge:
        h = await make_harness(judge_url=judge.base_url, workers=1, retry_delay_s=0.01, max_deliver=10)
        spec = calc_spec("judged", hidden_files={}, weights={}, rubric="ok?",
                         combine=CombinePolicy(mode="judge"))
        await h.rollout(spec, tar_of({"calc.py": CALC_OK}))
        stop = asyncio.Event()
        task = asyncio.create_task(h.evaluator.run(stop))
        try:
            for _ in range(200):
                if [d async for d in h.bus.read(Context.SCORES)]:
                    break
                await asyncio.sleep(0.05)
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
    [ev] = [d.event async for d in h.bus.read(Context.SCORES)]
    assert isinstance(ev, RolloutScored) and ev.score == 0.5 and not h.bus.dead_letters
    assert len(judge.requests) == 10  # 3 deliveries x 3 attempts, then the answer


def _many(n: int, failing_every: int) -> tuple[TestOutcome, ...]:
    return tuple(TestOutcome(name=f"tests/unit/test_module_{i // 50}.py::TestSomething::test_case_{i}[param-{i % 7}]",
                             outcome="failed" if i % failing_every == 0 else "passed") for i in range(n))


def test_a_large_suite_fits_the_event_failing_tests_first():
    outcomes = _many(20_000, failing_every=100)
    ended = RolloutFinished(run_id="r", rollout_id="ro", wall_time_s=1)
    ev = scored_event(ended, Combined(0.99, {"tests": 0.99}, "why"), outcomes, "iso", tests_digest="a" * 64)
    assert len(ev.to_json()) < 512 * 1024
    assert ev.tests_truncated and ev.tests_digest == "a" * 64
    assert ev.test_counts == {"passed": 19_800, "failed": 200}
    assert [t.name for t in ev.tests] == [o.name for o in outcomes if o.outcome == "failed"]
    small = scored_event(ended, Combined(1.0, {}, ""), outcomes[:10], "iso", tests_digest="a" * 64)
    assert len(small.tests) == 10 and not small.tests_truncated and small.tests_digest is None
    # all failing: capped too
    worst = scored_event(ended, Combined(0.0, {}, ""), _many(20_000, failing_every=1), "iso")
    assert len(worst.to_json()) < 512 * 1024 and worst.tests_truncated and worst.tests_digest is None


async def test_the_full_list_of_a_large_suite_goes_to_the_blob_store(make_harness, monkeypatch):
    h = await make_harness()
    outcomes = _many(8_000, failing_every=10)
    verdict = TestsVerdict(0.9, outcomes, "score 0.900, 7200/8000 tests passed")

    async def run_tests(spec, workdir):  # the sandbox run is not the point here
        return verdict, "test"

    monkeypatch.setattr(h.evaluator, "_run_tests", run_tests)
    ev = await h.score(calc_spec(), tar_of({"calc.py": CALC_OK}))
    assert isinstance(ev, RolloutScored) and ev.tests_truncated and ev.tests_digest
    assert len(ev.to_json()) < 1_000_000 and len(ev.tests) == 800
    full = json.loads(await h.store.get(ev.tests_digest))
    assert [TestOutcome(**t) for t in full] == list(outcomes)
