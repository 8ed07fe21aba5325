"""Packed trees -> the tensors one forward pass trains on (pure: torch only, no I/O).

A micro-step's samples (packed trees from :mod:`services.trajectory.packing`, each with
its execution's advantage) are laid out in one sequence. Untrained prefixes that several
samples share (a group's system prompt and task) are laid out once
(:func:`~services.trajectory.packing.merge_forest`); everything else keeps its own
segments. A token attends to its own segment up to itself and to its ancestor segments
(:class:`TreeLayout`), so a sample sees only its own tokens and the shared prefix it
starts from, never another sample's. The logits at a token's *parent* predict
it: that is how the last prefix token predicts every child's first token.

Loss data: only positions with ``loss_mask`` 1 are targets, each with the packing's
weight (1/N per execution, shared prefixes counted once) and the temperature its
behaviour logprob was taken under (the backends divide that target's logits by it). The trainer sums weight x
token loss and divides by the number of executions in the whole step, so micro-steps
can be reduced by plain summation. An execution split into pieces of which some were
refused (one piece too stale, say) counts in that number by the share of its trained
tokens the step kept (``TreeBatch.shares``), so its kept tokens weigh what they would
in a whole execution and the others' loss is not diluted.

``branch_batch`` builds the per-branch reference from the same samples: every selected
branch on its own (positions 0..L-1, plain causal attention), each occurrence of a
shared trained token weighted by 1/k (k = selected branches containing it). It is both
the equality proof's reference and the benchmark's flat baseline.
"""

from __future__ import annotations

import math
from array import array
from collections import Counter
from dataclasses import dataclass, field

import torch

from services.trajectory.packing import MergedForest, PackedTree, merge_forest


class BadSample(ValueError):
    """A packed sample whose columns do not agree; the reason says which check failed."""


@dataclass(frozen=True)
class TreeLayout:
    """Who sees whom: token -> segment, and segment -> its ancestors (itself included)."""

    segment_ids: torch.Tensor  # [s] long
    visible: torch.Tensor  # [n_seg, n_seg] bool: visible[a, b] = b is a or an ancestor of a
    segment_starts: torch.Tensor  # [n_seg] long

    @property
    def n_tokens(self) -> int:
        return int(self.segment_ids.numel())


@dataclass(frozen=True)
class TreeBatch:
    input_ids: torch.Tensor  # [s] long
    position_ids: torch.Tensor  # [s] long: depth in the tree
    layout: TreeLayout
    source_index: torch.Tensor  # [t]: the position whose logits predict each target
    target_ids: torch.Tensor  # [t]
    weights: torch.Tensor  # [t] float32: per-execution loss weights
    behaviour_logprobs: torch.Tensor  # [t] float32
    advantages: torch.Tensor  # [t] float32
    executions: tuple[str, ...]  # distinct rollout ids in this batch
    # [t] float32: the temperature each target's behaviour logprob was taken under; the
    # target's logprob is scored from logits / temperature. None: all 1.0 (no division).
    target_temperatures: torch.Tensor | None = None
    # rollout id -> (its trained tokens in this batch, its execution's trained tokens): the
    # share of each execution this batch trains (1 once all its pieces are in)
    shares: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def n_targets(self) -> int:
        return int(self.target_ids.numel())


# ------------------------------------------------------------------------- validation

def validate_sample(p: PackedTree, advantage: float, vocab_size: int | None = None) -> None:
    """Raises :class:`BadSample` when the sample's columns disagree with each other."""
    n = p.n_tokens
    columns = {"position_ids": p.position_ids, "parent_index": p.parent_index, "loss_mask": p.loss_mask,
               "loss_weights": p.loss_weights, "behaviour_logprobs": p.behaviour_logprobs,
               "weight_versions": p.weight_versions, "logprob_temperatures": p.logprob_temperatures}
    for name, col in columns.items():
        if len(col) != n:
            raise BadSample(f"{name} has {len(col)} entries for {n} tokens")
    if n == 0:
        raise BadSample("empty sample")
    if not math.isfinite(advantage):
        raise BadSample(f"advantage {advantage} is not finite")
    if vocab_size is not None and any(t < 0 or t >= vocab_size for t in p.token_ids):
        raise BadSample(f"token id outside the vocabulary [0, {vocab_size})")
    _check_segments(p)
    for i in range(n):
        m, w, lp, temp = p.loss_mask[i], p.loss_weights[i], p.behaviour_logprobs[i], p.logprob_temperatures[i]
        if m not in (0, 1):
            raise BadSample(f"loss_mask[{i}] = {m}, not 0/1")
        if m and (p.parent_index[i] < 0):
            raise BadSample(f"token {i} is trained but has no parent to predict it")
        if not math.isfinite(w) or w < 0 or (w and not m) or (m and not w):
            raise BadSample(f"loss_weights[{i}] = {w} disagrees with loss_mask {m}")
        if m and (not math.isfinite(lp) or lp > 1e-4):
            raise BadSample(f"behaviour_logprobs[{i}] = {lp} is not a log-probability")
        if m and not (math.isfinite(temp) and temp > 0):
            raise BadSample(f"logprob_temperatures[{i}] = {temp} is not a temperature")


def _check_segments(p: PackedTree) -> None:
    expect = 0
    for k, seg in enumerate(p.segments):
        if seg.offset != expect or seg.length <= 0:
            raise BadSample(f"segment {k} does not continue the previous one")
        if not -1 <= seg.parent < k:
            raise BadSample(f"segment {k} has parent {seg.parent}: not an earlier segment")
        first = seg.offset
        if first + seg.length > p.n_tokens:
            raise BadSample(f"segment {k} runs past the {p.n_tokens} tokens")
        want_parent = -1 if seg.parent < 0 else p.segments[seg.parent].offset + p.segments[seg.parent].length - 1
        if p.parent_index[first] != want_parent:
            raise BadSample(f"segment {k}'s first token has parent {p.parent_index[first]}, not {want_parent}")
        for i in range(first, first + seg.length):
            if i > first and p.parent_index[i] != i - 1:
                raise BadSample(f"token {i}'s parent is {p.parent_index[i]}, not {i - 1}")
            par = p.parent_index[i]
            want_pos = 0 if par < 0 else p.position_ids[par] + 1
            if par < 0 and seg.depth != p.position_ids[i]:
                raise BadSample(f"root token {i} has position {p.position_ids[i]}, segment depth {seg.depth}")
            if par >= 0 and p.position_ids[i] != want_pos:
                raise BadSample(f"position_ids[{i}] = {p.position_ids[i]}, not its parent's + 1")
        if p.position_ids[first] != seg.depth:
            raise BadSample(f"segment {k} has depth {seg.depth}, its first token position {p.position_ids[first]}")
        expect = first + seg.length
    if expect != p.n_tokens:
        raise BadSample(f"segments cover {expect} of {p.n_tokens} tokens")


# ------------------------------------------------------------------------- tree batch

def tree_batch(samples: list[tuple[PackedTree, float]], *, merge: bool = True) -> TreeBatch:
    """All samples in one sequence (validate them first).

    With ``merge`` (the default) the samples' shared untrained prefixes are laid out once
    (:func:`~services.trajectory.packing.merge_forest`: a group's common system prompt and
    task); the loss is the same either way, since trained tokens are never merged.
    ``merge=False`` lays the trees side by side.
    """
    trees = [p for p, _ in samples]
    forest = merge_forest(trees) if merge else _side_by_side(trees)
    n_seg = len(forest.segment_starts)
    ends = list(forest.segment_starts[1:]) + [forest.n_tokens]
    seg_of: list[int] = []
    for s in range(n_seg):
        seg_of.extend([s] * (ends[s] - forest.segment_starts[s]))
    src, tgt, w, blp, adv, temp = [], [], [], [], [], []
    for (p, advantage), index in zip(samples, forest.index):
        for i in range(p.n_tokens):
            if p.loss_mask[i]:
                src.append(index[p.parent_index[i]])
                tgt.append(p.token_ids[i])
                w.append(p.loss_weights[i])
                blp.append(p.behaviour_logprobs[i])
                adv.append(advantage)
                temp.append(p.logprob_temperatures[i])
    layout = _layout(seg_of, list(forest.segment_parents), list(forest.segment_starts))
    return _assemble(list(forest.token_ids), list(forest.position_ids), layout, src, tgt, w, blp, adv, temp,
                     samples)


def _side_by_side(trees: list[PackedTree]) -> MergedForest:
    """The trees one after another, each keeping its own segments (nothing merged)."""
    tok, pos, starts, parents, index = array("i"), array("i"), array("i"), array("i"), []
    for p in trees:
        offset, base = len(tok), len(starts)
        for seg in p.segments:
            starts.append(offset + seg.offset)
            parents.append(base + seg.parent if seg.parent >= 0 else -1)
        tok.extend(p.token_ids)
        pos.extend(p.position_ids)
        index.append(array("i", range(offset, offset + p.n_tokens)))
    return MergedForest(tok, pos, starts, parents, tuple(index))


def branch_batch(samples: list[tuple[PackedTree, float]]) -> TreeBatch:
    """Every selected branch on its own, shared trained tokens weighted 1/k."""
    tok, pos, seg_of, starts = [], [], [], []
    src, tgt, w, blp, adv, temp = [], [], [], [], [], []
    for p, advantage in samples:
        paths = [_path(p, b.last_token) for b in p.branches]
        k = Counter(i for path in paths for i in path)
        for path in paths:
            offset = len(tok)
            starts.append(offset)
            seg_of.extend([len(starts) - 1] * len(path))
            for j, i in enumerate(path):
                tok.append(p.token_ids[i])
                pos.append(j)
                if p.loss_mask[i]:
                    src.append(offset + j - 1)
                    tgt.append(p.token_ids[i])
                    w.append(p.loss_weights[i] / k[i])
                    blp.append(p.behaviour_logprobs[i])
                    adv.append(advantage)
                    temp.append(p.logprob_temperatures[i])
    layout = _layout(seg_of, [-1] * len(starts), starts)
    return _assemble(tok, pos, layout, src, tgt, w, blp, adv, temp, samples)


def _path(p: PackedTree, last: int) -> list[int]:
    out = []
    while last != -1:
        out.append(last)
        last = p.parent_index[last]
    return out[::-1]


def _layout(seg_of: list[int], parents: list[int], starts: list[int]) -> TreeLayout:
    n = len(parents)
    visible = torch.zeros(n, n, dtype=torch.bool)
    for s in range(n):  # parents come first, so their rows are complete
        if parents[s] >= 0:
            visible[s] = visible[parents[s]]
        visible[s, s] = True
    return TreeLayout(torch.tensor(seg_of, dtype=torch.long), visible, torch.tensor(starts, dtype=torch.long))


def _assemble(tok, pos, layout, src, tgt, w, blp, adv, temp, samples) -> TreeBatch:
    executions = tuple(dict.fromkeys(p.rollout_id for p, _ in samples))
    shares: dict[str, tuple[int, int]] = {}
    for p, _ in samples:
        kept, _n = shares.get(p.rollout_id, (0, 0))
        shares[p.rollout_id] = (kept + sum(1 for m in p.loss_mask if m), int(p.n_execution_trained_tokens))
    tempered = any(t != 1.0 for t in temp)
    return TreeBatch(
        input_ids=torch.tensor(tok, dtype=torch.long), position_ids=torch.tensor(pos, dtype=torch.long),
        layout=layout, source_index=torch.tensor(src, dtype=torch.long),
        target_ids=torch.tensor(tgt, dtype=torch.long), weights=torch.tensor(w, dtype=torch.float32),
        behaviour_logprobs=torch.tensor(blp, dtype=torch.float32),
        advantages=torch.tensor(adv, dtype=torch.float32), executions=executions,
        target_temperatures=torch.tensor(temp, dtype=torch.float32) if tempered else None, shares=shares)
