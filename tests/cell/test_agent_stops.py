"""An agent that wakes up inside a switch stops on any ``SwitchFailed`` that names the switch
(its causation id): the scheduler's declaration, or a record written for it without the
flag (a scheduler that thought no agent took the command). It writes its own only once
its switch is over, so such a record was not its own. In-memory bus, faked engine, proxy
and seat (the agent's decision is all that is tested here; tests/cell/test_agent_bounds.py
runs the declared case with the real engines and proxy)."""

from __future__ import annotations

import asyncio

import pytest

from libs.common.bus.memory import InMemoryBus
from libs.common.events import Context, SwitchFailed, SwitchPhaseEntered, SwitchRequested
from services.cell.agent import CellAgent

RUN = "stops"


class _Engine:
    def __init__(self) -> None:
        self.entered, self.wake, self.resumed = asyncio.Event(), asyncio.Event(), 0

    async def release(self) -> None:  # hangs until woken (the agent stuck in releasing)
        self.entered.set()
        await self.wake.wait()

    async def resume(self) -> None:
        self.resumed += 1

    async def weight_version(self) -> int:
        return 0


class _Proxy:
    def __init__(self) -> None:
        self.added = 0

    async def evacuate(self, cell: str) -> dict:
        return {"drained": True, "moves": [], "left": []}

    async def add(self, *args) -> None:
        self.added += 1


class _Seat:
    def __init__(self) -> None:
        self.joined = self.left = 0

    async def join(self, version: int) -> None:
        self.joined += 1

    async def leave(self) -> None:
        self.left += 1


def _agent(bus) -> CellAgent:
    return CellAgent(name="c1", run_id=RUN, bus=bus, proxy=_Proxy(), engine=_Engine(), seat=_Seat(), engine_url="x")


async def _events(bus) -> list:
    return [d.event async for d in bus.read(Context.CELLS)]


@pytest.mark.parametrize("declared", [True, False])
async def test_an_agent_stops_on_a_switch_failed_naming_its_switch(declared: bool) -> None:
    bus = InMemoryBus()
    agent = _agent(bus)
    request = SwitchRequested(run_id=RUN, cell="c1", from_role="inference", to_role="training", water_level=0,
                              reason="x")
    await bus.publish(request)
    task = asyncio.create_task(agent.switch("training", causation_id=request.event_id))
    await asyncio.wait_for(agent.engine.entered.wait(), 10)
    await bus.publish(SwitchFailed(run_id=RUN, cell="c1", role="inference", phase="releasing", reason="given up",
                                   declared_by_scheduler=declared, causation_id=request.event_id))
    agent.engine.wake.set()
    rec = await asyncio.wait_for(task, 10)
    assert not rec.ok and rec.failed_phase == "releasing" and "declared this switch failed" in rec.reason
    assert agent.role == "inference" and agent.seat.joined == 0 and agent.engine.resumed == 1
    events = await _events(bus)
    assert [e.phase for e in events if isinstance(e, SwitchPhaseEntered)] == ["draining", "migrating", "releasing"]
    own = [e for e in events if isinstance(e, SwitchFailed)][-1]
    assert not own.declared_by_scheduler and own.role == "inference" and own.causation_id == request.event_id


async def test_a_switch_failed_of_another_switch_does_not_stop_it() -> None:
    bus = InMemoryBus()
    agent = _agent(bus)
    await bus.publish(SwitchFailed(run_id=RUN, cell="c1", role="inference", phase="migrating", reason="older",
                                   causation_id="an-older-request"))
    assert not await agent._declared_failed("this-request")
    assert not await agent._declared_failed(None)
    await bus.publish(SwitchFailed(run_id=RUN, cell="c1", role="inference", phase="migrating", reason="x",
                                   causation_id="this-request"))
    assert await agent._declared_failed("this-request")
