"""The agent's conversation, independent of the wire API, and its compaction (pure).

Compaction mimics Claude Code (shared/notes/claude-code-forks.md), so that a proxy or a
trajectory service that knows Claude Code's shape recognises ours:

- the *summary request* is the agent's own request (same system, same tools) minus the
  retained tail (the most recent assistant round), with a text asking for a text-only
  detailed summary appended to the last user message;
- the *continuation* starts with one user message: "This session is being continued from
  a previous conversation that ran out of context. ..." + the summary, followed by the
  retained tail verbatim.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Literal

SUMMARY_PROMPT = (
    "CRITICAL: Respond with TEXT ONLY. Do NOT call any tools.\n\n"
    "Your task is to create a detailed summary of the conversation so far, paying close attention to the "
    "user's explicit requests and your previous actions. Include: the primary request, the files and code "
    "written so far, errors met and how they were fixed, the current state of the work and the next step.\n\n"
    "REMINDER: Do NOT call any tools. Respond with plain text only — an <analysis> block followed by a "
    "<summary> block."
)
CONTINUATION_INTRO = (
    "This session is being continued from a previous conversation that ran out of context. "
    "The summary below covers the earlier portion of the conversation.\n\nSummary:\n"
)
CONTINUATION_OUTRO = (
    "\n\nContinue the conversation from where it left off without asking the user any further questions. "
    "Continue with the last task that you were asked to work on."
)
_SUMMARY_RE = re.compile(r"<summary>(.*?)(?:</summary>|$)", re.S)
_ANALYSIS_RE = re.compile(r"<analysis>.*?(?:</analysis>|$)", re.S)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any] | None  # None: the arguments did not parse
    raw: str = ""


@dataclass(frozen=True)
class Message:
    role: Literal["user", "assistant", "tool"]
    text: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None  # role tool: the call it answers
    is_error: bool = False


@dataclass(frozen=True)
class Reply:
    text: str
    tool_calls: tuple[ToolCall, ...]
    input_tokens: int = 0
    output_tokens: int = 0
    stop_reason: str | None = None

    @property
    def empty(self) -> bool:
        return not self.text.strip() and not self.tool_calls

    @property
    def malformed(self) -> bool:
        """A tool call was meant but did not parse (it stayed in the text, or its arguments are not JSON)."""
        return "<tool_call>" in self.text or any(c.arguments is None for c in self.tool_calls)

    def as_message(self) -> Message:
        return Message("assistant", self.text, self.tool_calls)


def rounds(history: list[Message]) -> int:
    return sum(1 for m in history if m.role == "assistant")


def tail_start(history: list[Message]) -> int:
    """Index of the retained tail: the last assistant message and the tool results after it."""
    for i in range(len(history) - 1, -1, -1):
        if history[i].role == "assistant":
            return i
    return len(history)


def summary_request(history: list[Message]) -> list[Message]:
    """The messages of the compaction request (the system and tools stay the agent's own)."""
    return [*history[: tail_start(history)], Message("user", SUMMARY_PROMPT)]


def extract_summary(text: str) -> str:
    """The body of ``<summary>``, else the text without its ``<analysis>`` block."""
    found = _SUMMARY_RE.search(text)
    body = found.group(1) if found else _ANALYSIS_RE.sub("", text)
    return body.strip()


def continuation(history: list[Message], summary: str, task_prompt: str) -> list[Message]:
    """The rewritten history after compaction. A summary the model failed to write is
    replaced by the task statement, so the agent still knows what it is doing."""
    if not summary.strip():
        summary = "(The summary could not be produced.) The original request was:\n" + task_prompt.strip()
    head = Message("user", CONTINUATION_INTRO + summary.strip() + CONTINUATION_OUTRO)
    return [head, *history[tail_start(history):]]


def with_error_nudge(history: list[Message], reply: Reply) -> list[Message]:
    """After retries ran out on a tool call that does not parse: keep what the model
    wrote and tell it why nothing happened."""
    text = reply.text or "(tool call with unparseable arguments)"
    kept = Message("assistant", text, tuple(c for c in reply.tool_calls if c.arguments is not None))
    results = [Message("tool", "error: not run", tool_call_id=c.id, is_error=True) for c in kept.tool_calls]
    nudge = Message("user", "Your tool call could not be parsed. Call a tool with a JSON object of arguments, "
                            "or reply with a short final summary when the task is done.")
    return [*history, replace(kept), *results, nudge]
