"""The reference harness's parts: conversation rewriting, wire bodies, tools, and the
loop's retries / compaction / sub-agents / budgets against a scripted model API."""

from __future__ import annotations

import json

from services.runner.agent import convo
from services.runner.agent.convo import Message, Reply, ToolCall
from services.runner.agent.loop import Agent, AgentConfig
from services.runner.agent.tools import ToolLimits, Workspace
from services.runner.agent.wire import ContextTooLong, Request, anthropic_body, openai_body, openai_reply

from ._fakes import ScriptedApi, call

HISTORY = [Message("user", "task"), Message("assistant", "", (ToolCall("c1", "run", {"command": "ls"}),)),
           Message("tool", "a.py", tool_call_id="c1"),
           Message("assistant", "", (ToolCall("c2", "read_file", {"path": "a.py"}),)),
           Message("tool", "x = 1", tool_call_id="c2")]


def test_compaction_keeps_the_last_round_and_rewrites_the_rest() -> None:
    req = convo.summary_request(HISTORY)
    assert req[:3] == HISTORY[:3] and req[-1].text.startswith("CRITICAL: Respond with TEXT ONLY.")
    cont = convo.continuation(HISTORY, convo.extract_summary("<analysis>x</analysis><summary>Did A.</summary>"),
                              "task")
    assert cont[0].text.startswith("This session is being continued from a previous conversation")
    assert "Did A." in cont[0].text and cont[1:] == HISTORY[3:]
    assert "The original request was:\ntask" in convo.continuation(HISTORY, "", "task")[0].text


def test_anthropic_body_puts_the_summary_text_after_the_tool_result() -> None:
    body = anthropic_body("m", Request("sys", convo.summary_request(HISTORY), [], {}), 64, 1.0)
    last = body["messages"][-1]
    assert last["role"] == "user" and [b["type"] for b in last["content"]] == ["tool_result", "text"]
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
    assert body["system"] == "sys"


def test_openai_body_and_unparseable_arguments() -> None:
    body = openai_body("m", Request("sys", HISTORY, [], {}), 64, 1.0)
    assert "top_p" not in body  # not sent unless set: the server's default
    assert openai_body("m", Request("sys", HISTORY, [], {}), 64, 1.0, 0.9)["top_p"] == 0.9
    assert anthropic_body("m", Request("sys", HISTORY, [], {}), 64, 1.0, 0.9)["top_p"] == 0.9
    assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert json.loads(body["messages"][2]["tool_calls"][0]["function"]["arguments"]) == {"command": "ls"}
    reply = openai_reply({"choices": [{"message": {"content": None, "tool_calls": [
        {"id": "x", "function": {"name": "run", "arguments": "{oops"}}]}}]})
    assert reply.malformed and reply.tool_calls[0].arguments is None


def test_tools_stay_in_the_workspace_and_keep_limits(tmp_path) -> None:
    ws = Workspace(tmp_path, ToolLimits(read_chars=10, output_chars=40, run_timeout_s=20))
    assert ws.call("write_file", {"path": "pkg/a.py", "content": "print('hi')\n" * 5})[1] is False
    assert ws.call("read_file", {"path": "pkg/a.py"})[0].endswith("(truncated)")
    assert ws.call("list_files", {})[0] == "pkg/a.py"
    assert ws.call("read_file", {"path": "../etc/passwd"}) == ("error: '../etc/passwd' is outside the workspace",
                                                               True)
    assert ws.call("Bash", {"cmd": "python pkg/a.py > o.txt; wc -l < o.txt"})[0] == "exit status 0\n5\n"
    out, err = ws.call("run", {"command": "sleep 5", "timeout_s": 0.2})
    assert out.startswith("killed after 1 s") and not err
    assert ws.call("nope", {})[1] and ws.call("write_file", {"path": "b"})[1]


def test_loop_retries_compacts_and_spawns_a_subagent(tmp_path) -> None:
    api = ScriptedApi([
        Reply("", (call("write_file", path="m.py", content="x = 1\n"),)),
        Reply("<tool_call>{broken</tool_call>", ()),  # unparseable: asked again
        Reply("", (call("Agent", description="check", prompt="Check m.py"),)),
        Reply("", (call("run", command="python m.py"),)),  # the sub-agent
        Reply("m.py runs.", ()),
        Reply("<summary>Wrote m.py; it runs.</summary>", ()),  # compaction (over budget after 2 rounds)
        Reply("All done.", ()),
    ], tokens=5000)
    agent = Agent(api, Workspace(tmp_path), AgentConfig(context_budget=1000), log=lambda _: None)
    assert agent.run("Write m.py") == "All done."
    s = agent.stats
    assert (s.calls, s.retries, s.subagents, s.compactions, s.stop) == (7, 1, 1, 1, "done")
    retry, again = api.requests[1], api.requests[2]
    assert retry == again  # the same request, twice
    sub = api.requests[3]
    assert sub.headers["x-claude-code-agent-id"].startswith("a") and sub.messages[0].text == "Check m.py"
    assert "Agent" not in [t.name for t in sub.tools] and "Agent" in [t.name for t in api.requests[0].tools]
    assert api.requests[5].messages[-1].text.startswith("CRITICAL") and api.requests[5].tools == api.requests[0].tools
    assert api.requests[6].messages[0].text.startswith("This session is being continued")
    assert (tmp_path / "m.py").read_text() == "x = 1\n"


def test_loop_survives_nonsense_and_stops_at_budgets(tmp_path) -> None:
    api = ScriptedApi([Reply("", ())] * 3)
    agent = Agent(api, Workspace(tmp_path), AgentConfig(max_retries=2), log=lambda _: None)
    assert agent.run("x") == "" and agent.stats.stop == "empty_reply" and agent.stats.calls == 3
    api = ScriptedApi([Reply("", (ToolCall("c", "run", None),))] * 50)
    agent = Agent(api, Workspace(tmp_path), AgentConfig(max_turns=4, max_retries=1), log=lambda _: None)
    agent.run("x")
    assert agent.stats.stop == "max_turns" and agent.stats.calls == 8
    api = ScriptedApi([Reply("", (call("run", command="true"),))] * 50)
    agent = Agent(api, Workspace(tmp_path), AgentConfig(max_turns=100, max_calls=5), log=lambda _: None)
    agent.run("x")
    assert agent.stats.stop == "max_calls" and agent.stats.calls == 5


def test_prompt_too_long_compacts_and_asks_again(tmp_path) -> None:
    api = ScriptedApi([Reply("", (call("run", command="true"),)), Reply("", (call("run", command="true"),)),
                       ContextTooLong("prompt is too long"), Reply("<summary>s</summary>", ()), Reply("ok", ())])
    agent = Agent(api, Workspace(tmp_path), AgentConfig(), log=lambda _: None)
    assert agent.run("x") == "ok" and agent.stats.compactions == 1
