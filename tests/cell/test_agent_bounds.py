"""Bounds on a switch, with the real proxy, real embedded engines and a real nats-server:
an agent that hung and wakes up to find the scheduler declared its switch failed rolls
back instead of going on; an evacuation that runs past the deadline the agent gives the
proxy stops, and the switch rolls back consistently with what the proxy moved."""

from __future__ import annotations

import asyncio

from libs.common.events import Context, SessionRerouted, SwitchFailed, SwitchPhaseEntered, SwitchRequested
from services.cell.adapters import NoSeat, ProxyControl
from services.scheduler.core.translate import declared_reason
from services.scheduler.replay import CellsFold
from tests.proxy.conftest import ADMIN

from ._fakes import HangingRelease, SlowKvMover
from .test_agent import cell_events, engines, setup_cells, talk  # noqa: F401  (engines: a fixture)


async def test_an_agent_that_wakes_up_to_a_declared_failure_rolls_back(proxy, engines, model_dir) -> None:  # noqa: F811
    agents = await setup_cells(proxy, engines, model_dir)
    base = await proxy.rollout("cell-hung")
    histories = [[{"role": "user", "content": f"task {i}"}] for i in range(2)]
    await talk(base, histories)
    cell = agents[0]  # the core: its switch to training is legal in the scheduler's fold
    request = SwitchRequested(run_id="ptest", cell="e0", from_role="inference", to_role="training", water_level=0.0,
                              reason="backlog")
    await proxy.bus.publish(request)
    cell.engine = HangingRelease(cell.engine)
    task = asyncio.create_task(cell.switch("training", causation_id=request.event_id))
    await asyncio.wait_for(cell.engine.entered.wait(), 60)
    # the scheduler gave up on it, as LiveScheduler writes it (its agent answered nothing)
    await proxy.bus.publish(SwitchFailed(run_id="ptest", cell="e0", role="inference", phase="releasing",
                                         reason=declared_reason("no answer"), declared_by_scheduler=True,
                                         causation_id=request.event_id))
    cell.engine.wake.set()  # the release it hung in goes through
    rec = await asyncio.wait_for(task, 120)
    assert not rec.ok and rec.failed_phase == "releasing" and "declared this switch failed" in rec.reason
    assert cell.role == "inference" and cell.broken is None
    events = await cell_events(proxy.bus)
    assert [e.phase for e in events if isinstance(e, SwitchPhaseEntered)] == ["draining", "migrating", "releasing"]
    failed = [e for e in events if isinstance(e, SwitchFailed)]
    assert [f.declared_by_scheduler for f in failed] == [True, False]
    assert failed[-1].role == "inference" and failed[-1].causation_id == request.event_id
    assert await cell.engine.released() == [] and proxy.service.router.cells["e0"].state.value == "active"
    fold = CellsFold()  # what the scheduler (live or replayed) makes of the log
    for ev in events:
        fold.apply(ev)
    e0 = fold.state.cell("e0")
    assert e0.phase.value == "inference" and not e0.silent and not fold.errors
    await talk(base, histories)


async def test_an_evacuation_past_its_deadline_leaves_the_rest_and_the_switch_rolls_back(
        proxy, engines, model_dir) -> None:  # noqa: F811
    agents = await setup_cells(proxy, engines, model_dir, seat_for_e1=NoSeat())
    base = await proxy.rollout("cell-deadline")
    histories = [[{"role": "user", "content": f"task {i}"}] for i in range(8)]
    await talk(base, histories)
    on_e1 = proxy.service.router.sessions_on("e1")
    assert len(on_e1) >= 2
    proxy.service.kv_mover = SlowKvMover(60.0)  # a session's KV copy would take a minute
    cell = agents[1]
    # margins of seconds either side, for a loaded machine
    cell.proxy = ProxyControl(proxy.url, ADMIN, timeout_s=8.0)
    assert cell.proxy.evacuate_deadline_s == 4.0  # well inside the agent's own HTTP timeout
    rec = await cell.switch("training")
    assert not rec.ok and rec.failed_phase == "migrating" and cell.role == "inference"
    assert "left on the cell" in rec.reason
    ev = cell.last_evacuation
    assert ev["stopped"] == "deadline" and ev["complete"] is False and ev["deadline_s"] == 4.0
    assert ev["seconds"] < 8.0  # the proxy answered before the agent gave up on it
    moved = {m["session"] for m in ev["moves"]}
    assert len(moved) == 1 and set(ev["left"]) == set(on_e1) - moved
    # the copy under way got only the time left: that session is re-prefilled where it went
    assert ev["moves"][0]["kv"] == "reprefilled" and "TimeoutError" in ev["moves"][0]["error"]
    assert proxy.service.kv_mover.started == 1
    router = proxy.service.router
    assert all(router.sessions[s] == "e0" for s in moved) and all(router.sessions[s] == "e1" for s in ev["left"])
    assert router.cells["e1"].state.value == "active"  # back in inference, serving what it kept
    rerouted = [d.event.session_id async for d in proxy.bus.read(Context.CALLS)
                if isinstance(d.event, SessionRerouted)]
    assert set(rerouted) == moved
    await talk(base, histories)  # every session goes on, where the proxy has it
