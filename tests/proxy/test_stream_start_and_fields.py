"""A stream starts once its call is accepted and is kept alive while the model writes a
tool call; a caller gone before the first event is noticed; stop sequences are matched in
the reply's own text; chat logprobs, tool_choice, a typed ``stream``, and request ids."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import openai
import pytest

from services.proxy.main import proxy_config

from .conftest import RUN
from .tito_check import recorded_calls

KEY = {"Authorization": "Bearer k-secret"}
AKEY = {"x-api-key": "k-secret"}
ARGS = " ".join(f"w{i}" for i in range(60))
TOOL_ONLY = '<tool_call>\n{"name": "Write", "arguments": {"content": "' + ARGS + '"}}\n</tool_call>'
TOOLS_AN = [{"name": "Write", "input_schema": {"type": "object", "properties": {"content": {"type": "string"}}}}]
TOOLS_OA = [{"type": "function", "function": {"name": "Write", "parameters": TOOLS_AN[0]["input_schema"]}}]
TOOLS_RS = [{"type": "function", "name": "Write", "parameters": TOOLS_AN[0]["input_schema"]}]


def reply(proxy, text: str, delay_s: float = 0.0) -> None:
    for e in proxy.engines.values():
        e.replies, e.default_reply, e.delay_s = [], text, delay_s


def slow_tool_call(proxy, keepalive_s: float = 0.15) -> None:
    """A reply that is one tool call, written over about 2 s: no event until it closes."""
    proxy.service.config.keepalive_s = keepalive_s
    reply(proxy, TOOL_ONLY, 0.01)


async def calls_of(proxy, rollout: str, n: int = 1) -> list:
    for _ in range(100):
        await proxy.service.drain_background()
        got = [r.event for r in (await recorded_calls(proxy.bus, proxy.blobs, RUN)).values()
               if r.event.rollout_id == rollout]
        if len(got) >= n:
            return got
        await asyncio.sleep(0.05)
    return got


async def timed_lines(resp: httpx.Response, t0: float) -> list[tuple[float, str]]:
    loop = asyncio.get_running_loop()
    return [(loop.time() - t0, line) async for line in resp.aiter_lines() if line]


# -- 1: the stream starts when the call is accepted, and keepalives fill the silence -----


async def test_anthropic_stream_starts_at_once_and_pings_while_a_tool_call_is_written(proxy) -> None:
    slow_tool_call(proxy)
    base = await proxy.rollout("ka-an")
    loop = asyncio.get_running_loop()
    async with httpx.AsyncClient(timeout=30) as c:
        t0 = loop.time()
        body = {"model": "m", "max_tokens": 500, "stream": True, "tools": TOOLS_AN,
                "messages": [{"role": "user", "content": "write"}]}
        async with c.stream("POST", base + "/v1/messages", headers=AKEY, json=body) as r:
            headers_at = loop.time() - t0
            request_id = r.headers["request-id"]
            lines = await timed_lines(r, t0)
    events = [(t, line[7:]) for t, line in lines if line.startswith("event: ")]
    names = [e for _, e in events]
    assert names[0] == "message_start" and headers_at < 1.2  # not after the ~2 s tool call
    first_block = names.index("content_block_start")
    assert names[1:first_block].count("ping") >= 3
    assert names[first_block:] == ["content_block_start", "content_block_delta", "content_block_stop",
                                   "message_delta", "message_stop"]
    gaps = [b[0] - a[0] for a, b in zip(events, events[1:])]
    assert max(gaps) < 1.0  # never silent for long
    assert '{"type": "ping"}' in "\n".join(line for _, line in lines)
    start = json.loads(lines[1][1][6:])
    (call,) = await calls_of(proxy, "ka-an")
    assert start["message"]["id"] == f"msg_{call.call_id}" and request_id == call.call_id and call.delivered


async def test_openai_streams_start_at_once_with_their_keepalives(proxy) -> None:
    """Chat: SSE comments; Responses: ``response.in_progress`` again (Codex's idle timer
    counts events, not comments)."""
    slow_tool_call(proxy)
    base = await proxy.rollout("ka-oa")
    async with httpx.AsyncClient(timeout=30) as c:
        body = {"model": "m", "stream": True, "tools": TOOLS_OA, "messages": [{"role": "user", "content": "write"}]}
        r = await c.post(base + "/v1/chat/completions", headers=KEY, json=body)
        chat_lines = [line for line in r.text.splitlines() if line]
        chat_id = r.headers["x-request-id"]
        body = {"model": "m", "stream": True, "tools": TOOLS_RS, "input": "write"}
        r = await c.post(base + "/v1/responses", headers=KEY, json=body)
        rs_lines = [line for line in r.text.splitlines() if line]
        rs_id = r.headers["x-request-id"]
    first = json.loads(chat_lines[0][6:])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["id"] == f"chatcmpl-{chat_id}"
    tool_at = next(i for i, line in enumerate(chat_lines) if "tool_calls" in line)
    assert chat_lines[1:tool_at].count(": keepalive") >= 3 and chat_lines[-1] == "data: [DONE]"
    assert rs_lines[0] == "event: response.created" and rs_lines[2] == "event: response.in_progress"
    assert json.loads(rs_lines[1][6:])["response"]["id"] == f"resp_{rs_id}"
    added = rs_lines.index("event: response.output_item.added")
    assert rs_lines[4:added].count("event: response.in_progress") >= 3 and "event: response.completed" in rs_lines
    assert ": keepalive" not in rs_lines
    calls = await calls_of(proxy, "ka-oa", 2)
    assert {c.call_id for c in calls} == {chat_id, rs_id}


async def test_the_sdks_read_through_the_keepalives(sdk, proxy) -> None:
    slow_tool_call(proxy)
    base = await proxy.rollout("ka-sdk")
    ac = sdk(anthropic.AsyncAnthropic(base_url=base, api_key="k-secret", max_retries=0))
    async with ac.messages.stream(model="m", max_tokens=500, tools=TOOLS_AN,
                                  messages=[{"role": "user", "content": "write"}]) as st:
        msg = await st.get_final_message()
    assert msg.stop_reason == "tool_use" and msg.content[0].input == {"content": ARGS}
    oc = sdk(openai.AsyncOpenAI(base_url=base + "/v1", api_key="k-secret", max_retries=0))
    async with oc.chat.completions.stream(model="m", tools=TOOLS_OA,
                                          messages=[{"role": "user", "content": "write"}]) as st:
        done = await st.get_final_completion()
    assert done.choices[0].finish_reason == "tool_calls"
    assert json.loads(done.choices[0].message.tool_calls[0].function.arguments) == {"content": ARGS}
    async with oc.responses.stream(model="m", input="write", tools=TOOLS_RS) as st:
        final = await st.get_final_response()
    assert [o.type for o in final.output] == ["function_call"] and final.id.startswith("resp_")
    assert len(await calls_of(proxy, "ka-sdk", 3)) == 3


async def test_an_error_after_the_stream_started_ends_it_in_the_apis_format(proxy) -> None:
    """The only cell fails after the stream opened, before any event, and none comes back
    within ``cell_wait_s``: each API's error event (Responses: response.failed with the
    stream's response), not a broken stream."""
    slow_tool_call(proxy)
    proxy.service.config.cell_wait_s = 0.3
    proxy.service.router.drain("cell-b")
    base = await proxy.rollout("ka-err")
    async with httpx.AsyncClient(timeout=30) as c:
        for path, body, want in (
            ("/v1/messages", {"model": "m", "max_tokens": 500, "stream": True,
                              "messages": [{"role": "user", "content": "write"}]}, "event: error"),
            ("/v1/chat/completions", {"model": "m", "stream": True,
                                      "messages": [{"role": "user", "content": "write"}]}, 'data: {"error"'),
            ("/v1/responses", {"model": "m", "stream": True, "input": "write"}, "event: response.failed"),
        ):
            proxy.engines["cell-a"].fail_after_tokens = 40
            proxy.service.router.activate("cell-a")
            r = await c.post(base + path, headers={**KEY, **AKEY}, json=body)
            assert r.status_code == 200 and want in r.text, r.text
            assert "overloaded" in r.text or "server_error" in r.text
            if path == "/v1/responses":
                failed = json.loads(r.text.split("event: response.failed\ndata: ")[1].split("\n")[0])
                assert failed["response"]["status"] == "failed"
                assert failed["response"]["id"] == f"resp_{r.headers['x-request-id']}"
                assert failed["response"]["error"]["code"] == "server_error"


def test_the_keepalive_setting() -> None:
    import os

    old = os.environ.pop("GYRE_PROXY_KEEPALIVE_S", None)
    try:
        assert proxy_config("r").keepalive_s == 15.0
        os.environ["GYRE_PROXY_KEEPALIVE_S"] = "2.5"
        assert proxy_config("r").keepalive_s == 2.5
        for bad in ("0", "-1", "soon", "inf"):
            os.environ["GYRE_PROXY_KEEPALIVE_S"] = bad
            with pytest.raises(ValueError, match="GYRE_PROXY_KEEPALIVE_S"):
                proxy_config("r")
    finally:
        os.environ.pop("GYRE_PROXY_KEEPALIVE_S", None)
        if old is not None:
            os.environ["GYRE_PROXY_KEEPALIVE_S"] = old


# -- 2: a caller gone before the first event --------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_a_caller_gone_before_the_first_event_is_aborted_and_recorded_undelivered(proxy, renderer,
                                                                                       stream) -> None:
    slow_tool_call(proxy, keepalive_s=30.0)  # nothing but the opening events for ~2 s
    rollout = f"gone-{stream}"
    base = await proxy.rollout(rollout)
    body = {"model": "m", "max_tokens": 500, "stream": stream, "tools": TOOLS_AN,
            "messages": [{"role": "user", "content": "write"}]}
    if stream:
        async with httpx.AsyncClient(timeout=30) as c:
            async with c.stream("POST", base + "/v1/messages", headers=AKEY, json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and "message_start" in line:
                        await asyncio.sleep(0.3)  # some tokens generated, no event yet
                        break  # and the caller hangs up
    else:
        with pytest.raises(httpx.TimeoutException):
            async with httpx.AsyncClient(timeout=0.8) as c:
                await c.post(base + "/v1/messages", headers=AKEY, json=body)
    (call,) = await calls_of(proxy, rollout)
    assert call.delivered is False and 0 < call.n_output_tokens < len(renderer.encode(TOOL_ONLY))
    assert any(rid == f"{call.call_id}-0" for e in proxy.engines.values() for rid in e.aborted)
    await asyncio.sleep(0.1)
    assert proxy.service._in_flight == 0
    assert all(c.in_flight == 0 for c in proxy.service.router.cells.values())


# -- 3: stop sequences only in the reply's own text --------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_sequences_never_match_the_end_of_turn_token(proxy, stream) -> None:
    reply(proxy, "ok fine")
    base = await proxy.rollout(f"stops-{stream}")
    async with httpx.AsyncClient(timeout=30) as c:
        for stops, text, reason, seq in (
            (["end"], "ok fine", "end_turn", None),  # "end" is in "<|im_end|>"
            (["<|im_end|>"], "ok fine", "end_turn", None),
            (["<|"], "ok fine", "end_turn", None),
            ([" fi", "<|"], "ok", "stop_sequence", " fi"),  # a real one still cuts
        ):
            body = {"model": "m", "max_tokens": 50, "stream": stream, "stop_sequences": stops,
                    "messages": [{"role": "user", "content": "hi"}]}
            r = await c.post(base + "/v1/messages", headers=AKEY, json=body)
            assert r.status_code == 200, r.text
            if stream:
                data = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
                got = "".join(d["delta"].get("text", "") for d in data if d["type"] == "content_block_delta")
                delta = next(d for d in data if d["type"] == "message_delta")["delta"]
                assert (got, delta["stop_reason"], delta["stop_sequence"]) == (text, reason, seq), stops
            else:
                m = r.json()
                assert (m["content"][0]["text"], m["stop_reason"], m["stop_sequence"]) == (text, reason, seq), stops
            body = {"model": "m", "stream": stream, "stop": stops, "messages": [{"role": "user", "content": "hi"}]}
            r = await c.post(base + "/v1/chat/completions", headers=KEY, json=body)
            assert r.status_code == 200, r.text
            if stream:
                data = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
                got = "".join(d["choices"][0]["delta"].get("content") or "" for d in data)
                finish = data[-1]["choices"][0]["finish_reason"]
            else:
                got, finish = r.json()["choices"][0]["message"]["content"], r.json()["choices"][0]["finish_reason"]
            assert (got, finish) == (text, "stop"), stops


# -- 4: logprobs, tool_choice, a typed stream --------------------------------------------


async def test_chat_logprobs_stream_and_not(proxy, renderer) -> None:
    text = "Déjà vu 🙂 twice."
    reply(proxy, text)
    base = await proxy.rollout("lp")
    body = {"model": "m", "logprobs": True, "top_logprobs": 2, "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(base + "/v1/chat/completions", headers=KEY, json=body)
        whole = r.json()["choices"][0]["logprobs"]["content"]
        r = await c.post(base + "/v1/chat/completions", headers=KEY, json={**body, "stream": True})
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        plain = await c.post(base + "/v1/chat/completions", headers=KEY,
                             json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert plain.json()["choices"][0]["logprobs"] is None
        for bad in ({"logprobs": "yes"}, {"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}):
            r = await c.post(base + "/v1/chat/completions", headers=KEY,
                             json={"model": "m", "messages": [{"role": "user", "content": "hi"}], **bad})
            assert r.status_code == 400, bad
    ids = renderer.encode(text)
    assert len(whole) == len(ids)  # the end-of-turn token is not the caller's
    assert b"".join(bytes(e["bytes"]) for e in whole).decode() == text
    assert all(e["logprob"] < 0 and len(e["top_logprobs"]) == 2 for e in whole)  # top_logprobs 2: honoured
    assert all(e["top_logprobs"][0] == {k: e[k] for k in ("token", "logprob", "bytes")} for e in whole)
    assert [e["logprob"] for e in whole] == [-0.25 - 0.01 * (i % 7) for i in range(len(ids))]
    streamed = [e for ch in chunks for e in ((ch["choices"][0].get("logprobs") or {}).get("content") or [])]
    assert streamed == whole
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="k-secret", max_retries=0) as oc:
        done = await oc.chat.completions.create(model="m", logprobs=True, messages=[{"role": "user", "content": "x"}])
    assert "".join(t.token for t in done.choices[0].logprobs.content).replace("\ufffd", "") in text


async def test_tool_choice_none_leaves_the_markup_as_text_and_forcing_a_tool_is_refused(proxy) -> None:
    call = '<tool_call>\n{"name": "Write", "arguments": {"content": "x"}}\n</tool_call>'
    reply(proxy, "Sure." + call)
    base = await proxy.rollout("tc")
    async with httpx.AsyncClient(timeout=30) as c:
        msgs = [{"role": "user", "content": "go"}]
        r = await c.post(base + "/v1/chat/completions", headers=KEY,
                         json={"model": "m", "tools": TOOLS_OA, "tool_choice": "none", "messages": msgs})
        choice, first_id = r.json()["choices"][0], r.headers["x-request-id"]
        assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
        assert choice["message"]["content"] == "Sure." + call
        # sent back as it came: the next call continues the recorded one
        msgs += [choice["message"], {"role": "user", "content": "again"}]
        r = await c.post(base + "/v1/chat/completions", headers=KEY,
                         json={"model": "m", "tools": TOOLS_OA, "tool_choice": "auto", "messages": msgs})
        assert r.json()["choices"][0]["finish_reason"] == "tool_calls"
        second_id = r.headers["x-request-id"]
        r = await c.post(base + "/v1/messages", headers=AKEY,
                         json={"model": "m", "max_tokens": 100, "tools": TOOLS_AN, "stream": True,
                               "tool_choice": {"type": "none"}, "messages": [{"role": "user", "content": "go"}]})
        assert "tool_use" not in r.text and '"end_turn"' in r.text
        for path, body in (
            ("/v1/chat/completions", {"model": "m", "tools": TOOLS_OA, "tool_choice": "required", "messages": msgs}),
            ("/v1/chat/completions", {"model": "m", "tools": TOOLS_OA, "messages": msgs,
                                      "tool_choice": {"type": "function", "function": {"name": "Write"}}}),
            ("/v1/messages", {"model": "m", "max_tokens": 9, "tools": TOOLS_AN, "tool_choice": {"type": "any"},
                              "messages": msgs[:1]}),
            ("/v1/messages", {"model": "m", "max_tokens": 9, "tools": TOOLS_AN, "stream": True,
                              "tool_choice": {"type": "tool", "name": "Write"}, "messages": msgs[:1]}),
            ("/v1/responses", {"model": "m", "tools": TOOLS_RS, "input": "go", "stream": True,
                               "tool_choice": {"type": "function", "name": "Write"}}),
        ):
            r = await c.post(base + path, headers={**KEY, **AKEY}, json=body)
            assert r.status_code == 400 and "tool_choice" in r.text and "not supported" in r.text, r.text
        r = await c.post(base + "/v1/responses", headers=KEY,
                         json={"model": "m", "tools": TOOLS_RS, "input": "go", "tool_choice": "auto"})
        assert r.status_code == 200 and r.json()["output"][-1]["type"] == "function_call"
    calls = {c.call_id: c for c in await calls_of(proxy, "tc", 4)}
    assert calls[second_id].parent_call_id == first_id and calls[second_id].drift.value == "append"


async def test_a_stream_field_that_is_not_a_boolean_is_a_400(proxy) -> None:
    base = await proxy.rollout("typed")
    q = [{"role": "user", "content": "q"}]
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(base + "/v1/messages", headers=AKEY,
                         json={"model": "m", "max_tokens": 9, "stream": "yes", "messages": q})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = await c.post(base + "/v1/chat/completions", headers=KEY,
                         json={"model": "m", "stream": 1, "messages": q})
        assert r.status_code == 400
        r = await c.post(base + "/v1/messages", headers=AKEY,
                         json={"model": "m", "max_tokens": 9, "stream": None, "messages": q})
        assert r.status_code == 200


# -- 5: request ids ------------------------------------------------------------------------


async def test_responses_carry_the_call_id(proxy) -> None:
    base = await proxy.rollout("rid")
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(base + "/v1/messages", headers=AKEY,
                         json={"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "q"}]})
        assert r.json()["id"] == f"msg_{r.headers['request-id']}"
        r = await c.post(base + "/v1/chat/completions", headers=KEY,
                         json={"model": "m", "messages": [{"role": "user", "content": "q"}]})
        assert r.json()["id"] == f"chatcmpl-{r.headers['x-request-id']}"
    ids = {c.call_id for c in await calls_of(proxy, "rid", 2)}
    assert len(ids) == 2
