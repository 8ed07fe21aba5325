"""History survives the proxy; routing survives cells: restart, a second replica,
affinity, drain and moves, a cell dying mid-call, a client leaving mid-stream."""

from __future__ import annotations

import asyncio

import httpx

from .conftest import ADMIN, RUN, start_proxy
from .tito_check import check_exact, engine_view, recorded_calls

KEY = {"Authorization": "Bearer k-secret"}
ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}


async def chat(client: httpx.AsyncClient, base: str, messages: list, **kw) -> dict:
    r = await client.post(base + "/v1/chat/completions", headers=KEY, json={"model": "m", "messages": messages, **kw})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]


async def test_a_second_replica_and_a_restarted_proxy_stay_exact(proxy, renderer) -> None:
    base = await proxy.rollout("rep-1")
    for e in proxy.engines.values():
        e.default_reply = ("split reply déjà", True)  # generated ids != re-encoded text
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "one"}]
    async with httpx.AsyncClient(timeout=30) as c:
        reply = await chat(c, base, msgs)
        msgs += [{"role": "assistant", "content": reply["content"]}, {"role": "user", "content": "two"}]
        # replica B: a new process's worth of state, same log and blob store, same cells
        url_b, svc_b, server_b = await start_proxy(proxy.bus, proxy.blobs, renderer, proxy.engines)
        for name, served in zip(proxy.engines, proxy.served):
            svc_b.add_cell(name, served.url)
        base_b = f"{url_b}/r/rep-1"
        reply = await chat(c, base_b, msgs)
        msgs += [{"role": "assistant", "content": reply["content"]}, {"role": "user", "content": "three"}]
        reply = await chat(c, base, msgs)  # back on A, which must load B's call from the log
        server_b.should_exit = True
    recorded = list((await recorded_calls(proxy.bus, proxy.blobs, RUN)).values())
    check_exact({r.event.call_id: r for r in recorded}, engine_view(proxy.engines.values()))
    assert [r.event.drift.value for r in recorded] == ["fresh", "retoken_drift", "retoken_drift"]
    assert recorded[1].event.parent_call_id == recorded[0].event.call_id
    assert recorded[2].event.parent_call_id == recorded[1].event.call_id


async def test_session_affinity_drain_and_move(proxy) -> None:
    base = await proxy.rollout("aff-1")
    msgs = [{"role": "user", "content": "hi"}]
    async with httpx.AsyncClient(timeout=30) as c:
        reply = await chat(c, base, msgs)
        first_cell = next(n for n, e in proxy.engines.items() if e.received)
        for i in range(3):
            msgs += [{"role": "assistant", "content": reply["content"]}, {"role": "user", "content": f"more {i}"}]
            reply = await chat(c, base, msgs)
        assert len(proxy.engines[first_cell].received) == 4  # the session stayed on its cell
        r = await c.post(f"{proxy.url}/admin/cells/{first_cell}/drain", headers=ADMIN_H, json={"timeout_s": 5})
        assert r.status_code == 200 and r.json()["ok"] and len(r.json()["sessions"]) == 1
        session = r.json()["sessions"][0]
        other = next(n for n in proxy.engines if n != first_cell)
        r = await c.post(f"{proxy.url}/admin/sessions/move", headers=ADMIN_H, json={"session": session, "to_cell": other})
        assert r.json()["from_cell"] == first_cell
        msgs += [{"role": "assistant", "content": reply["content"]}, {"role": "user", "content": "after move"}]
        await chat(c, base, msgs)
        assert len(proxy.engines[other].received) == 1 and len(proxy.engines[first_cell].received) == 4
    await check(proxy)


async def check(proxy) -> None:
    check_exact(await recorded_calls(proxy.bus, proxy.blobs, RUN), engine_view(proxy.engines.values()))


async def test_a_cell_dying_mid_call_is_invisible_to_the_agent(proxy) -> None:
    base = await proxy.rollout("die-1")
    for e in proxy.engines.values():
        e.default_reply = "a fairly long answer that the first cell will not finish"
        e.fail_after_tokens = 3
    proxy.engines["cell-b"].fail_after_tokens = None
    for session in list(proxy.service.router.sessions):
        proxy.service.router.unpin(session)
    proxy.service.router.cells["cell-b"].in_flight = 1  # steer the new session to cell-a
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(base + "/v1/chat/completions", headers=KEY,
                         json={"model": "m", "messages": [{"role": "user", "content": "go"}], "stream": True})
        body = r.text
    proxy.service.router.cells["cell-b"].in_flight = 0
    assert r.status_code == 200 and "[DONE]" in body
    text = "".join(__import__("json").loads(line[6:])["choices"][0]["delta"].get("content") or ""
                   for line in body.splitlines() if line.startswith("data: {"))
    assert text == "a fairly long answer that the first cell will not finish"
    recorded = list((await recorded_calls(proxy.bus, proxy.blobs, RUN)).values())
    assert len(recorded) == 1  # recorded once
    rec = recorded[0]
    a_in, a_out = proxy.engines["cell-a"].by_rid[f"{rec.event.call_id}-0"]
    b_in, b_out = proxy.engines["cell-b"].by_rid[f"{rec.event.call_id}-1"]
    assert b_in == a_in + a_out[:3]  # the second cell continued from the tokens already produced
    assert rec.input_ids == a_in and rec.output_ids == a_out[:3] + b_out
    assert proxy.service.router.cells["cell-a"].state.value == "down"
    for _ in range(50):  # the failed attempt is aborted on its cell, in the background
        if proxy.engines["cell-a"].aborted:
            break
        await asyncio.sleep(0.05)
    assert proxy.engines["cell-a"].aborted == [f"{rec.event.call_id}-0"]
    # the health probe brings back a cell the proxy marked down, once it answers again
    proxy.engines["cell-a"].healthy = False
    assert await proxy.service.probe_cells() == []
    proxy.engines["cell-a"].healthy = True
    proxy.service.router.drain("cell-b")  # drained by the scheduler: the probe leaves it so
    assert await proxy.service.probe_cells() == ["cell-a"]
    assert proxy.service.router.cells["cell-a"].state.value == "active"
    assert proxy.service.router.cells["cell-b"].state.value == "draining"


async def test_client_leaving_mid_stream_aborts_and_records_undelivered(proxy) -> None:
    base = await proxy.rollout("dc-1")
    for e in proxy.engines.values():
        e.default_reply = "word " * 200
        e.delay_s = 0.02
    async with httpx.AsyncClient(timeout=30) as c:
        async with c.stream("POST", base + "/v1/chat/completions", headers=KEY,
                            json={"model": "m", "messages": [{"role": "user", "content": "go"}], "stream": True,
                                  "max_tokens": 400}) as r:
            n = 0
            async for _ in r.aiter_lines():
                n += 1
                if n > 10:
                    break
    for _ in range(100):
        await asyncio.sleep(0.05)
        recorded = list((await recorded_calls(proxy.bus, proxy.blobs, RUN)).values())
        if recorded:
            break
    assert recorded and recorded[0].event.delivered is False
    assert any(rid.endswith("-0") for e in proxy.engines.values() for rid in e.aborted)
    assert 0 < len(recorded[0].output_ids) < 200


async def test_client_gone_before_the_stream_starts_aborts_and_records_undelivered(proxy) -> None:
    """The caller leaves after its first token was generated but before the server sent
    the response's first bytes: the body generator never starts, and the call must still
    be aborted on its cell and recorded (the response's background task closes it)."""
    import json

    from services.proxy.app import create_app

    await proxy.rollout("dc-early")
    for e in proxy.engines.values():
        e.default_reply = "word " * 200
        e.delay_s = 0.02
    app = create_app(proxy.service, admin_token=ADMIN)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "go"}], "stream": True,
                       "max_tokens": 400}).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    started = asyncio.Event()

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        await started.wait()  # the response is about to go out: the caller hangs up now
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            started.set()
            await asyncio.Event().wait()  # the socket is gone: this send never completes

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/r/dc-early/v1/chat/completions", "raw_path": b"",
             "root_path": "", "query_string": b"", "server": ("127.0.0.1", 1), "client": ("127.0.0.1", 2),
             "headers": [(b"authorization", b"Bearer k-secret"), (b"content-type", b"application/json")]}
    await asyncio.wait_for(app(scope, receive, send), 10)
    for _ in range(100):
        await asyncio.sleep(0.05)
        recorded = [r for r in (await recorded_calls(proxy.bus, proxy.blobs, RUN)).values()
                    if r.event.rollout_id == "dc-early"]
        if recorded:
            break
    assert recorded and recorded[0].event.delivered is False
    assert any(rid.endswith("-0") for e in proxy.engines.values() for rid in e.aborted)
    assert all(c.in_flight == 0 for c in proxy.service.router.cells.values())


async def test_session_headers_reach_the_recorded_calls_hints(proxy) -> None:
    """x-gyre-role and Claude Code's agent ids travel to CallRecorded.hints, where the
    trajectory service reads them (an explicit role wins over any inference)."""
    base = await proxy.rollout("hint-1")
    headers = {**KEY, "x-gyre-role": "subagent", "x-claude-code-agent-id": "agent-7",
               "x-claude-code-parent-agent-id": "agent-1"}
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(base + "/v1/chat/completions", headers=headers,
                         json={"model": "m", "messages": [{"role": "user", "content": "go"}]})
        assert r.status_code == 200, r.text
    recorded = [r.event for r in (await recorded_calls(proxy.bus, proxy.blobs, RUN)).values()
                if r.event.rollout_id == "hint-1"]
    assert len(recorded) == 1
    hints = recorded[0].hints
    assert (hints.role, hints.agent_id, hints.parent_agent_id) == ("subagent", "agent-7", "agent-1")


async def test_a_rollouts_sessions_are_forgotten_when_it_ends(proxy) -> None:
    from libs.common.events import RolloutFinished

    base = await proxy.rollout("end-1")
    async with httpx.AsyncClient(timeout=30) as c:
        await chat(c, base, [{"role": "user", "content": "one"}])
        await chat(c, base, [{"role": "user", "content": "another conversation"}])
    router = proxy.service.router
    assert len([s for s in router.sessions if s.startswith("end-1/")]) == 2
    stop = asyncio.Event()
    follower = asyncio.create_task(proxy.service.book.follow_rollouts(stop))  # as main.py runs it
    await proxy.bus.publish(RolloutFinished(run_id=RUN, rollout_id="end-1", wall_time_s=1.0))
    for _ in range(100):
        if not router.sessions:
            break
        await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(follower, 5)
    assert not router.sessions and router.pinned("cell-a") == router.pinned("cell-b") == 0
