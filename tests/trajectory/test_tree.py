"""The radix tree: exact read-back, one stored position per distinct prefix, bad input."""

from __future__ import annotations

import math
import random

import pytest

from services.trajectory.tree import TrajectoryTree, TreeError

from ._calls import brute_force_positions, build, call, full_sequences, random_calls


def test_worked_example_from_the_docstring():
    a = call("a", [1, 2, 5], [20, 21])
    b = call("b", [6], [22], parent="a", prefix=5)
    c = call("c", [], [30], parent="a", prefix=3)
    tree = build([a, b, c])
    assert list(tree.tokens) == [1, 2, 5, 20, 21, 6, 22, 30]
    assert list(tree.generated) == [0, 0, 0, 1, 1, 0, 1, 1]
    assert tree.n_nodes == 3  # [1 2 5] -> [20 21 6 22] (b extended a in place), [30]
    assert tree.placements[1].sibling_call is None  # b made no fork
    assert tree.placements[2].sibling_call == 0 and tree.placements[2].graft_depth == 3
    assert [list(tree.sequence(i)) for i in range(3)] == [
        [1, 2, 5, 20, 21], [1, 2, 5, 20, 21, 6, 22], [1, 2, 5, 30]]


@pytest.mark.parametrize("seed", range(40))
def test_random_trees_read_back_exactly_and_store_each_position_once(seed):
    calls = random_calls(seed, n_calls=35)
    tree = build(calls)
    expected = full_sequences(calls)
    for i, c in enumerate(calls):
        assert list(tree.sequence(i)) == expected[c.call_id]
    assert tree.n_stored_tokens == len(brute_force_positions(calls))
    assert tree.n_flattened_tokens() == sum(len(s) for s in expected.values())


@pytest.mark.parametrize("seed", range(20))
def test_generated_positions_keep_the_first_delivered_generators_attributes(seed):
    calls = random_calls(seed, n_calls=30)
    tree = build(calls)
    first_gen: dict[tuple, tuple] = {}  # the first delivered generator, else the first one
    for i, c in enumerate(calls):
        seq = list(tree.sequence(i))
        n_in = c.n_input_tokens
        for j in range(n_in, len(seq)):
            key = tuple(seq[: j + 1])
            if key not in first_gen or (c.delivered and not calls[first_gen[key][0]].delivered):
                first_gen[key] = (i, c.output_logprobs[j - n_in])
    for i in range(len(calls)):
        seq = list(tree.sequence(i))
        for k, q in enumerate(_path_positions(tree, i)):
            owner = first_gen.get(tuple(seq[: k + 1]))
            assert tree.generated[q] == (owner is not None)
            if owner:
                assert tree.origin[q] == owner[0]
                assert tree.logprobs[q] == pytest.approx(owner[1], abs=1e-6)


def _path_positions(tree: TrajectoryTree, c: int) -> list[int]:
    ix = tree.call_end(c)
    out = []
    node = tree.owner(ix) if ix >= 0 else 0
    top = ix
    while node > 0:
        start, length, _, parent = tree.node(node)
        out.extend(range(top, start - 1, -1))
        node = parent
        if node > 0:
            top = tree.node(node)[0] + tree.node(node)[1] - 1
    return out[::-1]


def test_weight_versions_follow_the_spans_of_each_output_token():
    from services.trajectory.records import WeightSpan

    a = call("a", [1, 10, 2], [20, 21, 22, 23], version=3,
             weight_spans=(WeightSpan(2, 4, 4),))
    tree = build([a])
    assert list(tree.versions) == [-1, -1, -1, 3, 3, 4, 4]


def test_common_prefix_len_between_calls():
    calls = [call("a", [1, 2, 5], [20, 21]), call("b", [6], [22], parent="a", prefix=5),
             call("c", [], [30], parent="a", prefix=3), call("d", [9], [40])]
    tree = build(calls)
    assert tree.common_prefix_len(1, 0) == 5
    assert tree.common_prefix_len(2, 1) == 3
    assert tree.common_prefix_len(3, 0) == 0
    assert tree.common_prefix_len(1, 1) == 7


def test_digest_does_not_depend_on_arrival_order():
    rng = random.Random(7)
    for seed in range(15):
        calls = random_calls(seed, n_calls=25)
        reference = build(calls).digest()
        order = _shuffled_topological(calls, rng)
        assert build(order).digest() == reference


def _shuffled_topological(calls, rng):
    pending = list(calls)
    done: set[str] = set()
    out = []
    while pending:
        ready = [c for c in pending if c.parent_call_id is None or c.parent_call_id in done]
        pick = rng.choice(ready)
        pending.remove(pick)
        done.add(pick.call_id)
        out.append(pick)
    return out


@pytest.mark.parametrize("bad, reason", [
    (call("x", [1], [20], parent="nobody", prefix=1), "unknown parent"),
    (call("x", [1], [20], parent="a", prefix=99), "exceeds"),
    (call("x", [1], [20], prefix=2), "without a parent"),
    (call("a", [1], [20]), "already"),
])
def test_bad_calls_are_refused_and_leave_the_tree_untouched(bad, reason):
    tree = build([call("a", [1, 2, 5], [20, 21])])
    before = (tree.digest(), tree.n_stored_tokens, len(tree.calls))
    with pytest.raises(TreeError, match=reason):
        tree.add_call(bad)
    assert (tree.digest(), tree.n_stored_tokens, len(tree.calls)) == before


@pytest.mark.parametrize("bad, reason", [
    (call("x", [1], [20, 21], logprobs=[-0.1]), "1 logprobs for 2 output tokens"),
    # what the trainer's validate_sample calls "not a log-probability" (> 1e-4)
    (call("x", [1], [20, 21], logprobs=[-0.1, float("nan")]), "not a log-probability"),
    (call("x", [1], [20, 21], logprobs=[float("-inf"), -0.1]), "not a log-probability"),
    (call("x", [1], [20], logprobs=[float("inf")]), "not a log-probability"),
    (call("x", [1], [20], logprobs=[0.01]), "not a log-probability"),
    (call("x", [1], [20], logprob_temperature=0.0), "temperature"),
    (call("x", [], [20]), "no input tokens"),
    (call("x", [], [20], parent="a", prefix=0), "no input tokens"),
    (call("x", [3], [20], parent="a", prefix=4, logprobs=[float("nan")]), "not a log-probability"),
])
def test_an_untrainable_call_is_placed_as_context_only(bad, reason):
    """Its tokens are in the tree (the calls continuing it can be placed), none of its
    output positions is marked generated, and the reason is on its placement."""
    a = call("a", [1, 2, 5], [20, 21])
    tree = build([a])
    generated_before = bytes(tree.generated)
    placement = tree.add_call(bad)
    assert reason in placement.untrained
    assert list(tree.sequence(tree.index["x"])) == full_sequences([a, bad])["x"]
    # nothing the call wrote is generated; the positions it shares with "a" keep a's marks
    assert bytes(tree.generated[: len(generated_before)]) == generated_before
    assert not any(tree.generated[len(generated_before):])
    assert all(math.isfinite(lp) and lp <= 0 for lp in tree.logprobs)
    child = tree.add_call(call("y", [7], [30], parent="x", prefix=bad.n_tokens))
    assert not child.untrained and tree.generated[tree.call_end(tree.index["y"])]


def test_building_costs_new_tokens_not_context():
    """A 200k-token context extended 300 times: each extension touches only its new tokens."""
    tree = TrajectoryTree()
    tree.add_call(call("c0", list(range(100, 200_100)), [20]))
    compared = []
    original = tree._common_run

    def counting(pos, avail, tail, i):
        run = original(pos, avail, tail, i)
        compared.append(run)
        return run

    tree._common_run = counting
    prev, length = "c0", 200_001
    for k in range(1, 301):
        tree.add_call(call(f"c{k}", [3, 90 + k % 9], [20 + k % 40], parent=prev, prefix=length))
        prev, length = f"c{k}", length + 3
    assert sum(compared) == 0  # nothing re-matched: the reference points past the context
    assert tree.n_nodes == 1  # one growing main line
    assert list(tree.sequence(300))[-3:] == [3, 90 + 300 % 9, 20 + 300 % 40]


def test_a_logprob_just_above_zero_is_float_rounding_and_kept():
    tree = build([call("a", [1, 2, 5], [20, 21], logprobs=[0.0, 5e-5])])
    assert len(tree.calls) == 1


@pytest.mark.parametrize("bad", [float("nan"), float("-inf"), 0.5])
def test_a_bad_logprob_untrains_the_call_not_the_execution(bad):
    """The trainer rejects a whole packed sample with one bad behaviour logprob: the
    rollout tree keeps that call as context only (with the reason), and the calls after it
    on the agent's line, which arrive buffered before it, are still placed and trained."""
    from services.trainer.batch import validate_sample
    from services.trajectory.rollout_tree import RolloutTree, TreeConfig

    from ._calls import SYSTEM, TASK

    p = SYSTEM + TASK
    tree = RolloutTree("r1", TreeConfig())
    assert tree.add(call("c0", p, [20, 21, 22, 2])).outcome == "applied"
    n1 = len(p) + 4 + 2 + 3
    assert tree.add(call("c2", [3, 91], [25, 26, 2], parent="c1", prefix=n1)).outcome == "buffered"
    out = tree.add(call("c1", [3, 90], [23, 24, 2], parent="c0", prefix=len(p) + 4,
                        logprobs=[-0.1, bad, -0.2]))
    assert out.outcome == "applied" and out.released == ("c2",)
    sealed = tree.seal()
    assert sealed.rejected == ()
    assert [(r.call_id, "not a log-probability" in r.reason) for r in sealed.untrained] == [("c1", True)]
    (packed,) = sealed.packed
    # c0's 4 and c2's 3 output tokens are trained, c1's 3 are context
    assert packed.n_trained_tokens == 7
    trained = [t for t, m in zip(packed.token_ids, packed.loss_mask) if m]
    assert trained == [20, 21, 22, 2, 25, 26, 2]
    validate_sample(packed, advantage=1.0, vocab_size=512)
