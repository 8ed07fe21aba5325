"""Parallel tool calls off: the cell stops at the proxy's ``</tool_call>`` stop string. A
stop there that closes no call (the model wrote the tag inside its thinking, or in plain
text) is not the end of the reply: the generation goes on from the tokens produced, on
the same cell, and the reply and the record are those of one uninterrupted generation."""

from __future__ import annotations

import json

import httpx
import pytest

from services.proxy.core.toolparse import call_opened

from .conftest import RUN
from .test_review_fixes_s19 import CALL, KEY, OA, TOOLS_OA, oa_body
from .test_stream_start_and_fields import calls_of
from .tito_check import recorded_calls

THINK = "<think>A call would end with </tool_call>, so I write one.</think>\n\n"
TEXT = "The tag </tool_call> closes a call.\n"


@pytest.mark.parametrize(("text", "opened"), [
    ("<think>x </tool_call>", False), ("  <think>x</think>\n<tool_call>\n{}\n</tool_call>", True),
    ("plain </tool_call>", False), ("a <tool_call>{}</tool_call>", True), ("<think>a <tool_call>", False),
    ("<think>a</think> b", False), ("x <think> <tool_call>", True),
])
def test_call_opened_reads_the_reply_as_the_parser_does(text, opened) -> None:
    assert call_opened(text) is opened


@pytest.mark.parametrize(("prefix", "stream"), [(THINK, False), (THINK, True), (TEXT, False)])
async def test_a_stop_that_closes_no_call_does_not_end_the_reply(proxy, renderer, prefix, stream) -> None:
    reply = prefix + CALL.format("ls") + "\n" + CALL.format("pwd")
    for e in proxy.engines.values():
        e.replies, e.default_reply, e.honour_stop, e.bodies[:] = [], reply, True, []
    rollout = f"false-stop-{stream}-{len(prefix)}"
    base = await proxy.rollout(rollout)
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(base + OA, headers=KEY, json=oa_body(messages=[{"role": "user", "content": "go"}],
                                                              tools=TOOLS_OA, parallel_tool_calls=False,
                                                              stream=stream))
    assert r.status_code == 200, r.text
    if stream:
        chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
        calls = [t for ch in chunks for t in (ch["choices"][0]["delta"].get("tool_calls") or [])]
        reasoning = "".join(ch["choices"][0]["delta"].get("reasoning_content") or "" for ch in chunks)
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        choice = r.json()["choices"][0]
        calls, finish = choice["message"]["tool_calls"], choice["finish_reason"]
        reasoning = choice["message"].get("reasoning_content") or ""
    assert finish == "tool_calls" and len(calls) == 1, r.text
    assert json.loads(calls[0]["function"]["arguments"]) == {"cmd": "ls"}
    if prefix == THINK:
        assert "</tool_call>" in reasoning
    # two requests, the second going on from the first's tokens (same cell: its cache has them)
    sent = [(e.name, b) for e in proxy.engines.values() for b in e.bodies]
    assert len(sent) == 2 and sent[0][0] == sent[1][0], [n for n, _ in sent]
    first, second = sent[0][1], sent[1][1]
    engine = next(e for e in proxy.engines.values() if e.bodies)
    produced = engine.by_rid[str(first["rid"])][1]
    assert second["input_ids"] == first["input_ids"] + produced
    assert renderer.decode(produced).endswith("</tool_call>") and not call_opened(renderer.decode(produced))
    # the record: one call, every token generated, up to where the call closed
    await calls_of(proxy, rollout, 1)
    (rec,) = [r for r in (await recorded_calls(proxy.bus, proxy.blobs, RUN)).values()
              if r.event.rollout_id == rollout]
    assert rec.output_ids == produced + engine.by_rid[str(second["rid"])][1]
    text = renderer.decode(rec.output_ids)
    assert text.startswith(prefix.strip()) and text.endswith(CALL.format("ls")) and "pwd" not in text
