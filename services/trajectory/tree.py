"""The trajectory tree: one radix (compressed prefix) tree over token ids per rollout.

Every distinct (prefix, token) position is stored once, in a flat *arena* of parallel
arrays (token id, generated-by-the-model flag, behaviour logprob, the temperature that
logprob was taken under, weight version, the call that wrote it). A *node* is a
contiguous run of arena slots with one parent; a node's children are keyed by their
first token. Positions never move: splitting a node
only changes which node owns the slots, so a call's end is kept as an arena index.

Worked example (token ids mean something: 1 = system prompt, 5 = user, 20.. = model)::

    call a: input [1 2 5]           output [20 21]
    call b: parent a, prefix 5, new [6]   output [22]     (extends a: no new branch)
    call c: parent a, prefix 3, new []    output [30]     (retry of a's input)

    root
    └── [1 2 5]               prompt
        ├── [20* 21* 6 22*]   a, then b extends it in place   (* = generated)
        └── [30*]             c

Adding a call costs O(new tokens) plus a walk up the referenced call's path (one step
per branching node above the reference point).
"""

from __future__ import annotations

import hashlib
import math
from array import array
from bisect import bisect_right, insort
from collections.abc import Iterator
from dataclasses import dataclass

from .records import CallRecord

ROOT = 0
# A behaviour logprob above this is not a log-probability (the trainer's validate_sample
# uses the same bound; a little above 0 is float rounding of a near-certain token).
LOGPROB_TOLERANCE = 1e-4


class TreeError(ValueError):
    """A call that cannot be placed in the tree (its reference is unknown or too long):
    the whole call is rejected with the reason."""


@dataclass(frozen=True)
class Placement:
    """Where a call landed: the depth where its new positions start and what it left."""

    call_index: int
    graft_depth: int  # positions below this depth already existed
    new_positions: int
    sibling_call: int | None  # the call whose path this one left at graft_depth, if any
    # why the call's output is context only (never trained), else "": its behaviour
    # logprobs are no log-probabilities, or it has no input to predict the output from
    untrained: str = ""


def untrainable_reason(call: CallRecord) -> str:
    """Why a call's output cannot be trained on ("" when it can). The trainer applies the
    same logprob test to a whole packed sample (services/trainer/batch.py
    validate_sample), where one bad value would reject the execution's every branch."""
    if len(call.output_logprobs) != len(call.output_ids):
        return f"{len(call.output_logprobs)} logprobs for {len(call.output_ids)} output tokens"
    # tested as the tree keeps them, float32: a double past its range (1e-46, 1e39) is 0 or inf there
    if not 0.0 < array("f", [call.logprob_temperature])[0] < float("inf"):
        return f"logprob temperature {call.logprob_temperature} is not > 0 and finite as a float32"
    for j, lp in enumerate(array("f", call.output_logprobs)):
        if not (math.isfinite(lp) and lp <= LOGPROB_TOLERANCE):
            return f"output logprob {j} = {lp} is not a log-probability"
    if call.n_input_tokens == 0:
        return "no input tokens (nothing to predict its output from)"
    return ""


class TrajectoryTree:
    """A radix tree of calls. Build with :meth:`add_call`; read with the query methods."""

    def __init__(self) -> None:
        self.tokens = array("i")
        self.generated = bytearray()
        self.logprobs = array("f")
        self.temperatures = array("f")  # logprob temperature of each generated position, else 1.0
        self.versions = array("i")
        self.origin = array("i")  # call index that wrote (or generated) each position
        self._start: list[int] = [0]
        self._len: list[int] = [0]
        self._depth: list[int] = [0]
        self._parent: list[int] = [-1]
        self._children: list[dict[int, int]] = [{}]
        self._starts: list[int] = []  # sorted arena starts of non-root nodes
        self._node_at: dict[int, int] = {}
        self.calls: list[CallRecord] = []
        self.index: dict[str, int] = {}
        self._end: list[int] = []  # arena index of each call's last token (-1: empty)
        self._n_input: list[int] = []
        self._n_total: list[int] = []
        self.placements: list[Placement] = []
        self._ending_at: dict[int, list[int]] = {}

    # ------------------------------------------------------------------ building

    def add_call(self, call: CallRecord) -> Placement:
        """Merge one call; its parent (if any) must already be in the tree."""
        if call.call_id in self.index:
            raise TreeError(f"call {call.call_id} is already in the tree")
        cursor = self._reference_cursor(call)
        untrained = untrainable_reason(call)
        c = len(self.calls)
        tail = array("i", call.new_input_ids)
        # An untrainable call is still placed, its output as context: the calls that
        # continue it (its children, the rest of the agent's line) keep their place and
        # are trained; only its own output positions are not.
        out_from = len(tail) + (len(call.output_ids) if untrained else 0)
        tail.extend(array("i", call.output_ids))
        versions = call.output_versions()
        node, k, i = self._match(cursor, tail, out_from, call, versions, c)
        graft_depth = call.prefix_len + i
        sibling = None
        if i < len(tail):
            node, sibling = self._open_slot(node, k)
            self._append(node, tail, i, out_from, call, versions, c)
            end = len(self.tokens) - 1
        else:
            end = self._start[node] + k - 1 if node != ROOT else -1
            sibling = self._continuation_owner(node, k)
        self.calls.append(call)
        self.index[call.call_id] = c
        self._end.append(end)
        self._n_input.append(call.n_input_tokens)
        self._n_total.append(call.n_tokens)
        self._ending_at.setdefault(end, []).append(c)
        placement = Placement(c, graft_depth, len(tail) - i, sibling, untrained)
        self.placements.append(placement)
        return placement

    def _reference_cursor(self, call: CallRecord) -> tuple[int, int]:
        if call.parent_call_id is None:
            if call.prefix_len:
                raise TreeError(f"call {call.call_id}: prefix_len {call.prefix_len} without a parent")
            return ROOT, 0
        parent = self.index.get(call.parent_call_id)
        if parent is None:
            raise TreeError(f"call {call.call_id}: unknown parent call {call.parent_call_id}")
        if call.prefix_len > self._n_total[parent]:
            raise TreeError(f"call {call.call_id}: prefix_len {call.prefix_len} exceeds parent's "
                            f"{self._n_total[parent]} tokens")
        return self._locate(parent, call.prefix_len)

    def _locate(self, c: int, depth: int) -> tuple[int, int]:
        """Cursor (node, tokens of node matched) after ``depth`` tokens of call c's path."""
        if depth == 0:
            return ROOT, 0
        node = self.owner(self._end[c])
        while self._depth[node] >= depth:
            node = self._parent[node]
        return node, depth - self._depth[node]

    def _match(self, cursor, tail, out_from, call, versions, c) -> tuple[int, int, int]:
        """Follow existing positions as far as ``tail`` agrees with them."""
        node, k = cursor
        i, n = 0, len(tail)
        while i < n:
            if k < self._len[node]:
                run = self._common_run(self._start[node] + k, self._len[node] - k, tail, i)
                if run == 0:
                    break
                if i + run > out_from:
                    self._mark_generated(self._start[node] + k, i, i + run, out_from, call, versions, c)
                k += run
                i += run
            else:
                child = self._children[node].get(tail[i])
                if child is None:
                    break
                node, k = child, 0
        return node, k, i

    def _common_run(self, pos: int, avail: int, tail: array, i: int) -> int:
        """How many tokens from arena[pos] equal tail[i:], galloping with C-level compares."""
        m = min(avail, len(tail) - i)
        if m == 0 or self.tokens[pos] != tail[i]:
            return 0
        lo, step = 1, 1
        while lo < m:
            hi = min(m, lo + step)
            if self.tokens[pos + lo : pos + hi] == tail[i + lo : i + hi]:
                lo, step = hi, step * 2
                continue
            a, b = lo, hi  # [lo, a) agree; the first disagreement lies in [a, b)
            while b - a > 1:
                mid = (a + b) // 2
                if self.tokens[pos + a : pos + mid] == tail[i + a : i + mid]:
                    a = mid
                else:
                    b = mid
            return a
        return lo

    def _mark_generated(self, pos, i0, i1, out_from, call, versions, c) -> None:
        """Positions this call generated that already existed (e.g. a retry's same words)."""
        for j in range(max(i0, out_from), i1):
            q = pos + (j - i0)
            # The first delivered call to generate a position owns it; an undelivered
            # one (its output never reached the agent) only until a delivered one does.
            if not self.generated[q] or (call.delivered and not self.calls[self.origin[q]].delivered):
                o = j - out_from
                self.generated[q] = 1
                self.logprobs[q] = call.output_logprobs[o]
                self.temperatures[q] = call.logprob_temperature
                self.versions[q] = versions[o]
                self.origin[q] = c

    def _open_slot(self, node: int, k: int) -> tuple[int, int | None]:
        """Make room below cursor (node, k): split the node if the cursor is inside it.

        Returns the node to grow under and the call whose path continues past the
        cursor (the one the new call parts from), if any.
        """
        if k < self._len[node]:
            sibling = self.origin[self._start[node] + k]
            self._split(node, k)
            return node, sibling
        return node, self._continuation_owner(node, k)

    def _continuation_owner(self, node: int, k: int) -> int | None:
        if node != ROOT and k < self._len[node]:
            return self.origin[self._start[node] + k]
        children = self._children[node]
        if not children:
            return None
        first = min(children.values(), key=lambda ch: self._start[ch])
        return self.origin[self._start[first]]

    def _split(self, node: int, k: int) -> int:
        lower = len(self._start)
        self._start.append(self._start[node] + k)
        self._len.append(self._len[node] - k)
        self._depth.append(self._depth[node] + k)
        self._parent.append(node)
        self._children.append(self._children[node])
        for ch in self._children[lower].values():
            self._parent[ch] = lower
        self._len[node] = k
        self._children[node] = {self.tokens[self._start[lower]]: lower}
        insort(self._starts, self._start[lower])
        self._node_at[self._start[lower]] = lower
        return lower

    def _append(self, node, tail, i, out_from, call, versions, c) -> None:
        """Store tail[i:] as new positions below ``node`` (in place when it is the last leaf)."""
        n_new = len(tail) - i
        at = len(self.tokens)
        extend_in_place = (
            node != ROOT
            and not self._children[node]
            and self._start[node] + self._len[node] == at
        )
        if extend_in_place:
            self._len[node] += n_new
        else:
            child = len(self._start)
            self._start.append(at)
            self._len.append(n_new)
            self._depth.append(self._depth[node] + self._len[node])
            self._parent.append(node)
            self._children.append({})
            self._children[node][tail[i]] = child
            self._starts.append(at)  # arena end: stays sorted
            self._node_at[at] = child
        n_in = min(n_new, max(0, out_from - i))
        n_out = n_new - n_in
        o0 = max(0, i - out_from)
        self.tokens.extend(tail[i:])
        self.generated.extend(bytes(n_in) + b"\x01" * n_out)
        self.logprobs.extend(array("f", bytes(4 * n_in)))
        self.logprobs.extend(array("f", call.output_logprobs[o0 : o0 + n_out]))
        self.temperatures.extend(array("f", [1.0]) * n_in)
        self.temperatures.extend(array("f", [call.logprob_temperature]) * n_out)
        self.versions.extend(array("i", [-1]) * n_in)
        self.versions.extend(versions[o0 : o0 + n_out])
        self.origin.extend(array("i", [c]) * n_new)

    # ------------------------------------------------------------------ queries

    def owner(self, ix: int) -> int:
        """The node that holds arena position ``ix``."""
        return self._node_at[self._starts[bisect_right(self._starts, ix) - 1]]

    @property
    def n_stored_tokens(self) -> int:
        return len(self.tokens)

    @property
    def n_nodes(self) -> int:
        return len(self._start) - 1

    def n_flattened_tokens(self) -> int:
        return sum(self._n_total)

    def call_length(self, c: int) -> int:
        return self._n_total[c]

    def call_input_length(self, c: int) -> int:
        return self._n_input[c]

    def call_end(self, c: int) -> int:
        return self._end[c]

    def sequence(self, c: int) -> array:
        """Call c's exact input + output tokens, read back from the tree."""
        return self._gather(self.tokens, c)

    def _gather(self, column: array, c: int) -> array:
        ix = self._end[c]
        if ix < 0:
            return column[:0]
        node = self.owner(ix)
        parts = [column[self._start[node] : ix + 1]]
        node = self._parent[node]
        while node != ROOT:
            parts.append(column[self._start[node] : self._start[node] + self._len[node]])
            node = self._parent[node]
        out = column[:0]
        for part in reversed(parts):
            out.extend(part)
        return out

    def common_prefix_len(self, a: int, b: int) -> int:
        """Length of the longest common token prefix of calls a and b (via their paths)."""
        return self.common_prefix_lens(a, [b])[0]

    def common_prefix_lens(self, a: int, others: list[int]) -> list[int]:
        """:meth:`common_prefix_len` of call a with each of ``others`` (a's path walked once)."""
        ea = self._end[a]
        if ea < 0:
            return [0] * len(others)
        na = self.owner(ea)
        on_a = set()
        node = na
        while node != -1:
            on_a.add(node)
            node = self._parent[node]
        out = []
        for b in others:
            eb = self._end[b]
            if eb < 0:
                out.append(0)
                continue
            nb = node = self.owner(eb)
            while node not in on_a:
                node = self._parent[node]
            if node == ROOT:
                out.append(0)
                continue
            count_a = ea - self._start[node] + 1 if node == na else self._len[node]
            count_b = eb - self._start[node] + 1 if node == nb else self._len[node]
            out.append(self._depth[node] + min(count_a, count_b))
        return out

    def calls_ending_at(self, ix: int) -> list[int]:
        return self._ending_at.get(ix, [])

    def node(self, n: int) -> tuple[int, int, int, int]:
        """(arena start, length, depth of first token, parent node)."""
        return self._start[n], self._len[n], self._depth[n], self._parent[n]

    def children(self, n: int) -> list[int]:
        """Children in canonical order (by first token id), independent of arrival order."""
        kids = self._children[n]
        return [kids[t] for t in sorted(kids)]

    def chains(self, keep=None) -> Iterator[tuple[list[int], int]]:
        """Maximal single-child chains of nodes, in canonical preorder, with their parent chain.

        Chains hide where nodes happen to be split (that depends on arrival order), so
        anything derived from them is canonical. ``keep`` restricts the walk to a set of
        nodes closed under parents (a selected subtree). Yields (nodes, parent chain id),
        chain ids counting from 0 in yield order, -1 for the root.
        """
        def kids(n: int) -> list[int]:
            return [ch for ch in self.children(n) if keep is None or ch in keep]

        stack = [(ch, -1) for ch in reversed(kids(ROOT))]
        next_id = 0
        while stack:
            n, parent_chain = stack.pop()
            nodes = [n]
            below = kids(n)
            while len(below) == 1:
                n = below[0]
                nodes.append(n)
                below = kids(n)
            yield nodes, parent_chain
            stack.extend((ch, next_id) for ch in reversed(below))
            next_id += 1

    @property
    def tempered(self) -> bool:
        """Whether any position's logprob was taken under a temperature other than 1."""
        return self.temperatures.count(1.0) != len(self.temperatures)

    def digest(self) -> str:
        """sha256 of the canonical tree: same calls, same digest, whatever the node ids.

        The temperature column counts only in a tree that has a temperature other than 1
        (a tree without one keeps the digest it had before the column existed)."""
        h = hashlib.sha256(b"gyre-trajectory-tree-v1")
        columns = (self.tokens, self.generated, self.versions, self.logprobs)
        if self.tempered:
            columns += (self.temperatures,)
        for nodes, parent_chain in self.chains():
            runs = [(self._start[n], self._len[n]) for n in nodes]
            h.update(array("q", [self._depth[nodes[0]], parent_chain, sum(ln for _, ln in runs)]).tobytes())
            for column in columns:
                for s, ln in runs:
                    h.update(bytes(column[s : s + ln]) if column is self.generated
                             else column[s : s + ln].tobytes())
        return h.hexdigest()
