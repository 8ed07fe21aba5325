"""OpenAI Chat Completions: request parsing, responses, stream chunks, errors."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from ..core.messages import Msg, ToolCall
from .common import (
    ApiError, ChatRequest, Finished, GenEvent, Keepalive, TextDelta, ThinkingDelta, TokenLogprobs, ToolCallDone,
    bad_request, expect, opt_bool, opt_int, opt_number, opt_parallel, parse_arguments, refuse, refuse_structured_output,
    stop_list, text_of, tool_choice_mode, tool_spec,
)

REQUEST_ID_HEADER = "x-request-id"  # OpenAI's; the SDK exposes it as ``_request_id``
# a stream's keepalive: an SSE comment, which clients skip (the SDK; no chat client is known
# to need an event to reset an idle timer)
KEEPALIVE = ": keepalive\n\n"

FINISH = {"stop": "stop", "stop_sequence": "stop", "length": "length", "tool_calls": "tool_calls", "abort": "stop"}
ERROR_TYPES = {"invalid_request": "invalid_request_error", "authentication": "authentication_error",
               "permission": "permission_error", "not_found": "not_found_error", "too_large": "invalid_request_error",
               "rate_limit": "rate_limit_error", "overloaded": "server_error", "upstream": "server_error",
               "internal": "server_error"}


def error_body(err: ApiError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": ERROR_TYPES.get(err.kind, "server_error"),
                      "param": err.param, "code": err.kind}}


def parse(body: Any) -> ChatRequest:
    body = expect(body, dict, "body")
    model = expect(body.get("model"), str, "model")
    raw_msgs = expect(body.get("messages"), list, "messages")
    if not raw_msgs:
        raise bad_request("'messages' must not be empty", "messages")
    msgs = [_message(m, f"messages[{i}]") for i, m in enumerate(raw_msgs)]
    tools = []
    for i, t in enumerate(expect(body.get("tools") or [], list, "tools")):
        p = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise bad_request(f"'{p}' must be {{'type': 'function', 'function': {{...}}}}", p)
        f = t["function"]
        tools.append(tool_spec(f.get("name"), f.get("description"), f.get("parameters"), p))
    n = body.get("n")
    if n not in (None, 1):
        raise bad_request("only n=1 is supported", "n")
    stream_opts = body.get("stream_options") or {}
    logprobs = opt_bool(body, "logprobs")
    top = opt_int(body, "top_logprobs", 0, 20)
    if top and not logprobs:
        raise bad_request("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    _refuse_unsupported(body)
    max_tokens = opt_int(body, "max_completion_tokens", 1, 10**7) or opt_int(body, "max_tokens", 1, 10**7)
    return ChatRequest(
        api="openai_chat", model=model, messages=msgs, tools=tools,
        tool_choice=tool_choice_mode(body.get("tool_choice")),
        max_tokens=max_tokens, temperature=opt_number(body, "temperature", 0, 2),
        top_p=opt_number(body, "top_p", 0, 1), stop=stop_list(body.get("stop"), "stop"),
        seed=opt_int(body, "seed", -(2**63), 2**63 - 1), stream=opt_bool(body, "stream"),
        include_usage=bool(isinstance(stream_opts, dict) and stream_opts.get("include_usage")), logprobs=logprobs,
        top_logprobs=top or 0, parallel_tool_calls=opt_parallel(body.get("parallel_tool_calls")),
    )


# sampling fields whose neutral value is the only one this proxy honours (the cells are
# sent none of them: the record's logprobs are those of the plain sampler)
NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0}


def _refuse_unsupported(body: dict[str, Any]) -> None:
    """Fields that would change the answer and that the proxy cannot honour: a 400 naming
    the field, unless it is absent or at its no-op value (what SDKs and harnesses send by
    default passes)."""
    refuse_structured_output(body.get("response_format"), "response_format")
    for key, neutral in NEUTRAL.items():
        v = body.get(key)
        if v is not None and v != neutral:
            raise refuse(key, f"other than {neutral}")
    if body.get("logit_bias"):
        raise refuse("logit_bias", "(a non-empty bias)")
    if body.get("functions") or body.get("function_call") not in (None, "auto", "none"):
        raise refuse("functions", "(the legacy function-calling fields; send 'tools')")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise refuse("modalities", "other than ['text']")
    for key in ("audio", "prediction", "web_search_options"):
        if body.get(key) is not None:
            raise refuse(key, "")


def _message(m: Any, p: str) -> Msg:
    m = expect(m, dict, p)
    role = m.get("role")
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant", "tool"):
        raise bad_request(f"'{p}.role' must be system, developer, user, assistant or tool, got {role!r}", p)
    if role == "tool":
        tcid = m.get("tool_call_id")
        if not isinstance(tcid, str):
            raise bad_request(f"'{p}.tool_call_id' is required for tool messages", p)
        name = m.get("name")
        if name is not None:
            expect(name, str, f"{p}.name")
        return Msg("tool", text_of(m.get("content"), f"{p}.content"), tool_call_id=tcid, name=name)
    calls: list[ToolCall] = []
    for j, c in enumerate(expect(m.get("tool_calls") or [], list, f"{p}.tool_calls")):
        q = f"{p}.tool_calls[{j}]"
        if not isinstance(c, dict) or not isinstance(c.get("function"), dict):
            raise bad_request(f"'{q}' must have a 'function' object", q)
        f = c["function"]
        name = expect(f.get("name"), str, f"{q}.function.name")
        calls.append(ToolCall(str(c.get("id") or ""), name, parse_arguments(f.get("arguments", "{}"), f"{q}.function.arguments")))
    reasoning = m.get("reasoning_content") if isinstance(m.get("reasoning_content"), str) else None
    return Msg(role, text_of(m.get("content"), f"{p}.content"), tuple(calls), reasoning=reasoning)


def _tool_call_json(c: ToolCall, index: int | None = None) -> dict[str, Any]:
    d: dict[str, Any] = {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json()}}
    if index is not None:
        d["index"] = index
    return d


def response(req: ChatRequest, fin: Finished) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": fin.content or (None if fin.tool_calls else "")}
    if fin.tool_calls:
        message["tool_calls"] = [_tool_call_json(c) for c in fin.tool_calls]
    if fin.reasoning:
        message["reasoning_content"] = fin.reasoning
    return {
        "id": f"chatcmpl-{fin.call_id}", "object": "chat.completion", "created": int(time.time()), "model": req.model,
        "choices": [{"index": 0, "message": message, "finish_reason": FINISH.get(fin.reason, "stop"),
                     "logprobs": _logprobs(req, fin.logprobs or ())}],
        "usage": _usage(fin),
    }


def _usage(fin: Finished) -> dict[str, Any]:
    return {"prompt_tokens": fin.prompt_tokens, "completion_tokens": fin.completion_tokens,
            "total_tokens": fin.prompt_tokens + fin.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": fin.cached_tokens}}


def _logprobs(req: ChatRequest, entries: Any) -> dict[str, Any] | None:
    """OpenAI's ``logprobs`` for the tokens: one entry per generated token (tool-call markup
    and thinking included, the end-of-turn token not), each with the cell's ``top_logprobs``
    likeliest tokens at its position (empty when the caller asked for none)."""
    return {"content": list(entries), "refusal": None} if req.logprobs else None


async def stream(req: ChatRequest, call_id: str, events: AsyncIterator[GenEvent]) -> AsyncIterator[str]:
    """Chunks; the role chunk goes out at once (the call is accepted), a ``Keepalive`` is
    an SSE comment. With ``logprobs``, the tokens' entries ride on the next chunk that goes
    out after they were generated."""
    cid, created = f"chatcmpl-{call_id}", int(time.time())
    pending: list[dict[str, Any]] = []  # logprob entries not sent yet

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        lp = _logprobs(req, pending)
        pending.clear()
        body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}]}
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    yield chunk({"role": "assistant", "content": ""})
    try:
        async for ev in events:
            if isinstance(ev, Keepalive):
                yield KEEPALIVE
            elif isinstance(ev, TokenLogprobs):
                pending.extend(ev.entries)
            elif isinstance(ev, TextDelta) and ev.text:
                yield chunk({"content": ev.text})
            elif isinstance(ev, ThinkingDelta) and ev.text:
                yield chunk({"reasoning_content": ev.text})
            elif isinstance(ev, ToolCallDone):
                yield chunk({"tool_calls": [_tool_call_json(ev.call, ev.index)]})
            elif isinstance(ev, Finished):
                yield chunk({}, FINISH.get(ev.reason, "stop"))
                if req.include_usage:
                    body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                            "choices": [], "usage": _usage(ev)}
                    yield f"data: {json.dumps(body)}\n\n"
    except ApiError as e:
        yield stream_error(e)
        return
    yield "data: [DONE]\n\n"


def stream_error(err: ApiError, call_id: str | None = None) -> str:
    return f"data: {json.dumps(error_body(err))}\n\n"
