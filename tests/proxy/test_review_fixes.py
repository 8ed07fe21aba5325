"""Fixes from the proxy review: the context limit comes from the cells, streamed text adds
up to the recorded reply (every API), integers beyond 64 bits, and the default max_tokens.

In-process: the proxy app over ASGI, an in-memory bus and blob store, and scripted cells
(``FakeCell``) that answer ``/server_info`` as Gyre's engine and SGLang do (or not at all).
"""

from __future__ import annotations

import json
import random

import httpx
import pytest

from libs.common.blobs import MemoryBlobStore
from libs.common.bus.memory import InMemoryBus
from libs.common.events import CallRecorded, Context, RolloutStarted
from services.proxy.app import create_app
from services.proxy.core.messages import Msg, ToolCall, canonical_json
from services.proxy.core.routing import Router
from services.proxy.core.toolparse import StreamParser, parse_output
from services.proxy.history import key_digest
from services.proxy.main import positive_int_env
from services.proxy.service import ProxyConfig, ProxyService, context_length_in

RUN = "review"
BIG = 123456789012345678901234567890


class Rejected(Exception):
    """What the engine client raises for a 4xx (``status``, ``message``)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class FakeCell:
    """A scripted cell: each request gets the next reply (the tokenizer's ids + <|im_end|>);
    ``context`` is what ``/server_info`` says (an exception: it does not answer; None: no
    ``server_info`` at all); ``enforce`` refuses over-long requests as the engine words it."""

    def __init__(self, tok, replies=(), *, context=None, enforce: int | None = None) -> None:
        self.tok, self.replies, self.enforce = tok, list(replies), enforce
        self.sampling: list[dict] = []
        self.asked = 0
        if context is not None:
            self.context = context
        else:
            self.server_info = None  # type: ignore[assignment]

    async def server_info(self) -> dict:
        self.asked += 1
        if isinstance(self.context, Exception):
            raise self.context
        return {"context_length": self.context, "version": "test"}

    async def generate_stream(self, input_ids, sampling_params=None, *, return_logprob=True, rid=None):
        sp = dict(sampling_params or {})
        if self.enforce and len(input_ids) + sp["max_new_tokens"] >= self.enforce:
            raise Rejected(400, f"Requested token count exceeds the model's maximum context length of "
                                f"{self.enforce} tokens. You requested a total of {len(input_ids) + sp['max_new_tokens']}")
        self.sampling.append(sp)
        end = self.tok.convert_tokens_to_ids("<|im_end|>")
        ids = self.tok.encode(self.replies.pop(0) if self.replies else "ok", add_special_tokens=False) + [end]
        ids = ids[: sp["max_new_tokens"]]
        for n in range(1, len(ids) + 1):
            fin = ({"type": "stop", "matched": end} if ids[-1] == end else {"type": "length"}) if n == len(ids) else None
            yield {"output_ids": ids[:n], "meta_info": {"finish_reason": fin, "prompt_tokens": len(input_ids),
                                                        "cached_tokens": 0, "weight_version": 0,
                                                        "output_token_logprobs": [[-0.5, t, None] for t in ids[:n]]}}

    async def abort(self, rid=None) -> dict:
        return {}

    async def health(self) -> bool:
        return True


async def make(renderer, cells: dict[str, FakeCell], **config):
    bus, blobs = InMemoryBus(), MemoryBlobStore()
    router = Router()
    for name in cells:
        router.add_cell(name, 4)
    svc = ProxyService(ProxyConfig(run_id=RUN, **config), bus=bus, blobs=blobs, renderer=renderer, router=router,
                       clients=dict(cells))
    await bus.publish(RolloutStarted(run_id=RUN, rollout_id="r1", task_id="t", group_id="g", harness="x",
                                     weight_version=0, api_key_digest=key_digest("k")))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(svc, admin_token=None)),
                               base_url="http://t/r/r1", headers={"authorization": "Bearer k", "x-api-key": "k"})
    return svc, bus, client


async def recorded(bus) -> list[CallRecorded]:
    return [d.event async for d in bus.read(Context.CALLS, start_seq=1) if isinstance(d.event, CallRecorded)]


def sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


USER = [{"role": "user", "content": "hi"}]


# -- 1. the context limit is the cells' ---------------------------------------------------------


async def test_context_comes_from_the_cells_server_info_and_clamps_max_tokens(renderer) -> None:
    a, b = FakeCell(renderer.tokenizer, context=400), FakeCell(renderer.tokenizer, context=300)
    svc, bus, c = await make(renderer, {"a": a, "b": b})
    assert svc.max_context == renderer.max_context  # nobody asked yet: the tokenizer's
    r = await c.post("/v1/messages", json={"model": "claude", "max_tokens": 64000, "messages": USER})
    assert r.status_code == 200, r.text
    assert svc.max_context == 300 and a.asked == b.asked == 1  # the smallest cell's
    (sp,) = a.sampling + b.sampling
    assert sp["max_new_tokens"] == 300 - 1 - r.json()["usage"]["input_tokens"]
    await c.post("/v1/messages", json={"model": "claude", "max_tokens": 10, "messages": USER})
    assert a.asked == b.asked == 1  # asked once per cell
    svc.max_context = 250  # GYRE_PROXY_MAX_CONTEXT caps it further ...
    assert svc.max_context == 250
    svc.max_context = 100_000  # ... but never above what a cell takes
    assert svc.max_context == 300
    svc.router.remove_cell("b")  # a removed cell's limit goes with it
    assert svc.max_context == 400


async def test_too_long_for_the_cells_is_prompt_too_long_in_each_api(renderer) -> None:
    svc, bus, c = await make(renderer, {"a": FakeCell(renderer.tokenizer, context=64)})
    long = [{"role": "user", "content": "word " * 200}]
    r = await c.post("/v1/messages", json={"model": "claude", "max_tokens": 32000, "messages": long})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["message"].startswith("prompt is too long: ") and "> 62 maximum" in r.text
    r = await c.post("/v1/chat/completions", json={"model": "m", "messages": long})
    assert r.status_code == 400 and "prompt is too long" in r.json()["error"]["message"]


async def test_a_cell_that_does_not_answer_is_asked_again_and_its_refusal_teaches_the_limit(renderer) -> None:
    cell = FakeCell(renderer.tokenizer, ["one", "two"], context=ConnectionError("down"), enforce=200)
    svc, bus, c = await make(renderer, {"a": cell})
    r = await c.post("/v1/messages", json={"model": "claude", "max_tokens": 64000, "messages": USER})
    # the cell refused 64000 naming its context length: learnt, and the call retried within it
    assert r.status_code == 200, r.text
    assert svc.max_context == 200 and cell.sampling[-1]["max_new_tokens"] == 200 - 1 - r.json()["usage"]["input_tokens"]
    assert cell.asked == 1
    await c.post("/v1/messages", json={"model": "claude", "max_tokens": 5, "messages": USER})
    assert cell.asked == 1  # not asked again before CONTEXT_RETRY_S
    svc._context_retry_at["a"] = 0.0  # time passes; now it answers
    cell.context = 150
    svc.cell_context.pop("a")
    await svc.learn_contexts()
    assert cell.asked == 2 and svc.max_context == 150
    assert context_length_in("The input (9 tokens) is longer than the model's context length (8 tokens).") == 8


async def test_a_re_added_cell_is_asked_again(renderer) -> None:
    first, second = FakeCell(renderer.tokenizer, context=500), FakeCell(renderer.tokenizer, context=120)
    svc, bus, c = await make(renderer, {"a": first})
    svc.client_factory = lambda url: second
    await svc.learn_contexts()
    assert svc.max_context == 500
    svc.add_cell("a", "http://elsewhere:1")  # another engine behind the name
    await c.post("/v1/chat/completions", json={"model": "m", "messages": USER})
    assert svc.max_context == 120 and second.asked == 1


# -- 2. streamed text is the recorded reply ------------------------------------------------------

TC = '<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call>'
OUTPUTS = ["Let me look.\n\n" + TC + "\nThat should work.", TC + "\n" + TC, "a\n\n" + TC + "\n\n" + TC,
           "  spaced answer  ", "answer\n\n", "<think>\nplan\n</think>\n\n" + TC + "\nAfter.", "\n\n<think>x</think>y",
           "x <tool_call>{oops</tool_call> y\n", " \n" + TC + " tail <|im_end|>"]


@pytest.mark.parametrize("text", OUTPUTS)
def test_stream_parser_shows_exactly_its_content_however_split(text: str) -> None:
    whole = parse_output(text, ("<|im_end|>",))
    rng = random.Random(text)
    for _ in range(30):
        p, shown, think = StreamParser(("<|im_end|>",)), "", ""
        i = 0
        while i < len(text):
            j = i + rng.randint(1, 6)
            t, th = p.feed(text[i:j])
            shown, think, i = shown + t, think + th, j
        t, th = p.finish()
        shown, think = shown + t, think + th
        assert shown == p.content == whole.content
        assert think == (whole.reasoning or "") and p.reasoning == whole.reasoning
        assert [c.name for c in p.tool_calls] == [c.name for c in whole.tool_calls]


TOOLS_OA = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object",
                                                                              "properties": {"cmd": {"type": "string"}}}}}]
REPLY = "Let me look.\n\n" + TC + "\nThat should work."


async def _chat(c, msgs, stream: bool):
    r = await c.post("/v1/chat/completions", json={"model": "m", "messages": msgs, "tools": TOOLS_OA, "stream": stream})
    if not stream:
        m = r.json()["choices"][0]["message"]
        return m["content"] or "", m.get("tool_calls") or []
    text, calls = "", []
    for d in sse(r.text):
        for ch in d.get("choices", []):
            text += ch["delta"].get("content") or ""
            calls += [{"id": t["id"], "type": "function", "function": t["function"]}
                      for t in ch["delta"].get("tool_calls") or []]
    return text, calls


async def test_chat_streamed_text_is_the_recorded_reply_and_the_next_call_continues(renderer) -> None:
    for stream in (True, False):
        svc, bus, c = await make(renderer, {"a": FakeCell(renderer.tokenizer, [REPLY, "ok"])})
        text, calls = await _chat(c, USER, stream)
        assert text == "Let me look.\n\n\nThat should work." and len(calls) == 1
        echo = USER + [{"role": "assistant", "content": text, "tool_calls": calls},
                       {"role": "tool", "tool_call_id": calls[0]["id"], "content": "out"}]
        assert (await c.post("/v1/chat/completions", json={"model": "m", "messages": echo, "tools": TOOLS_OA})
                ).status_code == 200
        first, second = await recorded(bus)
        assert second.parent_call_id == first.call_id and second.drift.value != "fork", stream


async def test_responses_stream_has_the_whole_responses_items_and_codex_echo_continues(renderer) -> None:
    tools = [{"type": "function", "name": "bash", "parameters": {"type": "object", "properties": {}}}]
    reply = "<think>\nx\n</think>\n\n" + TC + "\nAfter."
    outs = {}
    for stream in (True, False):
        svc, bus, c = await make(renderer, {"a": FakeCell(renderer.tokenizer, [reply, "fine"])})
        inp = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "ls"}]}]
        body = {"model": "gpt-5", "instructions": "Codex.", "input": inp, "tools": tools, "store": False,
                "stream": stream}
        r = await c.post("/v1/responses", json=body)
        if stream:
            events = sse(r.text)
            out = [d["item"] for d in events if d["type"] == "response.output_item.done"]
            assert next(d for d in events if d["type"] == "response.completed")["response"]["output"] == out
        else:
            out = r.json()["output"]
        outs[stream] = [(x["type"], x.get("content", [{}])[0].get("text") if x["type"] == "message" else None)
                        for x in out]
        calls = [x for x in out if x["type"] == "function_call"]
        echo = inp + out + [{"type": "function_call_output", "call_id": x["call_id"], "output": "a"} for x in calls]
        assert (await c.post("/v1/responses", json=dict(body, input=echo, stream=False))).status_code == 200
        first, second = await recorded(bus)
        assert second.parent_call_id == first.call_id and second.drift.value != "fork", stream
    assert outs[True] == outs[False] == [("reasoning", None), ("message", "\nAfter."), ("function_call", None)]


async def test_anthropic_streamed_blocks_add_up_to_the_recorded_reply(renderer) -> None:
    tools = [{"name": "bash", "input_schema": {"type": "object", "properties": {}}}]
    svc, bus, c = await make(renderer, {"a": FakeCell(renderer.tokenizer, [REPLY, "ok"])})
    body = {"model": "claude", "max_tokens": 200, "tools": tools, "messages": USER}
    r = await c.post("/v1/messages", json=dict(body, stream=True))
    blocks: list[dict] = []
    for d in sse(r.text):
        if d["type"] == "content_block_start":
            blocks.append(dict(d["content_block"]))
        elif d["type"] == "content_block_delta" and d["delta"]["type"] == "text_delta":
            blocks[-1]["text"] += d["delta"]["text"]
        elif d["type"] == "content_block_delta" and d["delta"]["type"] == "input_json_delta":
            blocks[-1]["input"] = json.loads(d["delta"]["partial_json"])
    assert "".join(b.get("text", "") for b in blocks) == "Let me look.\n\n\nThat should work."
    use = next(b for b in blocks if b["type"] == "tool_use")
    echo = USER + [{"role": "assistant", "content": blocks},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "out"}]}]
    assert (await c.post("/v1/messages", json=dict(body, messages=echo))).status_code == 200
    first, second = await recorded(bus)
    assert second.parent_call_id == first.call_id and second.drift.value != "fork"


# -- 3. integers beyond 64 bits; a reply that cannot be indexed is still recorded ---------------

BIG_CALL = '<tool_call>\n{"name": "calc", "arguments": {"n": %d}}\n</tool_call>' % BIG


def test_canonical_json_falls_back_in_orjsons_form() -> None:
    import orjson

    ordinary = ["assistant", "héllo \u2028 \x01 \"q\" \\ 😀", [["f", {"b": [1, -2, 0.5, None, True], "a": {"z": 1, "y": ""}}]]]
    assert canonical_json(ordinary) == orjson.dumps(ordinary, option=orjson.OPT_SORT_KEYS)
    assert json.dumps(ordinary, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode() == canonical_json(ordinary)
    big = Msg("assistant", "", (ToolCall("1", "calc", {"n": BIG, "m": 1}),))
    assert canonical_json(["x", BIG]) == b'["x",%d]' % BIG
    assert big.canonical() == Msg("assistant", "", (ToolCall("2", "calc", json.dumps({"m": 1, "n": BIG})),)).canonical()


async def test_a_huge_integer_argument_is_served_recorded_and_echoed(renderer) -> None:
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {}}}}]
    svc, bus, c = await make(renderer, {"a": FakeCell(renderer.tokenizer, [BIG_CALL, "ok", BIG_CALL, "ok"])})
    r = await c.post("/v1/chat/completions", json={"model": "m", "messages": USER, "tools": tools})
    assert r.status_code == 200, r.text
    call = r.json()["choices"][0]["message"]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == {"n": BIG}
    echo = USER + [{"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": call["id"], "content": "done"}]
    assert (await c.post("/v1/chat/completions", json={"model": "m", "messages": echo, "tools": tools})).status_code == 200
    # Anthropic: the number comes back inside the JSON body, not in a string
    an_tools = [{"name": "calc", "input_schema": {"type": "object", "properties": {}}}]
    body = {"model": "claude", "max_tokens": 100, "tools": an_tools, "messages": [{"role": "user", "content": "again"}]}
    r = await c.post("/v1/messages", json=body)
    use = next(b for b in r.json()["content"] if b["type"] == "tool_use")
    assert use["input"] == {"n": BIG}
    echo = body["messages"] + [{"role": "assistant", "content": r.json()["content"]},
                               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"],
                                                             "content": "done"}]}]
    assert (await c.post("/v1/messages", json=dict(body, messages=echo))).status_code == 200
    calls = await recorded(bus)
    assert len(calls) == 4 and all(x.delivered for x in calls)
    assert calls[1].parent_call_id == calls[0].call_id and calls[3].parent_call_id == calls[2].call_id
    assert calls[3].drift.value != "fork"


async def test_a_reply_that_cannot_be_indexed_is_still_recorded(renderer, monkeypatch) -> None:
    from services.proxy.core.tito import Tito

    svc, bus, c = await make(renderer, {"a": FakeCell(renderer.tokenizer, ["hello", "again"])})

    def broken(*args, **kwargs):
        raise TypeError("cannot index this reply")

    monkeypatch.setattr(Tito, "record", broken)
    r = await c.post("/v1/chat/completions", json={"model": "m", "messages": USER})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hello"
    monkeypatch.undo()
    echo = USER + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    assert (await c.post("/v1/chat/completions", json={"model": "m", "messages": echo})).status_code == 200
    first, second = await recorded(bus)
    assert first.delivered and second.delivered and second.drift.value == "fork"  # no index: a fresh chain


# -- 4. the default max_tokens ------------------------------------------------------------------


async def test_default_max_tokens_is_configurable_else_the_room_left(renderer) -> None:
    cell = FakeCell(renderer.tokenizer, context=1000)
    svc, bus, c = await make(renderer, {"a": cell})
    r = await c.post("/v1/chat/completions", json={"model": "m", "messages": USER})
    assert cell.sampling[-1]["max_new_tokens"] == 1000 - 1 - r.json()["usage"]["prompt_tokens"]  # the room left
    svc.config.default_max_tokens = 77
    await c.post("/v1/responses", json={"model": "m", "input": "hi", "store": False})  # Codex names none
    assert cell.sampling[-1]["max_new_tokens"] == 77
    await c.post("/v1/chat/completions", json={"model": "m", "messages": USER, "max_tokens": 5})
    assert cell.sampling[-1]["max_new_tokens"] == 5  # the caller's own wins


def test_proxy_env_settings_and_gyre_up_passes_the_runs_max_tokens(monkeypatch) -> None:
    from gyre.up import plan_stack
    from libs.common.runconfig import load_run_config

    monkeypatch.setenv("GYRE_PROXY_DEFAULT_MAX_TOKENS", "4096")
    assert positive_int_env("GYRE_PROXY_DEFAULT_MAX_TOKENS") == 4096
    monkeypatch.setenv("GYRE_PROXY_MAX_CONTEXT", "")
    assert positive_int_env("GYRE_PROXY_MAX_CONTEXT") is None
    monkeypatch.setenv("GYRE_PROXY_MAX_CONTEXT", "lots")
    with pytest.raises(ValueError, match="GYRE_PROXY_MAX_CONTEXT"):
        positive_int_env("GYRE_PROXY_MAX_CONTEXT")
    cfg = load_run_config(None, ["cells.count=1", "sampling.max_tokens=3000"])
    (proxy,) = [x for x in plan_stack(cfg, "tok") if x.service == "proxy"]
    assert proxy.env["GYRE_PROXY_DEFAULT_MAX_TOKENS"] == "3000"
