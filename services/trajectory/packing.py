"""Loss data and packing: selected branches -> compact trees for tree-attention training.

The selected branches of one rollout (one *execution*) form a subtree. It is laid out as
one sequence in canonical depth-first order, as *segments* (maximal runs without a
fork), each with a parent segment. Position ids are depths in the tree; a token sees its
own segment up to itself and every ancestor segment, nothing else. Since ancestors come
first in depth-first order, that is a subset of a causal mask, and the trainer can
expand it per block from the segments without a dense s x s mask.

Example: selected branches [1 2 5 20 21] and [1 2 5 30] pack as::

    tokens    1  2  5 | 20 21 | 30        segments: 0 = [0,3) parent -1
    position  0  1  2 |  3  4 |  3                  1 = [3,5) parent 0
    parent   -1  0  1 |  2  3 |  2                  2 = [5,6) parent 0

Loss data: only model-generated positions are trained (mask 1); prompts, templates and
tool outputs are masked. Each trained position appears once however many selected
branches share it, and carries weight 1/N, N = the execution's trained positions, so an
execution's loss is the mean over its own unique generated tokens; the trainer sums
weight x token loss and divides by the number of executions in the step (an execution
with no trained position gets weight 0 everywhere and is not queued: ``ledger.py``).

A subtree longer than ``max_piece_tokens`` is split into pieces along segment
boundaries; a piece repeats the ancestor segments it needs as *context* (masked, weight
0: they are trained in the piece where they first appear). ``n_context_tokens`` reports
the duplication. A root-to-leaf path longer than the budget cannot be split this way:
the budget is then raised to the longest path (splitting finer would only repeat more
context), a branch shorter than the context it would repeat is kept in its piece, and
pieces over the asked budget are marked ``oversize``.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from .records import ROLE_PRIORITY, BranchRole
from .sampling import Branch
from .tree import TrajectoryTree


@dataclass(frozen=True)
class PackingConfig:
    max_piece_tokens: int | None = None  # None: one piece per execution
    train_undelivered: bool = False  # outputs the agent never received are not trained


@dataclass(frozen=True)
class Segment:
    offset: int  # index of its first token in the packed sequence
    length: int
    parent: int  # segment index; -1 at the root
    depth: int  # position id of its first token
    context: bool = False  # repeated ancestor context: not trained in this piece


@dataclass(frozen=True)
class BranchEnd:
    call_id: str
    role: BranchRole
    last_token: int  # packed index of the branch's last token


@dataclass(frozen=True, eq=False)
class PackedTree:
    """One piece of one execution's selected subtree, ready for the trainer."""

    rollout_id: str
    piece: int
    n_pieces: int
    role: BranchRole  # best role among the branches it trains
    token_ids: array  # 'i'
    position_ids: array  # 'i'
    parent_index: array  # 'i': packed index of each token's parent, -1 at the root
    loss_mask: bytes  # 1 = trained here
    loss_weights: array  # 'f': 1 / n_execution_trained_tokens where trained, else 0
    behaviour_logprobs: array  # 'f': the proxy's logprobs (0 where not generated)
    weight_versions: array  # 'i': version that generated the token, -1 if not generated
    segments: tuple[Segment, ...]
    branches: tuple[BranchEnd, ...]
    n_execution_trained_tokens: int
    oversize: bool = False
    # 'f': the temperature each behaviour logprob was taken under (the trainer divides its
    # logits by it); 1.0 where not generated. None (the default): all 1.0.
    logprob_temperatures: array | None = None

    def __post_init__(self) -> None:
        if self.logprob_temperatures is None:
            object.__setattr__(self, "logprob_temperatures", array("f", [1.0]) * len(self.token_ids))

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tempered(self) -> bool:
        """Whether any logprob was taken under a temperature other than 1."""
        return self.logprob_temperatures.count(1.0) != len(self.logprob_temperatures)

    @property
    def n_trained_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def n_context_tokens(self) -> int:
        return sum(s.length for s in self.segments if s.context)


@dataclass
class _Chain:
    runs: list[tuple[int, int]]  # (arena start, kept length) per tree node
    parent: int
    length: int
    depth: int
    best_role: int = len(ROLE_PRIORITY)


def pack_branches(
    tree: TrajectoryTree, selected: list[Branch], config: PackingConfig = PackingConfig()
) -> list[PackedTree]:
    """Pack one execution's selected branches into one or more pieces."""
    if not selected:
        return []
    kept = _kept_lengths(tree, selected)
    chains, where = [], {}
    for nodes, parent in tree.chains(kept):
        runs, offset = [], 0
        for n in nodes:
            where[n] = (len(chains), offset)
            runs.append((tree.node(n)[0], kept[n]))
            offset += kept[n]
        chains.append(_Chain(runs, parent, offset, tree.node(nodes[0])[2]))
    ends = []  # (chain, offset in chain) of each selected branch's last token
    for b in selected:
        n = tree.owner(b.end)
        chain, offset = where[n]
        ends.append((chain, offset + b.end - tree.node(n)[0]))
        i = chain
        while i != -1:
            chains[i].best_role = min(chains[i].best_role, ROLE_PRIORITY.index(b.role))
            i = chains[i].parent
    undelivered = set() if config.train_undelivered else {
        c for c, call in enumerate(tree.calls) if not call.delivered
    }
    masks = [_trained_mask(tree, ch, undelivered) for ch in chains]
    n_trained = sum(sum(m) for m in masks)
    plan = _plan_pieces(chains, config.max_piece_tokens)
    return [
        _build_piece(tree, chains, masks, entries, selected, ends, k, len(plan), n_trained, config)
        for k, entries in enumerate(plan)
    ]


def _kept_lengths(tree: TrajectoryTree, selected: list[Branch]) -> dict[int, int]:
    """How many leading tokens of each node the selected branches cover."""
    kept: dict[int, int] = {}
    for b in selected:
        n = tree.owner(b.end)
        start, length, _, parent = tree.node(n)
        kept[n] = max(kept.get(n, 0), b.end - start + 1)
        n = parent
        while n > 0 and kept.get(n) != tree.node(n)[1]:
            kept[n] = tree.node(n)[1]
            n = tree.node(n)[3]
    return kept


def _trained_mask(tree: TrajectoryTree, chain: _Chain, undelivered: set[int]) -> bytes:
    parts = []
    for s, ln in chain.runs:
        gen = bytes(tree.generated[s : s + ln])
        if undelivered and any(gen):
            gen = bytes(g and tree.origin[s + j] not in undelivered for j, g in enumerate(gen))
        parts.append(gen)
    return b"".join(parts)


def _plan_pieces(chains: list[_Chain], budget: int | None) -> list[list[tuple[int, bool]]]:
    """Split top-down into pieces of (chain index, is context) entries.

    Whole sibling subtrees are packed together under one copy of their common context;
    a subtree too big for a piece keeps its own chain in the first piece of its children
    and is context for the others. The budget is raised to the longest root-to-leaf
    path (a piece must hold a whole path), and a subtree smaller than the context it
    would have to repeat is not moved out (that would add work, not save memory).
    """
    if not budget:
        return [[(i, False) for i in range(len(chains))]]
    budget = max(budget, max(ch.depth + ch.length for ch in chains))
    children: dict[int, list[int]] = {-1: []}
    for i, ch in enumerate(chains):
        children.setdefault(i, [])
        children[ch.parent].append(i)
    size = [ch.length for ch in chains]
    span = [1] * len(chains)  # chains in the subtree: preorder makes it a contiguous range
    for i in range(len(chains) - 1, -1, -1):
        for c in children[i]:
            size[i] += size[c]
            span[i] += span[c]
    planner = _Planner(chains, children, size, span, budget)
    planner.place(children[-1], [])
    return planner.pieces


@dataclass
class _Planner:
    chains: list[_Chain]
    children: dict[int, list[int]]
    size: list[int]
    span: list[int]
    budget: int
    pieces: list[list[tuple[int, bool]]] = field(default_factory=list)

    def place(self, roots: list[int], context: list[int], carry: tuple[list[int], int] = ([], 0)) -> None:
        """Bin the subtrees under ``roots`` into pieces that repeat ``context``;
        ``carry`` (chains, tokens) are subtrees of an outer level riding along."""
        base = sum(self.chains[c].length for c in context)
        own, used = list(carry[0]), base + carry[1]
        for r in roots:
            # Moving a subtree smaller than the context it would repeat adds more work
            # than it takes off this piece: it stays, even over the budget.
            if used + self.size[r] <= self.budget or (own and base > self.size[r]):
                own.extend(range(r, r + self.span[r]))
                used += self.size[r]
            elif base + self.size[r] <= self.budget:
                self._emit(context, own)
                own, used = list(range(r, r + self.span[r])), base + self.size[r]
            else:  # r's subtree alone is too big: split below r
                ride = (own, used - base)
                if used + self.chains[r].length > self.budget:
                    self._emit(context, own)
                    ride = ([], 0)
                first = len(self.pieces)
                self.place(self.children[r], context + [r], ride)
                piece = self.pieces[first]  # r is trained in the first piece below it
                self.pieces[first] = [(c, ctx and c != r) for c, ctx in piece]
                own, used = [], base
        self._emit(context, own)

    def _emit(self, context: list[int], own: list[int]) -> None:
        if own:
            self.pieces.append([(c, True) for c in context] + [(c, False) for c in own])


def _build_piece(tree, chains, masks, entries, selected, ends, k, n_pieces, n_trained, config):
    cols = {name: array(code) for name, code in (
        ("tok", "i"), ("pos", "i"), ("par", "i"), ("w", "f"), ("lp", "f"), ("temp", "f"), ("ver", "i"))}
    mask = bytearray()
    segments: list[Segment] = []
    local: dict[int, int] = {}
    weight = 1.0 / n_trained if n_trained else 0.0
    for chain_index, is_context in entries:
        ch = chains[chain_index]
        offset = len(cols["tok"])
        parent = local.get(ch.parent, -1)
        local[chain_index] = len(segments)
        segments.append(Segment(offset, ch.length, parent, ch.depth, is_context))
        for s, ln in ch.runs:
            cols["tok"].extend(tree.tokens[s : s + ln])
            cols["lp"].extend(tree.logprobs[s : s + ln])
            cols["temp"].extend(tree.temperatures[s : s + ln])
            cols["ver"].extend(tree.versions[s : s + ln])
        cols["pos"].extend(array("i", range(ch.depth, ch.depth + ch.length)))
        first_parent = segments[parent].offset + segments[parent].length - 1 if parent >= 0 else -1
        cols["par"].append(first_parent)
        cols["par"].extend(array("i", range(offset, offset + ch.length - 1)))
        seg_mask = bytes(ch.length) if is_context else masks[chain_index]
        mask.extend(seg_mask)
        cols["w"].extend(array("f", [weight if m else 0.0 for m in seg_mask]))
    own = {c for c, ctx in entries if not ctx}
    branch_ends = tuple(
        BranchEnd(b.call_id, b.role, segments[local[chain]].offset + offset)
        for b, (chain, offset) in zip(selected, ends)
        if chain in own
    )
    best = min(chains[c].best_role for c in own)
    oversize = bool(config.max_piece_tokens) and len(cols["tok"]) > config.max_piece_tokens
    return PackedTree(
        rollout_id=selected[0].rollout_id, piece=k, n_pieces=n_pieces, role=ROLE_PRIORITY[best],
        token_ids=cols["tok"], position_ids=cols["pos"], parent_index=cols["par"],
        loss_mask=bytes(mask), loss_weights=cols["w"], behaviour_logprobs=cols["lp"],
        weight_versions=cols["ver"], segments=tuple(segments), branches=branch_ends,
        n_execution_trained_tokens=n_trained, oversize=oversize, logprob_temperatures=cols["temp"],
    )


# ---------------------------------------------------------------- reading a packed tree

def branch_tokens(packed: PackedTree, last_token: int) -> list[int]:
    """Read one branch back: the tokens from the root to ``last_token``, via parents."""
    out: list[int] = []
    i = last_token
    while i != -1:
        out.append(packed.token_ids[i])
        i = packed.parent_index[i]
    out.reverse()
    return out


def segment_ancestors(packed: PackedTree) -> list[tuple[int, ...]]:
    """For each segment, its ancestor segments (root first): what its tokens attend to."""
    out: list[tuple[int, ...]] = []
    for seg in packed.segments:
        out.append(out[seg.parent] + (seg.parent,) if seg.parent >= 0 else ())
    return out


def dense_mask(packed: PackedTree) -> list[list[bool]]:
    """The full s x s ancestor mask; for tests and small trees only."""
    n = packed.n_tokens
    rows = []
    for q in range(n):
        row = [False] * n
        i = q
        while i != -1:
            row[i] = True
            i = packed.parent_index[i]
        rows.append(row)
    return rows


# ------------------------------------------------------------ merging a micro-step's trees

@dataclass(frozen=True, eq=False)
class MergedForest:
    """Several packed trees laid out as one forest whose shared untrained prefixes appear once.

    The rollouts of one group start with the same system prompt and task. When such
    samples share a micro-step, the trainer computes each shared run once: a segment's
    leading run of *untrained* tokens is merged, radix-tree style, with the runs of the
    same ids at the same positions under the same (merged) parent. Trained tokens, and
    whatever follows them in their segment, stay the tree's own, so each trained token
    keeps its tree's weight, behaviour logprob (and its temperature) and advantage, and the loss is the
    unmerged loss. (Context that split pieces repeat is trained in its first piece: only
    its untrained leading run, such as the system prompt, merges with that piece.)

    ``segment_starts`` / ``segment_parents`` describe the merged segments (ancestors
    first); ``index[k][i]`` is where token ``i`` of tree ``k`` lies.
    """

    token_ids: array  # 'i'
    position_ids: array  # 'i'
    segment_starts: array  # 'i'
    segment_parents: array  # 'i': -1 at a root
    index: tuple[array, ...]  # per tree: 'i', merged position of each of its tokens

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def n_segments(self) -> int:
        return len(self.segment_starts)


class _Node:
    __slots__ = ("tree", "start", "length", "parent", "depth", "children")

    def __init__(self, tree: int, start: int, length: int, parent: int, depth: int) -> None:
        self.tree, self.start, self.length = tree, start, length
        self.parent, self.depth = parent, depth
        self.children: list[int] = []


class ForestBuilder:
    """Adds packed trees one at a time to a merged forest (see :class:`MergedForest`);
    ``n_tokens`` is the merged size so far, ``build()`` lays it out."""

    def __init__(self) -> None:
        self.trees: list[PackedTree] = []
        self.n_tokens = 0
        self._nodes: list[_Node] = []
        self._roots: list[int] = []
        self._shared: dict[tuple[int, int, int], int] = {}  # (parent or -1, depth, first token) -> node
        self._ends: list[list[int]] = []  # per tree, per segment: the node holding its last token
        self._raw: list[bytes] = []

    def add(self, t: PackedTree) -> int:
        """Merge one more tree in; returns the merged size."""
        k = len(self.trees)
        self.trees.append(t)
        self._raw.append(t.token_ids.tobytes())
        seg_end: list[int] = []
        for seg in t.segments:
            parent = seg_end[seg.parent] if seg.parent >= 0 else -1
            i, stop = seg.offset, seg.offset + seg.length
            depth = t.position_ids[i]
            untrained = t.loss_mask.find(1, i, stop)
            untrained = stop if untrained < 0 else untrained
            while i < untrained:  # the leading untrained run: shared where it matches
                key = (parent, depth, t.token_ids[i])
                child = self._shared.get(key)
                if child is None:
                    child = self._new(k, i, untrained - i, parent, depth)
                    self._shared[key] = child
                    parent, depth, i = child, depth + untrained - i, untrained
                    break
                c = self._nodes[child]
                m = _common_prefix_len(self._raw[c.tree], c.start, self._raw[k], i, min(c.length, untrained - i))
                if m < c.length:
                    child = self._split(child, key, m)
                parent, depth, i = child, depth + m, i + m
            if i < stop:  # the trained rest (and anything after it) is this tree's own
                parent = self._new(k, i, stop - i, parent, depth)
            seg_end.append(parent)
        self._ends.append(seg_end)
        return self.n_tokens

    def _new(self, tree: int, start: int, length: int, parent: int, depth: int) -> int:
        node = len(self._nodes)
        self._nodes.append(_Node(tree, start, length, parent, depth))
        (self._nodes[parent].children if parent >= 0 else self._roots).append(node)
        self.n_tokens += length
        return node

    def _split(self, child: int, key: tuple[int, int, int], m: int) -> int:
        """A new head node takes ``child``'s first ``m`` tokens; ``child`` keeps the tail
        (so what ends at or hangs below it stays where it was)."""
        c = self._nodes[child]
        head = len(self._nodes)
        self._nodes.append(_Node(c.tree, c.start, m, c.parent, c.depth))
        siblings = self._nodes[c.parent].children if c.parent >= 0 else self._roots
        siblings[siblings.index(child)] = head
        self._shared[key] = head
        c.start, c.length, c.parent, c.depth = c.start + m, c.length - m, head, c.depth + m
        self._nodes[head].children.append(child)
        self._shared[(head, c.depth, self.trees[c.tree].token_ids[c.start])] = child
        return head

    def build(self) -> MergedForest:
        return _lay_out(self.trees, self._nodes, self._roots, self._ends)


def merge_forest(trees: list[PackedTree]) -> MergedForest:
    """Lay ``trees`` out as one forest, each shared untrained prefix once (see MergedForest)."""
    builder = ForestBuilder()
    for t in trees:
        builder.add(t)
    return builder.build()


def plan_micro_steps(trees: list[PackedTree], budget: int | None) -> list[tuple[list[int], int]]:
    """Fill micro-steps in order: (indices into ``trees``, merged token count) per
    micro-step. A tree joins the current micro-step while the merged size stays within
    ``budget`` (None: no limit); a bigger tree gets its own."""
    plans: list[tuple[list[int], int]] = []
    members: list[int] = []
    builder = ForestBuilder()
    for k, tree in enumerate(trees):
        before = builder.n_tokens
        builder.add(tree)
        if members and budget is not None and builder.n_tokens > budget:  # it does not fit: close
            plans.append((members, before))
            members, builder = [], ForestBuilder()
            builder.add(tree)
        members.append(k)
    if members:
        plans.append((members, builder.n_tokens))
    return plans


def _common_prefix_len(a: bytes, a_start: int, b: bytes, b_start: int, n: int) -> int:
    """Common leading int32 tokens of a[a_start:] and b[b_start:], at most ``n``."""
    return common_prefix_bytes(a[4 * a_start : 4 * (a_start + n)], b[4 * b_start : 4 * (b_start + n)]) // 4


def common_prefix_bytes(a: bytes, b: bytes) -> int:
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:  # a[:lo] == b[:lo], a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _lay_out(trees, nodes, roots, ends) -> MergedForest:
    tok, pos, starts, parents = array("i"), array("i"), array("i"), array("i")
    where = [0] * len(nodes)  # node -> merged segment
    stack = list(reversed(roots))
    while stack:  # depth-first, ancestors first
        n = stack.pop()
        node = nodes[n]
        where[n] = len(starts)
        starts.append(len(tok))
        parents.append(where[node.parent] if node.parent >= 0 else -1)
        src = trees[node.tree].token_ids
        tok.extend(src[node.start : node.start + node.length])
        pos.extend(array("i", range(node.depth, node.depth + node.length)))
        stack.extend(reversed(node.children))
    index = []
    for k, t in enumerate(trees):
        out = array("i", bytes(4 * t.n_tokens))
        for s, seg in enumerate(t.segments):
            stop_at = ends[k][seg.parent] if seg.parent >= 0 else -1
            path, n = [], ends[k][s]
            while n != stop_at:
                path.append(n)
                n = nodes[n].parent
            i = seg.offset
            for n in reversed(path):
                first = starts[where[n]]
                out[i : i + nodes[n].length] = array("i", range(first, first + nodes[n].length))
                i += nodes[n].length
            if i != seg.offset + seg.length:
                raise AssertionError(f"merge_forest: tree {k} segment {s} maps {i - seg.offset} of {seg.length} tokens")
        index.append(out)
    return MergedForest(tok, pos, starts, parents, tuple(index))
