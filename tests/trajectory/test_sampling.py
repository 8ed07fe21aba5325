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


def _forking_rollout():
    """A main line, three sub-agents: a fork of its whole history, a fork of its first
    round, a fresh one; then a fresh one that compacts."""
    rec = Recorder()
    main = Agent(rec, SYSTEM + TASK)
    main.say([20, 2], [3, 90])
    early = main.fork(CallHints(agent_id="a-early", system_digest="5" * 64, tools_digest="7" * 64), [13, 2])
    for k in range(4):
        main.say([21 + k, 2], [3, 91 + k])
    late = main.fork(CallHints(agent_id="a-late", system_digest="5" * 64, tools_digest="7" * 64), [13, 3])
    fresh = Agent(rec, SUB_SYSTEM + [1, 14, 2],
                  CallHints(agent_id="a-fresh", system_digest="u" * 64, tools_digest="v" * 64), system=SUB_SYSTEM)
    for agent, word in ((early, 50), (late, 51), (fresh, 52)):
        agent.say([word, word, 2], [3, 96])
        agent.say([word, 2])
    main.say([29, 2])
    return rec


def test_within_a_role_the_branch_sharing_most_with_the_chosen_comes_first():
    rec = _forking_rollout()
    tree, labels, branches = _branches(rec)
    by_agent = {}
    for b in branches:
        by_agent[rec.calls[b.call_index].hints.agent_id] = b.call_id
    for seed in range(8):
        chosen = select_branches(branches, SamplingConfig(budget=4, seed=seed), tree)
        assert [b.role for b in chosen] == ["main", "subagent", "subagent", "subagent"]
        # the late fork shares the main line's whole history, the early one its first round
        assert [b.call_id for b in chosen[1:]] == [by_agent["a-late"], by_agent["a-early"], by_agent["a-fresh"]]
        again = select_branches(list(reversed(branches)), SamplingConfig(budget=4, seed=seed), tree)
        assert [b.call_id for b in again] == [b.call_id for b in chosen]


def test_sharing_never_outranks_a_role():
    """Every main and main_summary branch comes before any sub-agent, whatever they
    share; among the summaries the one sharing the longest prefix with the chosen goes first."""
    rec = _busy_rollout()
    tree, labels, branches = _branches(rec)
    for seed in range(6):
        chosen = select_branches(branches, SamplingConfig(budget=7, seed=seed), tree)
        ranks = [ROLE_PRIORITY.index(b.role) for b in chosen]
        assert ranks == sorted(ranks)
        assert [b.role for b in chosen[:5]] == ["main", "main", "main", "main_summary", "main_summary"]
        epochs = [b.call_index for b in chosen[:3]]
        shared = [max(tree.common_prefix_lens(s.call_index, epochs)) for s in chosen[3:5]]
        assert shared[0] > shared[1]


def test_common_prefix_lens_agree_with_the_sequences():
    rec = _forking_rollout()
    tree = build(rec.calls)
    seqs = [list(tree.sequence(c)) for c in range(len(rec.calls))]
    for a in range(len(seqs)):
        expected = []
        for b in range(len(seqs)):
            n = 0
            while n < min(len(seqs[a]), len(seqs[b])) and seqs[a][n] == seqs[b][n]:
                n += 1
            expected.append(n)
        assert tree.common_prefix_lens(a, list(range(len(seqs)))) == expected


def test_a_call_cut_off_at_the_time_limit_leaves_the_last_delivered_call_trained():
    """At the time limit the harness is killed while its next call streams; the proxy
    records that call undelivered. It extends the last delivered call, which must still
    end a branch (and be trained on) when undelivered calls are not; a failed call that a
    delivered retry then covers leaves no extra branch behind."""
    from services.trajectory.rollout_tree import RolloutTree, TreeConfig

    def sealed(cut: bool, retry: bool = False):
        rec = Recorder("r1")
        main = Agent(rec, SYSTEM + TASK)
        main.say([20, 2], [3, 90])
        if retry:
            main.say([21, 25], delivered=False)  # a broken stream, retried at once
        main.say([21, 2], [3, 91])
        main.say([22, 2], [3, 92])
        if cut:
            main.say([23, 24], delivered=False)
        tree = RolloutTree("r1", TreeConfig(RULES))
        for c in rec.calls:
            tree.add(c)
        return tree.seal()

    clean, cut = sealed(False), sealed(True)
    assert [b.call_id for b in clean.selected] == [clean.branches[-1].call_id]
    assert [b.call_id for b in cut.selected] == [b.call_id for b in clean.selected]  # the same last delivered call
    assert sum(p.n_trained_tokens for p in cut.packed) == sum(p.n_trained_tokens for p in clean.packed) > 0
    assert [b.delivered for b in cut.branches] == [True, False]
    both = sealed(True, retry=True)
    assert [b.delivered for b in both.branches].count(True) == 1  # the failed call's parent is covered by the retry
    assert sum(p.n_trained_tokens for p in both.packed) == sum(p.n_trained_tokens for p in clean.packed)


def _sealed(calls, rules=RULES):
    from services.trajectory.rollout_tree import RolloutTree, TreeConfig

    tree = RolloutTree("r1", TreeConfig(rules))
    for c in calls:
        assert tree.add(c).outcome == "applied"
    return tree.seal()


def test_a_fork_sub_agent_does_not_hide_the_main_lines_last_delivered_call_after_a_timeout():
    """A fork sub-agent's first call carries the main agent's whole history: it is another
    line's call, so it does not hold the main line's last delivered call when the next main
    call is cut off at the time limit; that call stays the main line and is trained."""

    def sealed(cut: bool):
        rec = Recorder("r1")
        main = Agent(rec, SYSTEM + TASK)
        main.say([20, 2], [3, 90])
        main.say([21, 2], [3, 91])
        for n in range(3):  # forks of epoch 1
            f = main.fork(CallHints(agent_id=f"e1fork{n}", system_digest="5" * 64, tools_digest="7" * 64),
                          [1, 60 + n, 2])
            f.say([30 + n, 2])
        main.compact([40, 2])
        main.say([22, 2], [3, 92])
        last = main.say([23, 2], [3, 93])  # the last delivered main call
        f = main.fork(CallHints(agent_id="e2fork", system_digest="5" * 64, tools_digest="7" * 64), [1, 69, 2])
        f.say([35, 2])  # forked from the main agent's whole history
        if cut:
            main.say([24, 25], delivered=False)  # cut off at the time limit
        return last, _sealed(rec.calls)

    last, clean = sealed(False)
    _, cut = sealed(True)
    assert clean.selected[0].call_id == cut.selected[0].call_id == last.call_id
    assert cut.selected[0].role == "main"
    assert [b.call_id for b in cut.selected] == [b.call_id for b in clean.selected]
    assert sum(p.n_trained_tokens for p in cut.packed) == sum(p.n_trained_tokens for p in clean.packed)


def test_an_identical_resend_before_a_cut_off_call_ends_the_branch_once():
    """Two identical delivered calls (a re-send answered alike) do not hold each other: when
    the next call is cut off, one of them ends the branch, once, and is trained."""
    from ._calls import call

    p = SYSTEM + TASK
    calls = [call("c0", p, [20, 2]),
             call("c1", [3, 90], [21, 2], parent="c0", prefix=len(p) + 2),
             call("c2", [3, 90], [21, 2], parent="c0", prefix=len(p) + 2)]  # identical re-send
    cut_off = call("c3", [3, 91], [22, 23], parent="c2", prefix=len(p) + 6, delivered=False)
    clean, cut = _sealed(calls), _sealed(calls + [cut_off])
    delivered = [b for b in cut.branches if b.delivered]
    assert len(delivered) == 1 and delivered[0].call_id in ("c1", "c2")
    assert [b.call_id for b in cut.selected] == [b.call_id for b in clean.selected] == [delivered[0].call_id]
    assert sum(p.n_trained_tokens for p in cut.packed) == sum(p.n_trained_tokens for p in clean.packed) > 0
