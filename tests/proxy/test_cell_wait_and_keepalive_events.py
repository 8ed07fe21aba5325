"""An open stream that has shown nothing yet waits for a cell instead of failing (a cell
that aborts or crashes after the grace, its only cell switching away), counted in
/metrics; each API's own keepalive (Responses: ``response.in_progress`` again, read by the
real SDK); a caller that leaves while sending its body is a quiet 499, on the chat and
admin routes alike."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import anthropic
import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from prometheus_client.parser import text_string_to_metric_families
from fastapi.responses import StreamingResponse

from ._fakes import ScriptedEngine, Served
from .conftest import ADMIN, RUN
from .tito_check import recorded_calls

KEY = {"Authorization": "Bearer k-secret"}
AKEY = {"x-api-key": "k-secret"}
ARGS = " ".join(f"w{i}" for i in range(30))
TOOL_ONLY = '<tool_call>\n{"name": "Write", "arguments": {"content": "' + ARGS + '"}}\n</tool_call>'
TOOLS_AN = [{"name": "Write", "input_schema": {"type": "object", "properties": {"content": {"type": "string"}}}}]
TOOLS_OA = [{"type": "function", "function": {"name": "Write", "parameters": TOOLS_AN[0]["input_schema"]}}]
TOOLS_RS = [{"type": "function", "name": "Write", "parameters": TOOLS_AN[0]["input_schema"]}]


@dataclass
class Failing:
    """One scripted failure: ``tokens`` of the reply at once, then after ``after_s`` an
    SGLang abort (``finish_reason: abort``), or a dropped connection (``crash``)."""

    after_s: float
    tokens: int = 0
    crash: bool = False


@dataclass
class FailingEngine(ScriptedEngine):
    """A ScriptedEngine whose next requests fail as ``failures`` say (one each, in order);
    then it answers as usual. Each failed attempt's (input, output) is in ``by_rid``."""

    failures: list[Failing] = field(default_factory=list)

    def app(self) -> FastAPI:
        plain = super().app()
        serve = next(r for r in plain.routes if getattr(r, "path", "") == "/generate").endpoint
        app = FastAPI()

        @app.post("/generate")
        async def generate(request: Request) -> Any:
            if not self.failures:
                return await serve(request)
            f = self.failures.pop(0)
            body = await request.json()
            input_ids = list(body["input_ids"])
            self.received.append(input_ids)
            ids = self._reply_ids(input_ids)[: f.tokens]
            self.by_rid[str(body.get("rid"))] = (input_ids, ids)

            def chunk(finish: Any) -> str:
                return "data: " + json.dumps({"text": "", "output_ids": ids, "meta_info": {
                    "id": body.get("rid"), "finish_reason": finish, "prompt_tokens": len(input_ids),
                    "completion_tokens": len(ids), "cached_tokens": 0, "weight_version": self.weight_version,
                    "output_token_logprobs": [[-0.5, t, None] for t in ids]}}) + "\n\n"

            async def chunks():
                if ids:
                    yield chunk(None)
                await asyncio.sleep(f.after_s)
                if f.crash:
                    raise ConnectionError("scripted cell crash")
                yield chunk({"type": "abort", "message": "scripted abort"})
                yield "data: [DONE]\n\n"

            return StreamingResponse(chunks(), media_type="text/event-stream")

        for route in plain.routes:  # /health, /abort_request
            if getattr(route, "path", "") != "/generate":
                app.router.routes.append(route)
        return app


def only_cell_a(proxy, failures: list[Failing], reply: str = TOOL_ONLY, *, wait_s: float = 30.0) -> FailingEngine:
    """cell-a alone (cell-b drained), failing as scripted; keepalives every 0.3 s."""
    old = proxy.engines["cell-a"]
    engine = FailingEngine(old.tokenizer, name="cell-a", default_reply=reply, failures=list(failures))
    served = Served(engine.app())
    proxy.served.append(served)
    proxy.engines["cell-a"] = engine
    proxy.service.add_cell("cell-a", served.url, capacity=4)
    proxy.service.router.drain("cell-b")
    proxy.service.config.keepalive_s = 0.3
    proxy.service.config.cell_wait_s = wait_s
    return engine


@pytest.fixture(autouse=True)
async def _stop_extra_cells(proxy):
    """The fixture stops the two cells it started; the ones these tests add stop here."""
    yield
    for served in proxy.served[2:]:
        served.stop()


async def calls_of(proxy, rollout: str, n: int = 1) -> list:
    got: list = []
    for _ in range(100):
        await proxy.service.drain_background()
        got = [r for r in (await recorded_calls(proxy.bus, proxy.blobs, RUN)).values()
               if r.event.rollout_id == rollout]
        if len(got) >= n:
            return got
        await asyncio.sleep(0.05)
    return got


async def served_by_sdk(api: str, base: str):
    """One streamed call through the API's real SDK (which would retry an HTTP error)."""
    if api == "anthropic":
        async with anthropic.AsyncAnthropic(base_url=base, api_key="k-secret", max_retries=2) as ac:
            async with ac.messages.stream(model="m", max_tokens=500, tools=TOOLS_AN,
                                          messages=[{"role": "user", "content": "write"}]) as st:
                msg = await st.get_final_message()
        assert msg.stop_reason == "tool_use" and msg.content[0].input == {"content": ARGS}
        return
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="k-secret", max_retries=2) as oc:
        if api == "chat":
            async with oc.chat.completions.stream(model="m", tools=TOOLS_OA,
                                                  messages=[{"role": "user", "content": "write"}]) as st:
                done = await st.get_final_completion()
            assert json.loads(done.choices[0].message.tool_calls[0].function.arguments) == {"content": ARGS}
            return
        async with oc.responses.stream(model="m", input="write", tools=TOOLS_RS) as st:
            final = await st.get_final_response()
    assert [o.type for o in final.output] == ["function_call"] and json.loads(final.output[0].arguments) == {
        "content": ARGS}


# -- 1: waiting for a cell -----------------------------------------------------------------


async def test_a_stream_whose_cell_aborts_after_the_grace_waits_and_is_served_once(proxy, renderer) -> None:
    """The only cell aborts the call after the 1 s grace (tokens generated, none shown: a
    tool call is still being written), then again at once, then serves it: the SDK's one
    request gets the whole answer, and the call is recorded once, with exactly the tokens
    generated, the aborted attempts' included."""
    for api in ("anthropic", "chat", "responses"):
        engine = only_cell_a(proxy, [Failing(1.5, tokens=3), Failing(0.1)])
        rollout = f"wait-{api}"
        base = await proxy.rollout(rollout)
        t0 = time.monotonic()
        await served_by_sdk(api, base)
        assert time.monotonic() - t0 > 1.5
        (rec,) = await calls_of(proxy, rollout)
        call_id = rec.event.call_id
        assert sorted(r for r in engine.by_rid if r.startswith(call_id)) == [f"{call_id}-{i}" for i in range(3)]
        a_in, a_out = engine.by_rid[f"{call_id}-0"]
        b_in, b_out = engine.by_rid[f"{call_id}-1"]
        c_in, c_out = engine.by_rid[f"{call_id}-2"]
        assert len(a_out) == 3 and b_out == [] and b_in == c_in == a_in + a_out  # continued, not restarted
        assert rec.input_ids == a_in and rec.output_ids == a_out + c_out
        assert renderer.decode(rec.output_ids).startswith(TOOL_ONLY)
        assert rec.event.delivered and rec.event.n_output_tokens == len(a_out + c_out)
        assert len(engine.received) == 3  # one call from the SDK: no retry
    assert proxy.service._in_flight == 0


async def test_a_crashed_only_cell_waits_for_another_cell_to_appear(proxy) -> None:
    """The only cell crashes after the grace (marked down); a new cell is added while the
    stream waits, with keepalives, and serves the call from the tokens already produced."""
    engine = only_cell_a(proxy, [Failing(1.3, tokens=4, crash=True)])
    other = proxy.engines["cell-b"]
    other.default_reply = TOOL_ONLY  # it continues the reply from the tokens cell-a produced
    other_url = proxy.served[1].url
    proxy.service.router.remove_cell("cell-b")
    base = await proxy.rollout("wait-new")

    async def add_cell_later() -> None:
        await asyncio.sleep(2.5)
        async with httpx.AsyncClient() as c:
            r = await c.post(proxy.url + "/admin/cells", headers={"Authorization": f"Bearer {ADMIN}"},
                             json={"name": "cell-c", "url": other_url, "capacity": 4})
            assert r.status_code == 200

    adder = asyncio.create_task(add_cell_later())
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(base + "/v1/chat/completions", headers=KEY,
                         json={"model": "m", "stream": True, "tools": TOOLS_OA,
                               "messages": [{"role": "user", "content": "write"}]})
    await adder
    lines = [line for line in r.text.splitlines() if line]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    assert lines.count(": keepalive") >= 5  # held through the crash and the wait
    calls = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    args = next(ch["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"] for ch in calls
                if ch["choices"][0]["delta"].get("tool_calls"))
    assert json.loads(args) == {"content": ARGS}
    assert proxy.service.router.cells["cell-a"].state.value == "down"
    (rec,) = await calls_of(proxy, "wait-new")
    a_in, a_out = engine.by_rid[f"{rec.event.call_id}-0"]
    b_in, b_out = other.by_rid[f"{rec.event.call_id}-1"]
    assert len(a_out) == 4 and b_in == a_in + a_out
    assert rec.output_ids == a_out + b_out and rec.event.cell == "cell-c" and rec.event.delivered


async def test_the_wait_is_bounded_and_ends_overloaded(proxy) -> None:
    """No cell takes the call within ``cell_wait_s``: the API's overloaded error in the
    stream; the tokens the attempts generated are recorded once, undelivered."""
    engine = only_cell_a(proxy, [Failing(1.2, tokens=2)] + [Failing(0.1, tokens=1)] * 50, wait_s=1.5)
    base = await proxy.rollout("wait-bound")
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(base + "/v1/messages", headers=AKEY,
                         json={"model": "m", "max_tokens": 500, "stream": True,
                               "messages": [{"role": "user", "content": "write"}]})
    took = time.monotonic() - t0
    assert r.status_code == 200 and 2.6 < took < 6, took
    data = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert data[-1]["type"] == "error" and data[-1]["error"]["type"] == "overloaded_error"
    assert "waited" in data[-1]["error"]["message"]
    assert {d["type"] for d in data[1:-1]} == {"ping"}
    (rec,) = await calls_of(proxy, "wait-bound")
    call_id = rec.event.call_id
    attempts = sorted((r for r in engine.by_rid if r.startswith(call_id)), key=lambda r: int(r.rsplit("-", 1)[1]))
    assert len(attempts) >= 2
    assert rec.output_ids == [t for rid in attempts for t in engine.by_rid[rid][1]]
    assert rec.event.delivered is False
    await asyncio.sleep(0.3)
    assert len(await calls_of(proxy, "wait-bound")) == 1


async def _wait_metrics(proxy) -> dict[str, float]:
    async with httpx.AsyncClient() as c:
        text = (await c.get(proxy.url + "/metrics")).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("gyre_proxy_cell_wait")}


async def test_waits_for_a_cell_are_counted_in_the_metrics(proxy) -> None:
    """A gauge of the calls waiting now, a counter of waits and one of waits that gave up."""
    assert await _wait_metrics(proxy) == {"gyre_proxy_cell_waiting": 0, "gyre_proxy_cell_waits_total": 0,
                                          "gyre_proxy_cell_waits_given_up_total": 0}
    only_cell_a(proxy, [Failing(1.2, tokens=2)] + [Failing(0.1, tokens=1)] * 50, wait_s=1.5)
    base = await proxy.rollout("wait-metrics")

    async def call() -> httpx.Response:
        async with httpx.AsyncClient(timeout=30) as c:
            return await c.post(base + "/v1/messages", headers=AKEY,
                                json={"model": "m", "max_tokens": 500, "stream": True,
                                      "messages": [{"role": "user", "content": "write"}]})

    given_up = asyncio.create_task(call())
    seen = []
    while not given_up.done():
        seen.append((await _wait_metrics(proxy))["gyre_proxy_cell_waiting"])
        await asyncio.sleep(0.05)
    assert "overloaded_error" in (await given_up).text
    assert 1 in seen  # it waited, and was seen waiting
    assert await _wait_metrics(proxy) == {"gyre_proxy_cell_waiting": 0, "gyre_proxy_cell_waits_total": 1,
                                          "gyre_proxy_cell_waits_given_up_total": 1}
    only_cell_a(proxy, [Failing(1.5, tokens=3), Failing(0.1)])  # waits, then is served
    served = await call()
    assert served.status_code == 200 and "message_stop" in served.text
    assert await _wait_metrics(proxy) == {"gyre_proxy_cell_waiting": 0, "gyre_proxy_cell_waits_total": 2,
                                          "gyre_proxy_cell_waits_given_up_total": 1}


async def test_a_stream_that_showed_content_does_not_wait(proxy) -> None:
    """Text already went out: the cell's abort ends the stream at once (no other cell)."""
    engine = only_cell_a(proxy, [Failing(1.5, tokens=4)], reply="some plain text that is shown as it comes")
    base = await proxy.rollout("no-wait")
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(base + "/v1/chat/completions", headers=KEY,
                         json={"model": "m", "stream": True, "messages": [{"role": "user", "content": "go"}]})
    assert time.monotonic() - t0 < 2.5
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert any(ch.get("choices") and ch["choices"][0]["delta"].get("content") for ch in chunks)
    assert chunks[-1]["error"]["code"] == "overloaded" and "waited" not in chunks[-1]["error"]["message"]
    (rec,) = await calls_of(proxy, "no-wait")
    assert rec.event.delivered is False and len(engine.received) == 1


async def test_a_caller_leaving_while_its_call_waits_for_a_cell_ends_it(proxy) -> None:
    """The wait is cancelled with the stream: no more attempts, recorded once, undelivered."""
    engine = only_cell_a(proxy, [Failing(1.2, tokens=2)] + [Failing(0.1, tokens=1)] * 100)
    base = await proxy.rollout("wait-gone")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    async with httpx.AsyncClient(timeout=30) as c:
        async with c.stream("POST", base + "/v1/messages", headers=AKEY,
                            json={"model": "m", "max_tokens": 500, "stream": True,
                                  "messages": [{"role": "user", "content": "write"}]}) as r:
            async for line in r.aiter_lines():
                if loop.time() - t0 > 2.5:
                    break  # waiting for a cell by now; the caller hangs up
    (rec,) = await calls_of(proxy, "wait-gone")
    tried = len(engine.received)
    assert tried >= 2 and rec.event.delivered is False
    call_id = rec.event.call_id
    attempts = sorted((r for r in engine.by_rid if r.startswith(call_id)), key=lambda r: int(r.rsplit("-", 1)[1]))
    assert rec.output_ids == [t for rid in attempts for t in engine.by_rid[rid][1]]
    await asyncio.sleep(2.0)
    assert len(engine.received) == tried and proxy.service._in_flight == 0
    assert len(await calls_of(proxy, "wait-gone")) == 1


async def test_a_failure_within_the_grace_is_still_an_http_529_the_sdk_retries(proxy) -> None:
    engine = only_cell_a(proxy, [Failing(0.2)])
    base = await proxy.rollout("grace-529")
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(base + "/v1/messages", headers=AKEY,
                         json={"model": "m", "max_tokens": 500, "stream": True,
                               "messages": [{"role": "user", "content": "write"}]})
    assert r.status_code == 529 and r.headers["x-should-retry"] == "true"
    engine.failures = [Failing(0.2)]
    await served_by_sdk("anthropic", base)  # the SDK sends it again after the 529
    assert len(engine.received) == 3
    calls = await calls_of(proxy, "grace-529")
    assert len(calls) == 1 and calls[0].event.delivered


async def test_a_stopping_proxy_ends_the_wait(proxy) -> None:
    only_cell_a(proxy, [Failing(1.2)] + [Failing(0.1)] * 100)
    base = await proxy.rollout("wait-stop")

    async def stop_later() -> None:
        await asyncio.sleep(2.0)
        proxy.service.stopping = True

    stopper = asyncio.create_task(stop_later())
    t0 = time.monotonic()
    try:
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(base + "/v1/responses", headers=KEY,
                             json={"model": "m", "stream": True, "input": "write"})
        await stopper
    finally:
        proxy.service.stopping = False
    assert time.monotonic() - t0 < 4
    assert "event: response.failed" in r.text and '"server_error"' in r.text
    assert await proxy.service.wait_calls(1.0)


# -- 2: each API's own keepalive -------------------------------------------------------------


async def test_responses_keepalives_are_in_progress_events_the_sdk_reads(sdk, proxy) -> None:
    """Responses' keepalive is ``response.in_progress`` again, with the next sequence
    number, never an SSE comment (Codex's reader drops comments); the real SDK reads the
    raw events and builds the final response through them. Anthropic's pings are skipped
    by its SDK."""
    proxy.service.config.keepalive_s = 0.15
    for e in proxy.engines.values():
        e.replies, e.default_reply, e.delay_s = [], TOOL_ONLY, 0.02
    base = await proxy.rollout("ka-rs")
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(base + "/v1/responses", headers=KEY,
                         json={"model": "m", "stream": True, "tools": TOOLS_RS, "input": "write"})
    assert not any(line.startswith(":") for line in r.text.splitlines())
    raw = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert [d["sequence_number"] for d in raw] == list(range(1, len(raw) + 1))
    oc = sdk(openai.AsyncOpenAI(base_url=base + "/v1", api_key="k-secret", max_retries=0))
    stream = await oc.responses.create(model="m", input="write", tools=TOOLS_RS, stream=True)
    kinds, seqs, ids = [], [], set()
    async for ev in stream:
        kinds.append(ev.type)
        seqs.append(ev.sequence_number)
        if ev.type in ("response.created", "response.in_progress", "response.completed"):
            ids.add(ev.response.id)
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    first_item = kinds.index("response.output_item.added")
    assert kinds[1:first_item] == ["response.in_progress"] * (first_item - 1) and first_item >= 4
    assert seqs == sorted(set(seqs)) and len(ids) == 1
    async with oc.responses.stream(model="m", input="write", tools=TOOLS_RS) as st:
        events = [ev.type async for ev in st]
        final = await st.get_final_response()
    assert events.count("response.in_progress") >= 3
    assert json.loads(final.output[0].arguments) == {"content": ARGS} and final.status == "completed"
    ac = sdk(anthropic.AsyncAnthropic(base_url=base, api_key="k-secret", max_retries=0))
    an = await ac.messages.create(model="m", max_tokens=500, tools=TOOLS_AN, stream=True,
                                  messages=[{"role": "user", "content": "write"}])
    an_kinds = [ev.type async for ev in an]
    assert an_kinds[0] == "message_start" and an_kinds[-1] == "message_stop" and "ping" not in an_kinds
    assert len(await calls_of(proxy, "ka-rs", 4)) == 4


# -- 3: a caller gone while sending its body -------------------------------------------------


async def test_a_caller_leaving_while_sending_its_body_is_a_quiet_499(proxy, caplog) -> None:
    caplog.set_level(logging.INFO, logger="services.proxy")
    await proxy.rollout("gone-body")
    host, port = proxy.url.removeprefix("http://").split(":")
    for path in ("/r/gone-body/v1/messages", "/r/gone-body/v1/chat/completions",
                 "/r/gone-body/v1/messages/count_tokens"):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write((f"POST {path} HTTP/1.1\r\nHost: x\r\nx-api-key: k-secret\r\nAuthorization: Bearer k-secret\r\n"
                      "Content-Type: application/json\r\nContent-Length: 5000\r\n\r\n"
                      '{"model": "m", "messages": [').encode())
        await writer.drain()
        await asyncio.sleep(0.2)  # the proxy is reading the body
        writer.close()
        await writer.wait_closed()
    for _ in range(50):
        if sum("left while sending" in r.getMessage() for r in caplog.records) >= 3:
            break
        await asyncio.sleep(0.05)
    assert sum("left while sending" in r.getMessage() for r in caplog.records) == 3
    await asyncio.sleep(0.2)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    async with httpx.AsyncClient() as c:
        metrics = (await c.get(proxy.url + "/metrics")).text
    assert 'kind="internal"' not in metrics


async def test_an_admin_caller_leaving_while_sending_its_body_is_a_quiet_499(proxy, caplog) -> None:
    caplog.set_level(logging.INFO, logger="services.proxy")
    host, port = proxy.url.removeprefix("http://").split(":")
    for path in ("/admin/cells", "/admin/cells/cell-a/drain", "/admin/sessions/move"):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write((f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN}\r\n"
                      "Content-Type: application/json\r\nContent-Length: 5000\r\n\r\n"
                      '{"name": "cell-z", ').encode())
        await writer.drain()
        await asyncio.sleep(0.2)  # the proxy is reading the body
        writer.close()
        await writer.wait_closed()
    for _ in range(200):
        if sum("left while sending" in r.getMessage() for r in caplog.records) >= 3:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)
    logged = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert sum("left while sending" in m for _, m in logged) == 3, logged
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], logged
    assert set(proxy.service.router.cells) == {"cell-a", "cell-b"}  # nothing half done
