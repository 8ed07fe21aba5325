"""Evacuating a cell: sessions move with their KV cache (two real embedded engines), or
are re-prefilled when the cell cannot export; every move is one SessionRerouted."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from libs.common.events import Context, SessionRerouted
from services.engine.main import build
from services.engine.settings import EngineSettings

from ._fakes import Served
from .conftest import ADMIN

ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def two_engines(model_dir):
    services = [build(EngineSettings(model="tiny-qwen", num_threads=1)) for _ in range(2)]
    served = [Served(s.app) for s in services]
    yield served
    for s in served:
        s.stop()
    for s in services:
        s.close()


async def reroutes(bus) -> list[SessionRerouted]:
    return [d.event async for d in bus.read(Context.CALLS) if isinstance(d.event, SessionRerouted)]


async def test_sessions_move_with_their_kv_cache(sdk, proxy, two_engines) -> None:
    for name in list(proxy.service.router.cells):
        proxy.service.router.remove_cell(name)
    proxy.service.add_cell("e0", two_engines[0].url)
    proxy.service.add_cell("e1", two_engines[1].url)
    base = await proxy.rollout("mig-1")
    client = sdk(anthropic.AsyncAnthropic(base_url=base, api_key="k-secret", max_retries=0))
    histories = []
    for i in range(4):  # four sessions mid-conversation, spread over both cells
        msgs = [{"role": "user", "content": f"session {i}: write a parser"}]
        r = await client.messages.create(model="m", max_tokens=8, messages=msgs, system=f"agent {i}")
        msgs += [{"role": "assistant", "content": r.content[0].text or "."}, {"role": "user", "content": "go on"}]
        histories.append(msgs)
    on_e1 = proxy.service.router.sessions_on("e1")
    assert on_e1, "some sessions must live on the cell we evacuate"
    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.post(proxy.url + "/admin/cells/e1/evacuate", headers=ADMIN_H, json={"timeout_s": 10})
    assert r.status_code == 200, r.text
    moves = r.json()["moves"]
    assert {m["session"] for m in moves} == set(on_e1)
    assert all(m["kv"] == "migrated" and m["to_cell"] == "e0" and m["tokens"] > 0 for m in moves)
    for i, msgs in enumerate(histories):  # every session completes its next turn
        r = await client.messages.create(model="m", max_tokens=4, messages=msgs, system=f"agent {i}")
        assert r.usage.cache_read_input_tokens > 0
    events = await reroutes(proxy.bus)
    assert len(events) == len(on_e1) and all(e.kv == "migrated" for e in events)


async def test_a_cell_that_cannot_export_falls_back_to_reprefill(proxy) -> None:
    base = await proxy.rollout("mig-2")
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(base + "/v1/chat/completions", headers={"Authorization": "Bearer k-secret"},
                         json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200
        cell = next(iter(proxy.service.router.sessions.values()))
        r = await c.post(f"{proxy.url}/admin/cells/{cell}/evacuate", headers=ADMIN_H, json={})
    moves = r.json()["moves"]
    assert len(moves) == 1 and moves[0]["kv"] == "reprefilled" and moves[0]["error"]
    assert (await reroutes(proxy.bus))[0].kv == "reprefilled"
