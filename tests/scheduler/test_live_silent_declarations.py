"""The live scheduler's declarations (in-memory bus): an agent that took a switch and then
dropped off the bus (no responders on a re-send) is declared failed in the phase the log
has, not recorded failed in the switch's first phase; a declaration is built once, with
an id fixed by its request, and tried as is until stored; an update waiting on a silent
core is logged."""

from __future__ import annotations

import asyncio
import logging
import time

from nats.errors import NoRespondersError

from libs.common.bus.memory import InMemoryBus
from libs.common.events import CellRegistered, Context, SwitchFailed, SwitchPhaseEntered, SwitchRequested
from services.cell.agent import CellAgent
from services.scheduler.core import Pressure, Role, Tick
from services.scheduler.core.policy import serving_capacity
from services.scheduler.core.translate import DECLARED
from services.scheduler.live import LiveScheduler, declaration_id
from services.scheduler.replay import CellsFold

from ._helpers import tick_until

RUN = "silent-live"


async def _log(bus, *phases: str, core_role: str = "training") -> SwitchRequested:
    """c0 (core) in ``core_role``; c1's switch to training stored, its agent in ``phases``."""
    request = SwitchRequested(run_id=RUN, cell="c1", from_role="inference", to_role="training", water_level=0,
                              reason="x")
    for ev in (CellRegistered(run_id=RUN, cell="c0", role=core_role, is_core=True, capacity=4),
               CellRegistered(run_id=RUN, cell="c1", role="inference", capacity=4), request,
               *(SwitchPhaseEntered(run_id=RUN, cell="c1", phase=p, causation_id=request.event_id) for p in phases)):
        await bus.publish(ev)
    return request


class _Still:
    """A policy that starts no switch: only the switches in the log move."""

    name, between_calls_weight, smoothing_s = "still", 0.5, 0.0

    def initial_role(self, index: int, is_core: bool) -> Role:
        return Role.INFERENCE

    def assess(self, state, tick, level) -> Pressure:
        return Pressure.STEADY

    def switches(self, state, tick, level) -> list:
        return []


def _scheduler(bus, send_switch, **kw) -> LiveScheduler:
    async def stats() -> dict:
        return {"cells": []}

    return LiveScheduler(run_id=RUN, bus=bus, policy=_Still(), proxy_stats=stats, send_switch=send_switch,
                         switch_timeout_s=0.2, max_resends=2, **kw)


async def _replayed(bus) -> CellsFold:
    fold = CellsFold()
    async for d in bus.read(Context.CELLS, filter_subject=f"gyre.{RUN}.cells.>"):
        fold.apply(d.event)
    return fold


async def _failures(bus) -> list[SwitchFailed]:
    return [d.event async for d in bus.read(Context.CELLS) if isinstance(d.event, SwitchFailed)]


async def test_no_responders_on_a_resend_declares_the_switch_failed_in_the_phase_the_log_has() -> None:
    """The agent took the command and hung; the server then dropped its connection, so the
    re-send finds no responders. The cell is half-way (releasing): it is declared failed
    there, silent and not serving; the agent that reconnects stops before joining."""
    bus = InMemoryBus()
    request = await _log(bus, "migrating", "releasing")
    sends: list[str] = []

    async def send_switch(cell: str, role: str, causation: str) -> dict:
        sends.append(causation)
        if len(sends) == 1:
            await asyncio.sleep(0.2)
            raise TimeoutError()  # hung: took it, no answer
        raise NoRespondersError()  # the server dropped the frozen client

    live = _scheduler(bus, send_switch)
    await live.catch_up_cells()
    await tick_until(live, lambda: not live.state.cell("c1").switching)
    assert sends == [request.event_id] * 2
    c1 = live.state.cell("c1")
    assert c1.phase.value == "inference" and c1.silent and c1.silent_in.value == "releasing"
    assert c1.last_failure.startswith(DECLARED) and "no agent listened" in c1.last_failure
    assert "c1" not in {c.name for c in live.state.serving} and serving_capacity(live.state) == 0
    [failed] = await _failures(bus)
    assert failed.declared_by_scheduler and failed.phase == "releasing" and failed.causation_id == request.event_id
    assert not live.fold.errors and (await _replayed(bus)).state == live.state
    # the agent, awake again inside that switch, reads it before its next phase
    agent = CellAgent(name="c1", run_id=RUN, bus=bus, proxy=None, engine=None, seat=None, engine_url="x")
    assert await agent._declared_failed(request.event_id)


async def _ended_by_no_responders(bus):
    """Ticks a scheduler whose every command meets no responders until c1's switch ends;
    returns c1 and the one SwitchFailed in the log."""
    async def send_switch(cell: str, role: str, causation: str) -> dict:
        raise NoRespondersError()

    live = _scheduler(bus, send_switch)
    await live.catch_up_cells()
    await tick_until(live, lambda: not live.state.cell("c1").switching)
    [failed] = await _failures(bus)
    return live.state.cell("c1"), failed


async def test_no_responders_on_a_first_send_of_a_switch_an_agent_took_declares_it() -> None:
    """This scheduler's first send (e.g. after a restart), the cell still in the first phase,
    but an event of the cell's own names the request (its agent announced draining): an
    agent took the switch, so it is declared, not recorded as never begun."""
    bus = InMemoryBus()
    request = await _log(bus, "draining")
    c1, failed = await _ended_by_no_responders(bus)
    assert c1.phase.value == "inference" and c1.silent
    assert failed.declared_by_scheduler and failed.phase == "draining" and failed.causation_id == request.event_id


async def test_no_responders_on_a_first_send_no_agent_took_is_recorded_as_before() -> None:
    bus = InMemoryBus()
    request = await _log(bus)  # stored, nothing of the cell's since
    c1, failed = await _ended_by_no_responders(bus)
    assert c1.phase.value == "inference" and not c1.silent and "no cell agent answered" in c1.last_failure
    assert not failed.declared_by_scheduler and failed.causation_id == request.event_id


class _LosesFirstDeclaration(InMemoryBus):
    """The first publish of a declaration fails; with ``stored`` it was stored anyway (its
    acknowledgement was lost)."""

    def __init__(self, stored: bool) -> None:
        super().__init__()
        self.stored, self.tried = stored, []

    async def publish(self, event, **kw):
        if isinstance(event, SwitchFailed) and event.declared_by_scheduler:
            self.tried.append(event)
            if len(self.tried) == 1:
                if self.stored:
                    await super().publish(event, **kw)
                raise ConnectionError("ack lost")
        return await super().publish(event, **kw)


async def _declare_with(bus: _LosesFirstDeclaration) -> tuple[LiveScheduler, SwitchRequested]:
    request = await _log(bus, "migrating")

    async def send_switch(cell: str, role: str, causation: str) -> dict:
        raise NoRespondersError()

    live = _scheduler(bus, send_switch)
    await live.catch_up_cells()
    live._sends[request.event_id] = 1  # sent before: an agent took it
    live._send(c := "c1", "training", request.event_id)
    for _ in range(50):
        await asyncio.sleep(0.02)
        if not live._sending:
            break
    assert c in live._give_up
    return live, request


async def test_a_declaration_is_built_once_and_tried_as_is() -> None:
    bus = _LosesFirstDeclaration(stored=False)
    live, request = await _declare_with(bus)
    await live._declare_silent()  # fails
    live.clock = lambda: time.time() + 100  # later: the same event all the same
    await live._declare_silent()
    first, second = bus.tried
    assert first is second and first.event_id == declaration_id(request.event_id, 0)
    await live.catch_up_cells()
    assert live.state.cell("c1").silent and len(await _failures(bus)) == 1


async def test_a_late_copy_of_a_stored_declaration_is_dropped() -> None:
    bus = _LosesFirstDeclaration(stored=True)
    live, request = await _declare_with(bus)
    await live._declare_silent()  # stored, but the publish failed
    await bus.publish(bus.tried[0])  # a late copy (the same id)
    await live.catch_up_cells()
    await live._declare_silent()
    assert len(await _failures(bus)) == 1 and not live._give_up
    c1 = live.state.cell("c1")
    assert c1.silent and c1.phase.value == "inference" and not live.fold.errors


def test_declaration_ids_are_fixed_by_the_request_and_count() -> None:
    assert declaration_id("req", 0) == declaration_id("req", 0)
    assert len({declaration_id("req", 0), declaration_id("req", 1), declaration_id("other", 0)}) == 3


async def test_an_update_waiting_on_a_silent_core_is_logged_once(caplog) -> None:
    bus = InMemoryBus()
    request = SwitchRequested(run_id=RUN, cell="c0", from_role="inference", to_role="training", water_level=0,
                              reason="x")
    for ev in (CellRegistered(run_id=RUN, cell="c0", role="inference", is_core=True, capacity=4), request,
               SwitchFailed(run_id=RUN, cell="c0", role="inference", phase="draining", reason="x",
                            declared_by_scheduler=True, causation_id=request.event_id)):
        await bus.publish(ev)

    async def send_switch(cell: str, role: str, causation: str) -> dict:
        raise AssertionError("nothing is sent")

    live = _scheduler(bus, send_switch)
    await live.catch_up_cells()
    assert live.state.core.silent
    with caplog.at_level(logging.ERROR, logger="services.scheduler.live"):
        for k in range(3):
            live._log_update_waiting(Tick(at=float(k), update_pending=True))
    assert [r.getMessage() for r in caplog.records].count(
        "scheduler: the step's update waits on the core c0, which is silent (its agent answered none of its last "
        "switch's commands; it is inference in the log): no update until it is heard from") == 1
