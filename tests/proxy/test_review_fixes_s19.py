"""Request fields the proxy used to drop silently: each is now honoured (``parallel_tool_calls``
false, Anthropic's ``disable_parallel_tool_use``, Chat ``top_logprobs``) or refused with a 400
in the caller's own API shape naming the field (structured output, penalties, logit bias,
Responses logprobs and ``custom`` tools, ...), while what real clients send by default passes."""

from __future__ import annotations

import json

import httpx
import pytest

from .conftest import RUN
from .test_errors import an_body, is_anthropic_error, oa_body
from .test_stream_start_and_fields import calls_of
from .tito_check import recorded_calls

OA = "/v1/chat/completions"
AN = "/v1/messages"
RS = "/v1/responses"
KEY = {"Authorization": "Bearer k-secret"}
AKEY = {"x-api-key": "k-secret"}
SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}
TOOL_SCHEMA = {"type": "object", "properties": {"cmd": {"type": "string"}}}
TOOLS_OA = [{"type": "function", "function": {"name": "bash", "parameters": TOOL_SCHEMA}}]
TOOLS_RS = [{"type": "function", "name": "bash", "parameters": TOOL_SCHEMA}]
TOOLS_AN = [{"name": "bash", "input_schema": TOOL_SCHEMA}]
CALL = '<tool_call>\n{{"name": "bash", "arguments": {{"cmd": "{}"}}}}\n</tool_call>'
TWO_CALLS = "Running both.\n" + CALL.format("ls") + "\n" + CALL.format("pwd")


def rs_body(**kw):
    return {"model": "m", "input": "hi", **kw}


def openai_refusal(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert param.split(".")[0] in err["message"] and "not supported" in err["message"], err


def two_calls(proxy) -> None:
    for e in proxy.engines.values():
        e.replies, e.default_reply, e.honour_stop = [], TWO_CALLS, True


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (OA, oa_body(response_format={"type": "json_object"}), "response_format"),
        (OA, oa_body(response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}),
         "response_format"),
        (OA, oa_body(presence_penalty=0.5), "presence_penalty"),
        (OA, oa_body(frequency_penalty=-1), "frequency_penalty"),
        (OA, oa_body(logit_bias={"1": 5}), "logit_bias"),
        (OA, oa_body(functions=[{"name": "f", "parameters": {}}]), "functions"),
        (OA, oa_body(modalities=["text", "audio"]), "modalities"),
        (OA, oa_body(prediction={"type": "content", "content": "x"}), "prediction"),
        (RS, rs_body(text={"format": {"type": "json_schema", "name": "t", "schema": SCHEMA}}), "text.format"),
        (RS, rs_body(text={"format": {"type": "json_object"}}), "text.format"),
        (RS, rs_body(top_logprobs=3), "top_logprobs"),
        (RS, rs_body(include=["message.output_text.logprobs"]), "include"),
        (RS, rs_body(truncation="auto"), "truncation"),
        (RS, rs_body(conversation="conv_1"), "conversation"),
        (RS, rs_body(tools=[{"type": "custom", "name": "apply_patch", "description": "patch",
                             "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}]),
         "tools[0]"),
        (RS, rs_body(tools=[{"type": "custom", "name": "note"}]), "tools[0]"),
    ],
)
async def test_openai_fields_it_cannot_honour_are_refused_by_name(proxy, path, body, param) -> None:
    base = await proxy.rollout("s19-refuse")
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(base + path, headers=KEY, json=body)
    if param == "tools[0]":
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0]", r.text
        assert "custom" in r.json()["error"]["message"]
    else:
        openai_refusal(r, param)
    assert not proxy.service.book.state("s19-refuse").tito.calls  # nothing generated or recorded


@pytest.mark.parametrize(
    ("body", "word"),
    [
        (an_body(output_config={"effort": "high", "format": {"type": "json_schema", "schema": SCHEMA}}),
         "output_config.format"),
        (an_body(output_format={"type": "json_schema", "schema": SCHEMA}), "output_format"),
        (an_body(mcp_servers=[{"type": "url", "url": "https://x", "name": "x"}]), "mcp_servers"),
        (an_body(tools=TOOLS_AN, tool_choice={"type": "auto", "disable_parallel_tool_use": "yes"}),
         "disable_parallel_tool_use"),
    ],
)
async def test_anthropic_fields_it_cannot_honour_are_refused_by_name(proxy, body, word) -> None:
    base = await proxy.rollout("s19-an-refuse")
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(base + AN + "?beta=true", headers=AKEY, json=body)
    is_anthropic_error(r, 400, "invalid_request_error", word)


async def test_defaults_and_what_real_clients_send_still_pass(proxy) -> None:
    """No-op values (what SDKs, litellm, Codex and Claude Code send) are accepted."""
    base = await proxy.rollout("s19-ok")
    codex = rs_body(instructions="You are Codex.", tools=TOOLS_RS, tool_choice="auto", parallel_tool_calls=False,
                    reasoning={"effort": "medium", "summary": "auto"}, store=False, stream=False,
                    include=["reasoning.encrypted_content"], prompt_cache_key="c1", text={"verbosity": "low"},
                    truncation="disabled")
    oks = [
        (OA, oa_body(response_format={"type": "text"}, parallel_tool_calls=True, presence_penalty=0,
                     frequency_penalty=0.0, logit_bias={}, modalities=["text"], logprobs=False, top_logprobs=0,
                     tools=TOOLS_OA, tool_choice="auto", n=1, user="u", store=False, metadata={"a": "b"},
                     reasoning_effort="low", service_tier="auto")),
        (OA, oa_body(response_format=None, function_call=None, functions=[], audio=None)),
        (RS, codex),
        (RS, rs_body(text={"format": {"type": "text"}}, top_logprobs=0, parallel_tool_calls=True)),
    ]
    async with httpx.AsyncClient(timeout=30) as c:
        for path, body in oks:
            r = await c.post(base + path, headers=KEY, json=body)
            assert r.status_code == 200, (body, r.text)
        assert r.json()["parallel_tool_calls"] is True
        r = await c.post(base + AN + "?beta=true", headers=AKEY,
                         json=an_body(output_config={"effort": "high"}, tools=TOOLS_AN,
                                      tool_choice={"type": "auto", "disable_parallel_tool_use": False}))
        assert r.status_code == 200, r.text
        # counting tokens refuses nothing that changes only the answer
        r = await c.post(base + AN + "/count_tokens", headers=AKEY,
                         json=an_body(output_config={"format": {"type": "json_schema", "schema": SCHEMA}}))
        assert r.status_code == 200, r.text
    sent = [b for e in proxy.engines.values() for b in e.bodies]
    assert sent and all("top_logprobs_num" not in b for b in sent)  # asked of the cell only when wanted
    # only Codex's request (tools, parallel_tool_calls false) ends at its first call
    assert sum("</tool_call>" in (b["sampling_params"].get("stop") or []) for b in sent) == 1


async def test_parallel_tool_calls_false_is_honoured_in_all_three_apis(proxy, renderer) -> None:
    """The model writes two calls; with parallel calls off the cell is told to stop where the
    first closes: the reply holds one call (a tool-call finish, not a stop sequence), and the
    record holds exactly the tokens generated, so the next turn continues it."""
    two_calls(proxy)
    base = await proxy.rollout("s19-par")
    msgs = [{"role": "user", "content": "go"}]
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(base + OA, headers=KEY, json=oa_body(messages=msgs, tools=TOOLS_OA))
        assert len(r.json()["choices"][0]["message"]["tool_calls"]) == 2  # default: parallel calls allowed
        r = await c.post(base + OA, headers=KEY, json=oa_body(messages=msgs, tools=TOOLS_OA,
                                                              parallel_tool_calls=False))
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        assert [json.loads(t["function"]["arguments"]) for t in choice["message"]["tool_calls"]] == [{"cmd": "ls"}]
        assert choice["message"]["content"] == "Running both."
        # streamed, the same
        r = await c.post(base + OA, headers=KEY, json=oa_body(messages=msgs, tools=TOOLS_OA, stream=True,
                                                              parallel_tool_calls=False))
        chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
        deltas = [t for ch in chunks for t in (ch["choices"][0]["delta"].get("tool_calls") or [])]
        assert len(deltas) == 1 and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        # the next turn: the call and its result come back, and continue the recorded tokens
        turn2 = msgs + [choice["message"], {"role": "tool", "tool_call_id": choice["message"]["tool_calls"][0]["id"],
                                            "content": "a.txt"}]
        for e in proxy.engines.values():
            e.default_reply = "Done."
        r = await c.post(base + OA, headers=KEY, json=oa_body(messages=turn2, tools=TOOLS_OA,
                                                              parallel_tool_calls=False))
        assert r.json()["choices"][0]["message"]["content"] == "Done."
        two_calls(proxy)
        # Responses (Codex sends parallel_tool_calls false)
        r = await c.post(base + RS, headers=KEY, json=rs_body(input="go", tools=TOOLS_RS, parallel_tool_calls=False))
        out = r.json()
        assert [i["type"] for i in out["output"]] == ["message", "function_call"], out
        assert out["parallel_tool_calls"] is False and out["status"] == "completed"
        # Anthropic: tool_choice.disable_parallel_tool_use
        for stream in (False, True):
            r = await c.post(base + AN, headers=AKEY, json=an_body(
                messages=msgs, tools=TOOLS_AN, stream=stream,
                tool_choice={"type": "auto", "disable_parallel_tool_use": True}))
            if stream:
                events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: ")]
                uses = [e for e in events if e["type"] == "content_block_start"
                        and e["content_block"]["type"] == "tool_use"]
                stop = next(e for e in events if e["type"] == "message_delta")["delta"]
            else:
                uses = [b for b in r.json()["content"] if b["type"] == "tool_use"]
                stop = r.json()
            assert len(uses) == 1 and stop["stop_reason"] == "tool_use" and stop["stop_sequence"] is None, r.text
    single = [b for e in proxy.engines.values() for b in e.bodies
              if "</tool_call>" in (b["sampling_params"].get("stop") or [])]
    assert len(single) == 6  # every call with parallel calls off, and only those
    await calls_of(proxy, "s19-par", 8)
    rec = {k: r for k, r in (await recorded_calls(proxy.bus, proxy.blobs, RUN)).items()
           if r.event.rollout_id == "s19-par"}
    turn2 = next(r for r in rec.values() if renderer.decode(r.output_ids).startswith("Done."))
    parent = rec[turn2.event.parent_call_id]
    # the parent holds one call, its tokens end where the call closed, and the turn after it
    # continues them all (the template's end of turn glued on): an append, not a fork
    assert renderer.decode(parent.output_ids).endswith("</tool_call>")
    assert renderer.decode(parent.output_ids).count("<tool_call>") == 1
    assert turn2.event.drift.value == "append", turn2.event.drift
    assert turn2.event.prefix_len >= len(parent.input_ids) + len(parent.output_ids)
    assert turn2.input_ids[: len(parent.input_ids) + len(parent.output_ids)] == parent.input_ids + parent.output_ids


async def test_chat_top_logprobs_are_the_cells(proxy) -> None:
    for e in proxy.engines.values():
        e.replies, e.default_reply = [], "Hello there."
    base = await proxy.rollout("s19-top")
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(base + OA, headers=KEY, json=oa_body(logprobs=True, top_logprobs=3))
        entries = r.json()["choices"][0]["logprobs"]["content"]
        r = await c.post(base + OA, headers=KEY, json=oa_body(logprobs=True))
        plain = r.json()["choices"][0]["logprobs"]["content"]
    assert entries and all(len(e["top_logprobs"]) == 3 for e in entries)
    for e in entries:
        assert [t["logprob"] for t in e["top_logprobs"]] == [e["logprob"] - j for j in range(3)]
        assert all(set(t) == {"token", "logprob", "bytes"} for t in e["top_logprobs"])
    assert all(e["top_logprobs"] == [] for e in plain)
    asked = [b.get("top_logprobs_num") for e in proxy.engines.values() for b in e.bodies]
    assert sorted(asked, key=str) == [3, None]
