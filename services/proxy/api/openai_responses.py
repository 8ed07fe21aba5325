"""OpenAI Responses: stateless use (``store: false``; the client sends the whole input,
function calls and their outputs included). Parsing, responses, stream events, errors."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from ..core.messages import Msg, ToolCall
from . import openai_chat
from .common import (
    ApiError, ChatRequest, Finished, GenEvent, Keepalive, TextDelta, ThinkingDelta, ToolCallDone, bad_request, expect,
    opt_bool, opt_int, opt_number, opt_parallel, parse_arguments, refuse, refuse_structured_output, text_of,
    tool_choice_mode, tool_spec,
)

error_body = openai_chat.error_body
REQUEST_ID_HEADER = openai_chat.REQUEST_ID_HEADER


def parse(body: Any) -> ChatRequest:
    body = expect(body, dict, "body")
    model = expect(body.get("model"), str, "model")
    if body.get("previous_response_id"):
        raise bad_request("previous_response_id is not supported: send the whole input (store: false)",
                          "previous_response_id")
    msgs: list[Msg] = []
    if body.get("instructions"):
        msgs.append(Msg("system", expect(body["instructions"], str, "instructions")))
    items = body.get("input")
    if isinstance(items, str):
        msgs.append(Msg("user", items))
    else:
        for i, item in enumerate(expect(items, list, "input")):
            _item(item, f"input[{i}]", msgs)
    if not msgs:
        raise bad_request("'input' must not be empty", "input")
    tools = _tools(body.get("tools") or [], "tools")
    _refuse_unsupported(body)
    return ChatRequest(
        api="openai_responses", model=model, messages=msgs, tools=tools,
        tool_choice=tool_choice_mode(body.get("tool_choice")),
        max_tokens=opt_int(body, "max_output_tokens", 1, 10**7), temperature=opt_number(body, "temperature", 0, 2),
        top_p=opt_number(body, "top_p", 0, 1), stream=opt_bool(body, "stream"),
        parallel_tool_calls=opt_parallel(body.get("parallel_tool_calls")),
        extra={k: body[k] for k in ("reasoning", "store", "include", "metadata") if k in body},
    )


LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _refuse_unsupported(body: dict[str, Any]) -> None:
    """Fields that would change the answer and that the proxy cannot honour: a 400 naming
    the field, unless absent or at its no-op value. (Codex sends ``parallel_tool_calls``,
    honoured, ``include: ["reasoning.encrypted_content"]``, ``text.verbosity``: accepted.)"""
    text = body.get("text")
    if text is not None:
        text = expect(text, dict, "text")
        refuse_structured_output(text.get("format"), "text.format")
    top = opt_int(body, "top_logprobs", 0, 20)
    if top:
        raise refuse("top_logprobs", "(Responses output carries no logprobs here; use Chat Completions)")
    include = body.get("include")
    if include is not None and LOGPROBS_INCLUDE in expect(include, list, "include"):
        raise refuse("include", f"{LOGPROBS_INCLUDE!r} (Responses output carries no logprobs here; "
                     "use Chat Completions)")
    if body.get("truncation") not in (None, "disabled"):
        raise refuse("truncation", f"{body.get('truncation')!r} (an input over the context is refused, never cut)")
    if body.get("conversation") is not None:
        raise refuse("conversation", "(stateless use only: send the whole input, store: false)")
    if body.get("background"):
        raise refuse("background", "")
    if body.get("prompt") is not None:
        raise refuse("prompt", "(stored prompt templates)")


def _tools(raw: Any, param: str) -> list:
    """Function tools; a ``namespace`` (Codex groups MCP tools so) contributes its function
    tools under ``<namespace>.<name>``. Hosted tools (web search, local shell, ...) run on
    OpenAI's side and a self-hosted policy cannot call them: they are left out of the
    prompt, so the model never sees a tool it cannot use. A ``custom`` tool (free-form
    input, optionally a grammar, as Codex's ``apply_patch`` for some models) is refused:
    its call comes back as text the grammar would have to constrain, and a client told
    nothing would wait in vain for a ``custom_tool_call``."""
    out = []
    for i, t in enumerate(expect(raw, list, param)):
        p = f"{param}[{i}]"
        t = expect(t, dict, p)
        kind = t.get("type")
        if kind == "function":
            out.append(tool_spec(t.get("name"), t.get("description"), t.get("parameters"), p))
        elif kind == "custom":
            raise bad_request(f"'{p}': custom (free-form) tool {t.get('name')!r} is not supported by this proxy: "
                              "give it as a function tool (Codex: a model whose apply_patch tool type is "
                              "'function', or none)", p)
        elif kind == "namespace":
            for sub in _tools(t.get("tools") or [], f"{p}.tools"):
                out.append(type(sub)(f"{t.get('name', 'ns')}.{sub.name}", sub.description, sub.parameters))
    return out


def _item(item: Any, p: str, msgs: list[Msg]) -> None:
    item = expect(item, dict, p)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        role = "system" if role == "developer" else role
        if role not in ("system", "user", "assistant"):
            raise bad_request(f"'{p}.role' must be system, developer, user or assistant", p)
        msgs.append(Msg(role, text_of(item.get("content"), f"{p}.content")))
    elif kind == "function_call":
        name = expect(item.get("name"), str, f"{p}.name")
        call = ToolCall(str(item.get("call_id") or ""), name, parse_arguments(item.get("arguments", "{}"), f"{p}.arguments"))
        last = msgs[-1] if msgs else None
        if last is not None and last.role == "assistant":  # calls belong to the assistant turn before them
            msgs[-1] = Msg("assistant", last.content, last.tool_calls + (call,), reasoning=last.reasoning)
        else:
            msgs.append(Msg("assistant", "", (call,)))
    elif kind == "function_call_output":
        out = item.get("output")
        out = out if isinstance(out, str) else text_of(out, f"{p}.output")
        msgs.append(Msg("tool", out, tool_call_id=str(item.get("call_id") or "")))
    elif kind == "reasoning":
        return  # the client's copy of earlier thinking; the recorded tokens are what count
    else:
        raise bad_request(f"'{p}.type' {kind!r} is not supported", p)


def _output(fin: Finished) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if fin.reasoning:
        out.append(_reasoning_item(f"rs_{fin.call_id}", fin.reasoning))
    if fin.content or not fin.tool_calls:
        out.append(_message_item(fin.call_id, fin.content))
    for c in fin.tool_calls:
        out.append(_call_item(c))
    return out


def _message_item(call_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{call_id}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(c: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{c.id}", "call_id": c.id, "name": c.name,
            "arguments": c.arguments_json(), "status": status}


def response(req: ChatRequest, fin: Finished, rid: str | None = None) -> dict[str, Any]:
    incomplete = fin.reason == "length"
    return {
        "id": rid or f"resp_{fin.call_id}", "object": "response", "created_at": int(time.time()),
        "status": "incomplete" if incomplete else "completed", "model": req.model, "output": _output(fin),
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "error": None,
        "usage": {"input_tokens": fin.prompt_tokens, "output_tokens": fin.completion_tokens,
                  "total_tokens": fin.prompt_tokens + fin.completion_tokens,
                  "input_tokens_details": {"cached_tokens": fin.cached_tokens},
                  "output_tokens_details": {"reasoning_tokens": 0}},
        "store": False, "parallel_tool_calls": req.parallel_tool_calls, "tools": [], "text": {"format": {"type": "text"}},
    }


async def stream(req: ChatRequest, call_id: str, events: AsyncIterator[GenEvent]) -> AsyncIterator[str]:
    """The items of the non-streamed response, in its order: thinking, one message with
    all the text (text the model wrote after a tool call included), then the function
    calls, which are streamed when the text is complete. A client keeps the items it is
    streamed and sends them back as the assistant's turn: a message after a call would come
    back as a second assistant message, not the recorded reply. ``response.completed``
    lists exactly the items streamed. ``response.created`` and ``response.in_progress`` go
    out at once (the call is accepted); a ``Keepalive`` sends ``response.in_progress``
    again (the response as it began, the next ``sequence_number``): an event, not an SSE
    comment, as Codex's idle timer counts events only (its SSE reader drops comments) and
    the SDK takes a repeated one in its stride. An error after them ends the stream with
    ``response.failed``, as OpenAI's does (the SDK and Codex read ``response.error``)."""
    rid = f"resp_{call_id}"
    seq = 0

    def ev(kind: str, data: dict[str, Any]) -> str:
        nonlocal seq
        seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **data}, ensure_ascii=False)}\n\n"

    base = {"id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "model": req.model, "output": [], "error": None, "incomplete_details": None, "store": False,
            "parallel_tool_calls": req.parallel_tool_calls, "tools": [], "text": {"format": {"type": "text"}}}
    yield ev("response.created", {"response": base})
    yield ev("response.in_progress", {"response": base})
    items: list[dict[str, Any]] = []  # finished items, at their output_index
    open_item: dict[str, Any] | None = None  # {"kind", "index", "id", "text"} of the item being streamed
    calls: list[ToolCall] = []  # function calls, streamed after the message

    def close() -> list[str]:
        nonlocal open_item
        o, open_item = open_item, None
        if o is None:
            return []
        if o["kind"] == "reasoning":
            item = _reasoning_item(o["id"], o["text"])
            out = [ev("response.reasoning_text.done", {"item_id": o["id"], "output_index": o["index"],
                                                       "content_index": 0, "text": o["text"]})]
        else:
            item = _message_item("", o["text"]) | {"id": o["id"]}
            part = {"type": "output_text", "text": o["text"], "annotations": []}
            out = [ev("response.output_text.done", {"item_id": o["id"], "output_index": o["index"],
                                                    "content_index": 0, "text": o["text"]}),
                   ev("response.content_part.done", {"item_id": o["id"], "output_index": o["index"],
                                                     "content_index": 0, "part": part})]
        items.append(item)
        return out + [ev("response.output_item.done", {"output_index": o["index"], "item": item})]

    def open_(kind: str) -> list[str]:
        nonlocal open_item
        out = close()
        index = len(items)
        prefix = "rs" if kind == "reasoning" else "msg"
        item_id = f"{prefix}_{rid}" if index == 0 or kind == "reasoning" else f"{prefix}_{rid}_{index}"
        open_item = {"kind": kind, "index": index, "id": item_id, "text": ""}
        if kind == "reasoning":
            return out + [ev("response.output_item.added", {"output_index": index,
                                                            "item": _reasoning_item(item_id, "") | {"content": []}})]
        return out + [
            ev("response.output_item.added", {"output_index": index,
                                              "item": _message_item("", "", "in_progress") | {"id": item_id,
                                                                                              "content": []}}),
            ev("response.content_part.added", {"item_id": item_id, "output_index": index, "content_index": 0,
                                               "part": {"type": "output_text", "text": "", "annotations": []}}),
        ]

    try:
        async for e in events:
            if isinstance(e, Keepalive):
                yield ev("response.in_progress", {"response": base})
            elif isinstance(e, (ThinkingDelta, TextDelta)) and e.text:
                kind = "reasoning" if isinstance(e, ThinkingDelta) else "text"
                if open_item is None or open_item["kind"] != kind:
                    for s in open_(kind):
                        yield s
                assert open_item is not None
                open_item["text"] += e.text
                delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
                yield ev(delta, {"item_id": open_item["id"], "output_index": open_item["index"], "content_index": 0,
                                 "delta": e.text})
            elif isinstance(e, ToolCallDone):
                calls.append(e.call)  # streamed after the text: see the docstring
            elif isinstance(e, Finished):
                if not items and (open_item is None or open_item["kind"] == "reasoning") and not e.tool_calls:
                    for s in open_("text"):  # an empty answer is still one (empty) message
                        yield s
                for s in close():
                    yield s
                for c in calls:
                    idx = len(items)
                    item = _call_item(c)
                    yield ev("response.output_item.added", {"output_index": idx,
                                                            "item": item | {"arguments": "", "status": "in_progress"}})
                    yield ev("response.function_call_arguments.delta", {"item_id": item["id"], "output_index": idx,
                                                                         "delta": item["arguments"]})
                    yield ev("response.function_call_arguments.done", {"item_id": item["id"], "output_index": idx,
                                                                        "arguments": item["arguments"]})
                    yield ev("response.output_item.done", {"output_index": idx, "item": item})
                    items.append(item)
                final = response(req, e, rid)
                final["output"] = items
                yield ev("response.incomplete" if final["status"] == "incomplete" else "response.completed",
                         {"response": final})
    except ApiError as err:
        failed = base | {"status": "failed", "error": _failure(err), "output": items}
        yield ev("response.failed", {"response": failed})


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def _failure(err: ApiError) -> dict[str, str]:
    """A response's ``error``: Codex takes ``context_length_exceeded`` as a full context."""
    if err.message.startswith("prompt is too long"):
        code = "context_length_exceeded"
    else:
        code = {"rate_limit": "rate_limit_exceeded", "invalid_request": "invalid_prompt"}.get(err.kind, "server_error")
    return {"code": code, "message": err.message}


def stream_error(err: ApiError, call_id: str) -> str:
    """Only for a failure outside ``stream`` (its own errors end in ``response.failed``)."""
    failed = {"id": f"resp_{call_id}", "object": "response", "created_at": int(time.time()), "status": "failed",
              "output": [], "error": _failure(err)}
    return f"event: response.failed\ndata: {json.dumps({'type': 'response.failed', 'response': failed})}\n\n"
