"""Fork classification and roles on Claude-Code-shaped and generic agent records."""

from __future__ import annotations

from services.trajectory.forks import HARNESS_RULES, HarnessRules, classify_calls, markers_from_texts
from services.trajectory.records import CallHints

from ._calls import (COMPACT, CONTINUE, MAIN_HINTS, SUB_SYSTEM, SYSTEM, TASK, Agent, Recorder, build,
                     call, show)

CLAUDE = HARNESS_RULES["claude_code"]
CLAUDE_MARKED = CLAUDE.with_markers(summary=[COMPACT[1:]])
SUB_HINTS = CallHints(agent_id="a0123456789abcdef", system_digest="u" * 64, tools_digest="v" * 64)


def _labels(rec, rules=CLAUDE, title=""):
    tree = build(rec.calls)
    labels = classify_calls(tree, rules)
    show(tree, labels, title=title)
    return tree, {lab.call_id: lab for lab in labels}


def _main_with_compaction():
    rec = Recorder()
    main = Agent(rec, SYSTEM + TASK)
    main.say([20, 21, 2], [3, 90, 91])
    main.say([22, 23, 2], [3, 92])
    main.say([24, 2], [3, 93, 94])
    summary, request = main.compact([40, 41, 42, 2])
    post = main.say([25, 2], [3, 95])
    main.say([26, 2])
    return rec, summary, post, request


def test_compaction_found_by_its_instruction_tokens():
    rec, summary, post, request = _main_with_compaction()
    _, lab = _labels(rec, CLAUDE_MARKED, "compaction (markers)")
    assert [lab[c.call_id].role for c in rec.calls] == [
        "main", "main", "main", "main_summary", "main", "main"]
    assert lab[summary.call_id].fork == "compaction"
    assert lab[summary.call_id].position == len(request) - len(COMPACT)  # parts before the instruction
    assert lab[summary.call_id].forked_from == 2
    assert lab[post.call_id].fork == "compaction"
    assert lab[post.call_id].position == len(SYSTEM)  # only the system prompt is shared
    assert lab[rec.calls[-1].call_id].fork is None and lab[rec.calls[-1].call_id].relation == "extend"


def test_compaction_found_in_hindsight_without_markers():
    rec, summary, post, _ = _main_with_compaction()
    _, lab = _labels(rec, CLAUDE)
    assert lab[summary.call_id].role == "main_summary" and lab[summary.call_id].fork == "compaction"
    assert lab[post.call_id].role == "main" and lab[post.call_id].fork == "compaction"


def test_a_trailing_summary_needs_markers_to_be_recognised():
    rec = Recorder()
    main = Agent(rec, SYSTEM + TASK)
    main.say([20, 2], [3, 90])
    main.say([21, 2], [3, 91])
    summary, _ = main.compact([40, 2])  # the rollout timed out here
    assert _labels(rec, CLAUDE)[1][summary.call_id].fork == "edit"
    assert _labels(rec, CLAUDE_MARKED)[1][summary.call_id].role == "main_summary"


def test_subagent_by_agent_id_and_its_own_compaction():
    rec = Recorder()
    main = Agent(rec, SYSTEM + TASK)
    main.say([20, 2], [3, 90])
    sub = Agent(rec, SUB_SYSTEM + [1, 14, 14, 2], SUB_HINTS, system=SUB_SYSTEM)
    first = sub.say([50, 2], [3, 96])
    sub.say([51, 2], [3, 97])
    sub_summary, _ = sub.compact([52, 2])
    sub_post = sub.say([53, 2])
    back = main.say([21, 2])
    _, lab = _labels(rec, CLAUDE, "sub-agent")
    assert lab[first.call_id].role == "subagent"
    assert lab[first.call_id].fork == "subagent"
    assert lab[first.call_id].position == 1  # only <|im_start|> is shared with the main line
    assert lab[sub_summary.call_id].role == "subagent_summary"
    assert lab[sub_post.call_id].role == "subagent" and lab[sub_post.call_id].fork == "compaction"
    assert lab[back.call_id].relation == "extend" and lab[back.call_id].role == "main"


def test_fork_subagent_parts_from_the_main_history_where_it_was_spawned():
    rec = Recorder()
    main = Agent(rec, SYSTEM + TASK)
    main.say([20, 2], [3, 90])
    spawned_at = main.say([21, 2])
    depth = len(main.history)
    fork = main.fork(CallHints(agent_id="afork", system_digest="5" * 64, tools_digest="7" * 64),
                     [1, 13, 13, 2])
    f1 = fork.say([60, 2], [3, 98])
    main.history += [3, 91]
    main.say([22, 2])
    _, lab = _labels(rec, CLAUDE, "fork sub-agent")
    assert lab[f1.call_id].role == "subagent" and lab[f1.call_id].fork == "subagent"
    assert lab[f1.call_id].position == depth
    assert lab[f1.call_id].forked_from == rec.calls.index(spawned_at)


def test_retry_after_a_broken_stream():
    rec = Recorder()
    main = Agent(rec, SYSTEM + TASK)
    main.say([20, 2], [3, 90])
    broken = main.say([21, 22], delivered=False)
    again = main.say([23, 24, 2], [3, 91])
    _, lab = _labels(rec, CLAUDE, "retry")
    assert lab[broken.call_id].fork is None and lab[broken.call_id].relation == "extend"
    assert lab[again.call_id].fork == "retry"
    assert lab[again.call_id].position == broken.n_input_tokens
    assert lab[again.call_id].role == "main"


def test_edit_of_history():
    rec = Recorder()
    main = Agent(rec, SYSTEM + TASK)
    main.say([20, 2], [3, 90, 91, 92])
    main.say([21, 2], [3, 93])
    cut = len(SYSTEM + TASK) + 2
    main.history = main.history[:cut] + [3, 99] + main.history[cut + 4 :]  # a tool result rewritten
    main.refs = main.refs[:1]
    edited = main.say([22, 2])
    _, lab = _labels(rec, CLAUDE, "edit")
    assert lab[edited.call_id].fork == "edit" and lab[edited.call_id].role == "main"


def test_side_request_does_not_break_the_main_line():
    rec = Recorder()
    main = Agent(rec, SYSTEM + TASK)
    main.say([20, 2], [3, 90])
    title_hints = CallHints(system_digest="x" * 64, tools_digest="y" * 64)  # no agent id
    title = rec.record([1, 15, 2, 1, 11, 2], [30, 31], [], title_hints)
    nxt = main.say([21, 2])
    _, lab = _labels(rec, CLAUDE, "side request")
    assert lab[title.call_id].lineage.startswith("side:")
    assert lab[title.call_id].role == "subagent"
    assert lab[nxt.call_id].relation == "extend" and lab[nxt.call_id].fork is None


def test_a_title_request_before_the_first_main_call_does_not_become_the_main_line():
    """Interactive Claude Code sends its title request (own system prompt, no tools: the
    proxy records no tools digest) before the first main request: it is the side line, the
    real main calls are the main line, and the same calls in the same order label alike."""
    from services.trajectory.sampling import list_branches, select_branches

    p = SYSTEM + TASK
    # the proxy's tool-less request (no tools digest), with a title after each prompt; a
    # side request with a tools digest of its own is told apart by the main calls' number
    for tools, n_titles in ((None, 2), ("0" * 64, 1)):
        title = CallHints(system_digest="t" * 64, tools_digest=tools)
        calls = [call("title", [1, 15, 15, 2, 1, 11, 2], [60, 2], hints=title),
                 call("m0", p, [20, 2]),
                 call("m1", [3, 90], [21, 2], parent="m0", prefix=len(p) + 2),
                 call("title2", [1, 15, 15, 2, 1, 12, 2], [61, 2], hints=title)][:3 + n_titles - 1]
        tree = build(calls)
        labels = classify_calls(tree, CLAUDE)
        assert labels == classify_calls(build(calls), CLAUDE)  # a replay labels alike
        lab = {x.call_id: x for x in labels}
        assert lab["m0"].lineage == lab["m1"].lineage == "main"
        assert lab["m0"].role == lab["m1"].role == "main"
        assert lab["m1"].relation == "extend" and lab["m1"].fork is None
        assert lab["title"].lineage.startswith("side:") and lab["title"].role == "subagent"
        if n_titles == 2:
            assert lab["title2"].lineage == lab["title"].lineage
        chosen = select_branches(list_branches(tree, labels, delivered_only=True))
        assert (chosen[0].call_id, chosen[0].role) == ("m1", "main")


def test_a_main_agent_without_tools_is_still_the_main_line():
    """Where no unnamed call has tools, the calls most of them agree with are the main line."""
    bare = CallHints(system_digest="5" * 64)
    p = SYSTEM + TASK
    calls = [call("m0", p, [20, 2], hints=bare),
             call("m1", [3, 90], [21, 2], parent="m0", prefix=len(p) + 2, hints=bare)]
    lab = {x.call_id: x for x in classify_calls(build(calls), CLAUDE)}
    assert lab["m0"].role == lab["m1"].role == "main" and lab["m1"].relation == "extend"


def test_explicit_gyre_role_wins():
    rec = Recorder()
    main = Agent(rec, SYSTEM + TASK)
    main.say([20, 2], [3, 90])
    hinted = CallHints(system_digest="5" * 64, tools_digest="7" * 64, role="main_summary")
    c = rec.record(main.history + [1, 77, 2], [40, 2], main.refs, hinted)
    post = rec.record(SYSTEM + CONTINUE + [40, 2], [25], [], MAIN_HINTS)
    _, lab = _labels(rec, HarnessRules("no-hindsight", infer_summaries=False))
    assert lab[c.call_id].role == "main_summary"
    assert lab[post.call_id].fork == "compaction" and lab[post.call_id].role == "main"


def test_proxy_kind_hints_are_used():
    rec = Recorder()
    main = Agent(rec, SYSTEM + TASK)
    main.say([20, 2], [3, 90])
    kind = CallHints(system_digest="5" * 64, tools_digest="7" * 64, kind="compaction_summary")
    s = rec.record(main.history[:-4] + [1, 77, 2], [40, 2], main.refs, kind)
    _, lab = _labels(rec, HarnessRules("plain", infer_summaries=False))
    assert lab[s.call_id].role == "main_summary" and lab[s.call_id].fork == "compaction"


def test_generic_openai_agent_lines_by_system_prompt():
    rules = HARNESS_RULES["openai_tools"]
    worker = CallHints(system_digest="w" * 64)
    boss = CallHints(system_digest="b" * 64)
    calls = [
        call("c0", [1, 10, 2, 1, 11, 2], [20, 2], hints=boss),
        call("c1", [1, 12, 2, 1, 14, 2], [50, 2], hints=worker),
        call("c2", [3, 90], [21], parent="c0", prefix=8, hints=boss),
    ]
    tree = build(calls)
    labels = classify_calls(tree, rules)
    assert [lab.role for lab in labels] == ["main", "subagent", "main"]
    assert labels[1].fork == "subagent" and labels[1].position == 1
    assert labels[2].relation == "extend"


def test_markers_from_texts_drop_the_edge_tokens():
    def encode(text):
        return [ord(ch) for ch in text]

    (marker,) = markers_from_texts(encode, ["abcdef"])
    assert marker == tuple(ord(ch) for ch in "bcde")
    assert markers_from_texts(encode, ["ab"]) == ()


def test_interleaved_conversations_of_one_line_each_continue_their_own_end():
    rules = HARNESS_RULES["openai_tools"]
    same = CallHints(system_digest="b" * 64)
    calls = [
        call("a1", [1, 10, 2, 1, 11, 2], [20, 2], hints=same),
        call("b1", [1, 10, 2, 1, 15, 2], [30, 2], hints=same),  # another conversation, same prompt
        call("a2", [3, 90], [21, 2], parent="a1", prefix=8, hints=same),
        call("b2", [3, 91], [31, 2], parent="b1", prefix=8, hints=same),
    ]
    tree = build(calls)
    labels = classify_calls(tree, rules)
    show(tree, labels, title="interleaved")
    assert [lab.relation for lab in labels] == ["first", "rewrite", "extend", "extend"]
    assert [lab.previous for lab in labels] == [None, 0, 0, 1]
    assert [lab.fork for lab in labels] == [None, "edit", None, None]
