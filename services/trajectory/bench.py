"""``gyre bench tree --json``: build, classify, sample and pack the synthetic workload.

Fields (issue 5): ``calls``, ``flattened_tokens`` (sum of every call's input + output),
``stored_tokens`` (tree positions), ``storage_ratio``, ``train_flat_tokens`` (sum of the
selected branches' lengths), ``train_tree_tokens`` (tokens in the packed trees as the
trainer lays them out: context repeated by splitting included, the group's shared
prefixes once, see below), ``train_token_ratio``, ``build_s_per_1m_new_tokens``
(tree building time per million tokens the proxy recorded as new: new input + output),
``stored_tokens_verified`` (an independent count, from the call records alone, of the
distinct (prefix, token) positions agrees). Extra fields explain the numbers; ``seal_s``
is the time to classify, sample and pack (not part of building).

The preset's rollouts are one group (same system prompt and task). With ``group_merge``
(the default, as the trainer does it) the group's packed trees are laid out in
micro-steps of ``max_piece_tokens`` (no limit when None) with their shared untrained
prefixes once (``packing.plan_micro_steps``), and ``train_tree_tokens`` counts that
layout; ``train_tree_tokens_per_rollout`` / ``train_token_ratio_per_rollout`` count each
rollout's trees on their own.

Options (all optional): ``preset`` (``default``; ``small``, the default at 1/40 of its
token sizes with 2 rollouts, which the trainer's benchmark trains; ``tiny``), any
:class:`~services.trajectory.workload.WorkloadPreset` field (``rollouts``, ``main_turns``,
``compact_at``, ``retry_prob``, ...), ``budget`` (branches per rollout, 5),
``max_piece_tokens`` (None), ``verify`` (True), ``group_merge`` (True).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import fields

from .forks import HARNESS_RULES
from .rollout_tree import RolloutTree, SealedTree, TreeConfig
from .packing import PackedTree, common_prefix_bytes, plan_micro_steps
from .records import CallRecord
from .workload import COMPACTION_INSTRUCTION, WorkloadPreset, generate, preset


def run_bench(**opts) -> dict:
    name = opts.pop("preset", "default")
    budget = int(opts.pop("budget", 5))
    max_piece = opts.pop("max_piece_tokens", None)
    verify = bool(opts.pop("verify", True))
    group_merge = bool(opts.pop("group_merge", True))
    known = {f.name for f in fields(WorkloadPreset)}
    p = preset(name, **{k: v for k, v in opts.items() if k in known and v is not None})
    t0 = time.perf_counter()
    rollouts = generate(p)
    gen_s = time.perf_counter() - t0
    rules = HARNESS_RULES["claude_code"].with_markers(summary=[COMPACTION_INSTRUCTION[1:-1]])
    config = TreeConfig(rules=rules, budget=budget, max_piece_tokens=max_piece)
    totals: Counter = Counter()
    forks: Counter = Counter()
    roles: Counter = Counter()
    verified = True
    group: list[PackedTree] = []
    for calls in rollouts:
        result = _measure_rollout(calls, config, totals)
        forks.update(lab.fork for lab in result.labels if lab.fork)
        roles.update(b.role for b in result.selected)
        group.extend(result.packed)
        if verify:
            verified &= distinct_positions(calls) == totals.pop("_stored_here")
    t0 = time.perf_counter()
    plans = plan_micro_steps(group, max_piece) if group_merge else [([k], pk.n_tokens) for k, pk in enumerate(group)]
    totals["merge_us"] += int((time.perf_counter() - t0) * 1e6)
    totals["train_tree_merged"] = sum(size for _, size in plans)
    totals["micro_steps"] = len(plans)
    report = _report(name, p, totals, forks, roles, verified if verify else None, gen_s)
    report["group_merge"] = group_merge
    return report


def _measure_rollout(calls: list[CallRecord], config: TreeConfig, totals: Counter) -> SealedTree:
    rollout = RolloutTree(calls[0].rollout_id, config)
    t0 = time.perf_counter()
    for call in calls:
        rollout.tree.add_call(call)
    totals["build_us"] += int((time.perf_counter() - t0) * 1e6)
    t0 = time.perf_counter()
    result = rollout.seal()
    totals["seal_us"] += int((time.perf_counter() - t0) * 1e6)
    tree = rollout.tree
    totals["calls"] += len(calls)
    totals["new"] += sum(len(c.new_input_ids) + len(c.output_ids) for c in calls)
    totals["flat"] += tree.n_flattened_tokens()
    totals["stored"] += tree.n_stored_tokens
    totals["_stored_here"] = tree.n_stored_tokens
    totals["branches"] += len(result.branches)
    totals["selected"] += len(result.selected)
    totals["train_flat"] += sum(b.n_tokens for b in result.selected)
    totals["train_tree"] += sum(pk.n_tokens for pk in result.packed)
    totals["context"] += sum(pk.n_context_tokens for pk in result.packed)
    totals["trained"] += sum(pk.n_trained_tokens for pk in result.packed)
    totals["pieces"] += len(result.packed)
    return result


def _report(name, p, totals, forks, roles, verified, gen_s) -> dict:
    build_s = totals["build_us"] / 1e6
    return {
        "preset": name,
        "rollouts": p.rollouts,
        "calls": totals["calls"],
        "flattened_tokens": totals["flat"],
        "stored_tokens": totals["stored"],
        "storage_ratio": round(totals["flat"] / max(1, totals["stored"]), 3),
        "train_flat_tokens": totals["train_flat"],
        "train_tree_tokens": totals["train_tree_merged"],
        "train_token_ratio": round(totals["train_flat"] / max(1, totals["train_tree_merged"]), 3),
        "build_s_per_1m_new_tokens": round(build_s / max(1e-9, totals["new"] / 1e6), 4),
        "stored_tokens_verified": verified,
        "new_tokens": totals["new"],
        "build_s": round(build_s, 4),
        "generate_s": round(gen_s, 3),
        "seal_s": round(totals["seal_us"] / 1e6, 4),  # classify + sample + pack, all rollouts
        "branches": totals["branches"],
        "selected_branches": totals["selected"],
        "selected_roles": dict(sorted(roles.items())),
        "forks": dict(sorted(forks.items())),
        "trained_tokens": totals["trained"],
        "packed_pieces": totals["pieces"],
        "split_duplicated_tokens": totals["context"],
        "train_tree_tokens_per_rollout": totals["train_tree"],
        "train_token_ratio_per_rollout": round(totals["train_flat"] / max(1, totals["train_tree"]), 3),
        "group_shared_tokens": totals["train_tree"] - totals["train_tree_merged"],
        "micro_steps": totals["micro_steps"],
        "merge_s": round(totals["merge_us"] / 1e6, 4),
    }


def distinct_positions(calls: list[CallRecord]) -> int:
    """Distinct (prefix, token) positions over all calls, without any tree.

    Each call's full sequence is rebuilt from the records (parent prefix + new input +
    output) as int32 bytes; after sorting, a sequence adds the positions it does not
    share with its predecessor: sum of lengths minus sum of adjacent common prefixes.
    """
    seqs: dict[str, bytes] = {}
    for call in calls:
        head = seqs[call.parent_call_id][: 4 * call.prefix_len] if call.parent_call_id else b""
        seqs[call.call_id] = head + _i32(call.new_input_ids) + _i32(call.output_ids)
    ordered = sorted(seqs.values())
    total = sum(len(s) for s in ordered) // 4
    shared = sum(common_prefix_bytes(a, b) // 4 for a, b in zip(ordered, ordered[1:]))
    return total - shared


def _i32(ids) -> bytes:
    from .codec import encode_ids

    return encode_ids(ids)


def packed_samples(preset_name: str = "default", *, budget: int = 5,
                   max_piece_tokens: int | None = None, **overrides) -> list[PackedTree]:
    """The packed trees the benchmark selects, for the trainer's benchmark to train on
    (e.g. ``packed_samples("small")`` for a 2-core machine)."""
    p = preset(preset_name, **overrides)
    rules = HARNESS_RULES["claude_code"].with_markers(summary=[COMPACTION_INSTRUCTION[1:-1]])
    config = TreeConfig(rules=rules, budget=budget, max_piece_tokens=max_piece_tokens)
    out: list[PackedTree] = []
    for calls in generate(p):
        rollout = RolloutTree(calls[0].rollout_id, config)
        for call in calls:
            rollout.add(call)
        out.extend(rollout.seal().packed)
    return out
