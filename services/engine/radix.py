"""A radix (compressed prefix) tree over token ids, with LRU eviction under a token cap (pure).

Each edge holds a run of token ids and an opaque value for exactly those tokens (the engine
stores their KV tensors there; this module never looks inside). The tree needs two things
from its owner: how to cut a value in two when an edge is split, and nothing else. Memory is
counted in tokens: after an insert, least-recently-used leaves are dropped until the tree
holds at most ``capacity_tokens``.

Worked example (values are the token runs themselves)::

    tree.insert([1, 2, 3, 4], lambda s, e: ...)   # root -[1,2,3,4]
    tree.insert([1, 2, 9], ...)                   # root -[1,2]- {[3,4], [9]}
    tree.match([1, 2, 3, 7])  -> (3, [v12, v3])   # v3: the first token of the [3,4] edge
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Callable, Generic, Sequence, TypeVar

V = TypeVar("V")
SplitValue = Callable[[V, int], "tuple[V, V]"]
MakeValue = Callable[[int, int], V]


@dataclass(eq=False)
class _Node(Generic[V]):
    key: tuple[int, ...]
    value: V | None
    parent: "_Node[V] | None"
    children: dict[int, "_Node[V]"] = field(default_factory=dict)
    last_access: int = 0


class RadixCache(Generic[V]):
    def __init__(self, capacity_tokens: int, split_value: SplitValue) -> None:
        self.capacity_tokens = capacity_tokens
        self._split_value = split_value
        self._root: _Node[V] = _Node(key=(), value=None, parent=None)
        self._clock = itertools.count(1)
        self.total_tokens = 0

    # -- queries ---------------------------------------------------------------------
    def match(self, tokens: Sequence[int], limit: int | None = None) -> tuple[int, list[V]]:
        """Longest cached prefix of ``tokens`` (at most ``limit`` long) and its values.

        A partly matched edge contributes the matching head of its value (the edge is split
        so the returned values cover exactly the matched tokens).
        """
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        node, pos, values = self._root, 0, []
        now = next(self._clock)
        while pos < limit:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            shared = _common_length(child.key, tokens, pos, limit)
            if shared < len(child.key):
                if shared == 0:
                    break
                child = self._split(child, shared)
            child.last_access = now
            values.append(child.value)
            pos += shared
            node = child
        return pos, values

    def held(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of ``tokens`` the tree holds (changes nothing: no split, no LRU touch)."""
        node, pos = self._root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            shared = _common_length(child.key, tokens, pos, len(tokens))
            pos += shared
            if shared < len(child.key):
                break
            node = child
        return pos

    def node_count(self) -> int:
        return sum(1 for _ in self._walk()) - 1

    # -- changes ---------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], make_value: MakeValue) -> int:
        """Adds ``tokens``; ``make_value(start, end)`` gives the value of a new run.

        Returns how many tokens were new. Evicts LRU leaves afterwards if over the cap.
        """
        node, pos = self._root, 0
        now = next(self._clock)
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                new = _Node(key=tuple(tokens[pos:]), value=make_value(pos, len(tokens)), parent=node)
                new.last_access = now
                node.children[tokens[pos]] = new
                self.total_tokens += len(new.key)
                added = len(new.key)
                self.evict(self.capacity_tokens)
                return added
            shared = _common_length(child.key, tokens, pos, len(tokens))
            if shared < len(child.key):
                child = self._split(child, shared)
            child.last_access = now
            pos += shared
            node = child
        return 0

    def evict(self, keep_tokens: int) -> int:
        """Drops least-recently-used leaves until at most ``keep_tokens`` remain."""
        if self.total_tokens <= keep_tokens:
            return 0
        heap = [(n.last_access, id(n), n) for n in self._walk() if n is not self._root and not n.children]
        heapq.heapify(heap)
        freed = 0
        while heap and self.total_tokens > keep_tokens:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            self.total_tokens -= len(leaf.key)
            freed += len(leaf.key)
            if parent is not self._root and not parent.children:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def clear(self) -> None:
        self._root.children.clear()
        self.total_tokens = 0

    # -- helpers ---------------------------------------------------------------------
    def _split(self, node: _Node[V], at: int) -> _Node[V]:
        """Cuts ``node``'s edge after ``at`` tokens; returns the new upper node."""
        assert node.parent is not None and 0 < at < len(node.key)
        head_value, tail_value = self._split_value(node.value, at)
        upper = _Node(key=node.key[:at], value=head_value, parent=node.parent, last_access=node.last_access)
        node.parent.children[upper.key[0]] = upper
        node.key, node.value, node.parent = node.key[at:], tail_value, upper
        upper.children[node.key[0]] = node
        return upper

    def _walk(self):
        stack = [self._root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def _common_length(key: tuple[int, ...], tokens: Sequence[int], start: int, stop: int) -> int:
    n = min(len(key), stop - start)
    i = 0
    while i < n and key[i] == tokens[start + i]:
        i += 1
    return i
