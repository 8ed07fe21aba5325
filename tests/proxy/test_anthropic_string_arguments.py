"""A tool call whose "arguments" the model wrote as a JSON string that is no object
(``{"name": "bash", "arguments": "ls -la"}``) is parsed with the string as its arguments
and recorded so. Anthropic's tool_use ``input`` must be an object, so the proxy sends it as
``{"raw": "ls -la"}`` (api/anthropic.py) -- and Claude Code sends exactly that back. The
message hash then differs from the recorded reply's, so the next turn does not continue
the reply: it forks from the earlier call's input and the reply is re-rendered."""

from __future__ import annotations

import httpx

from .conftest import RUN
from .tito_check import recorded_calls

KEY = {"x-api-key": "k-secret"}
TOOLS = [{"name": "bash", "description": "run", "input_schema": {"type": "object", "properties": {}}}]


async def test_the_echoed_tool_use_continues_the_reply(proxy) -> None:
    for e in proxy.engines.values():
        e.replies = ['<tool_call>\n{"name": "bash", "arguments": "ls -la"}\n</tool_call>', "done"]
    base = await proxy.rollout("an-raw")
    msgs = [{"role": "user", "content": "list files"}]
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(base + "/v1/messages", headers=KEY,
                         json={"model": "claude-x", "max_tokens": 64, "tools": TOOLS, "messages": msgs})
        assert r.status_code == 200, r.text
        content = r.json()["content"]
        use = next(b for b in content if b["type"] == "tool_use")
        msgs += [{"role": "assistant", "content": content},  # what Claude Code sends back: the blocks verbatim
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "a b"}]}]
        r = await c.post(base + "/v1/messages", headers=KEY,
                         json={"model": "claude-x", "max_tokens": 64, "tools": TOOLS, "messages": msgs})
        assert r.status_code == 200, r.text
    await proxy.service.drain_background()
    first, second = list((await recorded_calls(proxy.bus, proxy.blobs, RUN)).values())
    assert second.event.parent_call_id == first.event.call_id
    assert second.event.prefix_len == len(first.input_ids) + len(first.output_ids), \
        f"drift {second.event.drift.value}: reused {second.event.prefix_len} tokens, not the reply " \
        f"({len(first.input_ids)} input + {len(first.output_ids)} output)"
