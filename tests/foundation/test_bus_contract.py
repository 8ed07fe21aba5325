"""One contract for the bus port, run against the real JetStream server and in memory."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest

from libs.common.bus.memory import InMemoryBus, subject_matches
from libs.common.bus.port import ConsumerConfig, Deferred, Delivery, PermanentError
from libs.common.events import Context, RolloutFinished, RolloutStarted, RunStarted

D = "cd" * 32


def started(i: int, run: str = "r1") -> RolloutStarted:
    return RolloutStarted(run_id=run, rollout_id=f"ro-{i}", task_id="t", group_id=f"g{i % 3}", harness="gyre",
                          weight_version=0, api_key_digest=D)


@pytest.fixture(params=["jetstream", "memory"])
async def bus(request: pytest.FixtureRequest, tmp_path) -> AsyncIterator[object]:
    if request.param == "memory":
        yield InMemoryBus()
        return
    from libs.common.bus.jetstream import JetStreamBus
    from libs.common.natsserver import EmbeddedNats

    with EmbeddedNats(tmp_path / "nats") as server:
        js = await JetStreamBus.connect(server.url)
        yield js
        await js.close()


async def consume(bus, config: ConsumerConfig, until: int, handler=None, timeout: float = 10.0) -> list[Delivery]:
    got: list[Delivery] = []
    stop = asyncio.Event()

    async def h(d: Delivery) -> None:
        if handler is not None:
            await handler(d)
        got.append(d)
        if len(got) >= until:
            stop.set()

    await asyncio.wait_for(bus.run_consumer(config, h, stop=stop), timeout)
    return got


async def test_publish_returns_dense_sequences_and_dedupes_by_event_id(bus) -> None:
    events = [started(i) for i in range(5)]
    assert await bus.publish_many(events) == [1, 2, 3, 4, 5]
    assert await bus.publish(events[2]) == 3  # same event id: stored once
    assert await bus.publish(RunStarted(run_id="r1")) == 1  # another stream counts on its own
    assert await bus.last_seq(Context.ROLLOUTS) == 5
    assert await bus.last_seq(Context.CALLS) == 0


async def test_read_replays_in_order_from_seq_time_and_filter(bus) -> None:
    await bus.publish_many([started(i, run="a") for i in range(3)] + [started(i, run="b") for i in range(3, 6)])
    seqs = [d.seq async for d in bus.read(Context.ROLLOUTS)]
    assert seqs == [1, 2, 3, 4, 5, 6]
    assert [d.seq async for d in bus.read(Context.ROLLOUTS, start_seq=4)] == [4, 5, 6]
    only_b = [d.event.rollout_id async for d in bus.read(Context.ROLLOUTS, filter_subject="gyre.b.rollouts.>")]
    assert only_b == ["ro-3", "ro-4", "ro-5"]
    assert [d async for d in bus.read(Context.CALLS)] == []
    future = datetime.now(UTC) + timedelta(hours=1)
    assert [d async for d in bus.read(Context.ROLLOUTS, start_time=future)] == []
    assert [d.seq async for d in bus.read(Context.ROLLOUTS, until_seq=2)] == [1, 2]


async def test_durable_consumer_resumes_where_it_stopped(bus) -> None:
    await bus.publish_many([started(i) for i in range(10)])
    cfg = ConsumerConfig(name="c1", context=Context.ROLLOUTS, batch=4)
    first = await consume(bus, cfg, until=4)
    assert [d.seq for d in first] == [1, 2, 3, 4]
    await asyncio.sleep(0.1)
    rest = await consume(bus, cfg, until=6)
    assert [d.seq for d in rest] == [5, 6, 7, 8, 9, 10]


async def test_failing_handler_is_retried_in_order(bus) -> None:
    await bus.publish_many([started(i) for i in range(4)])
    failures = {2: 2}  # seq 2 fails twice, then succeeds

    async def flaky(d: Delivery) -> None:
        if failures.get(d.seq, 0) > 0:
            failures[d.seq] -= 1
            raise RuntimeError("transient")

    cfg = ConsumerConfig(name="c2", context=Context.ROLLOUTS, retry_delay_s=0.05, max_deliver=5)
    got = await consume(bus, cfg, until=4, handler=flaky)
    assert [d.seq for d in got] == [1, 2, 3, 4]
    assert got[1].num_delivered == 3


async def test_poison_and_rejected_events_are_dead_lettered_and_the_consumer_goes_on(bus) -> None:
    await bus.publish(started(0))
    # a message no decoder accepts, straight onto the stream
    if isinstance(bus, InMemoryBus):
        bus.append(Context.ROLLOUTS.stream, "gyre.r1.rollouts.Bogus", b'{"type":"Bogus"}', "bogus-1",
                   datetime.now(UTC))
    else:
        await bus.publish_raw("gyre.r1.rollouts.Bogus", b'{"type":"Bogus"}', {"Nats-Msg-Id": "bogus-1"})
    await bus.publish(RolloutFinished(run_id="r1", rollout_id="ro-x", wall_time_s=1.0))
    await bus.publish(started(2))

    async def reject_finished(d: Delivery) -> None:
        if isinstance(d.event, RolloutFinished):
            raise PermanentError("cannot apply")

    cfg = ConsumerConfig(name="c3", context=Context.ROLLOUTS, retry_delay_s=0.05)
    got = await consume(bus, cfg, until=2, handler=reject_finished)
    assert [d.seq for d in got] == [1, 4]
    reasons = await dead_letters(bus, "c3", expect=2)
    assert any("unknown event type 'Bogus'" in r for r in reasons)
    assert any("cannot apply" in r for r in reasons)
    # a replay skips what the consumers dead-letter, so a rebuild does not stop on it
    assert [d.seq async for d in bus.read(Context.ROLLOUTS)] == [1, 3, 4]


async def test_a_failing_event_costs_the_events_behind_it_no_delivery(bus) -> None:
    """Tried again in place: the ones behind it in the batch wait their turn, are not
    charged a delivery, and are handled once each, in order."""
    await bus.publish_many([started(i) for i in range(3)])
    tries: list[tuple[int, int]] = []

    async def first_always_fails(d: Delivery) -> None:
        tries.append((d.seq, d.num_delivered))
        if d.seq == 1:
            raise RuntimeError("transient, for ever")

    cfg = ConsumerConfig(name="c5", context=Context.ROLLOUTS, batch=10, retry_delay_s=0.02, max_deliver=3)
    got = await consume(bus, cfg, until=2, handler=first_always_fails)
    assert [d.seq for d in got] == [2, 3]
    assert tries == [(1, 1), (1, 2), (1, 3), (2, 1), (3, 1)]
    reasons = await dead_letters(bus, "c5", expect=1)
    assert len(reasons) == 1 and "failed 3 times" in reasons[0]


async def test_a_deferred_event_is_never_dead_lettered_however_often_it_comes_back(bus) -> None:
    """A hand-back says the event waits on something else, nothing against it: it comes
    back as often as it must (JetStream counts each as a delivery) and is handled once
    what it waits on is there; it is never dead-lettered."""
    await bus.publish(started(0))
    waits = {"left": 6}

    async def not_yet(d: Delivery) -> None:
        if waits["left"] > 0:
            waits["left"] -= 1
            raise Deferred("waits on something else")

    cfg = ConsumerConfig(name="c6", context=Context.ROLLOUTS, batch=1, retry_delay_s=0.02, max_deliver=2)
    got = await consume(bus, cfg, until=1, handler=not_yet)
    assert [d.seq for d in got] == [1] and waits["left"] == 0
    assert await dead_letters(bus, "c6", expect=0) == []


async def test_without_counting_redeliveries_hand_backs_leave_an_event_all_its_tries(bus) -> None:
    """A work queue's events are handed back in the ordinary course (``Deferred``): with
    ``count_redeliveries=False`` an event deferred many times, which then fails for real,
    still gets ``max_deliver`` tries in place before it could be dead-lettered."""
    await bus.publish(started(0))
    plan = ["defer"] * 5 + ["fail", "fail", "ok"]
    seen: list[str] = []

    async def handler(d: Delivery) -> None:
        step = plan[len(seen)]
        seen.append(step)
        if step == "defer":
            raise Deferred("not yet")
        if step == "fail":
            raise RuntimeError("transient")

    cfg = ConsumerConfig(name="c7", context=Context.ROLLOUTS, batch=1, retry_delay_s=0.02, max_deliver=3,
                         count_redeliveries=False)
    got = await consume(bus, cfg, until=1, handler=handler)
    assert [d.seq for d in got] == [1] and seen == plan
    assert await dead_letters(bus, "c7", expect=0) == []


async def test_follow_dead_letters_gives_each_of_a_consumers_letters_as_it_was(bus) -> None:
    await bus.publish_many([RolloutFinished(run_id="r1", rollout_id="ro-x", wall_time_s=1.0), started(0)])

    async def reject_finished(d: Delivery) -> None:
        if isinstance(d.event, RolloutFinished):
            raise PermanentError("cannot apply")

    cfg = ConsumerConfig(name="c8", context=Context.ROLLOUTS, retry_delay_s=0.02)
    await consume(bus, cfg, until=1, handler=reject_finished)
    await dead_letters(bus, "c8", expect=1)

    async def first():
        async for raw in bus.follow_dead_letters("c8", idle_s=0.02):
            if raw is not None:
                return raw

    raw = await asyncio.wait_for(first(), 10)
    assert (raw.stream, raw.seq) == (Context.ROLLOUTS.stream, 1)
    assert b"ro-x" in raw.data


async def dead_letters(bus, consumer: str, expect: int) -> list[str]:
    if isinstance(bus, InMemoryBus):
        return [d.reason for d in bus.dead_letters if d.consumer == consumer]
    reasons: list[str] = []
    for _ in range(50):
        reasons = [m.headers["Gyre-Dead-Reason"] async for m in bus.read_raw(
            "GYRE_DEADLETTER", filter_subject=f"gyredlq.{consumer}")]
        if len(reasons) >= expect:
            break
        await asyncio.sleep(0.05)
    return reasons


async def test_follow_tails_new_events(bus) -> None:
    await bus.publish(started(0))
    seen: list[int] = []

    async def tail() -> None:
        async for raw in bus.follow(Context.ROLLOUTS, start_seq=1):
            if raw is not None:
                seen.append(raw.seq)
                if len(seen) == 3:
                    return

    task = asyncio.create_task(tail())
    await asyncio.sleep(0.1)
    await bus.publish_many([started(1), started(2)])
    await asyncio.wait_for(task, 5)
    assert seen == [1, 2, 3]


@pytest.mark.parametrize(
    ("pattern", "subject", "ok"),
    [("gyre.*.calls.>", "gyre.r.calls.CallRecorded.x", True), ("gyre.*.calls.>", "gyre.r.calls", False),
     ("gyre.r.calls.*", "gyre.r.calls.X", True), ("gyre.r.calls.*", "gyre.r.calls.X.y", False),
     ("a.b", "a.c", False)],
)
def test_memory_subject_matching_follows_nats(pattern: str, subject: str, ok: bool) -> None:
    assert subject_matches(pattern, subject) is ok


async def test_last_on_subject_finds_the_newest_message_of_one_entity(bus) -> None:
    assert await bus.last_on_subject(Context.ROLLOUTS, "gyre.r1.rollouts.RolloutStarted.ro-1") is None
    await bus.publish_many([started(1), started(2)])
    got = await bus.last_on_subject(Context.ROLLOUTS, "gyre.r1.rollouts.RolloutStarted.ro-1")
    assert got is not None and got.seq == 1
    from libs.common.events import decode

    assert decode(got.data).rollout_id == "ro-1"


async def test_optimistic_append_on_a_subject(bus) -> None:
    from libs.common.bus.port import ConcurrencyConflict

    assert await bus.publish(started(1), expect_last_subject_seq=0) == 1
    with pytest.raises(ConcurrencyConflict):
        await bus.publish(started(1).model_copy(update={"event_id": "other"}), expect_last_subject_seq=0)
    assert await bus.publish(started(1).model_copy(update={"event_id": "third"}), expect_last_subject_seq=1) == 2
    assert await bus.publish(started(2), expect_last_subject_seq=0) == 3  # another subject counts on its own


async def test_optimistic_append_across_the_subjects_of_one_key(bus) -> None:
    """``expect_subject``: the expectation is checked on a wildcard of several event types
    (a rollout's scored and scoring-failed outcomes), not only the event's own subject."""
    from libs.common.bus.port import ConcurrencyConflict
    from libs.common.events import RolloutScored, RolloutScoringFailed

    def outcome(kind, rollout, eid, **kw):
        return kind(run_id="r", rollout_id=rollout, event_id=eid, **kw)

    both = "gyre.r.scores.*.{}"
    failed = outcome(RolloutScoringFailed, "a", "f-a", reason="judge down")
    seq = await bus.publish(failed, expect_last_subject_seq=0, expect_subject=both.format("a"))
    with pytest.raises(ConcurrencyConflict):
        await bus.publish(outcome(RolloutScored, "a", "s-a", score=1.0), expect_last_subject_seq=0,
                          expect_subject=both.format("a"))
    # another rollout's key is free; the expectation holds on the newest of either kind
    await bus.publish(outcome(RolloutScored, "b", "s-b", score=0.5), expect_last_subject_seq=0,
                      expect_subject=both.format("b"))
    await bus.publish(outcome(RolloutScored, "a", "s-a2", score=1.0), expect_last_subject_seq=seq,
                      expect_subject=both.format("a"))
    assert [d.event.event_id async for d in bus.read(Context.SCORES)] == ["f-a", "s-b", "s-a2"]


async def test_the_cli_tools_leave_deployed_streams_as_the_services_made_them(nats_server, monkeypatch) -> None:
    """A service bus (7-day max age) made the streams; a tool's connection (tail, export,
    replay) must not rewrite them to its own defaults."""
    from libs.common.bus.jetstream import JetStreamBus
    from libs.common.runtime import connect_tool_bus
    from libs.common.settings import GyreSettings

    week = 7 * 86400
    service = await JetStreamBus.connect(nats_server.url, max_age_s=week)
    tool = await connect_tool_bus(nats_server.url, name="gyre-tail", settings=GyreSettings(stream_max_age_days=0))
    try:
        info = await service.js.stream_info(Context.ROLLOUTS.stream)
        assert info.config.max_age == pytest.approx(week)
    finally:
        await tool.close()
        await service.close()


@pytest.mark.parametrize("heartbeat_s", [None, 0.3])
async def test_a_heartbeat_keeps_a_slow_handlers_claim(nats_server, heartbeat_s) -> None:
    """Two workers share a queue with a 1 s ack wait; the first handles its event for 2.5 s.
    Without a heartbeat the second gets it too; with one, the claim stays the first's."""
    from libs.common.bus.jetstream import JetStreamBus

    bus = await JetStreamBus.connect(nats_server.url)
    try:
        await bus.publish(started(0))
        cfg = ConsumerConfig(name="slow", context=Context.ROLLOUTS, batch=1, ack_wait_s=1.0, heartbeat_s=heartbeat_s)
        seen: list[int] = []
        stop = asyncio.Event()

        async def handle(d: Delivery) -> None:
            seen.append(d.num_delivered)
            if len(seen) == 1:
                await asyncio.sleep(2.5)
                stop.set()

        await asyncio.wait_for(asyncio.gather(bus.run_consumer(cfg, handle, stop=stop),
                                              bus.run_consumer(cfg, handle, stop=stop)), 10)
        assert seen == ([1] if heartbeat_s else [1, 2])
    finally:
        await bus.close()


async def test_an_event_retried_in_place_stays_claimed_by_its_worker(nats_server) -> None:
    """Two workers share a queue with a 1.5 s ack wait; the first fails its event again and
    again, 0.3 s apart, for longer than that: the claim is renewed as each wait starts, so
    the second never gets the event while the first still retries it."""
    from libs.common.bus.jetstream import JetStreamBus

    bus = await JetStreamBus.connect(nats_server.url)
    try:
        await bus.publish(started(0))
        cfg = ConsumerConfig(name="retry", context=Context.ROLLOUTS, batch=1, ack_wait_s=1.5, heartbeat_s=0.5,
                             retry_delay_s=0.3, max_deliver=12)
        seen: list[tuple[str, int]] = []
        stop = asyncio.Event()

        def worker(tag: str):
            async def handle(d: Delivery) -> None:
                seen.append((tag, d.num_delivered))
                if len(seen) >= 10:
                    stop.set()
                    return
                raise RuntimeError("transient")

            return handle

        await asyncio.wait_for(asyncio.gather(bus.run_consumer(cfg, worker("a"), stop=stop),
                                              bus.run_consumer(cfg, worker("b"), stop=stop)), 15)
        assert len({tag for tag, _ in seen}) == 1 and [n for _, n in seen] == list(range(1, 11))
    finally:
        await bus.close()


async def test_a_durable_that_follows_another_runs_subjects_is_refused(nats_server) -> None:
    """A durable consumer made by a service of another run (same name, that run's filter)
    is not silently bound to: the service would never see its own run's events."""
    import uuid

    from libs.common.bus.jetstream import BusError, JetStreamBus

    bus = await JetStreamBus.connect(nats_server.url)
    try:
        name = f"svc-{uuid.uuid4().hex[:8]}"
        await bus.publish(started(0, run="runa"))
        first = ConsumerConfig(name=name, context=Context.ROLLOUTS, filter_subject="gyre.runa.rollouts.>")
        assert len(await consume(bus, first, 1)) == 1
        second = ConsumerConfig(name=name, context=Context.ROLLOUTS, filter_subject="gyre.runb.rollouts.>")
        with pytest.raises(BusError, match=r"follows 'gyre\.runa\.rollouts\.>', not 'gyre\.runb\.rollouts\.>'"):
            await asyncio.wait_for(bus.run_consumer(second, lambda d: asyncio.sleep(0), stop=asyncio.Event()), 10)
    finally:
        await bus.close()
