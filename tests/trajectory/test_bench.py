"""The tree benchmark on a small preset: fields present, the brute-force count agrees."""

from __future__ import annotations

from services.trajectory.bench import distinct_positions, run_bench
from services.trajectory.workload import generate, preset

from ._calls import brute_force_positions, random_calls


def test_bench_fields_on_the_small_preset():
    out = run_bench(preset="small")
    for field in ("calls", "flattened_tokens", "stored_tokens", "storage_ratio", "train_flat_tokens",
                  "train_tree_tokens", "train_token_ratio", "build_s_per_1m_new_tokens",
                  "stored_tokens_verified"):
        assert field in out
    assert out["stored_tokens_verified"] is True
    assert out["storage_ratio"] > 1 and out["train_token_ratio"] >= 1
    assert out["flattened_tokens"] == sum(c.n_tokens for r in generate(preset("small")) for c in r)


def test_splitting_is_reported():
    out = run_bench(preset="small", max_piece_tokens=800)
    assert out["packed_pieces"] > out["rollouts"]
    assert out["split_duplicated_tokens"] > 0


def test_the_independent_count_agrees_with_the_set_of_prefixes():
    for seed in range(10):
        calls = random_calls(seed, n_calls=30)
        assert distinct_positions(calls) == len(brute_force_positions(calls))


def test_workload_is_deterministic():
    a = generate(preset("tiny"))
    b = generate(preset("tiny"))
    assert [[list(c.output_ids) for c in r] for r in a] == [[list(c.output_ids) for c in r] for r in b]


def test_the_synthetic_workload_packs_back_to_its_own_calls():
    """End to end on the small preset: every selected branch, read back from the packed
    pieces, is its call's exact sequence; each rollout trains its generated tokens once."""
    from services.trajectory.forks import HARNESS_RULES
    from services.trajectory.packing import branch_tokens
    from services.trajectory.rollout_tree import RolloutTree, TreeConfig
    from services.trajectory.workload import COMPACTION_INSTRUCTION

    from ._calls import full_sequences

    rules = HARNESS_RULES["claude_code"].with_markers(summary=[COMPACTION_INSTRUCTION[1:-1]])
    for calls in generate(preset("small")):
        rollout = RolloutTree(calls[0].rollout_id, TreeConfig(rules, max_piece_tokens=600))
        for c in calls:
            assert rollout.add(c).outcome == "applied"
        sealed = rollout.seal()
        roles = {lab.role for lab in sealed.labels}
        assert {"main", "main_summary", "subagent"} <= roles
        seqs = full_sequences(calls)
        ends = [e for p in sealed.packed for e in p.branches]
        assert sorted(e.call_id for e in ends) == sorted(b.call_id for b in sealed.selected)
        for p in sealed.packed:
            for e in p.branches:
                assert branch_tokens(p, e.last_token) == seqs[e.call_id]
        total = sum(p.n_trained_tokens for p in sealed.packed)
        assert total == sealed.packed[0].n_execution_trained_tokens
        assert abs(sum(sum(p.loss_weights) for p in sealed.packed) - 1.0) < 1e-4


def test_packed_samples_for_the_trainer_benchmark():
    from services.trajectory.bench import packed_samples

    samples = packed_samples("small")
    assert {p.rollout_id for p in samples} == {"r0", "r1"}
    assert all(p.n_trained_tokens > 0 for p in samples)


def test_the_small_preset_is_the_default_scaled_down():
    """Same calls per rollout, same compaction and fork structure, 1/40 of the tokens."""
    from services.trajectory.workload import PRESETS

    small, default = PRESETS["small"], PRESETS["default"]
    assert small == default.scaled(40, rollouts=2)
    assert (small.main_turns, small.subagent_every, small.subagent_turns) == (
        default.main_turns, default.subagent_every, default.subagent_turns)
    assert small.compact_at * 40 == default.compact_at
    out = run_bench(preset="small", verify=False)
    assert out["forks"]["compaction"] >= out["rollouts"] and out["forks"]["subagent"] > 0


def _union_size(seqs: list[list[int]]) -> int:
    """Distinct (prefix, token) positions of some sequences, from the sequences alone:
    sorted, each adds the positions it does not share with its predecessor."""
    ordered = sorted(seqs)
    total = sum(len(s) for s in ordered)
    for a, b in zip(ordered, ordered[1:]):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        total -= n
    return total


def _sealed_small(seed: int = 0, **overrides):
    from services.trajectory.forks import HARNESS_RULES
    from services.trajectory.rollout_tree import RolloutTree, TreeConfig
    from services.trajectory.workload import COMPACTION_INSTRUCTION

    rules = HARNESS_RULES["claude_code"].with_markers(summary=[COMPACTION_INSTRUCTION[1:-1]])
    for calls in generate(preset("small", seed=seed, **overrides)):
        rollout = RolloutTree(calls[0].rollout_id, TreeConfig(rules))
        for c in calls:
            rollout.add(c)
        yield calls, rollout.seal()


def test_train_token_counts_agree_with_an_independent_count_from_the_records():
    """``train_flat_tokens`` is the selected calls' lengths and ``train_tree_tokens`` the
    distinct positions of their sequences, both rebuilt from the call records alone."""
    from ._calls import full_sequences

    flat = tree = 0
    group = []
    for calls, sealed in _sealed_small():
        seqs = full_sequences(calls)
        chosen = [seqs[b.call_id] for b in sealed.selected]
        assert [b.n_tokens for b in sealed.selected] == [len(s) for s in chosen]
        assert sum(p.n_tokens for p in sealed.packed) == _union_size(chosen)
        assert len(sealed.packed) == 1  # one tree per execution: every shared prefix once
        flat += sum(len(s) for s in chosen)
        tree += _union_size(chosen)
        group += chosen
    out = run_bench(preset="small", verify=False)
    assert (out["train_flat_tokens"], out["train_tree_tokens_per_rollout"]) == (flat, tree)
    # merged: the group's rollouts share their prompt, and only their prompt (the rest is
    # random per rollout), so the merged layout holds the union of all chosen sequences
    assert out["train_tree_tokens"] == _union_size(group) < tree
    assert out["group_shared_tokens"] == tree - out["train_tree_tokens"]


def test_no_other_choice_within_the_roles_shares_more_on_the_small_preset():
    """The roles fix every pick but those of the last role reached; among all the ways to
    fill those (brute force), none reuses more of the already packed tokens than the
    greedy longest-prefix choice (services/trajectory/README.md). On ``small`` (one
    compaction per rollout) the roles fix both main epochs and the summary and leave two
    of the 8-10 sub-agent branches free."""
    from itertools import combinations

    from services.trajectory.records import ROLE_PRIORITY

    from ._calls import full_sequences

    for calls, sealed in (r for seed in range(3) for r in _sealed_small(seed)):
        seqs = full_sequences(calls)
        rank = lambda b: ROLE_PRIORITY.index(b.role)  # noqa: E731
        last = max(rank(b) for b in sealed.selected)
        fixed = [b for b in sealed.selected if rank(b) < last]
        free = [b for b in sealed.selected if rank(b) == last]
        pool = [b for b in sealed.branches if b.delivered and rank(b) == last]
        assert len(pool) > len(free) >= 1  # a real choice

        base = _union_size([seqs[b.call_id] for b in fixed])

        def shared(extra) -> int:  # tokens of ``extra`` already stored: not packed again
            new = _union_size([seqs[b.call_id] for b in fixed + list(extra)]) - base
            return sum(b.n_tokens for b in extra) - new

        assert shared(free) == max(shared(c) for c in combinations(pool, len(free)))
