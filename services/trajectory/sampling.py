"""Branches and priority sampling.

A *branch* is the path from the root to the end of a call that no later call of the
same agent line extends: the last call of each stretch of an agent's conversation (the
main line before and after each compaction, each summary, each sub-agent's line, each
abandoned attempt). Its role is that call's role. Such an end is often a tree leaf but
not always: a fork sub-agent that starts from the main agent's whole history continues
past the main line's end, and the main line is still a branch of its own. Per rollout at most ``budget`` branches are selected: the main line
(the branch of the rollout's last main call) first, then by role priority
(``main`` > ``main_summary`` > ``subagent`` > ``subagent_summary``), delivered before
undelivered, then a seeded hash of the call id, so the choice is deterministic and the
same on replay. Branches that end in an undelivered call (a broken stream that was sent
again) are left out unless ``include_undelivered``.
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


@dataclass(frozen=True)
class SamplingConfig:
    budget: int = 5
    seed: int = 0
    # A broken attempt's output never reached the agent: nothing on its own leaf is
    # trained (see PackingConfig.train_undelivered), so by default it is not a candidate.
    include_undelivered: bool = False


def list_branches(tree: TrajectoryTree, labels: list[CallLabel]) -> list[Branch]:
    """Branch ends in arrival order of their calls (one per distinct end position)."""
    extended = {lab.previous for lab in labels if lab.relation == "extend"}
    out, seen = [], set()
    for c, call in enumerate(tree.calls):
        end = tree.call_end(c)
        if c in extended or end < 0 or end in seen:
            continue
        seen.add(end)
        out.append(Branch(end, c, call.call_id, call.rollout_id, labels[c].role,
                          tree.call_length(c), call.delivered))
    return out


def select_branches(branches: list[Branch], config: SamplingConfig = SamplingConfig()) -> list[Branch]:
    """At most ``config.budget`` branches, main line first, then by priority."""
    if not config.include_undelivered:
        branches = [b for b in branches if b.delivered]
    if config.budget <= 0 or not branches:
        return []
    mains = [b for b in branches if b.role == "main" and b.delivered] or [
        b for b in branches if b.role == "main"
    ]
    main_line = max(mains, key=lambda b: b.call_index) if mains else None

    def rank(b: Branch) -> tuple:
        return (
            b is not main_line,
            ROLE_PRIORITY.index(b.role),
            not b.delivered,
            _seeded(config.seed, b.rollout_id, b.call_id),
        )

    return sorted(branches, key=rank)[: config.budget]


def _seeded(seed: int, rollout_id: str, call_id: str) -> str:
    return hashlib.sha256(f"{seed}:{rollout_id}:{call_id}".encode()).hexdigest()
