"""Anthropic's prefill: a last assistant message is the start of the reply. The model
writes on from its text (the engine's input ends with it, inside an open assistant turn),
the answer holds only what the model wrote, the record keeps the prefill in the input (it
is not trained on) and the next turn, sending the whole assistant message back, continues
the call."""

from __future__ import annotations

import httpx

from libs.common.events.calls import DriftClass

from .conftest import RUN
from .tito_check import recorded_calls

KEY = {"x-api-key": "k-secret"}


async def test_the_reply_continues_the_prefill_and_the_next_turn_continues_the_call(proxy, renderer) -> None:
    seen: list[str] = []
    replies = iter([" 42.", "Yes."])
    for e in proxy.engines.values():
        e.default_reply = lambda text: (seen.append(text) or next(replies))
    base = await proxy.rollout("pf")
    msgs = [{"role": "user", "content": "what is 6*7?"},
            {"role": "assistant", "content": [{"type": "text", "text": "The answer is"}]}]
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(base + "/v1/messages", headers=KEY, json={"model": "m", "max_tokens": 64, "messages": msgs})
        assert r.status_code == 200, r.text
        assert r.json()["content"] == [{"type": "text", "text": " 42."}]
        assert seen[0].endswith("<|im_start|>assistant\nThe answer is"), seen[0]
        assert seen[0].count("<|im_start|>assistant") == 1
        msgs = [msgs[0], {"role": "assistant", "content": "The answer is 42."},
                {"role": "user", "content": "sure?"}]
        r = await c.post(base + "/v1/messages", headers=KEY, json={"model": "m", "max_tokens": 64, "messages": msgs})
        assert r.status_code == 200, r.text
    await proxy.service.drain_background()
    first, second = list((await recorded_calls(proxy.bus, proxy.blobs, RUN)).values())
    prefill_ids = renderer.encode("The answer is")
    assert list(first.input_ids[-len(prefill_ids):]) == prefill_ids  # input: the model did not write it
    assert renderer.decode(list(first.output_ids)).startswith(" 42.")
    assert second.event.parent_call_id == first.event.call_id
    assert second.event.drift == DriftClass.APPEND
    assert second.event.prefix_len == len(first.input_ids) + len(first.output_ids)


async def test_count_tokens_counts_the_prefill(proxy) -> None:
    base = await proxy.rollout("pf-count")
    user = {"role": "user", "content": "what is 6*7?"}
    async with httpx.AsyncClient(timeout=30) as c:
        plain = await c.post(base + "/v1/messages/count_tokens", headers=KEY, json={"model": "m", "messages": [user]})
        more = await c.post(base + "/v1/messages/count_tokens", headers=KEY,
                            json={"model": "m", "messages": [user, {"role": "assistant", "content": "The answer is"}]})
    assert plain.status_code == more.status_code == 200, (plain.text, more.text)
    assert more.json()["input_tokens"] > plain.json()["input_tokens"]


async def test_a_prefill_anthropic_would_refuse_is_refused_in_its_shape(proxy) -> None:
    base = await proxy.rollout("pf-bad")
    user = {"role": "user", "content": "hi"}
    bad = [({"role": "assistant", "content": "The answer is "}, "trailing whitespace"),
           ({"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "bash", "input": {}}]},
            "cannot be continued")]
    async with httpx.AsyncClient(timeout=30) as c:
        for last, why in bad:
            r = await c.post(base + "/v1/messages", headers=KEY,
                             json={"model": "m", "max_tokens": 8, "messages": [user, last]})
            assert r.status_code == 400, r.text
            err = r.json()
            assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
            assert why in err["error"]["message"] and "messages.1" in err["error"]["message"]
