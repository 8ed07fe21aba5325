"""Two evaluator replicas (the Helm chart runs two on one durable) and a rollout end stored
twice (the runner's retry after a lost ack, past JetStream's de-duplication window): only
the first outcome for the rollout is stored, whichever replica scores which copy, and a
retry of our own publish whose ack was lost counts as done.

The streams here get a 1 s duplicate window instead of 120 s, so "past the window" takes a
second, not minutes; the nats-server is the shared ``nats_server`` fixture.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from libs.common.bus.jetstream import JetStreamBus
from libs.common.bus.port import Delivery
from libs.common.events import Context, RolloutFinished, RolloutScored, RolloutScoringFailed, RolloutStarted
from services.evaluator.core.scoring import outcome_event_id
from services.evaluator.service import Evaluator
from services.evaluator.settings import EvaluatorSettings

RUN = "duprun"
WINDOW_S = 1.0


@pytest.fixture
async def short_window_bus(nats_server, monkeypatch):
    orig = JetStreamBus._stream_config

    def short_window(self, name, subjects):
        cfg = orig(self, name, subjects)
        cfg.duplicate_window = WINDOW_S
        return cfg

    monkeypatch.setattr(JetStreamBus, "_stream_config", short_window)
    bus = await JetStreamBus.connect(nats_server.url)
    yield bus
    await bus.close()


def replica(bus, tmp_path, name: str, score: float, scoring_s: float = 0.0) -> Evaluator:
    settings = EvaluatorSettings(run_id=RUN, work_root=tmp_path / name, workers=1, retry_delay_s=0.1)
    ev = Evaluator(settings, bus, store=None, catalog=None, sandbox=None)

    async def evaluate(ended, *, may_retry=False):  # the sandbox run, replaced: only its time matters
        await asyncio.sleep(scoring_s)
        return RolloutScored(**ended.caused(event_id=outcome_event_id(ended), rollout_id=ended.rollout_id,
                                            score=score))

    ev.evaluate = evaluate
    return ev


async def store_end_twice(bus) -> tuple[Delivery, Delivery]:
    await bus.publish(RolloutStarted(run_id=RUN, rollout_id="r1", task_id="t1", group_id="g", harness="h",
                                     weight_version=0, api_key_digest="a" * 64, event_id="r1-started"))
    ended = RolloutFinished(run_id=RUN, rollout_id="r1", task_id="t1", exit_status=0, wall_time_s=3.0,
                            event_id="r1-ended", causation_id="r1-started")
    first = await bus.publish(ended)
    await asyncio.sleep(WINDOW_S + 0.3)  # the runner's retry, past the window
    second = await bus.publish(ended)
    assert second != first  # stored twice, same event id
    return (Delivery(ended, Context.ROLLOUTS.stream, first, ended.subject),
            Delivery(ended, Context.ROLLOUTS.stream, second, ended.subject))


async def stored_scores(bus) -> list[RolloutScored]:
    return [d.event async for d in bus.read(Context.SCORES)]


async def test_two_replicas_scoring_both_copies_store_one_outcome(short_window_bus, tmp_path):
    bus = short_window_bus
    copy1, copy2 = await store_end_twice(bus)
    a = replica(bus, tmp_path, "a", 1.0, scoring_s=WINDOW_S + 0.5)
    b = replica(bus, tmp_path, "b", 0.0, scoring_s=WINDOW_S + 0.5)

    async def b_later():
        await asyncio.sleep(WINDOW_S + 0.2)  # b takes copy 2 while a still scores copy 1
        await b.handle(copy2)

    await asyncio.gather(a.handle(copy1), b_later())
    scores = await stored_scores(bus)
    assert [(s.event_id, s.score) for s in scores] == [(outcome_event_id(copy1.event), 1.0)]


async def test_an_outcome_stored_by_another_replica_between_check_and_publish_wins(short_window_bus, tmp_path,
                                                                                  caplog):
    bus = short_window_bus
    copy1, copy2 = await store_end_twice(bus)
    a, b = replica(bus, tmp_path, "a", 1.0), replica(bus, tmp_path, "b", 0.0)
    await a.handle(copy1)
    await asyncio.sleep(WINDOW_S + 0.3)

    async def not_yet(_ended):  # b checked before a's outcome was stored
        return False

    b._already_scored = not_yet
    with caplog.at_level(logging.INFO, logger="services.evaluator.service"):
        await b.handle(copy2)  # returns: the delivery is acked, not retried
    assert [s.score for s in await stored_scores(bus)] == [1.0]
    assert b.counts["scored"] == 0
    assert "already has an outcome stored" in caplog.text


async def test_a_scored_and_a_failed_outcome_of_one_rollout_are_not_both_stored(short_window_bus, tmp_path):
    """The two kinds of outcome live on two subjects; the publish expects both empty."""
    bus = short_window_bus
    copy1, copy2 = await store_end_twice(bus)
    a, b = replica(bus, tmp_path, "a", 1.0), replica(bus, tmp_path, "b", 0.0)

    async def fails(ended, *, may_retry=False):
        return RolloutScoringFailed(**ended.caused(event_id=outcome_event_id(ended), rollout_id=ended.rollout_id,
                                                   reason="judge refused"))

    a.evaluate = fails
    await a.handle(copy1)

    async def not_yet(_ended):  # b checked before a's outcome was stored
        return False

    b._already_scored = not_yet
    await b.handle(copy2)
    assert [type(d.event).__name__ async for d in bus.read(Context.SCORES)] == ["RolloutScoringFailed"]
    assert (a.counts["failed"], b.counts["scored"]) == (1, 0)


class AckLostOnce:
    """The first publish is stored, then its ack is lost."""

    def __init__(self, bus):
        self._bus, self.lost = bus, False

    async def publish(self, event, **kw):
        seq = await self._bus.publish(event, **kw)
        if not self.lost:
            self.lost = True
            raise TimeoutError("ack lost")
        return seq

    def __getattr__(self, name):
        return getattr(self._bus, name)


async def test_a_retry_of_our_own_publish_after_a_lost_ack_is_done(short_window_bus, tmp_path):
    bus = short_window_bus
    copy1, _ = await store_end_twice(bus)
    a = replica(AckLostOnce(bus), tmp_path, "a", 1.0)
    with pytest.raises(TimeoutError):
        await a.handle(copy1)  # stored, but not known to be: redelivered
    await asyncio.sleep(WINDOW_S + 0.3)

    async def not_yet(_ended):
        return False

    a._already_scored = not_yet
    await a.handle(copy1)  # the redelivery's publish conflicts with our own stored copy: done
    assert [s.score for s in await stored_scores(bus)] == [1.0]


async def test_two_rollouts_whose_ids_differ_only_in_unsafe_characters_are_both_scored(short_window_bus, tmp_path):
    """"a.b" and "a_b" once shared one subject token: the second rollout's "already scored?"
    check found the first's outcome, and it was never scored."""
    bus = short_window_bus
    ends = []
    for rid in ("task.1-0", "task_1-0"):
        await bus.publish(RolloutStarted(run_id=RUN, rollout_id=rid, task_id="t1", group_id="g", harness="h",
                                         weight_version=0, api_key_digest="a" * 64))
        ended = RolloutFinished(run_id=RUN, rollout_id=rid, task_id="t1", exit_status=0, wall_time_s=3.0)
        ends.append(Delivery(ended, Context.ROLLOUTS.stream, await bus.publish(ended), ended.subject))
    a = replica(bus, tmp_path, "a", 1.0)
    for d in ends:
        await a.handle(d)
    assert sorted(s.rollout_id for s in await stored_scores(bus)) == ["task.1-0", "task_1-0"]
    assert a.counts["scored"] == 2
