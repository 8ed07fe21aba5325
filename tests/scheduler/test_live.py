"""The live scheduler over a real nats-server: rebuilds cells from the log, releases the
core cell to training when micro-steps wait and no calls run, sends the switch, applies
the cell's answer from the log, and reclaims it when calls pile up."""

from __future__ import annotations

import asyncio
import time

from libs.common.events import (CellRegistered, Context, MicroStepQueued, SwitchCompleted, SwitchPhaseEntered,
                                SwitchRequested)
from services.scheduler.core import ElasticPolicy
from services.scheduler.core.translate import DECLARED
from services.scheduler.live import LiveScheduler

RUN = "live"
D = "ab" * 32


async def test_release_and_reclaim_through_the_log(js_bus) -> None:
    bus = js_bus
    for i in range(3):
        await bus.publish(CellRegistered(run_id=RUN, cell=f"c{i}", role="inference", is_core=(i == 0), capacity=4))
    stats = {"cells": [{"name": f"c{i}", "in_flight": 0} for i in range(3)]}
    sent: list[tuple[str, str]] = []

    async def proxy_stats() -> dict:
        return stats

    async def send_switch(cell: str, to_role: str, causation: str) -> dict:
        sent.append((cell, to_role))  # answered through the log, as a real cell agent does
        phases = ("draining", "migrating", "releasing", "joining") if to_role == "training" else ("leaving", "resuming")
        for phase in phases:
            await bus.publish(SwitchPhaseEntered(run_id=RUN, cell=cell, phase=phase, causation_id=causation))
        await bus.publish(SwitchCompleted(run_id=RUN, cell=cell, role=to_role, weight_version=0,
                                          phase_timings={"joining": 0.1}, causation_id=causation))
        return {"ok": True, "role": to_role}

    clock = [time.time()]
    live = LiveScheduler(run_id=RUN, bus=bus, policy=ElasticPolicy(hold_s=0, min_dwell_s=0, smoothing_s=0),
                         proxy_stats=proxy_stats, send_switch=send_switch, tick_s=0.05, clock=lambda: clock[0])
    stop = asyncio.Event()
    runner = asyncio.create_task(live.run(stop))
    await asyncio.sleep(0.5)
    assert {c.name for c in live.state.cells} == {"c0", "c1", "c2"}
    await bus.publish(MicroStepQueued(run_id=RUN, step=0, micro_step="0.0", group_id="g", sample_digests=[D],
                                      advantages=[1.0], n_tokens=10))
    for _ in range(100):
        clock[0] += 10
        await asyncio.sleep(0.05)
        if sent:
            break
    assert sent and sent[0] == ("c0", "training")  # the core cell goes first
    for _ in range(100):
        await asyncio.sleep(0.05)
        if live.state.cell("c0").phase.value == "training":
            break
    assert live.state.cell("c0").phase.value == "training"
    # demand rises far above what the inference cells serve: a training cell comes back
    stats["cells"] = [{"name": "c1", "in_flight": 40}, {"name": "c2", "in_flight": 40}, {"name": "c0", "in_flight": 0}]
    live.demand.queued.clear()
    for _ in range(200):
        clock[0] += 10
        await asyncio.sleep(0.05)
        if any(role == "inference" for _, role in sent):
            break
    stop.set()
    await asyncio.wait_for(runner, 10)
    back = [cell for cell, role in sent if role == "inference"]
    trained = [cell for cell, role in sent if role == "training"]
    assert back and (back[0] != "c0" or trained == ["c0"])  # the core is the last out of training
    requested = [(e.cell, e.to_role) async for e in _requests(bus)]
    assert requested == sent  # every command is in the log, in order
    # the schedule rebuilt from the cells stream alone is the live scheduler's own
    from services.scheduler.replay import CellsFold, compare, summary

    final = live.final
    assert final is not None and final["switches"] == len(sent) and not final["errors"]
    assert [p for _, p in final["timelines"]["c0"]][:5] == ["inference", "draining", "migrating", "releasing",
                                                            "joining"]
    fold = CellsFold()
    async for d in bus.read(Context.CELLS, filter_subject=f"gyre.{RUN}.cells.>", until_seq=final["through_seq"]):
        fold.apply(d.event)
    result = compare(summary(fold), final)
    assert result["same_as_live"], result
    fold.timelines["c0"].pop()  # a replay that lost an event says so
    assert compare(summary(fold), final)["same_as_live"] is False


async def _requests(bus):
    async for d in bus.read(Context.CELLS):
        if isinstance(d.event, SwitchRequested):
            yield d.event


def test_the_replay_module_example() -> None:
    import doctest

    import services.scheduler.replay as replay

    assert doctest.testmod(replay).failed == 0


async def test_the_live_state_is_what_the_log_replays_to_the_microsecond(js_bus) -> None:
    """Its own facts are applied as their events record them: a clock reading at a
    rounding boundary (.0024996 s) gives the same digests live and replayed."""
    from services.scheduler.replay import CellsFold, compare, summary

    bus = js_bus
    await bus.publish(CellRegistered(run_id="edge", cell="c0", role="inference", is_core=True, capacity=4))

    async def proxy_stats() -> dict:
        return {"cells": [{"name": "c0", "in_flight": 1}]}

    async def send_switch(cell: str, to_role: str, causation: str) -> dict:
        return {"ok": True}

    live = LiveScheduler(run_id="edge", bus=bus, policy=ElasticPolicy(), proxy_stats=proxy_stats,
                         send_switch=send_switch, clock=lambda: 1764477447.0024996)
    await live.catch_up_cells()
    assert any(type(f).__name__ == "WaterLevelObserved" for f in await live.tick())
    final = await live.finish()
    fold = CellsFold()
    async for d in bus.read(Context.CELLS, filter_subject="gyre.edge.cells.>", until_seq=final["through_seq"]):
        fold.apply(d.event)
    assert compare(summary(fold), final)["same_as_live"]
    assert live.state.level_at == fold.state.level_at  # the microsecond the event stores


def _two_cells(run: str):
    return [CellRegistered(run_id=run, cell="c0", role="inference", is_core=True, capacity=4),
            CellRegistered(run_id=run, cell="c1", role="inference", capacity=4)]


async def _work(bus, run: str) -> None:
    await bus.publish(MicroStepQueued(run_id=run, step=0, micro_step="0.0", group_id="g", sample_digests=[D],
                                      advantages=[1.0], n_tokens=10))


def _eager(run: str, bus, proxy_stats, send_switch) -> LiveScheduler:
    return LiveScheduler(run_id=run, bus=bus, policy=ElasticPolicy(hold_s=0, min_dwell_s=0, smoothing_s=0),
                         proxy_stats=proxy_stats, send_switch=send_switch, clock=time.time)


async def _idle_pair(bus, run: str, on_stats=None) -> tuple[LiveScheduler, list]:
    """Two idle cells registered; the scheduler caught up; the commands it sends, listed.
    ``on_stats(sent)`` runs whenever the scheduler reads the proxy (while it decides)."""
    sent: list[tuple[str, str]] = []
    for ev in _two_cells(run):
        await bus.publish(ev)

    async def proxy_stats() -> dict:
        if on_stats is not None:
            await on_stats(sent)
        return {"cells": [{"name": "c0", "in_flight": 0}, {"name": "c1", "in_flight": 0}]}

    async def send_switch(cell: str, to_role: str, causation: str) -> dict:
        sent.append((cell, to_role))
        return {"ok": True}

    live = _eager(run, bus, proxy_stats, send_switch)
    await live.catch_up_cells()
    return live, sent


async def _replayed(bus, run: str):
    from services.scheduler.replay import CellsFold

    fold = CellsFold()
    async for d in bus.read(Context.CELLS, filter_subject=f"gyre.{run}.cells.>"):
        fold.apply(d.event)
    return fold


async def test_a_switch_is_sent_only_once_the_log_accepted_it(js_bus) -> None:
    """A cell event written while the scheduler decided (here: c0's agent restarted and
    registered in training) lands before the request; the request, illegal after it, is
    refused by the live fold as by a replay, and no command goes out."""
    run, bus = "race", js_bus

    async def c0_restarts_in_training(sent) -> None:
        if not sent:
            await bus.publish(CellRegistered(run_id=run, cell="c0", role="training", is_core=True, capacity=4))

    live, sent = await _idle_pair(bus, run, on_stats=c0_restarts_in_training)
    await _work(bus, run)
    await asyncio.sleep(0.3)  # the demand follower is not running: feed it by hand
    async for d in bus.read(Context.TREES):
        live.demand.apply(d.event)
    facts = await live.tick()
    assert any(type(f).__name__ == "SwitchStarted" for f in facts)  # decided on the state before c0's report
    await asyncio.sleep(0.1)
    assert sent == []
    assert live.state.cell("c0").phase.value == "training"
    assert any("already in role training" in e for e in live.fold.errors)
    replay = await _replayed(bus, run)
    assert (replay.state, replay.errors) == (live.state, live.fold.errors)


async def test_a_failed_publish_leaves_no_trace_and_sends_nothing(js_bus) -> None:
    bus = js_bus
    live, sent = await _idle_pair(bus, "nopub")
    live.demand.queued["0.0"] = 0  # training work waits
    publish = bus.publish

    async def failing(event):
        if type(event).__name__ == "SwitchRequested":
            raise ConnectionError("nats went away")
        return await publish(event)

    bus.publish = failing
    try:
        await live.tick()
    except ConnectionError:
        pass
    else:
        raise AssertionError("the tick should fail")
    finally:
        bus.publish = publish
    await asyncio.sleep(0.1)
    assert sent == [] and {c.phase.value for c in live.state.cells} == {"inference"}
    await live.catch_up_cells()
    assert {c.phase.value for c in live.state.cells} == {"inference"}  # the log holds no request either
    await live.tick()  # the next tick decides again, and sends
    await asyncio.sleep(0.1)
    assert sent == [("c0", "training")]


async def test_a_command_nobody_answers_puts_the_cell_back(js_bus) -> None:
    from nats.errors import NoRespondersError

    run, bus = "noagent", js_bus
    for ev in _two_cells(run):
        await bus.publish(ev)

    async def proxy_stats() -> dict:
        return {"cells": [{"name": "c0", "in_flight": 0}, {"name": "c1", "in_flight": 0}]}

    async def send_switch(cell: str, to_role: str, causation: str) -> dict:
        raise NoRespondersError()

    live = _eager(run, bus, proxy_stats, send_switch)
    await live.catch_up_cells()
    live.demand.queued["0.0"] = 0
    await live.tick()
    for _ in range(50):
        await asyncio.sleep(0.05)
        if live.switch_answers:
            break
    await live.catch_up_cells()
    c0 = live.state.cell("c0")
    assert c0.phase.value == "inference" and "no cell agent answered" in c0.last_failure
    assert not live.fold.errors
    # and it is not drained again at once, every tick (each attempt moves its sessions away)
    facts = await live.tick()
    assert not any(type(f).__name__ == "SwitchStarted" for f in facts)
    replay = await _replayed(bus, run)
    assert replay.state == live.state


async def test_a_request_stored_behind_a_lost_ack_is_still_sent(js_bus) -> None:
    bus = js_bus
    live, sent = await _idle_pair(bus, "lostack")
    live.demand.queued["0.0"] = 0
    publish = bus.publish

    async def lossy(event):
        seq = await publish(event)
        if type(event).__name__ == "SwitchRequested":
            raise TimeoutError("ack lost (the request is stored)")
        return seq

    bus.publish = lossy
    try:
        await live.tick()
    except TimeoutError:
        pass
    finally:
        bus.publish = publish
    assert sent == []
    await live.catch_up_cells()  # the next round reads the request back ...
    await live.tick()  # ... and sends it (and decides nothing new for c0, which is draining)
    await asyncio.sleep(0.1)
    assert sent == [("c0", "training")]


async def test_a_request_a_stopped_scheduler_never_sent_goes_out_after_a_restart(js_bus) -> None:
    """The scheduler before stored c0's request and stopped before sending it: the log has
    c0 draining. The next one sends it on its first tick, with the request's id (an agent
    that did get it answers it from memory), and not again while it waits for the answer."""
    from services.scheduler.core import ColocatePolicy

    run, bus = "restart", js_bus
    for ev in _two_cells(run):
        await bus.publish(ev)
    request = SwitchRequested(run_id=run, cell="c0", from_role="inference", to_role="training", water_level=0.0,
                              reason="backlog")
    await bus.publish(request)
    sent: list[tuple[str, str, str]] = []
    answer = asyncio.Event()

    async def proxy_stats() -> dict:
        return {"cells": [{"name": "c0", "in_flight": 0}, {"name": "c1", "in_flight": 0}]}

    async def send_switch(cell: str, to_role: str, causation: str) -> dict:
        sent.append((cell, to_role, causation))
        await answer.wait()  # the agent at work
        return {"ok": True}

    live = LiveScheduler(run_id=run, bus=bus, policy=ColocatePolicy(), proxy_stats=proxy_stats,
                         send_switch=send_switch)
    await live.catch_up_cells()
    assert live.state.cell("c0").phase.value == "draining"
    await live.tick()
    await asyncio.sleep(0.05)
    assert sent == [("c0", "training", request.event_id)]
    await live.tick()
    await asyncio.sleep(0.05)
    assert len(sent) == 1
    answer.set()


async def test_a_switch_nothing_is_heard_of_is_sent_again_and_a_dead_agent_declared(js_bus) -> None:
    """c0's agent died half-way (the log has it migrating) and no command of ours waits on
    it: once nothing was heard of it for the request timeout, the command goes again;
    nobody answers. An agent took the switch (it is past its first phase), so the switch is
    declared failed for it: back in inference, silent until it is heard from."""
    from nats.errors import NoRespondersError

    from services.scheduler.core import ColocatePolicy

    run, bus = "silent", js_bus
    request = SwitchRequested(run_id=run, cell="c0", from_role="inference", to_role="training", water_level=0.0,
                              reason="backlog")
    for ev in (*_two_cells(run), request, SwitchPhaseEntered(run_id=run, cell="c0", phase="draining"),
               SwitchPhaseEntered(run_id=run, cell="c0", phase="migrating")):
        await bus.publish(ev)
    sent: list[tuple[str, str, str]] = []

    async def proxy_stats() -> dict:
        return {"cells": [{"name": "c0", "in_flight": 0}, {"name": "c1", "in_flight": 0}]}

    async def send_switch(cell: str, to_role: str, causation: str) -> dict:
        sent.append((cell, to_role, causation))
        raise NoRespondersError()

    clock = [time.time()]
    live = LiveScheduler(run_id=run, bus=bus, policy=ColocatePolicy(), proxy_stats=proxy_stats,
                         send_switch=send_switch, clock=lambda: clock[0])  # the request timeout: 300 s
    await live.catch_up_cells()
    for advance in (0, 100, 150):  # 250 s of silence
        clock[0] += advance
        await live.tick()
        await asyncio.sleep(0.05)
    assert sent == [] and live.state.cell("c0").phase.value == "migrating"
    clock[0] += 100
    await live.tick()
    for _ in range(50):
        await asyncio.sleep(0.05)
        if live.switch_answers:
            break
    assert sent == [("c0", "training", request.event_id)]
    await live.tick()  # the declaration is written at the next tick
    await live.catch_up_cells()
    c0 = live.state.cell("c0")
    assert c0.phase.value == "inference" and c0.silent
    assert c0.last_failure.startswith(DECLARED) and "no agent listened" in c0.last_failure
    assert not live.fold.errors
    assert (await _replayed(bus, run)).state == live.state


async def test_colocate_moves_every_cell_to_training_once_the_batch_is_queued(js_bus) -> None:
    from libs.common.events import GroupQueued, RolloutStarted

    from services.scheduler.core import ColocatePolicy

    run, bus = "colocate", js_bus
    for ev in _two_cells(run):
        await bus.publish(ev)
    sent: list[tuple[str, str]] = []

    async def proxy_stats() -> dict:
        return {"cells": [{"name": "c0", "in_flight": 0}, {"name": "c1", "in_flight": 0}]}

    async def send_switch(cell: str, to_role: str, causation: str) -> dict:
        sent.append((cell, to_role))
        return {"ok": True}

    live = LiveScheduler(run_id=run, bus=bus, policy=ColocatePolicy(), proxy_stats=proxy_stats,
                         send_switch=send_switch, groups_per_step=1)
    await bus.publish(RolloutStarted(run_id=run, rollout_id="r1", task_id="t", group_id="g", harness="h",
                                     weight_version=0, api_key_digest=D, step=0, purpose="train"))
    await bus.publish(MicroStepQueued(run_id=run, step=0, micro_step="g.0", group_id="g", sample_digests=[D],
                                      advantages=[1.0], n_tokens=10, group_micro_steps=1))
    await _feed_demand(live)
    await live.catch_up_cells()
    await live.tick()
    await asyncio.sleep(0.05)
    assert sent == []  # the group is not queued in full yet
    await bus.publish(GroupQueued(run_id=run, step=0, group_id="g", micro_steps=1))
    await _feed_demand(live)
    await live.tick()
    await asyncio.sleep(0.05)
    assert sent == [("c0", "training"), ("c1", "training")]  # the core first


async def _feed_demand(live: LiveScheduler) -> None:
    """The demand followers are not running: feed the new demand events by hand."""
    live.demand = type(live.demand)(groups_per_step=live.demand.groups_per_step)
    for context in (Context.ROLLOUTS, Context.TREES):
        async for d in live.bus.read(context):
            live.demand.apply(d.event)


async def test_the_first_tick_sees_the_whole_history(js_bus) -> None:
    """Demand written before the scheduler started is read to the streams' ends before it
    decides anything (no fixed wait for the followers)."""
    run, bus = "history", js_bus
    for ev in _two_cells(run):
        await bus.publish(ev)
    n = 300
    await bus.publish_many([MicroStepQueued(run_id=run, step=0, micro_step=f"0.{i}", group_id="g",
                                            sample_digests=[D], advantages=[1.0], n_tokens=10) for i in range(n)])
    seen: list[int] = []
    stop = asyncio.Event()

    async def proxy_stats() -> dict:
        seen.append(live.demand.backlog)
        stop.set()
        return {"cells": [{"name": "c0", "in_flight": 1}, {"name": "c1", "in_flight": 1}]}

    async def send_switch(cell: str, to_role: str, causation: str) -> dict:
        return {"ok": True}

    live = LiveScheduler(run_id=run, bus=bus, policy=ElasticPolicy(), proxy_stats=proxy_stats,
                         send_switch=send_switch, tick_s=0.01)
    await asyncio.wait_for(live.run(stop), 20)
    assert seen[0] == n


def test_a_second_stored_copy_of_a_cells_event_changes_nothing() -> None:
    """A publisher's retry past the bus's duplicate window stores an event twice (same id).
    The fold reads the second copy as nothing: the same state, timelines and no error,
    whether the copy comes at once or after later events."""
    from services.scheduler.replay import CellsFold

    events = [CellRegistered(run_id="r", cell="c0", role="inference", is_core=True, capacity=4),
              SwitchRequested(run_id="r", cell="c0", from_role="inference", to_role="training",
                              water_level=0.0, reason="backlog"),
              *(SwitchPhaseEntered(run_id="r", cell="c0", phase=p) for p in ("migrating", "releasing", "joining")),
              SwitchCompleted(run_id="r", cell="c0", role="training", weight_version=0)]
    once, twice = CellsFold(), CellsFold()
    for ev in events:
        once.apply(ev)
    for i, ev in enumerate(events):
        twice.apply(ev)
        twice.apply(ev)  # at once
        if i >= 2:
            twice.apply(events[i - 2])  # after later events
    assert (twice.state, twice.timelines, twice.errors) == (once.state, once.timelines, [])
    assert twice.applied == once.applied and twice.duplicates == len(events) + len(events) - 2


async def test_the_live_scheduler_reads_a_second_copy_of_its_request_as_nothing(js_bus) -> None:
    """Its own SwitchRequested read back twice: the switch is still sent, once."""
    run, bus = "dup", js_bus
    live, sent = await _idle_pair(bus, run)
    await _work(bus, run)
    await asyncio.sleep(0.3)
    async for d in bus.read(Context.TREES):
        live.demand.apply(d.event)
    facts = await live.tick()
    assert any(type(f).__name__ == "SwitchStarted" for f in facts)
    requests = [d.event async for d in bus.read(Context.CELLS, filter_subject=f"gyre.{run}.cells.>")
                if isinstance(d.event, SwitchRequested)]
    live._apply_event(requests[-1])  # the second copy, read before the next tick
    await live.tick()
    await asyncio.sleep(0.1)
    assert len(sent) == 1 and live.fold.duplicates >= 1 and live.fold.errors == []
