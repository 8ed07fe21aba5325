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
