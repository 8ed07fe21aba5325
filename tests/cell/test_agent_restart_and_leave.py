"""Two ways a cell could end up in a role its engine or trainer is not in.

- A restarted agent after a failed switch that names the role the cell *should* be in: the
  scheduler's declaration for an agent that hung in ``releasing``, or an agent's own
  rollback that left the cell unusable. Its engine may still have its memory released
  (SGLang does not say), so the agent resumes it and loads the newest weights before the
  proxy routes to it.
- The core cell's trainer leave (``cells.core_follows_role``) timing out: the switch rolls
  back to training, and the trainer, which goes on leaving once its micro-step in hand is
  done, is asked to join again, so the cell trains as its role says.
"""

from __future__ import annotations

import asyncio

import pytest

from libs.common.bus.memory import InMemoryBus
from libs.common.events import CellRegistered, CellRepaired, SwitchFailed, SwitchPhaseEntered, SwitchRequested
from services.cell.adapters import TrainerSeat
from services.cell.agent import CellAgent
from services.trainer.gate import GatedWorker

from ._fakes import ForgetfulEngine, NoSeatWork, PublishedWeights, RoutingProxy

RUN = "restart"


def _agent(bus, engine) -> CellAgent:
    return CellAgent(name="c1", run_id=RUN, bus=bus, proxy=RoutingProxy(), engine=engine, seat=NoSeatWork(),
                     engine_url="x", latest_weights=PublishedWeights(3))


async def _log_until(bus, phase: str) -> SwitchRequested:
    req = SwitchRequested(run_id=RUN, cell="c1", from_role="inference", to_role="training", water_level=0,
                          reason="x")
    await bus.publish(CellRegistered(run_id=RUN, cell="c0", role="training", is_core=True, capacity=4))
    await bus.publish(CellRegistered(run_id=RUN, cell="c1", role="inference", capacity=4))
    await bus.publish(req)
    phases = ("draining", "migrating", "releasing", "joining")
    for p in phases[: phases.index(phase) + 1]:
        await bus.publish(SwitchPhaseEntered(run_id=RUN, cell="c1", phase=p, causation_id=req.event_id))
    return req


def _failed(req, phase: str, kind: str) -> SwitchFailed:
    if kind == "declared":
        return SwitchFailed(run_id=RUN, cell="c1", role="inference", phase=phase,
                            reason="declared failed by the scheduler: no answer", declared_by_scheduler=True,
                            causation_id=req.event_id)
    return SwitchFailed(run_id=RUN, cell="c1", role="inference", phase=phase,
                        reason="rollback to inference failed, the cell is not usable: OOM", unusable=True,
                        causation_id=req.event_id)


@pytest.mark.parametrize("phase", ["releasing", "joining"])
@pytest.mark.parametrize("kind", ["declared", "unusable"])
async def test_a_restart_after_a_failed_switch_resumes_a_released_engine_before_serving(kind, phase) -> None:
    bus, engine = InMemoryBus(), ForgetfulEngine(version=3)
    req = await _log_until(bus, phase)
    await engine.release()  # the release went through before the agent hung (or its rollback failed)
    await bus.publish(_failed(req, phase, kind))
    again = _agent(bus, engine)  # the agent process restarted: its in-memory repair plan is gone
    await again.register()
    assert "c1" in again.proxy.routed
    assert not engine.memory_released and engine.weights_valid and engine.pushes == [3]


@pytest.mark.parametrize("kind", ["declared", "unusable"])
async def test_a_failed_switch_before_releasing_leaves_the_engine_alone(kind) -> None:
    bus, engine = InMemoryBus(), ForgetfulEngine(version=3)
    req = await _log_until(bus, "migrating")
    await bus.publish(_failed(req, "migrating", kind))
    again = _agent(bus, engine)
    await again.register()
    assert "c1" in again.proxy.routed and engine.pushes == []


async def test_a_repaired_cell_is_served_as_its_role_says() -> None:
    bus, engine = InMemoryBus(), ForgetfulEngine(version=3)
    req = await _log_until(bus, "releasing")
    await bus.publish(_failed(req, "releasing", "unusable"))
    await bus.publish(CellRepaired(run_id=RUN, cell="c1", role="inference"))  # resumed and reloaded then
    again = _agent(bus, engine)
    await again.register()
    assert "c1" in again.proxy.routed and engine.pushes == []


class _SlowWorker:
    """A micro-step in hand that takes 1.5 s to finish once asked to pause."""

    async def run(self, pause) -> None:
        await pause.wait()
        await asyncio.sleep(1.5)


class _Engine:
    async def release(self) -> None: ...
    async def resume(self) -> None: ...
    async def released(self) -> list[str]: return []
    async def weight_version(self) -> int: return 0


async def test_a_core_leave_that_times_out_joins_the_trainer_again(js_bus) -> None:
    gate = GatedWorker(_SlowWorker(), "c0")
    sub = await gate.serve(js_bus.nc, RUN)
    try:
        seat = TrainerSeat(js_bus, RUN, "c0", leave_timeout_s=0.5)  # stands for the 240 s default
        agent = CellAgent(name="c0", run_id=RUN, bus=js_bus, proxy=RoutingProxy(), engine=_Engine(), seat=seat,
                          engine_url="x", is_core=True)
        assert (await agent.switch("training")).ok and gate.claiming
        rec = await agent.switch("inference")
        assert not rec.ok and rec.failed_phase == "leaving" and agent.role == "training"
        assert agent.broken is None  # rolled back: joined again
        await asyncio.sleep(2.0)  # the micro-step in hand has ended and the leave completed by now
        assert gate.claiming, "the cell trains by every account: its core trainer must claim"
    finally:
        await sub.unsubscribe()
        await gate.leave()
