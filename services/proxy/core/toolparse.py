"""Turn what the model wrote into an API reply: text, thinking, and tool calls.

The default format is Qwen's (Hermes-style): ``<think>...</think>`` first, then text, then
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks. A tool call
whose JSON does not parse stays in the text (the model did write it), so nothing is lost.

``StreamParser`` does the same incrementally: it lets text through as it comes, holds
back anything that may be the start of a tag, and hands out tool calls when they close.
The text it lets through adds up to exactly ``content``, however the output is split into
pieces: so a streaming client and a non-streaming one get (and send back) the same reply.
Whitespace at the end of the text so far is held back until more text follows; at the end
of a reply with tool calls it is dropped (the text between and after calls is kept, as the
model wrote it), at the end of a reply without any it is shown.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from .messages import Msg, ToolCall

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


def new_call_id(prefix: str = "call") -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _parse_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body.strip())
    except (ValueError, RecursionError):  # not JSON, or nested deeper than Python parses
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            pass
    return ToolCall(new_call_id(), obj["name"], args if isinstance(args, (dict, str)) else {"value": args})


@dataclass
class Parsed:
    content: str
    tool_calls: list[ToolCall]
    reasoning: str | None

    def as_msg(self) -> Msg:
        return Msg("assistant", self.content, tuple(self.tool_calls), reasoning=self.reasoning)


def parse_output(text: str, stop_texts: tuple[str, ...] = (), parse_calls: bool = True) -> Parsed:
    p = StreamParser(stop_texts, parse_calls=parse_calls)
    p.feed(text)
    p.finish()
    return Parsed(p.content, p.tool_calls, p.reasoning)


def call_opened(text: str) -> bool:
    """Whether ``text`` (a reply so far) opens a tool call where ``StreamParser`` reads one:
    after the thinking (a reply that begins with ``<think>`` and has not closed it yet has
    opened none)."""
    body = text.lstrip()
    if body.startswith(THINK_OPEN):
        end = body.find(THINK_CLOSE, len(THINK_OPEN))
        if end < 0:
            return False
        body = body[end + len(THINK_CLOSE):]
    return CALL_OPEN in body


@dataclass
class StreamParser:
    stop_texts: tuple[str, ...] = ()
    content: str = ""
    parse_calls: bool = True  # False (``tool_choice: none``): tool-call markup stays text
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    _buf: str = ""
    _state: str = "start"  # start | think | after_think | text | call
    _call_body: str = ""
    _ws: str = ""  # trailing whitespace of the text so far, not shown yet

    def _show(self, chunk: str) -> str:
        """Text to let through for ``chunk``: held whitespace goes out with the next text."""
        text = self._ws + chunk
        body = text.rstrip()
        self._ws = text[len(body):]
        self.content += body
        return body

    def feed(self, delta: str) -> tuple[str, str]:
        """Add generated text; returns (new visible text, new thinking text)."""
        self._buf += delta
        out_text, out_think = "", ""
        while True:
            if self._state == "start":
                stripped = self._buf.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self._buf = stripped[len(THINK_OPEN):]
                    self._state, self.reasoning = "think", ""
                    continue
                if THINK_OPEN.startswith(stripped):
                    return out_text, out_think  # could still become <think> (whitespace only: too)
                self._state = "text"
                continue
            if self._state == "think":
                i = self._buf.find(THINK_CLOSE)
                if i < 0:
                    keep = partial_tail(self._buf, THINK_CLOSE)
                    chunk, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                    self.reasoning = (self.reasoning or "") + chunk
                    return out_text, out_think + chunk
                chunk = self._buf[:i]
                self.reasoning = (self.reasoning or "") + chunk
                out_think += chunk
                self._buf = self._buf[i + len(THINK_CLOSE):]
                self._state = "after_think"
                continue
            if self._state == "after_think":  # the newlines after </think> are the template's, not text
                self._buf = self._buf.lstrip("\n")
                if not self._buf:
                    return out_text, out_think
                self._state = "text"
                continue
            if self._state == "text":
                i = self._buf.find(CALL_OPEN) if self.parse_calls else -1
                if i < 0:
                    tags = [partial_tail(self._buf, CALL_OPEN)] if self.parse_calls else [0]
                    keep = max(tags + [_held(self._buf, s) for s in self.stop_texts])
                    chunk, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                    return out_text + self._show(chunk), out_think
                out_text += self._show(self._buf[:i])
                self._buf = self._buf[i + len(CALL_OPEN):]
                self._state, self._call_body = "call", ""
                continue
            # inside a tool call
            i = self._buf.find(CALL_CLOSE)
            if i < 0:
                return out_text, out_think
            body = self._buf[:i]
            self._buf = self._buf[i + len(CALL_CLOSE):]
            call = _parse_call(body)
            if call is None:  # not a valid call: keep what the model wrote as text
                out_text += self._show(CALL_OPEN + body + CALL_CLOSE)
            else:
                self.tool_calls.append(call)
            self._state = "text"

    def finish(self) -> tuple[str, str]:
        """End of generation: flush what was held back (minus a trailing stop text)."""
        rest, think = self._buf, ""
        self._buf = ""
        for s in self.stop_texts:
            if rest.endswith(s):
                rest = rest[: -len(s)]
        if self._state == "call":
            call = _parse_call(rest)
            if call is not None:  # closed by the end of generation
                self.tool_calls.append(call)
                rest = ""
            else:
                rest = CALL_OPEN + rest
        elif self._state == "think":
            self.reasoning = (self.reasoning or "") + rest
            think, rest = rest, ""
        elif self._state == "after_think":
            rest = rest.lstrip("\n")
        self._state = "text"
        out = self._show(rest)
        if not self.tool_calls:  # a plain answer keeps its trailing whitespace
            out, self.content, self._ws = out + self._ws, self.content + self._ws, ""
        self._ws = ""
        return out, think


def _held(buf: str, stop: str) -> int:
    """Characters to hold back at the end of ``buf``: a whole stop text, or its start."""
    return len(stop) if buf.endswith(stop) else partial_tail(buf, stop)


def partial_tail(buf: str, tag: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:n]):
            return n
    return 0
