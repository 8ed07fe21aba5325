"""Nothing a decision asks for is lost to a failed write: the ledger moves on as it
decides, so what a seal (or a rejected call) asks for is kept until it is all stored and
published, tried again until the outage ends, before the next event is decided; events
that arrive meanwhile wait, and are not dead-lettered for it. A rebuild passes over what
the consumers dead-lettered instead of stopping on it."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

from libs.common.blobs import MemoryBlobStore
from libs.common.bus.memory import InMemoryBus
from libs.common.events import Context, MicroStepQueued, RolloutFinished, RolloutScored, SamplesSelected, TreeSealed
from services.trajectory.ledger import LedgerConfig
from services.trajectory.service import create_service

from .test_service import RUN, _publish_calls, _recorded, _rollout_calls, _run_until, _started, _trees


class _FailsOnce:
    """The real bus, whose first write of one kind fails (a NATS timeout, say)."""

    def __init__(self, bus: InMemoryBus, what: str) -> None:
        self.bus, self.what, self.failed = bus, what, 0

    def __getattr__(self, name):
        return getattr(self.bus, name)

    async def publish_many(self, events):
        events = list(events)
        if self.what == "seal" and not self.failed and any(isinstance(e, TreeSealed) for e in events):
            self.failed += 1
            raise ConnectionError("nats: timeout")
        return await self.bus.publish_many(events)

    async def dead_letter(self, consumer, message, reason):
        if self.what == "dead_letter" and not self.failed:
            self.failed += 1
            raise ConnectionError("nats: timeout")
        return await self.bus.dead_letter(consumer, message, reason)


async def _one_rollout(bus, blobs, *, score=True):
    await bus.publish(_started("r1"))
    await _publish_calls(bus, blobs, _rollout_calls("r1", 0))
    await bus.publish(RolloutFinished(run_id=RUN, rollout_id="r1", wall_time_s=10))
    if score:
        await bus.publish(RolloutScored(run_id=RUN, rollout_id="r1", score=1.0))


async def test_a_seal_whose_publish_failed_is_published_when_tried_again():
    bus, blobs = InMemoryBus(), MemoryBlobStore()
    await _one_rollout(bus, blobs, score=False)
    flaky = _FailsOnce(bus, "seal")
    service = create_service(LedgerConfig(RUN, group_size=1), bus=flaky, blobs=blobs)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    try:
        # the live consumer, not the rebuild, meets the score (and the failed publish)
        for _ in range(250):
            if service.ledger.has_call("r1", _rollout_calls("r1", 0)[-1].call_id):
                break
            await asyncio.sleep(0.02)
        await bus.publish(RolloutScored(run_id=RUN, rollout_id="r1", score=1.0))
        for _ in range(400):
            if any(isinstance(e, MicroStepQueued) for e in await _trees(bus)):
                break
            await asyncio.sleep(0.02)
    finally:
        stop.set()
        await asyncio.wait_for(task, 3)
    assert flaky.failed == 1
    trees = await _trees(bus)
    kinds = [type(e) for e in trees]
    assert kinds.count(TreeSealed) == 1 and kinds.count(SamplesSelected) == 1 and MicroStepQueued in kinds
    # a restart finds nothing missing: the live run published what a rebuild would
    again = create_service(LedgerConfig(RUN, group_size=1), bus=bus, blobs=blobs)
    await again.rebuild()
    assert [e.event_id for e in await _trees(bus)] == [e.event_id for e in trees]


async def test_a_rejected_calls_dead_letter_is_written_when_the_first_write_failed():
    bus, blobs = InMemoryBus(), MemoryBlobStore()
    await bus.publish(_started("r1"))
    first = _rollout_calls("r1", 0)[0]
    flaky = _FailsOnce(bus, "dead_letter")
    service = create_service(LedgerConfig(RUN, group_size=1), bus=flaky, blobs=blobs)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    try:
        await asyncio.sleep(0.2)  # the live consumer, not the rebuild, meets the call
        await bus.publish(await _recorded(blobs, first, output_digest="f" * 64))  # names no blob
        for _ in range(400):
            if bus.dead_letters:
                break
            await asyncio.sleep(0.02)
    finally:
        stop.set()
        await asyncio.wait_for(task, 3)
    assert flaky.failed == 1
    assert [(d.consumer, "BlobNotFound" in d.reason) for d in bus.dead_letters] == [("trajectory-calls", True)]
    assert [d.call_id for d in service.dead] == [first.call_id]


async def test_a_rebuild_passes_over_what_the_consumers_dead_lettered():
    bus, blobs = InMemoryBus(), MemoryBlobStore()
    bus.append(Context.CALLS.stream, f"gyre.{RUN}.calls.CallRecorded.r1", b"not json", "bad-1", datetime.now(UTC))
    await _one_rollout(bus, blobs)

    async def queued():
        return any(isinstance(e, MicroStepQueued) for e in await _trees(bus))

    await _run_until(bus, blobs, queued, LedgerConfig(RUN, group_size=1))
    assert any("undecodable" in d.reason for d in bus.dead_letters)
    before = [e.event_id for e in await _trees(bus)]
    again = create_service(LedgerConfig(RUN, group_size=1), bus=bus, blobs=blobs)
    await again.rebuild()  # reads the same log: the bad message is skipped, not raised
    assert [e.event_id for e in await _trees(bus)] == before


async def test_an_outage_longer_than_the_consumers_retries_loses_no_event(monkeypatch):
    """The bus is down for longer than a consumer's five tries a second apart, from a seal
    on: the events that arrive meanwhile (another rollout's start) wait for the seal's
    effects, and are decided on once they are out, not dead-lettered."""
    import services.trajectory.service as service_module

    monkeypatch.setattr(service_module, "CARRY_OUT_RETRY_S", 0.1)
    monkeypatch.setattr(service_module, "CARRY_OUT_RETRY_MAX_S", 0.3)

    class Outage:
        def __init__(self, bus):
            self.bus, self.down = bus, False

        def __getattr__(self, name):
            return getattr(self.bus, name)

        async def publish_many(self, events):
            if self.down:
                raise ConnectionError("nats: timeout")
            return await self.bus.publish_many(events)

    bus, blobs = InMemoryBus(), MemoryBlobStore()
    await _one_rollout(bus, blobs, score=False)
    flaky = Outage(bus)
    service = create_service(LedgerConfig(RUN, group_size=1), bus=flaky, blobs=blobs)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    try:
        await asyncio.sleep(0.3)
        flaky.down = True
        await bus.publish(RolloutScored(run_id=RUN, rollout_id="r1", score=1.0))  # its seal is unsent
        await asyncio.sleep(0.2)
        await bus.publish(_started("r2", group="g2"))
        await asyncio.sleep(5.5)
        flaky.down = False
        await _publish_calls(bus, blobs, _rollout_calls("r2", 1))
        await bus.publish(RolloutFinished(run_id=RUN, rollout_id="r2", wall_time_s=1))
        await bus.publish(RolloutScored(run_id=RUN, rollout_id="r2", score=0.0))
        for _ in range(300):
            if {e.rollout_id for e in await _trees(bus) if isinstance(e, TreeSealed)} == {"r1", "r2"}:
                break
            await asyncio.sleep(0.02)
    finally:
        stop.set()
        await asyncio.wait_for(task, 3)
    assert bus.dead_letters == []
    assert {e.rollout_id for e in await _trees(bus) if isinstance(e, TreeSealed)} == {"r1", "r2"}
