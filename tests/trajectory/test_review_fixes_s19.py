"""Review fixes (s19): a call id met twice is compared, not just counted.

The service used to return early for a call id the ledger already held, so a second copy
with other tokens or logprobs was never compared with the first (the fingerprint check of
``RolloutTree.add`` was never reached from the service) and disappeared without a trace.
Now an identical copy is a harmless duplicate, and another one under the same id is
dead-lettered as itself with a reason, the call recorded first kept in the tree.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from libs.common.blobs import MemoryBlobStore
from libs.common.bus.memory import InMemoryBus
from libs.common.events import (CallRecorded, Context, MicroStepQueued, RolloutFinished, RolloutScored,
                                SamplesSelected, TreeSealed)
from services.trajectory.ledger import LedgerConfig
from services.trajectory.service import create_service

from .test_service import RUN, _has, _recorded, _rollout_calls, _run_until, _started, _trees

SOLO = LedgerConfig(RUN, group_size=1)


async def _log(bus, blobs, *, extra=()):
    """One rollout's log, ``extra`` copies recorded before its end (the seal's catch-up read
    of the calls stream meets them all, whichever stream is consumed first)."""
    await bus.publish(_started("r1", group="solo"))
    calls = _rollout_calls("r1", 0)
    for c in calls:
        await bus.publish(await _recorded(blobs, c))
    for make in extra:
        await bus.publish(await make(blobs, calls))
    await bus.publish(RolloutFinished(run_id=RUN, rollout_id="r1", wall_time_s=1))
    await bus.publish(RolloutScored(run_id=RUN, rollout_id="r1", score=0.5))
    return calls


async def _same(blobs, calls):  # the proxy's record again (a new event id, the same content)
    return await _recorded(blobs, calls[1])


async def _other_tokens(blobs, calls):
    return await _recorded(blobs, replace(calls[1], output_ids=[*calls[1].output_ids[:-1], 99]))


async def _other_logprobs(blobs, calls):
    return await _recorded(blobs, replace(calls[1], output_logprobs=[-3.0] * len(calls[1].output_ids)))


async def _seqs_of(bus, call_id):
    return [d.seq async for d in bus.read(Context.CALLS) if isinstance(d.event, CallRecorded)
            and d.event.call_id == call_id]


async def _sealed(bus):
    events = await _trees(bus)
    return (next(e for e in events if isinstance(e, TreeSealed)),
            [r.digest for e in events if isinstance(e, SamplesSelected) for r in e.samples])


async def _outcome(extra=()):
    bus, blobs = InMemoryBus(), MemoryBlobStore()
    calls = await _log(bus, blobs, extra=extra)
    service = await _run_until(bus, blobs, lambda: _has(bus, MicroStepQueued), config=SOLO)
    return (bus, blobs, service, calls, *await _sealed(bus))


async def test_an_identical_copy_is_a_duplicate_and_other_content_is_dead_lettered_as_itself():
    _, _, _, _, clean_sealed, clean_samples = await _outcome()
    bus, blobs, service, calls, sealed, samples = await _outcome(extra=(_same, _other_tokens, _same, _other_logprobs))
    # the call recorded first is what the tree holds: the same tree, the same samples
    assert (sealed.tree_digest, samples) == (clean_sealed.tree_digest, clean_samples)
    seqs = await _seqs_of(bus, calls[1].call_id)  # original, same, other, same, other
    assert len(seqs) == 5
    dead = sorted((d.seq, d.reason) for d in bus.dead_letters)
    assert [s for s, _ in dead] == [seqs[2], seqs[4]]  # the two other copies, each as itself
    for _, reason in dead:
        assert "same call id, other content" in reason and "kept" in reason
    assert sorted(d.seq for d in service.dead) == [seqs[2], seqs[4]]
    assert service._call_msgs == {}  # the kept call's message went with its sealed tree

    # a rebuild from the same log decides the same: the same events, the same dead letters
    before = [e.event_id for e in await _trees(bus)]
    again = await _run_until(bus, blobs, lambda: _has(bus, MicroStepQueued), config=SOLO)
    assert [e.event_id for e in await _trees(bus)] == before
    assert sorted(d.seq for d in again.dead) == [seqs[2], seqs[4]]
    assert len(bus.dead_letters) == 2


async def test_a_copy_with_other_content_after_the_seal_is_dead_lettered_not_dropped():
    _, _, _, _, clean_sealed, clean_samples = await _outcome()
    bus, blobs = InMemoryBus(), MemoryBlobStore()
    calls = await _log(bus, blobs)
    service = create_service(SOLO, bus=bus, blobs=blobs)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    try:
        for _ in range(250):
            if await _has(bus, MicroStepQueued):
                break
            await asyncio.sleep(0.02)
        assert service.ledger.is_sealed("r1") and service.ledger.rollouts["r1"].tree is None
        await bus.publish(await _same(blobs, calls))
        await bus.publish(await _other_tokens(blobs, calls))
        await bus.publish(await _same(blobs, calls))
        for _ in range(250):
            if len(await _seqs_of(bus, calls[1].call_id)) == 4 and bus.dead_letters:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)  # the last identical copy is read too
    finally:
        stop.set()
        await asyncio.wait_for(task, 2)
    sealed, samples = await _sealed(bus)  # the call recorded first is what the tree holds
    assert (sealed.tree_digest, samples) == (clean_sealed.tree_digest, clean_samples)
    seqs = await _seqs_of(bus, calls[1].call_id)
    assert [(d.seq, "other content" in d.reason) for d in bus.dead_letters] == [(seqs[2], True)]
    assert [d.call_id for d in service.dead] == [calls[1].call_id]
    assert service._call_msgs == {}


async def test_other_delivery_or_weight_versions_under_the_same_id_is_a_conflict():
    async def undelivered(blobs, calls):
        return await _recorded(blobs, replace(calls[1], delivered=False))

    async def other_version(blobs, calls):
        return await _recorded(blobs, replace(calls[1], weight_version=7),
                               weight_spans=[{"start": 0, "end": len(calls[1].output_ids), "version": 7}])

    bus, _, _, calls, _, _ = await _outcome(extra=(undelivered, other_version))
    seqs = await _seqs_of(bus, calls[1].call_id)
    assert sorted(d.seq for d in bus.dead_letters) == seqs[1:]


# ---------------------------------------------------------------- loss normalisation per execution
# The trainer divides a step's loss by the distinct executions (rollout ids) of its queued
# samples (services/trainer/batch.py, step.py). An execution whose every token is masked
# has no loss of its own: queued, it only grew that divisor.

def _ledger_group(*, nan_r2: bool, late_r2: bool = False, group_size: int | None = None):
    from libs.common.events import GroupQueued, RolloutStarted
    from services.trajectory.ledger import TrajectoryLedger

    from ._calls import call

    def started(r):
        return RolloutStarted(run_id=RUN, rollout_id=r, task_id="t", group_id="g", harness="claude_code",
                              weight_version=0, api_key_digest="a" * 64, step=1, group_size=group_size)

    ledger, events = TrajectoryLedger(LedgerConfig(RUN)), []
    ledger.rollout_started(started("r1"))
    if not late_r2:
        ledger.rollout_started(started("r2"))
    ledger.call_recorded(call("a", [1, 10, 2], [20, 21], rollout="r1"))
    ledger.call_recorded(call("b", [1, 10, 2], [20, 22], rollout="r2",
                              logprobs=[float("nan"), -0.1] if nan_r2 else None))
    for r, score in (("r1", 1.0), ("r2", 0.0)):
        if late_r2 and r == "r2":
            events += ledger.rollout_started(started("r2")).events
        ledger.rollout_ended(r)
        scored = RolloutScored(run_id=RUN, rollout_id=r, score=score)
        ledger.rollout_judged(scored)
        events += ledger.seal(r, scored).events
    steps = [e for e in events if isinstance(e, MicroStepQueued)]
    groups = [e for e in events if isinstance(e, GroupQueued)]
    return ledger, steps, groups


def test_an_execution_with_no_trained_token_is_not_queued_but_its_score_counts():
    ledger, steps, groups = _ledger_group(nan_r2=True)  # r2's only output is context only
    r1, r2 = ledger.rollouts["r1"], ledger.rollouts["r2"]
    assert [s.n_trained_tokens for s in r2.samples] == [0]  # still listed in SamplesSelected
    (step,) = steps
    assert step.sample_digests == [s.digest for s in r1.samples]  # only r1's: one execution in the divisor
    assert step.advantages[0] > 0  # r1 is above the group's mean, r2's score counted
    assert groups[0].rollout_ids == ["r1", "r2"] and groups[0].samples == 1
    assert not r1.packed and not r2.packed  # nothing held after the group settled
    _, steps, _ = _ledger_group(nan_r2=False)  # the same group with r2 trainable: both queued
    assert len(steps[0].sample_digests) == 2


def test_a_rollout_started_after_its_sizeless_group_settled_is_dropped_explicitly(caplog):
    ledger, steps, groups = _ledger_group(nan_r2=False, late_r2=True)
    assert [g.rollout_ids for g in groups] == [["r1"]]  # settled before r2 started: no size stated
    assert not ledger.rollouts["r2"].packed  # not held for the rest of the run
    assert "not queued for training" in caplog.text
    # with the size stated the group waits for r2
    _, steps, groups = _ledger_group(nan_r2=False, late_r2=True, group_size=2)
    assert [g.rollout_ids for g in groups] == [["r1", "r2"]] and len(steps[0].sample_digests) == 2


# ---------------------------------------------------------------- floats compared as floats
def test_a_copy_with_nan_logprobs_or_temperature_is_still_a_duplicate():
    """The fingerprint compares floats as their float32 bytes: NaN == NaN is False, so a
    float compare made an identical copy of a context-only call a 'conflict'."""
    from services.trajectory.rollout_tree import RolloutTree

    from ._calls import call

    rt = RolloutTree("r1")
    for c in (call("a", [1, 10, 2], [20, 21], logprobs=[float("nan"), -0.1]),
              call("b", [1, 11, 2], [20, 22], logprob_temperature=float("nan"))):
        assert rt.add(c).outcome == "applied"  # placed, context only
        assert rt.add(replace(c, output_logprobs=list(c.output_logprobs))).outcome == "duplicate"
    assert rt.add(call("a", [1, 10, 2], [20, 21], logprobs=[-0.5, -0.1])).outcome == "rejected"
