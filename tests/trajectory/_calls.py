"""Helpers for the trajectory tests: calls built by hand with token ids that mean something.

Nothing is faked here: the core is pure, so the tests drive it with call records
directly. Token ids used across the tests:

    1  <|im_start|>        2  <|im_end|>          3  tool-result header
    10 main system prompt  11 task prompt          12 sub-agent system prompt
    7  compaction instruction (7 71 72 73)          8  post-compaction header (8 81 82)
    20-69 words the model writes                    90-99 tool output

Set GYRE_SHOW_TREES=1 to print every tree a test renders (``pytest -s``).
"""

from __future__ import annotations

import os
import random

from services.trajectory.forks import CallLabel
from services.trajectory.records import CallHints, CallRecord
from services.trajectory.render import render_tree
from services.trajectory.tree import TrajectoryTree

SYSTEM = [1, 10, 10, 10, 2]
TASK = [1, 11, 11, 2]
SUB_SYSTEM = [1, 12, 12, 2]
COMPACT = [7, 71, 72, 73]
CONTINUE = [8, 81, 82]
MAIN_HINTS = CallHints(system_digest="5" * 64, tools_digest="7" * 64)


def logprob_at(depth: int, token: int) -> float:
    """A behaviour logprob that depends only on the position, so writers agree."""
    return -((token * 7 + depth) % 13) / 10.0 - 0.01


def call(call_id, new_input, output, *, parent=None, prefix=0, rollout="r1", hints=MAIN_HINTS,
         delivered=True, version=0, logprobs=None, **kw) -> CallRecord:
    start = prefix + len(new_input)
    lps = logprobs if logprobs is not None else [logprob_at(start + j, t) for j, t in enumerate(output)]
    return CallRecord(call_id=call_id, rollout_id=rollout, new_input_ids=list(new_input),
                      output_ids=list(output), output_logprobs=lps, parent_call_id=parent,
                      prefix_len=prefix, delivered=delivered, weight_version=version,
                      hints=hints, **kw)


def full_sequences(calls: list[CallRecord]) -> dict[str, list[int]]:
    """Every call's input + output, rebuilt from the records alone (no tree)."""
    seqs: dict[str, list[int]] = {}
    for c in calls:
        head = seqs[c.parent_call_id][: c.prefix_len] if c.parent_call_id else []
        seqs[c.call_id] = head + list(c.new_input_ids) + list(c.output_ids)
    return seqs


def brute_force_positions(calls: list[CallRecord]) -> set[tuple[int, ...]]:
    out = set()
    for seq in full_sequences(calls).values():
        for k in range(1, len(seq) + 1):
            out.add(tuple(seq[:k]))
    return out


def build(calls: list[CallRecord]) -> TrajectoryTree:
    tree = TrajectoryTree()
    for c in calls:
        tree.add_call(c)
    return tree


def random_calls(seed: int, n_calls: int = 30, vocab: int = 6, rollout: str = "r1") -> list[CallRecord]:
    """A random tree: calls reference random earlier calls at random prefix lengths; a
    small vocabulary makes new tokens often coincide with existing positions."""
    rng = random.Random(seed)
    calls: list[CallRecord] = []
    seqs: dict[str, list[int]] = {}
    for i in range(n_calls):
        parent = rng.choice(calls) if calls and rng.random() < 0.85 else None
        base = seqs[parent.call_id] if parent else []
        prefix = rng.choice([len(base), len(base), rng.randint(0, len(base))]) if parent else 0
        new_input = [rng.randint(1, vocab) for _ in range(rng.randint(0, 4))]
        if parent and rng.random() < 0.2:
            new_input = base[prefix : prefix + rng.randint(0, 3)]  # re-sends existing tokens
        if not prefix and not new_input:
            new_input = [1]  # a call has input (the tree rejects one without); no draw: seeds keep their trees
        output = [20 + rng.randint(0, vocab) for _ in range(rng.randint(1, 5))]
        agent = rng.choice([None, None, "a1", "a2"])
        hints = CallHints(agent_id=agent, system_digest=("s" if agent is None else "u") * 64,
                          tools_digest="t" * 64)
        c = call(f"c{i}", new_input, output, parent=parent.call_id if parent else None,
                 prefix=prefix, rollout=rollout, hints=hints,
                 delivered=rng.random() > 0.15)
        calls.append(c)
        seqs[c.call_id] = base[:prefix] + new_input + output
    return calls


def show(tree: TrajectoryTree, labels: list[CallLabel], selected=None, title: str = "") -> str:
    text = render_tree(tree, labels, selected, title=title, show_tokens=True, max_tokens=40)
    if os.environ.get("GYRE_SHOW_TREES"):
        print("\n" + text)
    return text


class Recorder:
    """Records calls the way the proxy does: a reference to the latest call whose
    input + output is a prefix of the new input, plus the new tokens."""

    def __init__(self, rollout: str = "r1") -> None:
        self.rollout = rollout
        self.calls: list[CallRecord] = []
        self.sequences: dict[str, list[int]] = {}

    def record(self, history, output, refs, hints, *, delivered=True, **kw) -> CallRecord:
        ref = next(((cid, n) for cid, n in reversed(refs)
                    if self.sequences[cid][:n] == list(history[:n]) and n <= len(history)), None)
        parent, prefix = ref if ref else (None, 0)
        c = call(f"c{len(self.calls)}", history[prefix:], output, parent=parent, prefix=prefix,
                 rollout=self.rollout, hints=hints, delivered=delivered, **kw)
        self.calls.append(c)
        self.sequences[c.call_id] = list(history) + list(output)
        return c


class Agent:
    """One agent line of a harness: it talks, gets tool results, compacts, retries."""

    def __init__(self, rec: Recorder, history, hints=MAIN_HINTS, system=SYSTEM, refs=None) -> None:
        self.rec, self.hints, self.system = rec, hints, list(system)
        self.history = list(history)
        self.refs: list[tuple[str, int]] = list(refs or [])
        self.last_round: list[int] = []

    def say(self, output, tool=(), *, delivered=True, **kw) -> CallRecord:
        c = self.rec.record(self.history, list(output), self.refs, self.hints, delivered=delivered, **kw)
        if delivered:
            self.history += list(output)
            self.refs.append((c.call_id, len(self.history)))
            self.history += list(tool)
            self.last_round = list(output) + list(tool)
        return c

    def compact(self, summary, **kw) -> tuple[CallRecord, list[int]]:
        """Summary call on the history minus its last round; the history starts over."""
        cut = len(self.history) - len(self.last_round)
        request = self.history[:cut] + COMPACT
        refs = [(cid, n) for cid, n in self.refs if n <= cut]
        c = self.rec.record(request, list(summary), refs, self.hints, **kw)
        self.history = self.system + CONTINUE + list(summary) + self.last_round
        self.refs = []
        return c, request

    def fork(self, hints, directive) -> "Agent":
        """A fork sub-agent: the whole history so far, then its directive."""
        return Agent(self.rec, self.history + list(directive), hints, self.system, self.refs)
