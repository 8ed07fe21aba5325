"""Each call is recorded exactly once, whatever happens around the append: a caller
leaving while the event is being stored, a lost publish ack, a non-streaming caller
leaving mid-generation. The event id is fixed per call, so JetStream drops a re-append."""

from __future__ import annotations

import asyncio
import logging

import httpx
from prometheus_client.parser import text_string_to_metric_families

from libs.common.events import CallRecorded, Context

from .conftest import RUN

AKEY = {"x-api-key": "k-secret"}
BODY = {"model": "c", "max_tokens": 50, "messages": [{"role": "user", "content": "q"}]}


async def recorded(proxy, rollout: str) -> list[CallRecorded]:
    out = []
    async for d in proxy.bus.read(Context.CALLS, filter_subject=f"gyre.{RUN}.calls.CallRecorded.>"):
        if d.event.rollout_id == rollout:
            out.append(d.event)
    return out


async def test_a_caller_leaving_while_the_call_is_appended_records_it_once(proxy) -> None:
    real = proxy.service.bus.publish

    async def slow_ack(ev, **kw):
        seq = await real(ev, **kw)
        if isinstance(ev, CallRecorded):
            await asyncio.sleep(1.0)  # stored; the ack is late
        return seq

    proxy.service.bus.publish = slow_ack
    base = await proxy.rollout("once-1")
    async with httpx.AsyncClient(timeout=20) as c:
        async with c.stream("POST", base + "/v1/messages", headers=AKEY, json={**BODY, "stream": True}) as r:
            async def read() -> None:
                async for _ in r.aiter_lines():
                    pass

            try:
                await asyncio.wait_for(read(), 0.5)  # the user presses ESC before message_stop
            except asyncio.TimeoutError:
                pass
    await asyncio.sleep(1.5)
    await proxy.service.drain_background()
    calls = await recorded(proxy, "once-1")
    assert len(calls) == 1 and calls[0].n_output_tokens > 0
    assert proxy.service.stats.calls == 1


async def test_a_lost_publish_ack_is_retried_and_deduplicated(proxy) -> None:
    real = proxy.service.bus.publish
    lost = []

    async def lossy(ev, **kw):
        seq = await real(ev, **kw)
        if isinstance(ev, CallRecorded) and not lost:
            lost.append(ev.event_id)
            raise asyncio.TimeoutError("nats: timeout")  # stored, ack lost
        return seq

    proxy.service.bus.publish = lossy
    base = await proxy.rollout("once-2")
    async with httpx.AsyncClient(timeout=20) as c:
        r = await c.post(base + "/v1/messages", headers=AKEY, json=BODY)
        assert r.status_code == 200, r.text
        # the next turn continues the recorded call: the book's position survived the retry
        r2 = await c.post(base + "/v1/messages", headers=AKEY, json={**BODY, "messages": [
            *BODY["messages"], {"role": "assistant", "content": r.json()["content"][0]["text"]},
            {"role": "user", "content": "more"}]})
        assert r2.status_code == 200, r2.text
    await proxy.service.drain_background()
    calls = await recorded(proxy, "once-2")
    assert len(calls) == 2 and [c.delivered for c in calls] == [True, True]
    assert calls[0].event_id == lost[0] and calls[1].parent_call_id == calls[0].call_id


async def test_an_append_conflict_on_the_calls_own_event_ends_the_retries(proxy) -> None:
    """The ack was lost and the retry met a newer subject sequence: that newer message is
    our own event, so the call is recorded and nothing more is appended."""
    from libs.common.bus.port import ConcurrencyConflict

    real = proxy.service.bus.publish
    tries = []

    async def conflicting(ev, **kw):
        if isinstance(ev, CallRecorded):
            tries.append(kw)
            if len(tries) == 1:
                await real(ev, **kw)
                raise ConcurrencyConflict("stored, but the caller only saw a conflict")
        return await real(ev, **kw)

    proxy.service.bus.publish = conflicting
    base = await proxy.rollout("once-3")
    async with httpx.AsyncClient(timeout=20) as c:
        r = await c.post(base + "/v1/messages", headers=AKEY, json=BODY)
        assert r.status_code == 200, r.text
    assert len(tries) == 1 and len(await recorded(proxy, "once-3")) == 1


async def test_a_non_streaming_caller_leaving_is_aborted_and_recorded_undelivered(proxy, caplog) -> None:
    for e in proxy.engines.values():
        e.default_reply = "word " * 40
        e.delay_s = 0.1
    base = await proxy.rollout("once-4")
    caplog.set_level(logging.ERROR)
    try:
        async with httpx.AsyncClient(timeout=1.2) as c:
            await c.post(base + "/v1/messages", headers=AKEY, json={**BODY, "max_tokens": 100})
    except httpx.TimeoutException:
        pass  # the caller gave up
    for _ in range(60):
        await asyncio.sleep(0.1)
        calls = await recorded(proxy, "once-4")
        if calls:
            break
    await proxy.service.drain_background()
    assert len(calls) == 1 and calls[0].delivered is False and 0 < calls[0].n_output_tokens < 41
    assert any(e.aborted for e in proxy.engines.values())
    assert all(c.in_flight == 0 for c in proxy.service.router.cells.values())
    assert not [r for r in caplog.records if "aclose" in r.getMessage() or r.exc_info]
    async with httpx.AsyncClient() as c:
        text = (await c.get(proxy.url + "/metrics")).text
    samples = [s for f in text_string_to_metric_families(text) if f.name == "gyre_proxy_calls" for s in f.samples
               if s.name.endswith("_total")]
    assert [(s.labels["delivered"], s.value) for s in samples] == [("false", 1.0)]


async def test_a_server_briefly_absent_is_waited_for(proxy) -> None:
    """A JetStream 'no responders' (the stream's leader away for a moment): nothing was
    stored, the append is tried again and the call is recorded once."""
    from nats.errors import NoRespondersError

    real = proxy.service.bus.publish
    hit = []

    async def flaky(ev, **kw):
        if isinstance(ev, CallRecorded) and not hit:
            hit.append(ev.call_id)
            raise NoRespondersError
        return await real(ev, **kw)

    proxy.service.bus.publish = flaky
    base = await proxy.rollout("absent-1")
    async with httpx.AsyncClient(timeout=20) as c:
        r = await c.post(base + "/v1/messages", headers=AKEY, json=BODY)
        assert r.status_code == 200, r.text
    calls = await recorded(proxy, "absent-1")
    assert [c.call_id for c in calls] == hit


async def test_a_call_that_could_not_be_appended_is_no_one_s_parent(proxy, monkeypatch) -> None:
    """The log stays away past every retry: the caller gets an error, and the proxy
    forgets the call, so the harness's retry of the turn is not recorded as its child."""
    from nats.errors import NoRespondersError

    import services.proxy.service as service

    monkeypatch.setattr(service, "APPEND_BACKOFF_S", 0.001)
    real = proxy.service.bus.publish
    failing = [True]

    async def down(ev, **kw):
        if isinstance(ev, CallRecorded) and failing[0]:
            raise NoRespondersError
        return await real(ev, **kw)

    proxy.service.bus.publish = down
    base = await proxy.rollout("absent-2")
    async with httpx.AsyncClient(timeout=20) as c:
        r = await c.post(base + "/v1/messages", headers=AKEY, json=BODY)
        assert r.status_code >= 500 and r.json()["type"] == "error"  # in the caller's format
        failing[0] = False
        again = await c.post(base + "/v1/messages", headers=AKEY, json=BODY)  # the harness retries
        assert again.status_code == 200, again.text
    await proxy.service.drain_background()
    calls = await recorded(proxy, "absent-2")
    assert len(calls) == 1 and calls[0].parent_call_id is None
