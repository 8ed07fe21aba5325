"""Branches and priority sampling.

A *branch* is the path from the root to the end of a call that no later call of the
same agent line extends: the last call of each stretch of an agent's conversation (the
main line before and after each compaction, each summary, each sub-agent's line, each
abandoned attempt). Its role is that call's role. Such an end is often a tree leaf but
not always: a fork sub-agent that starts from the main agent's whole history continues
past the main line's end, and the main line is still a branch of its own.

Per rollout at most ``budget`` branches are selected, one at a time:

1. the main line (the branch of the rollout's last main call) first;
2. then the next role by priority (``main`` > ``main_summary`` > ``subagent`` >
   ``subagent_summary``), delivered before undelivered;
3. within that role, the branch sharing the **longest prefix with the branches already
   selected** (tokens, read from the tree), then a seeded hash of the call id.

Rule 3 is what makes a choice within a role cheap and still meaningful. A branch that
shares a long prefix with the selected ones has its context in the packed tree already:
training it costs only its own new tokens, and its generated tokens are learned in the
very context the selected branches are (a summary of a selected context epoch, a fork
sub-agent that starts from a selected stretch of the main agent's history). Roles are
never traded for sharing: a sub-agent is not taken before a summary however much it
shares. The bias it brings is explicit: within a role, forks of selected contexts are
preferred over branches with a context of their own (e.g. a fresh sub-agent); with
nothing shared (or without a tree) the seeded hash decides. Everything
depends on the tree's tokens, the seed and the order calls were applied in (the main
line is the main call applied last; fork classes follow the order too), so replay, which
keeps the log's order, makes the same choice; another arrival order of the same calls
gives the same tree but not always the same choice. Branches that end in an undelivered call (a broken
stream that was sent again) are left out unless ``include_undelivered``. A branch whose
last call is context only (its behaviour logprobs were no log-probabilities, see
``tree.py``) comes after every other branch, whatever its role, except as the main line:
its own output is never trained.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from .forks import CallLabel
from .records import ROLE_PRIORITY, BranchRole
from .tree import TrajectoryTree


@dataclass(frozen=True)
class Branch:
    end: int  # arena index of the branch's last token
    call_index: int  # the call that ends there
    call_id: str
    rollout_id: str
    role: BranchRole
    n_tokens: int
    delivered: bool
    # False when the call that ends it is context only (tree.py untrainable_reason): its
    # own output is never trained, so it is chosen only after every branch whose end is trained
    untrained_end: bool = False


@dataclass(frozen=True)
class SamplingConfig:
    budget: int = 5
    seed: int = 0
    # A broken attempt's output never reached the agent: nothing on its own leaf is
    # trained (see PackingConfig.train_undelivered), so by default it is not a candidate.
    include_undelivered: bool = False


def list_branches(tree: TrajectoryTree, labels: list[CallLabel], *, delivered_only: bool = False) -> list[Branch]:
    """Branch ends in arrival order of their calls (one per distinct end position).

    A call another call extends is no end. With ``delivered_only`` (the sampling does not
    train undelivered calls), a delivered call that only undelivered calls extend (the call
    cut off at the time limit, recorded undelivered, or a failed one) is an end again
    unless a longer delivered call of its own line holds its whole sequence (the retry
    after a failed call), so a timed-out rollout's last delivered work is still trained
    on. An identical delivered copy does not hold it, nor does another line's call (a
    fork sub-agent's first call carries the main agent's whole history)."""
    extended = {lab.previous for lab in labels if lab.relation == "extend"}
    if delivered_only:
        by_delivered = {lab.previous for c, lab in enumerate(labels)
                        if lab.relation == "extend" and tree.calls[c].delivered}
        delivered = [c for c, call in enumerate(tree.calls) if call.delivered]
        for p in sorted(x for x in extended - by_delivered if x is not None and tree.calls[x].delivered):
            length = tree.call_length(p)
            # only a longer delivered call of p's own line holds it: an identical re-send
            # holds nothing (one of the two still ends the branch, the tree keeps one end
            # per position), and a fork sub-agent's first call, which carries the main
            # agent's whole history, is another line's work
            held = any(d != p and n >= length and tree.call_length(d) > length
                       and labels[d].lineage == labels[p].lineage
                       for d, n in zip(delivered, tree.common_prefix_lens(p, delivered)))
            if not held:
                extended.discard(p)
    out, seen = [], set()
    for c, call in enumerate(tree.calls):
        end = tree.call_end(c)
        if c in extended or end < 0 or end in seen:
            continue
        seen.add(end)
        out.append(Branch(end, c, call.call_id, call.rollout_id, labels[c].role,
                          tree.call_length(c), call.delivered, bool(tree.placements[c].untrained)))
    return out


def select_branches(
    branches: list[Branch], config: SamplingConfig = SamplingConfig(), tree: TrajectoryTree | None = None
) -> list[Branch]:
    """At most ``config.budget`` branches in selection order: the main line first, then
    by role priority; within a role, the longest prefix shared with the branches already
    chosen (measured on ``tree``; without it nothing is shared), then the seeded hash."""
    if not config.include_undelivered:
        branches = [b for b in branches if b.delivered]
    if config.budget <= 0 or not branches:
        return []
    mains = [b for b in branches if b.role == "main" and b.delivered] or [
        b for b in branches if b.role == "main"
    ]
    main_line = max(mains, key=lambda b: b.call_index) if mains else None
    chosen: list[Branch] = []
    shared = [0] * len(branches)  # each candidate's longest prefix shared with `chosen`

    def take(pick: Branch) -> None:
        chosen.append(pick)
        if tree is not None:
            lens = tree.common_prefix_lens(pick.call_index, [b.call_index for b in branches])
            for i, n in enumerate(lens):
                shared[i] = max(shared[i], n)

    def tier(i: int) -> tuple[bool, int, bool]:
        return branches[i].untrained_end, ROLE_PRIORITY.index(branches[i].role), not branches[i].delivered

    if main_line is not None:
        take(main_line)
    pool = [i for i, b in enumerate(branches) if b is not main_line]
    while pool and len(chosen) < config.budget:
        best = min(tier(i) for i in pool)
        pick = min((i for i in pool if tier(i) == best), key=lambda i: (
            -shared[i], _seeded(config.seed, branches[i].rollout_id, branches[i].call_id)))
        pool.remove(pick)
        take(branches[pick])
    return chosen


def _seeded(seed: int, rollout_id: str, call_id: str) -> str:
    return hashlib.sha256(f"{seed}:{rollout_id}:{call_id}".encode()).hexdigest()
