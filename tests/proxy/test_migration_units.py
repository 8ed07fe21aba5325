"""evacuate() on a bare router: what moves and what stays (no engines needed)."""

from __future__ import annotations

from types import SimpleNamespace

from libs.common.bus.memory import InMemoryBus
from libs.common.events import Context, SessionRerouted
from services.proxy.core.routing import Router
from services.proxy.migration import evacuate


def _service(cells=("a", "b", "c")):
    router = Router()
    for name in cells:
        router.add_cell(name, capacity=4)
    return SimpleNamespace(router=router, clients={n: object() for n in cells}, bus=InMemoryBus(),
                           config=SimpleNamespace(run_id="run1"), book=SimpleNamespace(states={}))


async def _rerouted(bus) -> list[tuple[str, str, str]]:
    return [(d.event.session_id, d.event.from_cell, d.event.to_cell) async for d in bus.read(Context.CALLS)
            if isinstance(d.event, SessionRerouted)]


async def test_a_cell_still_busy_after_the_drain_keeps_its_sessions():
    """The switch fails and rolls back, so nothing is moved away (nor announced moved)."""
    service = _service()
    service.router.pin("r1/s1", "a")
    service.router.begin("a")  # a call that outlasts the drain
    out = await evacuate(service, "a", timeout_s=0.05, migrate=False)
    assert not out.drained and out.moves == []
    assert service.router.sessions["r1/s1"] == "a" and await _rerouted(service.bus) == []


async def test_a_session_a_new_turn_took_elsewhere_is_not_moved_again():
    """While the first session moves, a new turn of the second runs on another cell; the
    evacuation leaves it there instead of re-pinning it and announcing a move from ``a``."""
    service = _service()
    for s in ("r1/s1", "r1/s2"):
        service.router.pin(s, "a")
    publish = service.bus.publish

    async def new_turn_meanwhile(ev, **kw):
        if isinstance(ev, SessionRerouted) and ev.session_id == "r1/s1":
            service.router.unpin("r1/s2")
            service.router.pin("r1/s2", "b")  # the proxy routed s2's new turn to b
        return await publish(ev, **kw)

    service.bus.publish = new_turn_meanwhile
    out = await evacuate(service, "a", timeout_s=0.05, migrate=False)
    assert out.drained and [m.session for m in out.moves] == ["r1/s1"]
    assert service.router.sessions["r1/s2"] == "b"
    assert [s for s, _, _ in await _rerouted(service.bus)] == ["r1/s1"]
