"""An event stored twice (a publisher's retry after a lost ack, past JetStream's duplicate
window: same event id, same bytes, two stream sequences) is one event to ``gyre report``
and ``gyre replay --trees``. The second copies here are stored under another message id."""

from __future__ import annotations

import asyncio

from gyre.report import RunFacts, figures
from libs.common.events import (CallRecorded, Context, GroupQueued, MicroStepQueued, RolloutFinished, RolloutScored,
                                RolloutStarted, RunStarted, SamplesSelected, StepApplied, TreeSealed)
from libs.common.events.trees import SampleRef

D = "ab" * 32
RUN = "duprun"


def _events() -> list:
    return [
        RunStarted(run_id=RUN, config={}),
        RolloutStarted(run_id=RUN, rollout_id="a", task_id="t", group_id="g", harness="h", weight_version=0,
                       api_key_digest=D, step=0),
        CallRecorded(run_id=RUN, call_id="1", rollout_id="a", session_id="s", api="openai_chat", prefix_len=0,
                     new_input_digest=D, n_new_input_tokens=100, output_digest=D, logprobs_digest=D,
                     n_output_tokens=20),
        RolloutFinished(run_id=RUN, rollout_id="a", task_id="t", exit_status=1, wall_time_s=1.0),
        RolloutScored(run_id=RUN, rollout_id="a", score=0.5),
        TreeSealed(run_id=RUN, rollout_id="a", tree_digest=D, n_calls=1, n_nodes=1, n_tokens=120),
        SamplesSelected(run_id=RUN, rollout_id="a", samples=[SampleRef(digest=D, role="main", n_tokens=120,
                                                                  n_trained_tokens=20)]),
        MicroStepQueued(run_id=RUN, step=0, micro_step="0.0", group_id="g", sample_digests=[D], advantages=[0.1],
                        n_tokens=120),
        StepApplied(run_id=RUN, step=0, weight_version=1, micro_steps_used=["0.0"], loss={"mean": 0.5}),
    ]


def test_report_counts_a_twice_stored_event_once():
    once, twice = RunFacts(RUN), RunFacts(RUN)
    events = _events()
    for ev in events:
        once.add(ev)
    for ev in events + events:  # every event stored a second time, later in the log
        twice.add(ev)
    assert figures(twice) == figures(once)
    assert figures(once)["micro_step_tokens"] == 120 and figures(once)["calls"] == 1
    assert twice.run_starts == 1


async def _store_again(bus, ev, msg_id: str) -> None:
    await bus.publish_raw(ev.subject, ev.to_json(), {"Nats-Msg-Id": msg_id, "Gyre-Type": ev.TYPE})


async def test_replay_trees_compares_distinct_events(js_bus, nats_server):
    from gyre.events_cmd import replay_trees
    from gyre.report import collect
    from libs.common.blobs import ObjectStoreBlobStore
    from services.trajectory.main import ledger_config
    from services.trajectory.service import TrajectoryService
    from tests.trajectory.test_service import KEY, _recorded, _rollout_calls

    blobs = await ObjectStoreBlobStore.open(js_bus.js, "gyre-blobs")
    await js_bus.publish(RunStarted(run_id=RUN, config={}))
    for i, rid in enumerate(("r1", "r2")):
        await js_bus.publish(RolloutStarted(run_id=RUN, rollout_id=rid, task_id="t1", group_id="g1",
                                            harness="claude_code", weight_version=0, api_key_digest=KEY, step=0,
                                            group_size=2))
        for c in _rollout_calls(rid, i):
            await js_bus.publish(await _recorded(blobs, c, run_id=RUN))
        await js_bus.publish(RolloutFinished(run_id=RUN, rollout_id=rid, task_id="t1", exit_status=0,
                                             wall_time_s=1.0, snapshot_digest="b" * 64))
        await js_bus.publish(RolloutScored(run_id=RUN, rollout_id=rid, score=float(i)))
    svc = TrajectoryService(ledger_config(RUN, {}), bus=js_bus, blobs=blobs)
    stop = asyncio.Event()
    task = asyncio.create_task(svc.run(stop))
    for _ in range(200):
        if any(isinstance(e, MicroStepQueued) for e in [d.event async for d in js_bus.read(Context.TREES)]):
            break
        await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(task, 10)
    trees = [d.event async for d in js_bus.read(Context.TREES)]
    batch = [e for e in trees if isinstance(e, (GroupQueued, MicroStepQueued))]
    assert batch
    before = figures(await collect(js_bus, RUN))
    for n, ev in enumerate(batch):  # the service's batch stored a second time
        await _store_again(js_bus, ev, f"again-{n}")

    result = await replay_trees(nats_server.url, RUN)
    assert result["identical"], result
    assert figures(await collect(js_bus, RUN)) == before
