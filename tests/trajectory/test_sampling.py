"""Branches and priority sampling."""

from __future__ import annotations

from services.trajectory.forks import HARNESS_RULES, classify_calls
from services.trajectory.records import ROLE_PRIORITY, CallHints
from services.trajectory.sampling import SamplingConfig, list_branches, select_branches

from ._calls import COMPACT, SUB_SYSTEM, SYSTEM, TASK, Agent, Recorder, build, show

RULES = HARNESS_RULES["claude_code"].with_markers(summary=[COMPACT[1:]])


def _busy_rollout():
    """Main line with two compactions, two sub-agents (one compacts), a broken retry."""
    rec = Recorder()
    main = Agent(rec, SYSTEM + TASK)
    for k in range(3):
        main.say([20 + k, 2], [3, 90 + k])
    main.compact([40, 2])
    main.say([23, 2], [3, 93])
    main.say([24, 25], delivered=False)  # broken stream
    main.say([24, 2], [3, 94])
    for n in range(2):
        hints = CallHints(agent_id=f"a{n}", system_digest="u" * 64, tools_digest="v" * 64)
        sub = Agent(rec, SUB_SYSTEM + [1, 14 + n, 2], hints, system=SUB_SYSTEM)
        sub.say([50 + n, 2], [3, 96])
        if n:
            sub.compact([52, 2])
            sub.say([53, 2])
    main.say([26, 2], [3, 97])
    main.compact([41, 2])
    main.say([27, 2])
    return rec


def _branches(rec):
    tree = build(rec.calls)
    labels = classify_calls(tree, RULES)
    return tree, labels, list_branches(tree, labels)


def test_branches_are_the_ends_of_each_agent_lines_stretches():
    rec = _busy_rollout()
    tree, labels, branches = _branches(rec)
    roles = sorted(b.role for b in branches)
    assert roles.count("main") == 4  # three stretches between compactions + the broken attempt
    assert roles.count("main_summary") == 2
    assert roles.count("subagent") == 3 and roles.count("subagent_summary") == 1  # c10: after compaction
    assert sum(not b.delivered for b in branches) == 1


def test_main_line_first_then_priority_and_budget():
    rec = _busy_rollout()
    tree, labels, branches = _branches(rec)
    chosen = select_branches(branches, SamplingConfig(budget=5))
    show(tree, labels, chosen, "busy rollout")
    assert len(chosen) == 5
    assert chosen[0].call_id == rec.calls[-1].call_id  # the latest main call's branch
    ranks = [ROLE_PRIORITY.index(b.role) for b in chosen]
    assert ranks == sorted(ranks)
    assert [b.role for b in chosen] == ["main", "main", "main", "main_summary", "main_summary"]
    assert all(b.delivered for b in chosen)


def test_a_large_budget_takes_every_delivered_branch_and_zero_takes_none():
    rec = _busy_rollout()
    _, _, branches = _branches(rec)
    assert len(select_branches(branches, SamplingConfig(budget=50))) == len(branches) - 1
    assert len(select_branches(branches, SamplingConfig(budget=50, include_undelivered=True))) == len(branches)
    assert select_branches(branches, SamplingConfig(budget=0)) == []


def test_choice_within_a_role_is_seeded_and_deterministic():
    rec = _busy_rollout()
    _, _, branches = _branches(rec)
    picks = set()
    for seed in range(12):
        a = select_branches(branches, SamplingConfig(budget=7, seed=seed))
        b = select_branches(list(reversed(branches)), SamplingConfig(budget=7, seed=seed))
        assert [x.call_id for x in a] == [x.call_id for x in b]  # not arrival order
        picks.add(a[-1].call_id)  # the 7th pick is one of three sub-agent branches
    assert len(picks) >= 2
