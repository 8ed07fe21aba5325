"""The proxy's one message model, whatever API a harness speaks, and its hash chain.

Every request (OpenAI Chat, OpenAI Responses, Anthropic Messages) is normalised into a
list of ``Msg``; replies are ``Msg`` too. Two messages that mean the same (same role,
text, tool calls and results) have the same ``canonical`` form, whatever the wire shape
and whatever hints (``cache_control``, ids) ride along. The *chain hash* after message i
names the whole conversation up to i, so "is this request an earlier call's messages plus
its reply, then more?" is a dictionary lookup per message boundary.

Worked example::

    >>> a = [Msg("system", "be brief"), Msg("user", "hi")]
    >>> h = chain_hashes(a, tools_key="")
    >>> len(h) == 3 and h[0] != h[1] != h[2]   # h[0]: empty conversation (tools only)
    True
"""

from __future__ import annotations

import hashlib
import json

import orjson
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any] | str  # parsed JSON when it parses, else the raw string

    def arguments_json(self) -> str:
        if isinstance(self.arguments, str):
            return self.arguments
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass(frozen=True)
class Msg:
    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None  # for role "tool"
    name: str | None = None  # tool name for role "tool", when known
    reasoning: str | None = None  # model's thinking, when the API carries it back

    def canonical(self) -> bytes:
        """What the message means, as stable bytes (ids and hints left out)."""
        calls = [[c.name, _canon_args(c.arguments)] for c in self.tool_calls]
        return canonical_json([self.role, self.content.strip(), calls])

    def template_dict(self) -> dict[str, Any]:
        """The message as HF chat templates expect it."""
        d: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            d["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments if isinstance(c.arguments, dict)
                              else _maybe_json(c.arguments)}}
                for c in self.tool_calls
            ]
        if self.role == "tool":
            d["tool_call_id"] = self.tool_call_id
            if self.name:
                d["name"] = self.name
        return d


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)

    def template_dict(self) -> dict[str, Any]:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


def _maybe_json(s: str) -> Any:
    try:
        return json.loads(s)
    except (ValueError, RecursionError):
        return s


def _canon_args(a: dict[str, Any] | str) -> Any:
    """A tool call's arguments as they compare (key order: OPT_SORT_KEYS in canonical()).
    Arguments the model wrote as something other than a JSON object compare as
    ``{"raw": <the text>}``: the form Anthropic's ``tool_use.input`` (an object) carries them
    in, and Claude Code sends them back in, so its echo still continues the reply."""
    v = _maybe_json(a) if isinstance(a, str) else a
    if isinstance(v, dict):
        return v
    return {"raw": a if isinstance(a, str) else v}


def canonical_json(value: Any) -> bytes:
    """Compact JSON with sorted keys. orjson's, or, for what orjson refuses (an integer
    beyond 64 bits, nesting deeper than 255), the standard library's in the same form
    (they agree on ordinary values: strings, integers, plain decimals, nesting)."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except (TypeError, orjson.JSONEncodeError):
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def tools_key(tools: list[ToolSpec]) -> str:
    """Digest of the tool list: tools render into the system header, so they start the chain."""
    body = json.dumps([[t.name, t.description, t.parameters] for t in tools], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(body.encode()).hexdigest()


def _step(prev: bytes, msg: Msg) -> bytes:
    return hashlib.blake2b(prev + msg.canonical(), digest_size=16).digest()


def chain_hashes(msgs: list[Msg], tools_key: str) -> list[bytes]:
    """``h[i]`` names ``msgs[:i]`` (with the tools); ``len(h) == len(msgs) + 1``."""
    h = [hashlib.blake2b(b"gyre-chain:" + tools_key.encode(), digest_size=16).digest()]
    for m in msgs:
        h.append(_step(h[-1], m))
    return h


def extend_hash(prev: bytes, msg: Msg) -> bytes:
    return _step(prev, msg)


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
