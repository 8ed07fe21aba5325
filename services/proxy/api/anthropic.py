"""Anthropic Messages: request parsing, responses, SSE events, errors, token counting."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from ..core.messages import Msg, ToolCall
from .common import (
    ApiError, ChatRequest, Finished, GenEvent, Keepalive, TextDelta, ThinkingDelta, ToolCallDone, bad_request, expect,
    opt_bool, opt_int, opt_number, refuse, refuse_structured_output, stop_list, tool_choice_mode, tool_spec,
)

REQUEST_ID_HEADER = "request-id"  # Anthropic's; the SDKs expose it as the response's request id
KEEPALIVE = 'event: ping\ndata: {"type": "ping"}\n\n'  # what Anthropic sends while a reply is slow

STOP_REASON = {"stop": "end_turn", "stop_sequence": "stop_sequence", "length": "max_tokens",
               "tool_calls": "tool_use", "abort": "end_turn"}
ERROR_TYPES = {"invalid_request": "invalid_request_error", "authentication": "authentication_error",
               "permission": "permission_error", "not_found": "not_found_error", "too_large": "request_too_large",
               "rate_limit": "rate_limit_error", "overloaded": "overloaded_error", "upstream": "api_error",
               "internal": "api_error"}
# Server-side tools Anthropic runs itself; a self-hosted policy cannot, so they are refused.
SERVER_TOOL_PREFIXES = ("web_search", "web_fetch", "code_execution", "computer_", "bash_2", "text_editor_2")


def error_body(err: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(err.kind, "api_error"), "message": err.message}}


def parse(body: Any, *, count_only: bool = False) -> ChatRequest:
    body = expect(body, dict, "body")
    model = expect(body.get("model"), str, "model")
    raw = expect(body.get("messages"), list, "messages")
    if not raw:
        raise bad_request("messages: at least one message is required", "messages")
    msgs: list[Msg] = []
    system = _system_text(body.get("system"))
    if system:
        msgs.append(Msg("system", system))
    for i, m in enumerate(raw):
        msgs.extend(_message(m, f"messages.{i}"))
    prefill = _prefill(msgs, raw)
    tools = []
    for i, t in enumerate(expect(body.get("tools") or [], list, "tools")):
        p = f"tools.{i}"
        t = expect(t, dict, p)
        ttype = t.get("type")
        if isinstance(ttype, str) and ttype != "custom" and ttype.startswith(SERVER_TOOL_PREFIXES):
            if count_only:  # counting refuses nothing it does not need: such a tool adds no tokens here
                continue
            raise bad_request(f"{p}: server tool {ttype!r} is not available with a self-hosted policy", p)
        tools.append(tool_spec(t.get("name"), t.get("description"), t.get("input_schema"), p))
    max_tokens = opt_int(body, "max_tokens", 1, 10**7)
    if max_tokens is None and not count_only:
        raise bad_request("max_tokens: Field required", "max_tokens")
    try:
        choice = tool_choice_mode(body.get("tool_choice"))
        single = _disable_parallel(body.get("tool_choice"))
    except ApiError:
        if not count_only:  # a forced tool choice changes the answer, not the prompt's length
            raise
        choice, single = "auto", False
    if not count_only:  # nor do these
        _refuse_unsupported(body)
    return ChatRequest(
        api="anthropic_messages", model=model, messages=msgs, tools=tools,
        tool_choice=choice,
        max_tokens=max_tokens, temperature=opt_number(body, "temperature", 0, 1),
        top_p=opt_number(body, "top_p", 0, 1), top_k=opt_int(body, "top_k", 0, 10**6),
        stop=stop_list(body.get("stop_sequences"), "stop_sequences"), stream=opt_bool(body, "stream"),
        prefill=prefill, parallel_tool_calls=not single,
        extra={k: body[k] for k in ("thinking", "metadata", "context_management", "output_config") if k in body},
    )


def _disable_parallel(choice: Any) -> bool:
    """``tool_choice.disable_parallel_tool_use`` (at most one tool call): honoured."""
    v = choice.get("disable_parallel_tool_use") if isinstance(choice, dict) else None
    if v is not None and not isinstance(v, bool):
        raise bad_request("tool_choice.disable_parallel_tool_use: must be a boolean", "tool_choice")
    return bool(v)


def _refuse_unsupported(body: dict[str, Any]) -> None:
    """Fields that would change the answer and that the proxy cannot honour: a 400 naming
    the field. Claude Code's ``output_config`` (``effort``), ``thinking``,
    ``context_management`` and ``metadata`` pass; its interactive title request's
    ``output_config.format`` (a JSON schema) is refused: the cells cannot constrain the
    reply to it. Only that side request sends it (shared/notes/claude-code-forks.md); the
    headless ``-p`` runs and the agents' own requests do not."""
    config = body.get("output_config")
    if config is not None:
        config = expect(config, dict, "output_config")
        refuse_structured_output(config.get("format"), "output_config.format", plain=())
    refuse_structured_output(body.get("output_format"), "output_format", plain=())
    if body.get("mcp_servers"):
        raise refuse("mcp_servers", "(MCP connectors run on Anthropic's side)")


def _prefill(msgs: list[Msg], raw: list[Any]) -> str:
    """A last assistant message is the start of the reply (Anthropic's prefill): taken out
    of ``msgs`` and returned; the model writes on from its text, and the answer holds only
    what it wrote. Refused as Anthropic refuses it: text ending in whitespace, tool_use."""
    if not msgs or msgs[-1].role != "assistant":
        return ""
    last = msgs.pop()
    p = f"messages.{len(raw) - 1}"
    if last.tool_calls:
        raise bad_request(f"{p}: a final assistant message with tool_use blocks cannot be continued; "
                          "send the tool_result in a user message", p)
    if last.content != last.content.rstrip():
        raise bad_request(f"{p}: final assistant content cannot end with trailing whitespace", p)
    return last.content


def _system_text(system: Any) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    if isinstance(system, list):
        parts = []
        for i, b in enumerate(system):
            if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
                raise bad_request(f"system.{i}: only text blocks are supported", "system")
            parts.append(b["text"])
        return "\n\n".join(parts)
    raise bad_request("system: must be a string or an array of text blocks", "system")


def _message(m: Any, p: str) -> list[Msg]:
    m = expect(m, dict, p)
    role, content = m.get("role"), m.get("content")
    if role == "system":  # some clients put it here; treat it as a system turn
        return [Msg("system", _system_text(content))]
    if role not in ("user", "assistant"):
        raise bad_request(f"{p}.role: must be 'user' or 'assistant', got {role!r}", p)
    if isinstance(content, str):
        return [Msg(role, content)]
    blocks = expect(content, list, f"{p}.content")
    texts: list[str] = []
    calls: list[ToolCall] = []
    results: list[Msg] = []
    thinking: list[str] = []
    for j, b in enumerate(blocks):
        q = f"{p}.content.{j}"
        b = expect(b, dict, q)
        kind = b.get("type")
        if kind == "text":
            texts.append(expect(b.get("text"), str, f"{q}.text"))
        elif kind == "tool_use" and role == "assistant":
            name = expect(b.get("name"), str, f"{q}.name")
            args = b.get("input", {})
            calls.append(ToolCall(str(b.get("id") or ""), name, args if isinstance(args, dict) else {"value": args}))
        elif kind == "tool_result" and role == "user":
            results.append(Msg("tool", _result_text(b.get("content"), q), tool_call_id=str(b.get("tool_use_id") or ""),
                               name=None))
        elif kind in ("thinking", "redacted_thinking"):
            if isinstance(b.get("thinking"), str):
                thinking.append(b["thinking"])
        elif kind in ("image", "document"):
            raise bad_request(f"{q}: {kind} blocks are not supported by this policy (text only)", q)
        else:
            raise bad_request(f"{q}.type: unsupported content block {kind!r} in a {role} message", q)
    out = list(results)
    if texts or calls or not results:
        out.append(Msg(role, "".join(texts), tuple(calls), reasoning="".join(thinking) or None))
    return out


def _result_text(content: Any, p: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, b in enumerate(content):
            if isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str):
                parts.append(b["text"])
            else:
                raise bad_request(f"{p}.content.{i}: only text blocks are supported in tool results", p)
        return "\n".join(parts)
    raise bad_request(f"{p}.content: must be a string or an array of text blocks", p)


def _usage(fin: Finished) -> dict[str, Any]:
    return {"input_tokens": fin.prompt_tokens - fin.cached_tokens, "output_tokens": fin.completion_tokens,
            "cache_read_input_tokens": fin.cached_tokens, "cache_creation_input_tokens": 0}


def response(req: ChatRequest, fin: Finished) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if fin.reasoning:
        content.append({"type": "thinking", "thinking": fin.reasoning, "signature": ""})
    if fin.content or not fin.tool_calls:
        content.append({"type": "text", "text": fin.content})
    for c in fin.tool_calls:
        content.append({"type": "tool_use", "id": c.id, "name": c.name,
                        "input": c.arguments if isinstance(c.arguments, dict) else {"raw": c.arguments}})
    return {"id": f"msg_{fin.call_id}", "type": "message", "role": "assistant", "model": req.model,
            "content": content, "stop_reason": STOP_REASON.get(fin.reason, "end_turn"),
            "stop_sequence": fin.stop_sequence, "usage": _usage(fin)}


def sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def stream(req: ChatRequest, call_id: str, events: AsyncIterator[GenEvent]) -> AsyncIterator[str]:
    """The message's events; ``message_start`` goes out at once (the call is accepted), a
    ``Keepalive`` is a ``ping`` event, and an error after it ends the stream with an
    ``error`` event."""
    yield sse("message_start", {"type": "message_start", "message": {
        "id": f"msg_{call_id}", "type": "message", "role": "assistant", "model": req.model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}})
    index, open_kind = -1, None

    def open_block(kind: str, block: dict[str, Any]) -> list[str]:
        nonlocal index, open_kind
        out = []
        if open_kind is not None:
            out.append(sse("content_block_stop", {"type": "content_block_stop", "index": index}))
        index += 1
        open_kind = kind
        out.append(sse("content_block_start", {"type": "content_block_start", "index": index, "content_block": block}))
        return out

    try:
        async for ev in events:
            if isinstance(ev, Keepalive):
                yield KEEPALIVE
            elif isinstance(ev, ThinkingDelta) and ev.text:
                if open_kind != "thinking":
                    for s in open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                        yield s
                yield sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                                  "delta": {"type": "thinking_delta", "thinking": ev.text}})
            elif isinstance(ev, TextDelta) and ev.text:
                if open_kind != "text":
                    for s in open_block("text", {"type": "text", "text": ""}):
                        yield s
                yield sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                                  "delta": {"type": "text_delta", "text": ev.text}})
            elif isinstance(ev, ToolCallDone):
                c = ev.call
                for s in open_block("tool_use", {"type": "tool_use", "id": c.id, "name": c.name, "input": {}}):
                    yield s
                args = c.arguments if isinstance(c.arguments, dict) else {"raw": c.arguments}
                yield sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                                  "delta": {"type": "input_json_delta",
                                                            "partial_json": json.dumps(args)}})
            elif isinstance(ev, Finished):
                if open_kind is None:
                    for s in open_block("text", {"type": "text", "text": ""}):
                        yield s
                yield sse("content_block_stop", {"type": "content_block_stop", "index": index})
                yield sse("message_delta", {"type": "message_delta",
                                            "delta": {"stop_reason": STOP_REASON.get(ev.reason, "end_turn"),
                                                      "stop_sequence": ev.stop_sequence},
                                            "usage": _usage(ev)})
                yield sse("message_stop", {"type": "message_stop"})
    except ApiError as e:
        yield stream_error(e)


def stream_error(err: ApiError, call_id: str | None = None) -> str:
    return sse("error", error_body(err))
