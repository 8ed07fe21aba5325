"""The two wire APIs the agent speaks to its model: OpenAI Chat Completions and
Anthropic Messages, over plain httpx (non-streaming). Transport failures (connection
errors, 408/409/429/5xx) are retried with backoff on the same body; a context-length
error is reported as ``ContextTooLong`` so the agent can compact and try again."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from .convo import Message, Reply, ToolCall

RETRY_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504, 529})


class ApiFailure(RuntimeError):
    """The model API refused the request for good (bad key, finished rollout, bad request)."""


class ContextTooLong(ApiFailure):
    pass


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class Request:
    system: str
    messages: Sequence[Message]
    tools: Sequence[ToolSpec]
    headers: dict[str, str]


class ModelApi(Protocol):
    def complete(self, request: Request) -> Reply: ...


def _args(raw: Any) -> dict[str, Any] | None:
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw) if isinstance(raw, str) and raw.strip() else {}
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def openai_body(model: str, req: Request, max_tokens: int, temperature: float,
                top_p: float | None = None) -> dict[str, Any]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": req.system}]
    for m in req.messages:
        if m.role == "tool":
            msgs.append({"role": "tool", "tool_call_id": m.tool_call_id, "content": m.text})
        elif m.role == "assistant" and m.tool_calls:
            msgs.append({"role": "assistant", "content": m.text or None, "tool_calls": [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": json.dumps(c.arguments or {})}} for c in m.tool_calls]})
        else:
            msgs.append({"role": m.role, "content": m.text})
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                               "parameters": t.parameters}} for t in req.tools]
    body = {"model": model, "messages": msgs, "tools": tools, "max_tokens": max_tokens, "temperature": temperature}
    return body if top_p is None else {**body, "top_p": top_p}


def openai_reply(data: dict[str, Any]) -> Reply:
    choice = (data.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    calls = tuple(ToolCall(c.get("id") or f"call_{i}", (c.get("function") or {}).get("name") or "",
                           _args((c.get("function") or {}).get("arguments")),
                           str((c.get("function") or {}).get("arguments")))
                  for i, c in enumerate(msg.get("tool_calls") or []))
    usage = data.get("usage") or {}
    return Reply(msg.get("content") or "", calls, int(usage.get("prompt_tokens") or 0),
                 int(usage.get("completion_tokens") or 0), choice.get("finish_reason"))


def anthropic_body(model: str, req: Request, max_tokens: int, temperature: float,
                   top_p: float | None = None) -> dict[str, Any]:
    msgs: list[dict[str, Any]] = []
    for m in req.messages:
        if m.role == "assistant":
            blocks: list[dict[str, Any]] = [{"type": "text", "text": m.text}] if m.text else []
            blocks += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments or {}}
                       for c in m.tool_calls]
            msgs.append({"role": "assistant", "content": blocks or [{"type": "text", "text": "(empty)"}]})
            continue
        block = ({"type": "tool_result", "tool_use_id": m.tool_call_id, "content": m.text, "is_error": m.is_error}
                 if m.role == "tool" else {"type": "text", "text": m.text})
        if msgs and msgs[-1]["role"] == "user":
            msgs[-1]["content"].append(block)  # tool results and a following text share one user turn
        else:
            msgs.append({"role": "user", "content": [block]})
    tools = [{"name": t.name, "description": t.description, "input_schema": t.parameters} for t in req.tools]
    body = {"model": model, "system": req.system, "messages": msgs, "tools": tools, "max_tokens": max_tokens,
            "temperature": temperature}
    return body if top_p is None else {**body, "top_p": top_p}


def anthropic_reply(data: dict[str, Any]) -> Reply:
    text, calls = [], []
    for b in data.get("content") or []:
        if b.get("type") == "text":
            text.append(b.get("text") or "")
        elif b.get("type") == "tool_use":
            calls.append(ToolCall(b.get("id") or f"toolu_{len(calls)}", b.get("name") or "", _args(b.get("input")),
                                  json.dumps(b.get("input"))))
    usage = data.get("usage") or {}
    n_in = sum(int(usage.get(k) or 0) for k in ("input_tokens", "cache_read_input_tokens",
                                                 "cache_creation_input_tokens"))
    return Reply("".join(text), tuple(calls), n_in, int(usage.get("output_tokens") or 0), data.get("stop_reason"))


class HttpModelApi:
    """One wire API over httpx, with transport retries."""

    def __init__(self, api: str, base_url: str, api_key: str, model: str, *, max_tokens: int = 512,
                 temperature: float = 1.0, top_p: float | None = None, timeout_s: float = 300.0,
                 transport_retries: int = 3, backoff_s: float = 0.5) -> None:
        if api not in ("openai", "anthropic"):
            raise ValueError(f"api must be openai or anthropic, not {api!r}")
        self.api, self.model, self.max_tokens, self.temperature = api, model, max_tokens, temperature
        self.top_p = top_p  # None: not sent (the server's default, 1.0)
        self.transport_retries, self.backoff_s = transport_retries, backoff_s
        auth = {"authorization": f"Bearer {api_key}"} if api == "openai" else \
            {"x-api-key": api_key, "anthropic-version": "2023-06-01"}
        self.client = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s,
                                   headers={**auth, "user-agent": "gyre-agent/1"})
        self.path = "/v1/chat/completions" if api == "openai" else "/v1/messages"
        self.transport_failures = 0

    def complete(self, request: Request) -> Reply:
        build = openai_body if self.api == "openai" else anthropic_body
        body = build(self.model, request, self.max_tokens, self.temperature, self.top_p)
        for attempt in range(self.transport_retries + 1):
            try:
                resp = self.client.post(self.path, json=body, headers=request.headers)
            except httpx.HTTPError as exc:
                failure: str = f"transport error: {exc}"
            else:
                if resp.status_code == 200:
                    data = resp.json()
                    return openai_reply(data) if self.api == "openai" else anthropic_reply(data)
                failure = f"HTTP {resp.status_code}: {resp.text[:300]}"
                if resp.status_code not in RETRY_STATUS:
                    _raise_for(resp.status_code, failure)
            self.transport_failures += 1
            if attempt < self.transport_retries:
                time.sleep(self.backoff_s * 2**attempt)
        raise ApiFailure(f"gave up after {self.transport_retries + 1} attempts: {failure}")

    def close(self) -> None:
        self.client.close()


def _raise_for(status: int, failure: str) -> None:
    low = failure.lower()
    if status in (400, 413) and ("too long" in low or "context" in low or "maximum" in low):
        raise ContextTooLong(failure)
    raise ApiFailure(failure)
