"""The service on the in-memory bus and blob store: events in, tree events out."""

from __future__ import annotations

import asyncio

import pytest

from libs.common.blobs import MemoryBlobStore, encode_logprobs, encode_tokens
from libs.common.bus.memory import InMemoryBus
from libs.common.events import (CallRecorded, Context, ForkDetected, MicroStepQueued, RolloutFinished,
                                RolloutScored, RolloutScoringFailed, RolloutStarted, RolloutTimedOut,
                                SamplesSelected, TreeSealed)
from libs.common.events.calls import SessionHints
from services.trajectory.codec import decode_packed
from services.trajectory.ledger import LedgerConfig
from services.trajectory.packing import branch_tokens
from services.trajectory.service import create_service

from ._calls import SYSTEM, TASK, Agent, Recorder, full_sequences

RUN = "run1"
KEY = "a" * 64


async def _publish_calls(bus, blobs, calls):
    for c in calls:
        await bus.publish(await _recorded(blobs, c))


async def _recorded(blobs, c, **overrides):
    fields = dict(
        run_id=RUN, call_id=c.call_id, rollout_id=c.rollout_id, session_id="s1",
        api="anthropic_messages", parent_call_id=c.parent_call_id, prefix_len=c.prefix_len,
        new_input_digest=await blobs.put(encode_tokens(list(c.new_input_ids))),
        n_new_input_tokens=len(c.new_input_ids),
        output_digest=await blobs.put(encode_tokens(list(c.output_ids))),
        logprobs_digest=await blobs.put(encode_logprobs(list(c.output_logprobs))),
        n_output_tokens=len(c.output_ids), delivered=c.delivered,
        hints=SessionHints(agent_id=c.hints.agent_id, system_digest=c.hints.system_digest,
                           tools_digest=c.hints.tools_digest, role=c.hints.role),
    )
    fields.update(overrides)
    return CallRecorded(**fields)


def _rollout_calls(rollout: str, variant: int):
    rec = Recorder(rollout)
    main = Agent(rec, SYSTEM + TASK)
    main.say([20 + variant, 2], [3, 90])
    main.say([21, 2], [3, 91])
    main.compact([40 + variant, 2])
    main.say([22, 2], [3, 92])
    main.say([23, 24], delivered=False)
    main.say([23, 2])
    return rec.calls


def _started(rollout, group="g1"):
    return RolloutStarted(run_id=RUN, rollout_id=rollout, task_id="t1", group_id=group,
                          harness="claude_code", weight_version=0, api_key_digest=KEY, step=3)


async def _run_until(bus, blobs, predicate, config=None, timeout=5.0):
    service = create_service(config or LedgerConfig(RUN, group_size=2), bus=bus, blobs=blobs)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    try:
        for _ in range(int(timeout / 0.02)):
            if await predicate():
                break
            await asyncio.sleep(0.02)
    finally:
        stop.set()
        await asyncio.wait_for(task, 2)
    return service


async def _trees(bus):
    return [d.event async for d in bus.read(Context.TREES)]


async def _has(bus, kind):
    return any(isinstance(e, kind) for e in await _trees(bus))


async def _group_log(bus, blobs, *, score_first=False):
    await bus.publish(_started("r1"))
    await bus.publish(_started("r2"))
    calls = {r: _rollout_calls(r, v) for v, r in enumerate(("r1", "r2"))}
    if score_first:  # the evaluator's event is handled before the calls are consumed
        await bus.publish(RolloutScored(run_id=RUN, rollout_id="r1", score=1.0))
    for r in ("r1", "r2"):
        await _publish_calls(bus, blobs, calls[r])
    await bus.publish(RolloutFinished(run_id=RUN, rollout_id="r1", wall_time_s=10))
    await bus.publish(RolloutTimedOut(run_id=RUN, rollout_id="r2", wall_time_s=99))
    if not score_first:
        await bus.publish(RolloutScored(run_id=RUN, rollout_id="r1", score=1.0))
    await bus.publish(RolloutScored(run_id=RUN, rollout_id="r2", score=0.25, partial=True))
    return calls


async def test_a_group_flows_from_calls_to_micro_steps():
    bus, blobs = InMemoryBus(), MemoryBlobStore()
    calls = await _group_log(bus, blobs)
    service = await _run_until(bus, blobs, lambda: _has(bus, MicroStepQueued))
    # a long run holds no sealed tree, no packed tree once queued, no call message
    assert all(s.tree is None and not s.packed for s in service.ledger.rollouts.values())
    assert service._call_msgs == {}
    events = await _trees(bus)
    forks = [e for e in events if isinstance(e, ForkDetected)]
    assert sorted({e.fork_type for e in forks}) == ["compaction", "retry"]
    assert {e.role for e in forks if e.fork_type == "compaction"} <= {"main", "main_summary"}
    assert all(e.role is not None for e in forks)  # the role of the branch that starts there
    assert all(e.drift is not None for e in forks)  # and the proxy's drift class of its call
    assert sum(isinstance(e, TreeSealed) for e in events) == 2
    selected = {e.rollout_id: e for e in events if isinstance(e, SamplesSelected)}
    assert set(selected) == {"r1", "r2"}
    for rollout, ev in selected.items():
        seqs = full_sequences(calls[rollout])
        for ref in ev.samples:
            packed = decode_packed(await blobs.get(ref.digest))
            assert packed.rollout_id == rollout
            for end in packed.branches:
                assert branch_tokens(packed, end.last_token) == seqs[end.call_id]
    (step,) = [e for e in events if isinstance(e, MicroStepQueued)]
    assert step.step == 3 and step.group_id == "g1"
    assert step.advantages[0] > 0 > step.advantages[-1]
    assert step.sample_digests == [r.digest for r in selected["r1"].samples + selected["r2"].samples]
    sealed = next(e for e in events if isinstance(e, TreeSealed))
    assert await blobs.has(sealed.tree_digest)  # the summary gyre tree show reads


async def test_a_score_before_the_calls_waits_for_them_in_the_log():
    bus, blobs = InMemoryBus(), MemoryBlobStore()
    await _group_log(bus, blobs, score_first=True)
    await _run_until(bus, blobs, lambda: _has(bus, MicroStepQueued))
    sealed = {e.rollout_id: e for e in await _trees(bus) if isinstance(e, TreeSealed)}
    assert sealed["r1"].n_calls == 6


async def test_restart_publishes_nothing_twice_and_a_replay_gives_the_same_digests():
    bus, blobs = InMemoryBus(), MemoryBlobStore()
    await _group_log(bus, blobs)
    await _run_until(bus, blobs, lambda: _has(bus, MicroStepQueued))
    first = await _trees(bus)
    await _run_until(bus, blobs, lambda: asyncio.sleep(0.1, result=True))  # a restarted service
    assert [e.event_id for e in await _trees(bus)] == [e.event_id for e in first]
    other_bus, other_blobs = InMemoryBus(), MemoryBlobStore()  # the same log, replayed elsewhere
    await _group_log(other_bus, other_blobs)
    await _run_until(other_bus, other_blobs, lambda: _has(other_bus, MicroStepQueued))
    again = await _trees(other_bus)
    assert [(e.TYPE, e.event_id) for e in again] == [(e.TYPE, e.event_id) for e in first]
    digests = [r.digest for e in first if isinstance(e, SamplesSelected) for r in e.samples]
    assert digests == [r.digest for e in again if isinstance(e, SamplesSelected) for r in e.samples]


async def test_broken_and_orphan_calls_are_dead_lettered_with_a_reason():
    bus, blobs = InMemoryBus(), MemoryBlobStore()
    await bus.publish(_started("r1", group="solo"))
    calls = _rollout_calls("r1", 0)
    await _publish_calls(bus, blobs, calls[:2])
    orphan = calls[2].__class__(**{**calls[2].__dict__, "call_id": "lost", "parent_call_id": "ghost"})
    await bus.publish(await _recorded(blobs, orphan))
    await bus.publish(await _recorded(blobs, calls[3], n_output_tokens=99))
    await bus.publish(await _recorded(blobs, calls[4], call_id="no-blob", logprobs_digest="e" * 64))
    await bus.publish(RolloutFinished(run_id=RUN, rollout_id="r1", wall_time_s=1))
    await bus.publish(RolloutScored(run_id=RUN, rollout_id="r1", score=0.5))
    service = await _run_until(bus, blobs, lambda: _has(bus, MicroStepQueued),
                               config=LedgerConfig(RUN, group_size=1))
    reasons = {d.call_id: d.reason for d in service.dead}
    assert "ghost" in reasons["lost"]
    assert "the event says" in reasons[calls[3].call_id]
    assert "BlobNotFound" in reasons["no-blob"]
    assert {d.reason for d in bus.dead_letters} == set(reasons.values())
    assert service._call_msgs == {}  # dead-lettered or in the sealed tree


async def test_a_rollout_whose_scoring_failed_is_sealed_without_samples():
    bus, blobs = InMemoryBus(), MemoryBlobStore()
    await bus.publish(_started("r1"))
    await bus.publish(_started("r2"))
    for v, r in enumerate(("r1", "r2")):
        await _publish_calls(bus, blobs, _rollout_calls(r, v))
        await bus.publish(RolloutFinished(run_id=RUN, rollout_id=r, wall_time_s=1))
    await bus.publish(RolloutScored(run_id=RUN, rollout_id="r1", score=0.5))
    await bus.publish(RolloutScoringFailed(run_id=RUN, rollout_id="r2", reason="sandbox died"))
    await _run_until(bus, blobs, lambda: _has(bus, MicroStepQueued))
    events = await _trees(bus)
    assert {e.rollout_id for e in events if isinstance(e, TreeSealed)} == {"r1", "r2"}
    assert {e.rollout_id for e in events if isinstance(e, SamplesSelected)} == {"r1"}
    (step,) = [e for e in events if isinstance(e, MicroStepQueued)]
    assert step.advantages == [pytest.approx(0.0)] * len(step.advantages)


async def test_tree_show_rebuilds_a_rollout_from_the_log():
    from services.trajectory.show import show_rollout

    bus, blobs = InMemoryBus(), MemoryBlobStore()
    await _group_log(bus, blobs)
    config = LedgerConfig(RUN, group_size=2)
    text = await show_rollout(bus, blobs, config, "r1")
    assert text.startswith("r1 (claude_code, group g1): 6 calls")
    assert "score 1.000" in text and "compaction@" in text and "retry@" in text
    assert "main_summary =>branch *" in text
    dot = await show_rollout(bus, blobs, config, "r1", fmt="dot")
    assert dot.startswith("digraph") and "compaction" in dot
    svg = await show_rollout(bus, blobs, config, "r1", fmt="svg")
    assert svg.startswith("<svg") and svg.count("<rect") == 7 and "(retry)" in svg


async def test_the_same_flow_on_a_real_jetstream_and_object_store(js_bus):
    """The service against nats-server (started by the shared fixture), not the fake."""
    from libs.common.blobs import ObjectStoreBlobStore

    blobs = await ObjectStoreBlobStore.open(js_bus.js, "gyre-test-blobs")
    calls = await _group_log(js_bus, blobs)
    await _run_until(js_bus, blobs, lambda: _has(js_bus, MicroStepQueued), timeout=20.0)
    events = await _trees(js_bus)
    selected = [e for e in events if isinstance(e, SamplesSelected)]
    assert {e.rollout_id for e in selected} == {"r1", "r2"}
    seqs = full_sequences(calls["r2"])
    ref = next(e for e in selected if e.rollout_id == "r2").samples[0]
    packed = decode_packed(await blobs.get(ref.digest))
    for end in packed.branches:
        assert branch_tokens(packed, end.last_token) == seqs[end.call_id]
    memory_bus, memory_blobs = InMemoryBus(), MemoryBlobStore()
    await _group_log(memory_bus, memory_blobs)
    await _run_until(memory_bus, memory_blobs, lambda: _has(memory_bus, MicroStepQueued))
    assert [e.event_id for e in await _trees(memory_bus)] == [e.event_id for e in events]


def test_the_run_configs_budget_and_micro_step_size_reach_the_ledger_through_gyre_up():
    from gyre.up import plan_stack
    from libs.common.runconfig import load_run_config
    from services.trajectory.main import env_options, ledger_config

    cfg = load_run_config(None, ["loss.sample_budget=3", "trainer.micro_step_tokens=4096", "cells.count=0"])
    (launch,) = [x for x in plan_stack(cfg, "tok") if x.service == "trajectory"]
    config = ledger_config("r", env_options({}, launch.env))
    assert (config.budget, config.micro_step_tokens) == (3, 4096)
    # an option given on the command line wins over the environment
    assert ledger_config("r", env_options({"budget": 2}, launch.env)).budget == 2


async def test_a_rebuild_holds_one_open_tree_at_a_time_for_judged_rollouts():
    """Scores are read before calls: each judged rollout is built and sealed (its tree
    freed) before the next, so a restart of a long run does not hold every tree at once."""
    bus, blobs = InMemoryBus(), MemoryBlobStore()
    await _group_log(bus, blobs)
    service = create_service(LedgerConfig(RUN, group_size=2), bus=bus, blobs=blobs)
    peak = [0]
    seal = service.ledger.seal

    def counting_seal(rollout_id, cause):
        live = sum(1 for s in service.ledger.rollouts.values() if s.tree is not None)
        peak[0] = max(peak[0], live)
        return seal(rollout_id, cause)

    service.ledger.seal = counting_seal
    await service.rebuild()
    assert await _has(bus, MicroStepQueued)
    assert peak[0] == 1


async def test_a_call_recorded_after_the_live_seal_stays_out_of_the_rebuilt_tree():
    """A rollout is sealed live; then the record of its call cut off at the time limit
    lands (the live service rejects it). A restarted service reads every call of the
    rollout before sealing it, so it must take the call list of the logged TreeSealed as
    the seal's boundary: the group's micro-step then holds the sample the log announced."""
    bus, blobs = InMemoryBus(), MemoryBlobStore()
    config = LedgerConfig(RUN, group_size=2, train_undelivered=True)  # the late call would be trained
    await bus.publish(_started("r1"))
    await bus.publish(_started("r2"))
    rec = Recorder("r1")
    main = Agent(rec, SYSTEM + TASK)
    main.say([20, 2], [3, 90])
    main.say([21, 2], [3, 91])
    await _publish_calls(bus, blobs, rec.calls)
    await bus.publish(RolloutTimedOut(run_id=RUN, rollout_id="r1", wall_time_s=99))
    await bus.publish(RolloutScored(run_id=RUN, rollout_id="r1", score=0.3, partial=True))
    await _run_until(bus, blobs, lambda: _has(bus, SamplesSelected), config=config)
    announced = [r.digest for e in await _trees(bus) if isinstance(e, SamplesSelected) for r in e.samples]
    await bus.publish(await _recorded(blobs, main.say([22, 23], delivered=False)))  # lands after the seal
    await _publish_calls(bus, blobs, _rollout_calls("r2", 1))
    await bus.publish(RolloutFinished(run_id=RUN, rollout_id="r2", wall_time_s=5))
    await bus.publish(RolloutScored(run_id=RUN, rollout_id="r2", score=1.0))
    service = await _run_until(bus, blobs, lambda: _has(bus, MicroStepQueued), config=config)  # restarted
    assert set(service.seal_boundaries) == {"r1"}
    queued = [d for e in await _trees(bus) if isinstance(e, MicroStepQueued) for d in e.sample_digests]
    assert set(announced) <= set(queued)
