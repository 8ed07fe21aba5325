"""A rollout's tree under bad input: out of order, duplicated, broken; replay equality."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from services.trajectory.codec import encode_packed, sha256_hex
from services.trajectory.rollout_tree import RolloutTree, TreeConfig

from ._calls import call, random_calls


def _sealed_digests(calls, config=None):
    rt = RolloutTree("r1", config)
    for c in calls:
        rt.add(c)
    sealed = rt.seal()
    return sealed.tree_digest, [sha256_hex(encode_packed(p)) for p in sealed.packed], sealed


def test_out_of_order_calls_wait_for_their_parent():
    a = call("a", [1, 10, 2], [20])
    b = call("b", [3, 90], [21], parent="a", prefix=4)
    c = call("c", [3, 91], [22], parent="b", prefix=7)
    rt = RolloutTree("r1")
    assert rt.add(c).outcome == "buffered"
    assert rt.add(b).outcome == "buffered"
    done = rt.add(a)
    assert done.outcome == "applied" and done.released == ("b", "c")
    assert rt.n_waiting == 0
    assert list(rt.tree.sequence(rt.tree.index["c"])) == [1, 10, 2, 20, 3, 90, 21, 3, 91, 22]


def test_duplicates_are_ignored_and_conflicts_rejected():
    rt = RolloutTree("r1")
    a = call("a", [1, 10, 2], [20])
    assert rt.add(a).outcome == "applied"
    assert rt.add(call("a", [1, 10, 2], [20])).outcome == "duplicate"
    clash = rt.add(call("a", [1, 10, 2], [29]))
    assert clash.outcome == "rejected" and "other content" in clash.reason
    assert len(rt.tree.calls) == 1
    # a difference past the first tokens, in a logprob or in delivery is a conflict too
    long = call("b", list(range(1, 13)), list(range(20, 29)))
    assert rt.add(long).outcome == "applied"
    for other in (call("b", list(range(1, 13)), list(range(20, 28)) + [99]),
                  replace(long, output_logprobs=[-3.0] * 9), replace(long, delivered=False)):
        assert rt.add(other).outcome == "rejected", other
    assert rt.add(replace(long)).outcome == "duplicate"


@pytest.mark.parametrize("bad, reason", [
    (call("x", [1], [20], parent="a", prefix=50), "exceeds"),
    (call("x", [1], [20], rollout="r9"), "belongs to rollout r9"),
])
def test_broken_calls_are_rejected_with_a_reason(bad, reason):
    rt = RolloutTree("r1")
    rt.add(call("a", [1, 10, 2], [20]))
    before = rt.tree.digest()
    out = rt.add(bad)
    assert out.outcome == "rejected" and reason in out.reason
    assert rt.tree.digest() == before


def test_calls_whose_parent_never_arrives_are_rejected_at_seal():
    rt = RolloutTree("r1")
    rt.add(call("a", [1, 10, 2], [20]))
    rt.add(call("b", [3], [21], parent="ghost", prefix=3))
    sealed = rt.seal()
    assert [(r.call_id, r.outcome) for r in sealed.rejected] == [("b", "rejected")]
    assert "ghost" in sealed.rejected[0].reason


def test_a_released_call_that_is_broken_is_reported():
    rt = RolloutTree("r1")
    rt.add(call("b", [3], [21], parent="a", prefix=99))
    out = rt.add(call("a", [1, 10, 2], [20]))
    assert out.outcome == "applied" and [r.call_id for r in out.also_rejected] == ["b"]
    assert [r.call_id for r in rt.seal().rejected] == ["b"]


@pytest.mark.parametrize("seed", range(12))
def test_rebuilding_gives_identical_trees_and_sample_digests(seed):
    calls = random_calls(seed, n_calls=30)
    config = TreeConfig(budget=4, seed=seed, max_piece_tokens=20)
    first = _sealed_digests(calls, config)
    again = _sealed_digests(calls, config)
    assert first[:2] == again[:2]
    # Arrival order scrambled (parents after children): buffering restores the same result.
    shuffled = list(calls)
    random.Random(seed).shuffle(shuffled)
    third = _sealed_digests(shuffled, config)
    assert third[0] == first[0]
    assert not third[2].rejected
