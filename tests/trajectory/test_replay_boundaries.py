"""Rebuilding trees from the log with the seal boundaries `gyre replay --trees` reads from
each recorded TreeSealed summary: a rollout with a rejected call seals the same tree again
(its summary lists the rejection; a boundary made of the held calls alone left it out)."""

from __future__ import annotations

import json

from libs.common.blobs import MemoryBlobStore
from libs.common.bus.memory import InMemoryBus
from libs.common.events import Context, RolloutFinished, RolloutScored, TreeSealed
from services.trajectory.ledger import LedgerConfig
from services.trajectory.service import TrajectoryService

from ._calls import SYSTEM, TASK, Agent, Recorder, call
from .test_service import RUN, _has, _recorded, _run_until, _started, _trees


async def test_a_rollout_with_a_rejected_call_replays_to_the_same_sealed_tree():
    bus, blobs = InMemoryBus(), MemoryBlobStore()
    config = LedgerConfig(RUN, group_size=1)
    await bus.publish(_started("r1"))
    rec = Recorder("r1")
    agent = Agent(rec, SYSTEM + TASK)
    agent.say([20, 2], [3, 90])
    agent.say([21, 2])
    bad = call("bad", [5], [22], parent=rec.calls[0].call_id, prefix=999, rollout="r1")  # longer than its parent
    for c in rec.calls + [bad]:
        await bus.publish(await _recorded(blobs, c))
    await bus.publish(RolloutFinished(run_id=RUN, rollout_id="r1", wall_time_s=1))
    await bus.publish(RolloutScored(run_id=RUN, rollout_id="r1", score=1.0))
    await _run_until(bus, blobs, lambda: _has(bus, TreeSealed), config=config)
    live = [e for e in await _trees(bus) if isinstance(e, TreeSealed)]
    assert [r["call_id"] for r in json.loads(await blobs.get(live[0].tree_digest))["rejected"]] == ["bad"]

    copy = InMemoryBus()  # what `gyre replay --trees` rebuilds from: the inputs, not the trees
    for ctx in (Context.ROLLOUTS, Context.CALLS, Context.SCORES):
        for m in bus.streams.get(ctx.stream, []):
            copy.load(ctx.stream, m.seq, m.subject, m.data, m.time)
    service = TrajectoryService(config, bus=copy, blobs=blobs)
    await service.load_seal_boundaries({e.rollout_id: e.tree_digest for e in live}, blobs)
    await service.rebuild()
    replayed = [d.event async for d in copy.read(Context.TREES) if isinstance(d.event, TreeSealed)]
    assert [e.tree_digest for e in replayed] == [live[0].tree_digest]
