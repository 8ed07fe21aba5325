"""The worker pool on the bus: every ended rollout gets exactly one outcome event."""

from __future__ import annotations

import asyncio
import time

from libs.common.events import Context, RolloutScored, RolloutScoringFailed
from services.evaluator.main import build_evaluator
from services.evaluator.settings import EvaluatorSettings

from ._workspaces import CALC_OK, CALC_PARTIAL, calc_spec, dedent_bytes, tar_of

SLOW_TEST = dedent_bytes("""
    import time
    def test_slow():
        time.sleep(1.5)
""")


async def outcomes(bus) -> list:
    return [d.event async for d in bus.read(Context.SCORES)]


async def wait_for(bus, n: int, timeout_s: float = 40.0) -> list:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = await outcomes(bus)
        if len(got) >= n:
            return got
        await asyncio.sleep(0.05)
    raise AssertionError(f"only {len(await outcomes(bus))} of {n} outcomes after {timeout_s}s")


async def test_pool_scores_good_and_bad_rollouts_concurrently_once_each(make_harness):
    h = await make_harness(workers=2)
    slow = calc_spec("slow", hidden_files={"test_slow.py": SLOW_TEST}, weights={})
    ended = [
        await h.rollout(slow, tar_of({"x.py": ""})),
        await h.rollout(slow, tar_of({"y.py": ""})),
        await h.rollout(calc_spec(), tar_of({"calc.py": CALC_PARTIAL}), timed_out=True),
        await h.rollout("unknown-task", tar_of({"calc.py": CALC_OK})),
        await h.rollout(calc_spec(), b"corrupt" * 50),
    ]
    # how many rollouts are scored at once (the pool's concurrency, not a timing)
    evaluate, running, most = h.evaluator.evaluate, [0], [0]

    async def counted(*args, **kwargs):
        running[0] += 1
        most[0] = max(most[0], running[0])
        try:
            return await evaluate(*args, **kwargs)
        finally:
            running[0] -= 1

    h.evaluator.evaluate = counted
    stop = asyncio.Event()
    runner = asyncio.create_task(h.evaluator.run(stop))
    try:
        got = await wait_for(h.bus, len(ended))
        await asyncio.sleep(0.3)  # nothing more should come
        got = await outcomes(h.bus)
    finally:
        stop.set()
        await asyncio.wait_for(runner, 10)
    by_rollout = {}
    for ev in got:
        by_rollout.setdefault(ev.rollout_id, []).append(ev)
    assert sorted(by_rollout) == sorted(e.rollout_id for e in ended)
    assert all(len(v) == 1 for v in by_rollout.values())
    first, second, partial, unknown, corrupt = (by_rollout[e.rollout_id][0] for e in ended)
    assert isinstance(first, RolloutScored) and first.score == 1.0
    assert isinstance(second, RolloutScored) and second.score == 1.0
    assert isinstance(partial, RolloutScored) and partial.partial and partial.score == 0.25
    assert isinstance(unknown, RolloutScoringFailed) and "unknown task" in unknown.reason
    assert isinstance(corrupt, RolloutScoringFailed) and "tar" in corrupt.reason
    # the two workers score at once (timings belong in benchmarks: this machine is shared)
    assert most[0] == 2
    assert not h.bus.dead_letters


class FlakyPublishBus:
    """The in-memory bus, except that the first publish of a score fails (a broker hiccup)."""

    def __init__(self, inner):
        self.inner, self.failed = inner, False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def publish(self, event, **kw):
        if event.CONTEXT is Context.SCORES and not self.failed:
            self.failed = True
            raise ConnectionError("broker unavailable")
        return await self.inner.publish(event, **kw)


async def test_a_failed_publish_is_retried_not_lost(make_harness, work_root):
    h = await make_harness()
    ended = await h.rollout(calc_spec(), tar_of({"calc.py": CALC_OK}))
    flaky = FlakyPublishBus(h.bus)
    settings = EvaluatorSettings(work_root=work_root, workers=1, retry_delay_s=0.1)
    evaluator = build_evaluator(settings, bus=flaky, store=h.store, catalog=h.catalog)
    stop = asyncio.Event()
    runner = asyncio.create_task(evaluator.run(stop))
    try:
        got = await wait_for(h.bus, 1)
    finally:
        stop.set()
        await asyncio.wait_for(runner, 10)
    assert flaky.failed
    assert [(type(e), e.rollout_id) for e in got] == [(RolloutScored, ended.rollout_id)]


class FlakyStore:
    """The memory blob store, except that the first get fails (a store hiccup)."""

    def __init__(self, inner):
        self.inner, self.failures = inner, 0

    async def get(self, digest):
        if self.failures == 0:
            self.failures += 1
            raise ConnectionError("object store unavailable")
        return await self.inner.get(digest)

    async def put(self, data):
        return await self.inner.put(data)

    async def has(self, digest):
        return await self.inner.has(digest)


async def test_a_store_hiccup_is_retried_and_only_a_lasting_one_fails(make_harness, work_root):
    h = await make_harness()
    ended = await h.rollout(calc_spec(), tar_of({"calc.py": CALC_OK}))
    store = FlakyStore(h.store)
    settings = EvaluatorSettings(work_root=work_root, workers=1, retry_delay_s=0.1)
    evaluator = build_evaluator(settings, bus=h.bus, store=store, catalog=h.catalog)
    stop = asyncio.Event()
    runner = asyncio.create_task(evaluator.run(stop))
    try:
        got = await wait_for(h.bus, 1)
    finally:
        stop.set()
        await asyncio.wait_for(runner, 10)
    assert store.failures == 1
    assert [(type(e), e.rollout_id) for e in got] == [(RolloutScored, ended.rollout_id)]
    # On the last delivery (or outside the pool) the same hiccup is a reasoned failure.
    store.failures = 0
    ev = await evaluator.evaluate(ended)
    assert isinstance(ev, RolloutScoringFailed) and "could not fetch" in ev.reason
