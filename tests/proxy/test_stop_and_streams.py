"""What the caller sees of the model's words: stop sequences left out of the content (the
record keeps every generated token), and streamed answers that say the same as whole ones
(item indices, no stray whitespace items between tool calls)."""

from __future__ import annotations

import json
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from services.proxy.service import StopCutter

from ._fakes import Served
from .conftest import RUN
from .tito_check import recorded_calls

KEY = {"Authorization": "Bearer k-secret"}
AKEY = {"x-api-key": "k-secret"}
TWO_CALLS = ('Let me look.\n<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>\n'
             '<tool_call>\n{"name": "pwd", "arguments": {}}\n</tool_call>')


def stop_engine(tok, text: str, seen: list[list[int]]) -> FastAPI:
    """Like SGLang: a stop string ends the generation and stays in ``output_ids``."""
    app = FastAPI()

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        body = await request.json()
        sp = body.get("sampling_params") or {}
        ids = tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
        finish: dict[str, Any] = {"type": "stop", "matched": ids[-1]}
        for n in range(1, len(ids) + 1):
            hit = next((s for s in sp.get("stop") or [] if s in tok.decode(ids[:n])), None)
            if hit:
                ids, finish = ids[:n], {"type": "stop", "matched": hit}
                break
        seen.append(ids)

        async def chunks():
            for n in range(1, len(ids) + 1):
                meta = {"finish_reason": finish if n == len(ids) else None, "prompt_tokens": len(body["input_ids"]),
                        "cached_tokens": 0, "output_token_logprobs": [[-0.1, t, None] for t in ids[:n]]}
                yield f"data: {json.dumps({'output_ids': ids[:n], 'meta_info': meta})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app


def only_cell(proxy, app: FastAPI) -> None:
    served = Served(app)
    proxy.served.append(served)
    for name in list(proxy.service.router.cells):
        proxy.service.router.remove_cell(name)
    proxy.service.add_cell("x", served.url, capacity=4)


def sse_data(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_stop_cutter_holds_back_a_possible_stop_and_cuts_at_the_first() -> None:
    cut = StopCutter(["END", "##"])
    assert cut.feed("The ans") == "The ans"
    assert cut.feed("wer E") == "wer "  # "E" may start END
    assert cut.feed("N") == ""
    assert cut.feed("D and more") == "" and cut.matched == "END"
    assert cut.feed("later") == "" and cut.finish() == ""
    cut = StopCutter(["END"])
    assert cut.feed("no E") == "no " and cut.finish() == "E" and cut.matched is None
    assert StopCutter([]).feed("END") == "END"


async def test_a_stop_sequence_is_not_in_the_content_but_is_in_the_record(proxy, renderer) -> None:
    seen: list[list[int]] = []
    only_cell(proxy, stop_engine(renderer.tokenizer, "The answer is 42.\nEND of answer", seen))
    base = await proxy.rollout("stop-1")
    msgs = [{"role": "user", "content": "q"}]
    async with httpx.AsyncClient(timeout=20) as c:
        r = await c.post(base + "/v1/chat/completions", headers=KEY, json={"model": "m", "messages": msgs,
                                                                            "stop": ["END"]})
        choice = r.json()["choices"][0]
        assert choice["message"]["content"] == "The answer is 42.\n" and choice["finish_reason"] == "stop"
        r = await c.post(base + "/v1/messages", headers=AKEY, json={"model": "c", "max_tokens": 50, "messages": msgs,
                                                                     "stop_sequences": ["END"]})
        body = r.json()
        assert body["content"] == [{"type": "text", "text": "The answer is 42.\n"}]
        assert body["stop_reason"] == "stop_sequence" and body["stop_sequence"] == "END"
        r = await c.post(base + "/v1/chat/completions", headers=KEY, json={"model": "m", "messages": msgs,
                                                                            "stop": ["END"], "stream": True})
        streamed = "".join(d["choices"][0]["delta"].get("content") or "" for d in sse_data(r.text) if d["choices"])
        assert streamed == "The answer is 42.\n"
        # the next turn sends the trimmed reply back: it continues the recorded call
        r = await c.post(base + "/v1/chat/completions", headers=KEY, json={"model": "m", "stop": ["END"], "messages": [
            *msgs, {"role": "assistant", "content": streamed}, {"role": "user", "content": "and?"}]})
        assert r.status_code == 200
    calls = list((await recorded_calls(proxy.bus, proxy.blobs, RUN)).values())
    assert len(calls) == 4
    third, fourth = calls[2], calls[3]
    assert third.output_ids == seen[2] and renderer.decode(third.output_ids).endswith("END")  # every generated token
    assert fourth.event.parent_call_id == third.event.call_id
    assert fourth.event.drift.value == "template_drift"  # the template would not have written "END"
    assert fourth.input_ids[: len(third.input_ids) + len(third.output_ids)] == third.input_ids + third.output_ids


async def test_responses_stream_items_are_indexed_and_match_the_completed_response(proxy) -> None:
    reply = TWO_CALLS + "\nDone looking."
    for e in proxy.engines.values():
        e.default_reply = reply
    tools = [{"type": "function", "name": n, "parameters": {"type": "object", "properties": {}}} for n in ("ls", "pwd")]
    base = await proxy.rollout("rs-1")
    async with httpx.AsyncClient(timeout=20) as c:
        r = await c.post(base + "/v1/responses", headers=KEY, json={"model": "m", "input": "q", "tools": tools,
                                                                      "stream": True})
    events = sse_data(r.text)
    added = [(d["output_index"], d["item"]["type"]) for d in events if d["type"] == "response.output_item.added"]
    # one message with all the text (a client echoes a second message as a second assistant
    # turn, which the record does not have), then the calls: the non-streamed order
    assert added == [(0, "message"), (1, "function_call"), (2, "function_call")]
    done = [d["item"] for d in events if d["type"] == "response.output_item.done"]
    assert [d["output_index"] for d in events if d["type"] == "response.output_item.done"] == [0, 1, 2]
    deltas = [(d["output_index"], d["item_id"], d["delta"]) for d in events
              if d["type"] == "response.output_text.delta"]
    assert all(i >= 0 for i, _, _ in deltas)
    assert "".join(t for i, _, t in deltas if i == 0) == "Let me look.\n\n\nDone looking."
    assert len({item["id"] for item in done}) == 3 and {i for i, _, _ in deltas} == {0}
    completed = next(d for d in events if d["type"] == "response.completed")["response"]
    assert completed["output"] == done


async def test_anthropic_stream_has_no_whitespace_block_between_tool_uses(proxy) -> None:
    for e in proxy.engines.values():
        e.default_reply = TWO_CALLS
    tools = [{"name": n, "input_schema": {"type": "object", "properties": {}}} for n in ("ls", "pwd")]
    body = {"model": "c", "max_tokens": 200, "tools": tools, "messages": [{"role": "user", "content": "q"}]}
    base = await proxy.rollout("an-1")
    async with httpx.AsyncClient(timeout=20) as c:
        whole = (await c.post(base + "/v1/messages", headers=AKEY, json=body)).json()
        r = await c.post(base + "/v1/messages", headers=AKEY, json={**body, "stream": True})
    events = sse_data(r.text)
    blocks = [d["content_block"]["type"] for d in events if d["type"] == "content_block_start"]
    assert blocks == [b["type"] for b in whole["content"]] == ["text", "tool_use", "tool_use"]
    text = "".join(d["delta"]["text"] for d in events if d["type"] == "content_block_delta"
                   and d["delta"]["type"] == "text_delta")
    assert text == whole["content"][0]["text"] == "Let me look."
