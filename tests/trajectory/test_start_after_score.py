"""The service reads three streams; live, a rollout's score may be read before its start.
It must seal the rollout as a rebuild does (the rebuild reads the start first): with the
harness's rules, hence the same roles and sample digests. And a call's logprob temperature
reaches the packed tree the trainer reads."""

from __future__ import annotations

from libs.common.blobs import MemoryBlobStore
from libs.common.bus.memory import InMemoryBus
from libs.common.events import (Context, GroupQueued, RolloutFinished, RolloutScored, RolloutStarted,
                                SamplesSelected, TreeSealed)
from services.trajectory.codec import MAGIC_TEMPERED, decode_packed
from services.trajectory.ledger import LedgerConfig
from services.trajectory.main import harness_rules
from services.trajectory.service import create_service

from .test_ledger import _claude_code_compaction_timeout
from .test_service import KEY, RUN, _recorded


async def _log(bus, blobs, calls, temperature):
    start = RolloutStarted(run_id=RUN, rollout_id="r1", task_id="t", group_id="g", harness="claude_code",
                           weight_version=0, api_key_digest=KEY, step=0, group_size=1)
    await bus.publish(start)
    for c in calls:
        await bus.publish(await _recorded(blobs, c, logprob_temperature=temperature))
    await bus.publish(RolloutFinished(run_id=RUN, rollout_id="r1", wall_time_s=5))
    await bus.publish(RolloutScored(run_id=RUN, rollout_id="r1", score=0.3, partial=True))


async def _seal(order, temperature=0.7):
    """Feed the log to a service context by context, in ``order``; the tree events."""
    enc, calls = _claude_code_compaction_timeout()
    bus, blobs = InMemoryBus(), MemoryBlobStore()
    await _log(bus, blobs, calls, temperature)
    service = create_service(LedgerConfig(RUN, rules=harness_rules(enc)), bus=bus, blobs=blobs)
    for ctx in order:
        async for d in bus.read(ctx, filter_subject=f"gyre.{RUN}.{ctx.value}.>"):
            await service.handle(d)
    return [d.event async for d in bus.read(Context.TREES)], blobs


async def test_a_score_read_before_the_start_seals_as_the_rebuild_does():
    replay, _ = await _seal([Context.ROLLOUTS, Context.SCORES, Context.CALLS])  # the rebuild's order
    live, blobs = await _seal([Context.SCORES, Context.CALLS, Context.ROLLOUTS])

    def samples(events):
        return [(s.role, s.digest) for e in events if isinstance(e, SamplesSelected) for s in e.samples]

    assert samples(live) == samples(replay)
    assert [role for role, _ in samples(live)] == ["main_summary"]  # Claude Code's marker, not generic rules
    assert [e.event_id for e in live] == [e.event_id for e in replay]
    assert sum(isinstance(e, TreeSealed) for e in live) == 1
    assert any(isinstance(e, GroupQueued) for e in live)  # carried out by the service, group queued
    # the temperature the proxy recorded is on every trained token of the sample
    (digest,) = [d for _, d in samples(live)]
    data = await blobs.get(digest)
    assert data.startswith(MAGIC_TEMPERED)
    packed = decode_packed(data)
    assert {round(t, 4) for t, m in zip(packed.logprob_temperatures, packed.loss_mask) if m} == {0.7}


async def test_a_start_that_seals_reads_the_rollouts_calls_from_the_log_first():
    """Score, then start (which seals), then the calls stream: the seal must not miss the
    calls the live consumer has not read yet."""
    replay, _ = await _seal([Context.ROLLOUTS, Context.SCORES, Context.CALLS])
    live, _ = await _seal([Context.SCORES, Context.ROLLOUTS, Context.CALLS])
    assert [e.event_id for e in live] == [e.event_id for e in replay]
