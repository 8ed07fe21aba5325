"""Test doubles for the agent harness's edge: ``ScriptedApi`` fakes the model API (a
wire adapter) with a list of replies and records each request. Faked: the model and the
HTTP transport. The real adapters (``wire.HttpModelApi`` against the real proxy) are
exercised in test_end_to_end.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.runner.agent.convo import Reply, ToolCall
from services.runner.agent.wire import Request


def call(name: str, **arguments) -> ToolCall:
    return ToolCall(f"c{abs(hash((name, tuple(arguments))))}", name, arguments)


@dataclass
class ScriptedApi:
    replies: list[Reply | Exception]
    tokens: int = 100  # input tokens each reply reports
    requests: list[Request] = field(default_factory=list)

    def complete(self, request: Request) -> Reply:
        self.requests.append(request)
        item = self.replies.pop(0) if self.replies else Reply("done", ())
        if isinstance(item, Exception):
            raise item
        return Reply(item.text, item.tool_calls, self.tokens, 10, None)
