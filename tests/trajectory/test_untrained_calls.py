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


def test_a_temperature_or_logprob_past_float32_is_context_only_not_a_bad_sample() -> None:
    """Finite and > 0 as doubles (CallRecorded accepts them) but 0 or inf as the float32
    the tree keeps: the call is context only, and the packed sample still validates (the
    trainer would otherwise reject the execution's every branch)."""
    from services.trainer.batch import validate_sample
    from services.trajectory.records import CallRecord

    for odd in (dict(logprob_temperature=1e-46), dict(logprob_temperature=1e39),
                dict(output_logprobs=[-0.5, -1e39])):
        good = CallRecord("c0", "r", [1, 2, 3], [20, 21], [-0.5, -0.25])
        fields = dict(output_logprobs=[-0.5, -0.25], parent_call_id="c0", prefix_len=5) | odd
        bad = CallRecord("c1", "r", [4], [22, 23], **fields)
        tree = RolloutTree("r", TreeConfig())
        for c in (good, bad):
            assert tree.add(c).outcome == "applied"
        assert "float32" in tree.tree.placements[-1].untrained or "log-probability" in tree.tree.placements[-1].untrained
        sealed = tree.seal()
        assert [u.call_id for u in sealed.untrained] == ["c1"]
        for p in sealed.packed:
            validate_sample(p, 1.0)
