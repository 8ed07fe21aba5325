"""The evacuation's deadline over the proxy's real HTTP admin API: a bad value is a 400 in
the proxy's error format; a deadline that passes before any move leaves every session on
the cell and says so."""

from __future__ import annotations

import httpx

from .conftest import ADMIN

ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}


async def test_a_bad_deadline_is_a_clear_400(proxy) -> None:
    async with httpx.AsyncClient(timeout=30) as c:
        for bad in (0, -5, "soon", True, [30]):
            r = await c.post(f"{proxy.url}/admin/cells/cell-a/evacuate", headers=ADMIN_H,
                             json={"timeout_s": 1, "deadline_s": bad})
            assert r.status_code == 400, (bad, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request" and "'deadline_s' must be a positive number" in err["message"]
        r = await c.post(f"{proxy.url}/admin/cells/cell-a/evacuate", content=b'{"deadline_s": NaN}',
                         headers={**ADMIN_H, "Content-Type": "application/json"})
        assert r.status_code == 400 and "deadline_s" in r.json()["error"]["message"]
    assert proxy.service.router.cells["cell-a"].state.value == "active"  # refused before anything was done


async def test_an_evacuation_answers_what_moved_and_what_was_left(proxy) -> None:
    base = await proxy.rollout("dl-1")
    async with httpx.AsyncClient(timeout=30) as c:
        for i in range(2):
            r = await c.post(base + "/v1/chat/completions", headers={"Authorization": "Bearer k-secret"},
                             json={"model": "m", "messages": [{"role": "user", "content": f"hi {i}"}]})
            assert r.status_code == 200, r.text
        cell = next(iter(proxy.service.router.sessions.values()))
        pinned = proxy.service.router.sessions_on(cell)
        r = await c.post(f"{proxy.url}/admin/cells/{cell}/evacuate", headers=ADMIN_H,
                         json={"timeout_s": 1, "deadline_s": 1e-9})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["stopped"] == "deadline" and body["complete"] is False and body["moves"] == []
        assert body["left"] == pinned and body["deadline_s"] == 1e-9
        r = await c.post(f"{proxy.url}/admin/cells/{cell}/evacuate", headers=ADMIN_H, json={"timeout_s": 1})
        body = r.json()  # no deadline: everything moves, as before
        assert body["complete"] is True and body["left"] == [] and {m["session"] for m in body["moves"]} == set(pinned)
