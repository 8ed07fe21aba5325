"""A cell whose rollback fails (its engine would not resume) is out of the proxy's routing;
the cells stream says so (``SwitchFailed.unusable``, then ``CellRepaired``), so the
scheduler's fold, live or replayed, does not count it as serving meanwhile. In-memory bus;
the engine, proxy and seat are faked (the agent and the scheduler's fold are real)."""

from __future__ import annotations

import asyncio

from libs.common.bus.memory import InMemoryBus
from libs.common.events import CellRepaired, Context, SwitchFailed, SwitchRequested
from services.cell.agent import CellAgent
from services.scheduler.core.policy import serving_capacity
from services.scheduler.replay import CellsFold

from ._fakes import FailingSeat

RUN = "unusable"


class _Proxy:
    def __init__(self) -> None:
        self.routed: set[str] = set()

    async def add(self, cell: str, url: str, capacity: int) -> None:
        self.routed.add(cell)

    async def evacuate(self, cell: str) -> dict:
        self.routed.discard(cell)
        return {"drained": True, "moves": [], "left": []}

    async def cells(self) -> list[dict]:
        return [{"name": c} for c in self.routed]


class _Engine:
    client = None

    def __init__(self) -> None:
        self.resume_fails = False

    async def release(self) -> None:
        return None

    async def resume(self) -> None:
        if self.resume_fails:
            raise RuntimeError("CUDA OOM: cannot get memory back")

    async def released(self) -> list[str]:
        return []

    async def weight_version(self) -> int:
        return 0


async def _fold(bus) -> CellsFold:
    fold = CellsFold()
    async for d in bus.read(Context.CELLS):
        fold.apply(d.event)
    return fold


async def test_an_unusable_cell_is_not_serving_in_the_fold_until_repaired() -> None:
    bus, proxy = InMemoryBus(), _Proxy()
    agents = {}
    for name, core in (("c0", True), ("c1", False), ("c2", False)):
        agents[name] = CellAgent(name=name, run_id=RUN, bus=bus, proxy=proxy, engine=_Engine(), seat=FailingSeat(),
                                 engine_url="http://x", capacity=8, is_core=core)
        await agents[name].register()
    c0 = agents["c0"]
    c0.engine.resume_fails = True
    req = SwitchRequested(run_id=RUN, cell="c0", from_role="inference", to_role="training", water_level=0.0,
                          reason="t")
    await bus.publish(req)
    rec = await c0.switch("training", causation_id=req.event_id)
    assert not rec.ok and c0.broken is not None and "c0" not in proxy.routed
    failed = [d.event async for d in bus.read(Context.CELLS) if isinstance(d.event, SwitchFailed)]
    assert failed[-1].unusable and failed[-1].role == "inference"
    fold = await _fold(bus)
    assert [c.name for c in fold.state.serving] == ["c1", "c2"] and serving_capacity(fold.state) == 16
    assert fold.state.cell("c0").unusable and not fold.errors

    refused = await c0.switch("training")  # refused while broken: still unusable in the log
    assert refused.failed_phase == "refused"
    assert (await _fold(bus)).state.cell("c0").unusable

    c0.engine.resume_fails = False
    stop = asyncio.Event()
    task = asyncio.create_task(c0.keep_registered(stop, every_s=0.01))
    for _ in range(1000):  # a busy machine: up to 10 s
        await asyncio.sleep(0.01)
        if c0.broken is None:
            break
    stop.set()
    await task
    assert c0.broken is None and "c0" in proxy.routed
    repaired = [d.event async for d in bus.read(Context.CELLS) if isinstance(d.event, CellRepaired)]
    assert [(e.cell, e.role) for e in repaired] == [("c0", "inference")]
    fold = await _fold(bus)
    assert not fold.state.cell("c0").unusable and serving_capacity(fold.state) == 24 and not fold.errors
