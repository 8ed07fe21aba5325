"""The agent loop: ask the model, run its tool calls, repeat until it answers without a
tool call or a budget runs out. Along the way it

- **retries** a step whose reply is empty or whose tool call does not parse: the same
  request again (a retry fork in the trajectory tree), up to ``max_retries`` times;
- **compacts** its context when a call's tokens pass ``context_budget`` (or the server
  says the prompt is too long): a summary call, then a rewritten history (``convo``);
- **spawns sub-agents** through the ``Agent`` tool: a separate conversation with its own
  system prompt and an ``x-claude-code-agent-id`` header, whose final report returns as
  the tool's result (nested ones also send ``x-claude-code-parent-agent-id``).
"""

from __future__ import annotations

import json
import secrets
import sys
from dataclasses import asdict, dataclass, field

from . import convo
from .convo import Message, Reply, ToolCall
from .tools import AGENT_SPEC, ALIASES, SPECS, Workspace
from .wire import ApiFailure, ContextTooLong, ModelApi, Request, ToolSpec

MAIN_SYSTEM = (
    "You are a coding agent. You work in a workspace folder (your current directory) on the task the user "
    "gives you. Use the tools to list, read and write files and to run commands such as `python -m pytest -q`. "
    "Write tests for your code and run them. For a self-contained sub-task you may start a sub-agent with the "
    "Agent tool. When the task is complete, reply with a short summary and no tool call."
)
SUB_SYSTEM = (
    "You are a sub-agent of a coding agent. Do the sub-task you are given in the shared workspace with the "
    "tools, then reply with a short report of what you did and found, without a tool call."
)
MAX_CALLS_PER_REPLY = 8


@dataclass(frozen=True)
class AgentConfig:
    max_turns: int = 40  # replies of the main agent
    max_sub_turns: int = 12  # replies of each sub-agent
    max_calls: int = 200  # model calls of the whole run (retries, summaries, sub-agents included)
    max_retries: int = 2  # re-asks after an empty or unparseable reply
    context_budget: int = 6000  # tokens of one call (input + output) that trigger compaction
    min_rounds_between_compactions: int = 2
    max_depth: int = 1  # sub-agent nesting (0: no Agent tool)
    max_subagents: int = 4


@dataclass
class Stats:
    calls: int = 0
    turns: int = 0
    retries: int = 0
    compactions: int = 0
    subagents: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    stop: str = ""


class OutOfCalls(Exception):
    pass


@dataclass
class _Line:
    """One conversation: the main agent or a sub-agent."""

    system: str
    tools: list[ToolSpec]
    headers: dict[str, str]
    prompt: str
    depth: int
    agent_id: str | None = None
    history: list[Message] = field(default_factory=list)
    rounds_since_compaction: int = 0


class Agent:
    def __init__(self, api: ModelApi, workspace: Workspace, config: AgentConfig = AgentConfig(),
                 log=None) -> None:
        self.api = api
        self.workspace = workspace
        self.config = config
        self.stats = Stats()
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))

    def run(self, prompt: str) -> str:
        line = _Line(MAIN_SYSTEM, self._tools(0), {}, prompt, 0)
        try:
            final, stop = self._converse(line, self.config.max_turns)
        except OutOfCalls:
            final, stop = "", "max_calls"
        self.stats.stop = stop
        return final

    def _tools(self, depth: int) -> list[ToolSpec]:
        return [*SPECS.values(), *([AGENT_SPEC] if depth < self.config.max_depth else [])]

    def _converse(self, line: _Line, max_turns: int) -> tuple[str, str]:
        line.history = [Message("user", line.prompt)]
        turns = 0
        while turns < max_turns:
            try:
                reply = self._ask(line, line.history)
            except ContextTooLong:
                if line.rounds_since_compaction < 1 or convo.rounds(line.history) < 2:
                    return "", "context_too_long"
                self._compact(line)
                continue
            turns += 1
            if line.depth == 0:
                self.stats.turns += 1
            if reply.empty:
                return "", "empty_reply"
            line.rounds_since_compaction += 1
            if reply.malformed:
                line.history = convo.with_error_nudge(line.history, reply)
                continue
            line.history.append(reply.as_message())
            if not reply.tool_calls:
                return reply.text, "done"
            line.history += [self._tool(line, c) for c in reply.tool_calls[:MAX_CALLS_PER_REPLY]]
            if self._over_budget(line, reply):
                self._compact(line)
        return "", "max_turns"

    def _ask(self, line: _Line, messages: list[Message]) -> Reply:
        """One step; an empty or unparseable reply is asked again with the same request."""
        request = Request(line.system, list(messages), line.tools, line.headers)
        reply = Reply("", ())
        for attempt in range(self.config.max_retries + 1):
            if self.stats.calls >= self.config.max_calls:
                raise OutOfCalls
            self.stats.calls += 1
            reply = self.api.complete(request)
            self.log(f"call {self.stats.calls} agent={line.agent_id or 'main'} in={reply.input_tokens} "
                     f"out={reply.output_tokens} tools={[c.name for c in reply.tool_calls]} "
                     f"text={reply.text[:80]!r}")
            if not (reply.empty or reply.malformed):
                break
            if attempt < self.config.max_retries:
                self.stats.retries += 1
        return reply

    def _over_budget(self, line: _Line, reply: Reply) -> bool:
        return (reply.input_tokens + reply.output_tokens > self.config.context_budget
                and line.rounds_since_compaction >= self.config.min_rounds_between_compactions)

    def _compact(self, line: _Line) -> None:
        try:
            reply = self._ask(line, convo.summary_request(line.history))
            summary = convo.extract_summary(reply.text)
        except ContextTooLong:
            summary = ""
        line.history = convo.continuation(line.history, summary, line.prompt)
        line.rounds_since_compaction = 0
        self.stats.compactions += 1
        self.log(f"compacted agent={line.agent_id or 'main'} summary_chars={len(summary)}")

    def _tool(self, line: _Line, call: ToolCall) -> Message:
        self.stats.tool_calls += 1
        args = call.arguments or {}
        if ALIASES.get(call.name, call.name) == "Agent" and line.depth < self.config.max_depth:
            text, is_error = self._subagent(line, args)
        else:
            text, is_error = self.workspace.call(call.name, args)
        self.stats.tool_errors += is_error
        return Message("tool", text, tool_call_id=call.id, is_error=is_error)

    def _subagent(self, parent: _Line, args: dict) -> tuple[str, bool]:
        prompt = args.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            return "error: the Agent tool needs a non-empty 'prompt'", True
        if self.stats.subagents >= self.config.max_subagents:
            return "error: no more sub-agents allowed in this run", True
        self.stats.subagents += 1
        agent_id = "a" + secrets.token_hex(8)
        headers = {"x-claude-code-agent-id": agent_id}
        if parent.agent_id:
            headers["x-claude-code-parent-agent-id"] = parent.agent_id
        line = _Line(SUB_SYSTEM, self._tools(parent.depth + 1), headers, prompt, parent.depth + 1, agent_id)
        final, stop = self._converse(line, self.config.max_sub_turns)
        report = final.strip() or f"(the sub-agent stopped without a report: {stop})"
        return f"{report}\nagentId: {agent_id}", False


def run_agent(api: ModelApi, workspace: Workspace, prompt: str, config: AgentConfig) -> tuple[str, Stats, int]:
    """Run to the end; returns (final text, stats, exit status). A model API that refuses
    for good (bad key, finished rollout) ends the run with status 3."""
    agent = Agent(api, workspace, config)
    try:
        final = agent.run(prompt)
        status = 0
    except ApiFailure as exc:
        agent.log(f"model API failure: {exc}")
        agent.stats.stop, final, status = "api_failure", "", 3
    print(json.dumps({"final": final[:2000], **asdict(agent.stats)}), flush=True)
    return final, agent.stats, status
