"""Calls recorded the way the live proxy records them, on the policy's real tokenizer.

The proxy's own TITO planner (``services/proxy/core/tito.py``, pure) with the tiny-qwen
model's Qwen tokenizer and chat template: each call's parent, prefix, new ids and drift
class are what a live run would put in ``CallRecorded``. Messages are the proxy's
normalised ones: an Anthropic user turn with a ``tool_result`` and a text block becomes a
``tool`` message and a ``user`` message (``services/proxy/api/anthropic.py``).
"""

from __future__ import annotations

from services.proxy.core.messages import Msg, ToolSpec, tools_key
from services.proxy.core.tito import Tito
from services.proxy.core.toolparse import parse_output
from services.trajectory.records import CallHints, CallRecord

from ._calls import MAIN_HINTS, call

# Claude Code's compaction texts (shared/notes/claude-code-forks.md), as its requests carry them.
SUMMARY_REQUEST = (
    "CRITICAL: Respond with TEXT ONLY. Do NOT call any tools.\n\n"
    "Your task is to create a detailed summary of the conversation so far, paying close attention to the "
    "user's explicit requests and your previous actions.\n\n"
    "REMINDER: Do NOT call any tools. Respond with plain text only - an <analysis> block followed by a "
    "<summary> block."
)
CONTINUATION = (
    "This session is being continued from a previous conversation that ran out of context. "
    "The summary below covers the earlier portion of the conversation.\n\nSummary:\n{summary}\n\n"
    "Continue the conversation from where it left off without asking the user any further questions."
)
BASH = ToolSpec("Bash", "Run a shell command", {"type": "object", "properties": {"command": {"type": "string"}}})


def bash(command: str) -> str:
    """A reply that calls the Bash tool, as the policy writes it."""
    return f'<tool_call>\n{{"name": "Bash", "arguments": {{"command": "{command}"}}}}\n</tool_call>'


class ProxyRecorder:
    """One rollout's calls through the proxy's planner; ``send`` returns the record and the
    reply message the harness appends to its history."""

    def __init__(self, renderer, tools: list[ToolSpec] | None = None, rollout: str = "r1") -> None:
        self.renderer = renderer
        self.tito = Tito(renderer, stop_texts=renderer.stop_texts)
        self.tools = [BASH] if tools is None else tools
        self.rollout = rollout
        self.calls: list[CallRecord] = []

    def send(self, msgs: list[Msg], text: str | None = None, *, output_ids: list[int] | None = None,
             hints: CallHints = MAIN_HINTS, delivered: bool = True) -> tuple[CallRecord, Msg]:
        r, key = self.renderer, tools_key(self.tools)
        plan = self.tito.plan(msgs, self.tools, key)
        out = (list(output_ids) if output_ids is not None else r.encode(text)) + [r.stop_token_ids[-1]]
        reply = parse_output(r.decode(out), r.stop_texts).as_msg()
        call_id = f"c{len(self.calls)}"
        self.tito.record(call_id, plan, out, reply, self.tools, key, True)
        record = call(call_id, plan.new_ids, out, parent=plan.parent_call_id, prefix=plan.prefix_len,
                      rollout=self.rollout, hints=hints, delivered=delivered, drift=plan.drift.value)
        self.calls.append(record)
        return record, reply


def tool_result(reply: Msg, output: str) -> Msg:
    call_id = reply.tool_calls[0].id if reply.tool_calls else "toolu_0"
    return Msg("tool", output, tool_call_id=call_id)
