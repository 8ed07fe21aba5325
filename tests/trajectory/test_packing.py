"""Packing: read-back, masks, per-execution weights, tree attention, splitting."""

from __future__ import annotations

import random

import pytest

from services.trajectory.forks import HARNESS_RULES, classify_calls
from services.trajectory.packing import (PackingConfig, branch_tokens, dense_mask, merge_forest,
                                         pack_branches, plan_micro_steps, segment_ancestors)
from services.trajectory.sampling import SamplingConfig, list_branches, select_branches

from ._calls import build, call, full_sequences, random_calls

RULES = HARNESS_RULES["claude_code"]


def _selected(seed: int, n_calls: int = 30):
    calls = random_calls(seed, n_calls=n_calls)
    tree = build(calls)
    labels = classify_calls(tree, RULES)
    budget = random.Random(seed).randint(1, 8)
    chosen = select_branches(list_branches(tree, labels), SamplingConfig(budget=budget, seed=seed))
    return calls, tree, chosen


def _prefix_at(packed, i: int) -> tuple[int, ...]:
    return tuple(branch_tokens(packed, i))


def _trained_positions(calls, chosen) -> set[tuple[int, ...]]:
    """Brute force: positions on the selected branches some delivered call generated."""
    seqs = full_sequences(calls)
    on_branches = {tuple(seqs[b.call_id][: k + 1]) for b in chosen for k in range(b.n_tokens)}
    generated = set()
    for c in calls:
        if c.delivered:
            seq = seqs[c.call_id]
            generated.update(tuple(seq[: k + 1]) for k in range(c.n_input_tokens, len(seq)))
    return on_branches & generated


def test_worked_example_from_the_docstring():
    calls = [call("a", [1, 2, 5], [20, 21]), call("b", [], [30], parent="a", prefix=3)]
    tree = build(calls)
    chosen = select_branches(list_branches(tree, classify_calls(tree, RULES)))
    (p,) = pack_branches(tree, chosen)
    assert list(p.token_ids) == [1, 2, 5, 20, 21, 30]  # canonical: children by first token
    assert list(p.position_ids) == [0, 1, 2, 3, 4, 3]
    assert list(p.parent_index) == [-1, 0, 1, 2, 3, 2]
    assert p.loss_mask == bytes([0, 0, 0, 1, 1, 1])
    assert list(p.loss_weights) == pytest.approx([0, 0, 0, 1 / 3, 1 / 3, 1 / 3])
    assert [(s.offset, s.length, s.parent) for s in p.segments] == [(0, 3, -1), (3, 2, 0), (5, 1, 0)]
    assert segment_ancestors(p) == [(), (0,), (0,)]


@pytest.mark.parametrize("seed", range(40))
def test_packed_branches_read_back_and_count_each_position_once(seed):
    calls, tree, chosen = _selected(seed)
    (p,) = pack_branches(tree, chosen)
    seqs = full_sequences(calls)
    assert {b.call_id for b in p.branches} == {b.call_id for b in chosen}
    for end in p.branches:
        assert branch_tokens(p, end.last_token) == seqs[end.call_id]
    prefixes = [_prefix_at(p, i) for i in range(p.n_tokens)]
    assert len(set(prefixes)) == p.n_tokens  # every position once
    union = {tuple(seqs[b.call_id][: k + 1]) for b in chosen for k in range(b.n_tokens)}
    assert set(prefixes) == union
    assert all(p.position_ids[i] == len(prefixes[i]) - 1 for i in range(p.n_tokens))
    trained = _trained_positions(calls, chosen)
    assert {prefixes[i] for i in range(p.n_tokens) if p.loss_mask[i]} == trained
    assert p.n_execution_trained_tokens == len(trained)
    if trained:
        assert sum(p.loss_weights) == pytest.approx(1.0, rel=1e-5)
    assert all(p.parent_index[i] < i for i in range(p.n_tokens))  # a subset of causal


@pytest.mark.parametrize("seed", range(15))
def test_loss_equals_the_per_branch_reference_that_shares_tokens_by_count(seed):
    """Sum of weight x f over the packed tree == the per-branch sum where a position
    shared by k selected branches weighs 1/k: shared tokens count once."""
    calls, tree, chosen = _selected(seed)
    (p,) = pack_branches(tree, chosen)
    if not p.n_execution_trained_tokens:
        return
    seqs = full_sequences(calls)
    trained = _trained_positions(calls, chosen)

    def f(prefix):
        return (prefix[-1] * 0.37 + len(prefix) * 0.11) % 1.7

    packed_loss = sum(p.loss_weights[i] * f(_prefix_at(p, i)) for i in range(p.n_tokens))
    k = {}
    for b in chosen:
        for j in range(b.n_tokens):
            pos = tuple(seqs[b.call_id][: j + 1])
            k[pos] = k.get(pos, 0) + 1
    reference = 0.0
    for b in chosen:
        for j in range(b.n_tokens):
            pos = tuple(seqs[b.call_id][: j + 1])
            if pos in trained:
                reference += f(pos) / k[pos] / len(trained)
    assert packed_loss == pytest.approx(reference, rel=1e-5)


@pytest.mark.parametrize("seed", range(10))
def test_tree_attention_mask_is_the_ancestor_relation(seed):
    calls, tree, chosen = _selected(seed, n_calls=15)
    (p,) = pack_branches(tree, chosen)
    mask = dense_mask(p)
    prefixes = [_prefix_at(p, i) for i in range(p.n_tokens)]
    for q in range(p.n_tokens):
        for k in range(p.n_tokens):
            sees = prefixes[q][: len(prefixes[k])] == prefixes[k]
            assert mask[q][k] == sees


@pytest.mark.parametrize("seed", range(30))
def test_split_pieces_carry_their_context_and_train_everything_once(seed):
    calls, tree, chosen = _selected(seed)
    (whole,) = pack_branches(tree, chosen)
    budget = random.Random(seed).randint(6, 24)
    pieces = pack_branches(tree, chosen, PackingConfig(max_piece_tokens=budget))
    own, trained = [], []
    for p in pieces:
        assert p.n_pieces == len(pieces)
        longest_path = max(s.depth + s.length for s in p.segments)
        assert p.n_tokens <= budget or p.oversize
        assert not p.oversize or longest_path > budget or p.n_tokens > budget
        prefixes = [_prefix_at(p, i) for i in range(p.n_tokens)]
        for s in p.segments:
            span = range(s.offset, s.offset + s.length)
            if s.context:
                assert not any(p.loss_mask[i] for i in span)
            else:
                own.extend(prefixes[i] for i in span)
        trained.extend(prefixes[i] for i in range(p.n_tokens) if p.loss_mask[i])
        assert all(w in (0.0, pytest.approx(1 / whole.n_execution_trained_tokens)) for w in p.loss_weights)
        seqs = full_sequences(calls)
        for end in p.branches:
            assert branch_tokens(p, end.last_token) == seqs[end.call_id]
    whole_prefixes = [_prefix_at(whole, i) for i in range(whole.n_tokens)]
    assert sorted(own) == sorted(whole_prefixes)  # each position is own in exactly one piece
    assert sorted(trained) == sorted(whole_prefixes[i] for i in range(whole.n_tokens) if whole.loss_mask[i])
    assert sorted(e.call_id for p in pieces for e in p.branches) == sorted(b.call_id for b in chosen)
    duplicated = sum(p.n_context_tokens for p in pieces)
    assert duplicated == sum(p.n_tokens for p in pieces) - whole.n_tokens


def test_undelivered_outputs_are_not_trained_unless_asked():
    calls = [call("a", [1, 10, 2], [20, 21], delivered=False),
             call("b", [], [22, 23], parent="a", prefix=3)]
    tree = build(calls)
    branches = list_branches(tree, classify_calls(tree, RULES))
    everything = select_branches(branches, SamplingConfig(include_undelivered=True))
    (p,) = pack_branches(tree, everything)
    assert sum(p.loss_mask) == 2  # b's output only
    (q,) = pack_branches(tree, everything, PackingConfig(train_undelivered=True))
    assert sum(q.loss_mask) == 4


def test_nothing_selected_packs_nothing():
    tree = build([call("a", [1], [20])])
    assert pack_branches(tree, []) == []


def _long_and_wide():
    """A 100-token prompt; the answer (30) and a 2-token retry end under it; another
    conversation parts at depth 10 with 101 tokens of its own."""
    calls = [call("a", list(range(100, 200)), list(range(300, 330))),
             call("c", [], [400, 401], parent="a", prefix=100),
             call("b", list(range(500, 600)), [21], parent="a", prefix=10)]
    tree = build(calls)
    chosen = select_branches(list_branches(tree, classify_calls(tree, RULES)))
    return tree, chosen


def test_siblings_share_one_copy_of_their_context():
    tree, chosen = _long_and_wide()
    pieces = pack_branches(tree, chosen, PackingConfig(max_piece_tokens=140))
    assert [(p.n_tokens, p.n_context_tokens, p.oversize) for p in pieces] == [(132, 0, False), (111, 10, False)]
    assert {e.call_id for e in pieces[0].branches} == {"a", "c"}


def test_a_tiny_branch_is_not_moved_away_from_a_long_context():
    tree, chosen = _long_and_wide()
    pieces = pack_branches(tree, chosen, PackingConfig(max_piece_tokens=125))  # < the 130-token path
    assert [(p.n_tokens, p.n_context_tokens, p.oversize) for p in pieces] == [(132, 0, True), (111, 10, False)]


# ------------------------------------------------------------------ merging several trees

def _trees_of_a_group(seed: int):
    """Packed trees of three random rollouts (a 6-token vocabulary: their prompts often
    coincide), some split into pieces that repeat their context."""
    rng = random.Random(seed)
    trees = []
    for r in range(3):
        calls = random_calls(seed * 10 + r, n_calls=rng.randint(3, 20), rollout=f"r{r}")
        tree = build(calls)
        chosen = select_branches(list_branches(tree, classify_calls(tree, RULES)),
                                 SamplingConfig(budget=rng.randint(1, 6), seed=seed))
        budget = rng.choice([None, rng.randint(6, 20)])
        trees.extend(pack_branches(tree, chosen, PackingConfig(max_piece_tokens=budget)))
    return trees


def _merged_path(forest, i: int) -> list[int]:
    """Tokens from the root to merged position ``i``, following the merged segments."""
    starts = list(forest.segment_starts) + [forest.n_tokens]
    seg = max(s for s in range(forest.n_segments) if starts[s] <= i)
    out = list(forest.token_ids[starts[seg] : i + 1])
    seg = forest.segment_parents[seg]
    while seg >= 0:
        out[:0] = forest.token_ids[starts[seg] : starts[seg + 1]]
        seg = forest.segment_parents[seg]
    return out


@pytest.mark.parametrize("seed", range(40))
def test_merged_forest_keeps_every_tree_and_shares_only_untrained_prefixes(seed):
    trees = _trees_of_a_group(seed)
    forest = merge_forest(trees)
    starts = list(forest.segment_starts)
    assert starts == sorted(starts) and all(p < s for s, p in enumerate(forest.segment_parents))
    trained_at, expected_shared, expected_own = [], set(), 0
    for k, p in enumerate(trees):
        for i in range(p.n_tokens):
            j = forest.index[k][i]
            path = branch_tokens(p, i)
            # same token, same position, same ancestors
            assert forest.token_ids[j] == p.token_ids[i] and forest.position_ids[j] == p.position_ids[i]
            assert _merged_path(forest, j) == path
            chain, q = [], i
            while q != -1:
                chain.append(q)
                q = p.parent_index[q]
            if any(p.loss_mask[q] for q in chain):
                expected_own += 1  # on or under a trained token: never shared
            else:
                expected_shared.add(tuple(path))
            if p.loss_mask[i]:
                trained_at.append(j)
    assert len(trained_at) == len(set(trained_at))  # a trained token appears once per tree
    assert forest.n_tokens == len(expected_shared) + expected_own
    assert forest.n_tokens <= sum(p.n_tokens for p in trees)


def test_a_group_prompt_is_laid_out_once():
    shared = [1, 2, 3, 4]
    trees = []
    for r, answer in enumerate(([20, 21], [30], [20, 22])):
        tree = build([call("a", shared + [5 + r], answer, rollout=f"r{r}")])
        trees.extend(pack_branches(tree, select_branches(list_branches(tree, classify_calls(tree, RULES)))))
    forest = merge_forest(trees)
    # the four shared prompt tokens once; each rollout's own prompt token and answer apart
    assert forest.n_tokens == 4 + 3 + 5
    assert [forest.index[k][3] for k in range(3)] == [3, 3, 3]
    assert len({forest.index[k][4] for k in range(3)}) == 3


@pytest.mark.parametrize("seed", range(20))
def test_micro_steps_are_filled_by_the_merged_size(seed):
    trees = _trees_of_a_group(seed)
    budget = random.Random(seed).choice([None, 10, 25, 60])
    plans = plan_micro_steps(trees, budget)
    assert [k for members, _ in plans for k in members] == list(range(len(trees)))
    for members, size in plans:
        assert size == merge_forest([trees[k] for k in members]).n_tokens
        assert budget is None or size <= budget or len(members) == 1
