"""A call placed as context only (its behaviour logprobs are no log-probabilities): its
branch never takes a budget slot from a branch with something to train, and a tree with no
such call keeps the summary (and so the TreeSealed digest) it had before they existed."""

from __future__ import annotations

import json

from services.trajectory.ledger import RolloutState, tree_summary
from services.trajectory.records import CallHints
from services.trajectory.rollout_tree import RolloutTree, TreeConfig

from ._calls import SUB_SYSTEM, SYSTEM, TASK, Agent, Recorder
from .test_forks import SUB_HINTS


def _rollout(side_first: bool):
    rec = Recorder()
    main = Agent(rec, SYSTEM + TASK)
    main.say([20, 2], [3, 90])
    main.say([21, 2])
    side_hints = CallHints(system_digest="x" * 64, tools_digest="y" * 64)
    sub = Agent(rec, SUB_SYSTEM + [1, 14, 14, 2], SUB_HINTS, system=SUB_SYSTEM)
    steps = [lambda: rec.record([1, 15, 2, 1, 11, 2], [30, 31], [], side_hints, logprobs=[float("nan"), -0.1]),
             lambda: sub.say([50, 51, 2])]
    for step in (steps if side_first else steps[::-1]):
        step()
    return rec.calls


def test_a_context_only_branch_never_takes_a_trainable_branchs_slot() -> None:
    for side_first in (True, False):
        tree = RolloutTree("r1", TreeConfig(budget=2))
        for c in _rollout(side_first):
            assert tree.add(c).outcome == "applied"
        sealed = tree.seal()
        (untrained,) = sealed.untrained
        assert len(sealed.branches) == 3
        assert [b.role for b in sealed.selected] == ["main", "subagent"]
        assert untrained.call_id not in {b.call_id for b in sealed.selected}
        wide = RolloutTree("r1", TreeConfig(budget=5))
        for c in _rollout(side_first):
            wide.add(c)
        assert wide.seal().selected[-1].call_id == untrained.call_id  # with room, it comes last


def test_the_summary_names_untrained_calls_only_when_there_are_some() -> None:
    rec = Recorder()
    main = Agent(rec, SYSTEM + TASK)
    main.say([20, 2], [3, 90])
    main.say([21, 2])
    plain = RolloutTree("r1")
    for c in rec.calls:
        plain.add(c)
    sealed = plain.seal()
    assert "untrained" not in json.loads(tree_summary(RolloutState("r1", tree=plain), sealed))
    mixed = RolloutTree("r1")
    for c in _rollout(True):
        mixed.add(c)
    sealed = mixed.seal()
    doc = json.loads(tree_summary(RolloutState("r1", tree=mixed), sealed))
    assert [u["call_id"] for u in doc["untrained"]] == [sealed.untrained[0].call_id]
