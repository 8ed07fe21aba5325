"""The proxy's drift class in fork classification (forks.py, "The proxy's drift class").

``append``, ``template_drift``, ``retoken_drift``: the call starts right after its parent's
reply, the first to do so, on the generated ids; it continues its parent, never an edit.
``fresh`` and ``fork``: the tree decides. Records that contradict the class: the tree decides.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from services.trajectory.forks import HARNESS_RULES, classify_calls
from services.trajectory.ledger import RolloutState, tree_summary
from services.trajectory.main import load_policy_tokenizer
from services.trajectory.rollout_tree import RolloutTree, TreeConfig
from services.trajectory.records import CallHints
from services.trajectory.sampling import list_branches
from services.trajectory.workload import generate, preset

from ._calls import SYSTEM, TASK, Agent, Recorder, build, call, show
from ._proxy_calls import SUMMARY_REQUEST, Msg, ProxyRecorder, bash, tool_result

CLAUDE = HARNESS_RULES["claude_code"]
GENERIC = HARNESS_RULES["openai_tools"]
SAME_PROMPT = CallHints(system_digest="b" * 64)
CONTINUES = ("append", "template_drift", "think_stripped", "retoken_drift")


@pytest.fixture(scope="module")
def renderer():
    from services.proxy.adapters.template import HFRenderer

    tok = load_policy_tokenizer("tiny-qwen")
    assert tok.encode is not None, tok.error
    return HFRenderer(tok.folder)


def _labels(calls, rules, title=""):
    tree = build(calls)
    labels = classify_calls(tree, rules)
    show(tree, labels, title=title)
    return tree, labels, {lab.call_id: lab for lab in labels}


def test_every_drift_class_of_a_real_proxy_session(renderer):
    """The proxy's planner on the real tokenizer gives each class; the tree agrees with
    every one of them by itself, so the class changes no label here."""
    rec = ProxyRecorder(renderer)
    msgs = [Msg("system", "You are an agent."), Msg("user", "Fix the bug.")]
    fresh, reply = rec.send(msgs, "Let me look.\n" + bash("ls"))
    msgs += [reply, tool_result(reply, "a.py b.py")]
    appended, reply = rec.send(msgs, "<think>the bug is in a.py</think>\nReading a.py.")
    msgs += [reply, Msg("user", "go on")]
    # the template drops the thinking (think_stripped): the next call continues on the generated ids anyway
    template, reply = rec.send(msgs, output_ids=renderer.encode("Hel") + renderer.encode("lo there"))
    msgs += [reply, Msg("user", "and?")]
    # "Hel" + "lo" re-encodes as "Hello": the next call keeps the generated ids
    retoken, reply = rec.send(msgs, "Working.")
    msgs += [reply, Msg("user", "continue")]
    broken, _ = rec.send(msgs, "Partial ans", delivered=False)  # the client went away mid-stream
    retry, reply = rec.send(msgs, "Full answer.")  # the same request again
    msgs += [reply, tool_result(reply, "ok")]
    summary, _ = rec.send(msgs[:-2] + [Msg("user", SUMMARY_REQUEST)], "<summary>a.py fixed</summary>")
    drifts = [c.drift for c in rec.calls]
    assert drifts == ["fresh", "append", "think_stripped", "retoken_drift", "append", "fork", "fork"]
    _, labels, lab = _labels(rec.calls, CLAUDE, "drift classes")
    assert lab[fresh.call_id].relation == "first" and lab[fresh.call_id].fork is None
    for c in (appended, template, retoken, broken):
        assert lab[c.call_id].relation == "extend" and lab[c.call_id].fork is None
    assert lab[retry.call_id].fork == "retry"
    assert lab[summary.call_id].fork == "edit"  # the rollout ends here: hindsight cannot tell
    assert not any(x.by_drift for x in labels)


def _lost_end(drift: str, others: int = 9):
    """Conversation a under one line key with ``others`` more conversations started after
    its first call (more than the line keeps open ends), then a's second call."""
    calls = [call("a1", [1, 10, 2, 1, 11, 2], [20, 2], hints=SAME_PROMPT)]
    for k in range(others):
        calls.append(call(f"b{k}", [1, 10, 2, 1, 30 + k, 2], [40 + k, 2], hints=SAME_PROMPT))
    calls.append(call("a2", [3, 90], [21, 2], parent="a1", prefix=8, hints=SAME_PROMPT, drift=drift))
    return calls


@pytest.mark.parametrize("drift", CONTINUES)
def test_a_continuation_whose_end_the_line_lost_is_not_an_edit(drift):
    tree, labels, lab = _labels(_lost_end(drift), GENERIC, f"lost end, {drift}")
    a2 = lab["a2"]
    assert (a2.relation, a2.fork, a2.previous, a2.by_drift) == ("extend", None, 0, True)
    assert "a1" not in {b.call_id for b in list_branches(tree, labels)}  # a1 is extended: no branch ends there


@pytest.mark.parametrize("drift", ["fresh", "fork"])
def test_fresh_and_fork_leave_the_trees_answer(drift):
    _, _, lab = _labels(_lost_end(drift), GENERIC)
    assert lab["a2"].relation == "rewrite" and lab["a2"].fork == "edit" and not lab["a2"].by_drift


def test_a_recent_end_is_found_without_the_drift_class():
    _, _, lab = _labels(_lost_end("fresh", others=3), GENERIC)
    assert lab["a2"].relation == "extend" and lab["a2"].previous == 0 and not lab["a2"].by_drift


def test_fork_drift_on_the_main_agent_after_a_fork_subagent_is_no_fork(renderer):
    """The fork sub-agent continues the main agent's reply first (append); the main agent's
    next call is the second continuation of that reply (fork), yet only extends its line."""
    rec = ProxyRecorder(renderer)
    msgs = [Msg("system", "You are an agent."), Msg("user", "Build it.")]
    _, reply = rec.send(msgs, "Spawning a worker.\n" + bash("spawn"))
    fork_hints = CallHints(agent_id="afork0123456789ab", system_digest="5" * 64, tools_digest="7" * 64)
    sub, _ = rec.send(msgs + [reply, tool_result(reply, "Fork started"), Msg("user", "Your directive: test it")],
                      "Testing.", hints=fork_hints)
    main, _ = rec.send(msgs + [reply, tool_result(reply, "Async agent launched successfully.")], "Waiting.")
    assert (sub.drift, main.drift) == ("append", "fork")
    _, _, lab = _labels(rec.calls, CLAUDE, "fork sub-agent")
    assert lab[sub.call_id].fork == "subagent" and lab[sub.call_id].relation == "first"
    assert lab[main.call_id].relation == "extend" and lab[main.call_id].fork is None


def test_a_summary_recorded_as_append_after_its_parent_was_continued_stays_a_compaction():
    """``append`` claims the first continuation; the tree shows the parent already extended
    (the next main call continued it), so the compaction found in hindsight stands."""
    rec = Recorder()
    main = Agent(rec, SYSTEM + TASK)
    main.say([20, 2], [3, 90])
    main.say([21, 2], [3, 91])
    main.say([22, 2], [3, 92])
    summary, _ = main.compact([40, 2], drift="append")
    post = main.say([23, 2], [3, 93])
    assert summary.parent_call_id == "c1"
    _, _, lab = _labels(rec.calls, CLAUDE, "summary recorded as append")
    assert lab[summary.call_id].fork == "compaction" and lab[summary.call_id].role == "main_summary"
    assert lab[post.call_id].fork == "compaction" and not lab[summary.call_id].by_drift


@pytest.mark.parametrize("case", ["another line's parent", "not after its parent's reply"])
def test_a_parent_in_another_line_or_a_short_prefix_leave_the_trees_answer(case):
    sub = CallHints(agent_id="a1", system_digest="b" * 64)
    calls = _lost_end("append")[:-1] + [call("s1", [1, 10, 2, 1, 50, 2], [51, 2], hints=sub)]
    if case == "another line's parent":
        calls.append(call("m", [3, 90], [22, 2], parent="s1", prefix=8, hints=SAME_PROMPT, drift="append"))
    else:
        calls.append(call("m", [3, 91], [23, 2], parent="a1", prefix=7, hints=SAME_PROMPT, drift="append"))
    _, _, lab = _labels(calls, GENERIC)
    assert lab["m"].relation == "rewrite" and lab["m"].fork == "edit" and not lab["m"].by_drift


def test_the_tree_summary_shows_each_calls_drift_class():
    rollout = RolloutTree("r1", TreeConfig(rules=GENERIC))
    for c in _lost_end("retoken_drift"):
        assert rollout.add(replace(c, rollout_id="r1")).outcome == "applied"
    state = RolloutState("r1", harness="openai_tools", tree=rollout)
    doc = json.loads(tree_summary(state, rollout.seal()))
    a2 = next(c for c in doc["calls"] if c["call_id"] == "a2")
    assert (a2["drift"], a2["by_drift"], a2["relation"], a2["fork"]) == ("retoken_drift", True, "extend", None)


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_the_workloads_drift_classes_are_the_proxys_and_change_no_label(name):
    for calls in generate(preset(name, rollouts=1)):
        tree = build(calls)
        labels = classify_calls(tree, CLAUDE)
        assert calls[0].drift == "fresh" and not any(lab.by_drift for lab in labels)
        for c, lab in zip(calls, labels):
            if lab.relation in ("retry", "rewrite") or (lab.fork and c.parent_call_id is None):
                assert c.drift == "fork", (c.call_id, lab)
        without = classify_calls(build([replace(c, drift="fresh") for c in calls]), CLAUDE)
        assert without == labels
