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


def _slow_reroutes(service, delay_s: float, then=None) -> None:
    """Each SessionRerouted takes ``delay_s`` to store (a slow bus); ``then(n)`` runs after
    the n-th."""
    publish = service.bus.publish
    count = {"n": 0}

    async def slow(ev, **kw):
        if isinstance(ev, SessionRerouted):
            import asyncio

            await asyncio.sleep(delay_s)
            count["n"] += 1
            if then is not None:
                then(count["n"])
        return await publish(ev, **kw)

    service.bus.publish = slow


async def test_no_move_starts_past_the_deadline_and_the_rest_stays_on_the_cell():
    service = _service()
    sessions = [f"r1/s{i}" for i in range(5)]
    for s in sessions:
        service.router.pin(s, "a")
    _slow_reroutes(service, 0.3)
    out = await evacuate(service, "a", timeout_s=5, migrate=False, deadline_s=0.45)
    assert out.stopped == "deadline" and out.drained and not out.complete and out.deadline_s == 0.45
    moved = [m.session for m in out.moves]
    assert 1 <= len(moved) < len(sessions) and sorted(moved + out.left) == sessions
    assert all(service.router.sessions[s] == "a" for s in out.left)  # not moved: still served by a
    assert all(service.router.sessions[s] != "a" for s in moved)
    assert [s for s, _, _ in await _rerouted(service.bus)] == moved  # announced: exactly what moved


async def test_the_drain_waits_no_longer_than_the_deadline():
    import time

    service = _service()
    service.router.pin("r1/s1", "a")
    service.router.begin("a")  # a call that outlasts everything
    start = time.monotonic()
    out = await evacuate(service, "a", timeout_s=30, migrate=False, deadline_s=0.1)
    assert time.monotonic() - start < 2 and not out.drained and out.left == ["r1/s1"] and not out.complete


async def test_a_cell_reactivated_meanwhile_keeps_the_sessions_not_moved_yet():
    """The agent gave up and rolled the switch back (the cell serves again): the proxy
    stops moving sessions off it."""
    service = _service()
    for i in range(3):
        service.router.pin(f"r1/s{i}", "a")
    _slow_reroutes(service, 0.0, then=lambda n: service.router.activate("a") if n == 1 else None)
    out = await evacuate(service, "a", timeout_s=1, migrate=False)
    assert out.stopped == "reactivated" and [m.session for m in out.moves] == ["r1/s0"]
    assert out.left == ["r1/s1", "r1/s2"] and all(service.router.sessions[s] == "a" for s in out.left)


async def test_without_a_deadline_every_session_moves():
    service = _service()
    for i in range(3):
        service.router.pin(f"r1/s{i}", "a")
    out = await evacuate(service, "a", timeout_s=1, migrate=False)
    assert out.complete and out.stopped is None and out.left == [] and len(out.moves) == 3


def test_a_deadline_must_be_a_positive_number():
    import math

    import pytest

    from services.proxy.migration import check_deadline

    assert check_deadline(None) is None and check_deadline(2) == 2.0
    for bad in (0, -1, math.nan, math.inf, "10", True, [1]):
        with pytest.raises(ValueError, match="deadline_s"):
            check_deadline(bad)


class _Engine:
    """A cell's engine client as the HTTP mover sees it: an export, and an import answered
    as Gyre's engine answers it (``success`` only when the cache holds the whole prefix)."""

    def __init__(self, answer: dict) -> None:
        self.answer = answer

    async def kv_export(self, ids):
        return b"kv"

    async def kv_import(self, blob):
        return self.answer


async def test_the_http_mover_records_a_copy_the_target_did_not_keep_as_a_reprefill(monkeypatch):
    import services.proxy.migration as migration

    monkeypatch.setattr(migration, "session_tokens", lambda service, s: list(range(70)))
    cases = {"kept": ({"success": True, "added_tokens": 67, "tokens": 67, "cached_tokens": 67}, "migrated", 67),
             "not kept": ({"success": False, "added_tokens": 0, "tokens": 67, "cached_tokens": 0,
                           "message": "KV prefix of 67 tokens not kept"}, "reprefilled", 0),
             "nothing cached at the source": ({"success": True, "added_tokens": 0, "tokens": 0,
                                               "cached_tokens": 0}, "reprefilled", 0)}
    for name, (answer, kv, tokens) in cases.items():
        service = _service(("a", "b"))
        service.clients = {"a": _Engine({}), "b": _Engine(answer)}
        service.router.pin("r1/s1", "a")
        out = await evacuate(service, "a", timeout_s=0.05)
        events = [d.event async for d in service.bus.read(Context.CALLS) if isinstance(d.event, SessionRerouted)]
        assert (out.moves[0].kv, events[0].kv, events[0].migrated_tokens) == (kv, kv, tokens), name
        assert (out.moves[0].error is None) == (kv == "migrated"), name
