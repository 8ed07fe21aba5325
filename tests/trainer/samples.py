"""Packed samples for the trainer's tests: the trajectory workload's trees (``tiny``
preset) with token ids folded into a small vocabulary, and hand-made trees whose
token ids mean something (1 = prompt start, 20.. = the model's answers)."""

from __future__ import annotations

from array import array
from dataclasses import replace

from services.trajectory.bench import packed_samples
from services.trajectory.packing import BranchEnd, PackedTree, Segment


def fold(p: PackedTree, vocab: int) -> PackedTree:
    return replace(p, token_ids=array("i", [t % vocab for t in p.token_ids]))


def workload_samples(vocab: int = 512, preset: str = "tiny", **overrides) -> list[PackedTree]:
    return [fold(p, vocab) for p in packed_samples(preset, **overrides)]


def two_branch_tree(rollout_id: str = "r0") -> PackedTree:
    """Prompt [1 2 5], shared answer [20 21], then branches [22 23] and [30 31 32]::

        tokens    1  2  5 20 21 | 22 23 | 30 31 32
        position  0  1  2  3  4 |  5  6 |  5  6  7
    """
    tokens = [1, 2, 5, 20, 21, 22, 23, 30, 31, 32]
    pos = [0, 1, 2, 3, 4, 5, 6, 5, 6, 7]
    parent = [-1, 0, 1, 2, 3, 4, 5, 4, 7, 8]
    mask = bytes([0, 0, 0, 1, 1, 1, 1, 1, 1, 1])
    n = sum(mask)
    return PackedTree(
        rollout_id=rollout_id, piece=0, n_pieces=1, role="main", token_ids=array("i", tokens),
        position_ids=array("i", pos), parent_index=array("i", parent), loss_mask=mask,
        loss_weights=array("f", [1.0 / n if m else 0.0 for m in mask]),
        behaviour_logprobs=array("f", [-1.5 if m else 0.0 for m in mask]),
        weight_versions=array("i", [0 if m else -1 for m in mask]),
        segments=(Segment(0, 5, -1, 0), Segment(5, 2, 0, 5), Segment(7, 3, 0, 5)),
        branches=(BranchEnd("c1", "main", 6), BranchEnd("c2", "main", 9)),
        n_execution_trained_tokens=n)


def with_behaviour(samples, backend, noise: float = 0.3, seed: int = 0):
    """The samples with behaviour logprobs near the backend's own (some ratios clip)."""
    import torch

    from services.trainer.attention import AttentionConfig
    from services.trainer.batch import tree_batch

    gen = torch.Generator().manual_seed(seed)
    out = []
    for p, adv in samples:
        with torch.no_grad():
            lp = backend.target_logprobs(tree_batch([(p, adv)]), AttentionConfig())
        lp = (lp + noise * torch.randn(lp.shape, generator=gen)).clamp(max=0.0).tolist()
        blp = array("f", p.behaviour_logprobs)
        it = iter(lp)
        for i, m in enumerate(p.loss_mask):
            if m:
                blp[i] = next(it)
        out.append((replace(p, behaviour_logprobs=blp), adv))
    return out
