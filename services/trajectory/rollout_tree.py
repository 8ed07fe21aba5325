"""One rollout's tree from arrival to seal: bad input handled, then classify, sample, pack.

Calls may arrive out of order (a call before the parent it references: buffered until
the parent arrives), twice (same call id and content: ignored; same id, other content:
rejected), or broken (a prefix longer than the parent, logprobs that do not match the
output, another rollout's call: rejected with a reason). The tree itself is never left
half-changed: a call is checked before any position is written. A call whose output
cannot be trained on (behaviour logprobs that are no log-probabilities, no input) is
placed as context only and listed in ``untrained``: the calls that continue it are not
lost with it.

Sealing classifies every call, lists the branches, selects at most ``budget`` of them
and packs them. Calls still waiting for an unknown parent at seal time are rejected.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

from .forks import HARNESS_RULES, CallLabel, HarnessRules, classify_calls
from .packing import PackedTree, PackingConfig, pack_branches
from .records import CallRecord
from .sampling import Branch, SamplingConfig, list_branches, select_branches
from .tree import TrajectoryTree, TreeError

log = logging.getLogger(__name__)

Outcome = Literal["applied", "buffered", "duplicate", "rejected"]


@dataclass(frozen=True)
class TreeConfig:
    rules: HarnessRules = field(default_factory=lambda: HARNESS_RULES["claude_code"])
    budget: int = 5
    seed: int = 0
    max_piece_tokens: int | None = None
    train_undelivered: bool = False

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.budget, self.seed, include_undelivered=self.train_undelivered)

    @property
    def packing(self) -> PackingConfig:
        return PackingConfig(self.max_piece_tokens, self.train_undelivered)


@dataclass(frozen=True)
class CallOutcome:
    call_id: str
    outcome: Outcome
    reason: str = ""
    released: tuple[str, ...] = ()  # buffered calls applied because this one arrived
    also_rejected: tuple["CallOutcome", ...] = ()  # buffered calls released but invalid


@dataclass(frozen=True)
class SealedTree:
    rollout_id: str
    tree_digest: str
    labels: list[CallLabel]
    branches: list[Branch]
    selected: list[Branch]
    packed: list[PackedTree]
    rejected: tuple[CallOutcome, ...] = ()
    untrained: tuple[CallOutcome, ...] = ()  # placed, its output context only (the reason)

    @property
    def forks(self) -> list[CallLabel]:
        return [lab for lab in self.labels if lab.fork]


class RolloutTree:
    def __init__(self, rollout_id: str, config: TreeConfig | None = None) -> None:
        self.rollout_id = rollout_id
        self.config = config or TreeConfig()
        self.tree = TrajectoryTree()
        self._waiting: dict[str, list[CallRecord]] = {}  # parent call id -> calls
        self._waiting_ids: dict[str, CallRecord] = {}
        self.rejected: list[CallOutcome] = []
        self.untrained: list[CallOutcome] = []

    def add(self, call: CallRecord) -> CallOutcome:
        known = self._known(call.call_id)
        if known is not None:
            if known.fingerprint() == call.fingerprint():
                return CallOutcome(call.call_id, "duplicate")
            return CallOutcome(call.call_id, "rejected",
                               "same call id, other content: the call recorded first is kept, this one is not applied")
        if call.rollout_id != self.rollout_id:
            return CallOutcome(call.call_id, "rejected", f"belongs to rollout {call.rollout_id}")
        if call.parent_call_id is not None and call.parent_call_id not in self.tree.index:
            self._waiting.setdefault(call.parent_call_id, []).append(call)
            self._waiting_ids[call.call_id] = call
            return CallOutcome(call.call_id, "buffered", f"waits for parent {call.parent_call_id}")
        reason = self._apply(call)
        if reason:
            outcome = CallOutcome(call.call_id, "rejected", reason)
            self.rejected.append(outcome)
            return outcome
        released, failed = self._release(call.call_id)
        return CallOutcome(call.call_id, "applied", released=tuple(released), also_rejected=tuple(failed))

    def knows(self, call_id: str) -> bool:
        return self._known(call_id) is not None

    def _known(self, call_id: str) -> CallRecord | None:
        c = self.tree.index.get(call_id)
        return self.tree.calls[c] if c is not None else self._waiting_ids.get(call_id)

    def _apply(self, call: CallRecord) -> str:
        try:
            placement = self.tree.add_call(call)
        except TreeError as exc:
            return str(exc)
        if placement.untrained:
            self.untrained.append(CallOutcome(call.call_id, "applied", f"context only: {placement.untrained}"))
            log.warning("rollout %s: call %s is context only, never trained: %s",
                        self.rollout_id, call.call_id, placement.untrained)
        return ""

    def _release(self, call_id: str) -> tuple[list[str], list[CallOutcome]]:
        """Apply buffered calls whose parent has now arrived (and theirs, and so on)."""
        released, failed, ready = [], [], [call_id]
        while ready:
            for child in self._waiting.pop(ready.pop(), []):
                del self._waiting_ids[child.call_id]
                reason = self._apply(child)
                if reason:
                    failed.append(CallOutcome(child.call_id, "rejected", reason))
                else:
                    released.append(child.call_id)
                    ready.append(child.call_id)
        self.rejected.extend(failed)
        return released, failed

    @property
    def n_waiting(self) -> int:
        return len(self._waiting_ids)

    def seal(self) -> SealedTree:
        rejected = tuple(self.rejected) + tuple(
            CallOutcome(c.call_id, "rejected", f"parent {c.parent_call_id} never arrived")
            for c in self._waiting_ids.values()
        )
        labels = classify_calls(self.tree, self.config.rules)
        branches = list_branches(self.tree, labels, delivered_only=not self.config.sampling.include_undelivered)
        selected = select_branches(branches, self.config.sampling, self.tree)
        packed = pack_branches(self.tree, selected, self.config.packing)
        return SealedTree(self.rollout_id, self.tree.digest(), labels, branches, selected,
                          packed, rejected, tuple(self.untrained))
