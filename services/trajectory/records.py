"""The seam between the trajectory core and its adapters: frozen call records.

A call record is what the proxy recorded for one model call, with its token arrays
already fetched from the blob store. Its input is a *reference* to an earlier call's
tokens plus new tokens (TITO)::

    input(call)  = sequence(parent)[:prefix_len] + new_input_ids
    sequence(c)  = input(c) + output_ids

so building the tree costs O(new tokens), not O(context).

Roles (sampling priority, best first) and fork types use the catalogue's words
(``libs/common/events/trees.py``); they are repeated here as plain strings so the core
imports nothing but the standard library.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

BranchRole = Literal["main", "main_summary", "subagent", "subagent_summary"]
ForkType = Literal["compaction", "subagent", "retry", "edit"]
# The proxy's TITO match class (libs/common/events/calls.py DriftClass). The core compares
# token paths in the tree, which says the same and more; forks.py uses the class only to
# find which end of its line an ``append``/``template_drift``/``think_stripped``/``retoken_drift``
# call continues.
DriftClass = Literal["fresh", "append", "template_drift", "think_stripped", "retoken_drift", "fork"]

ROLE_PRIORITY: tuple[BranchRole, ...] = ("main", "main_summary", "subagent", "subagent_summary")
ROLES: frozenset[str] = frozenset(ROLE_PRIORITY)


@dataclass(frozen=True)
class WeightSpan:
    """Output tokens [start, end) were produced by weight ``version``."""

    start: int
    end: int
    version: int


@dataclass(frozen=True)
class CallHints:
    """What the proxy saw about a call besides its tokens.

    ``role`` is an explicit ``x-gyre-role`` header and always wins. ``kind`` is the
    proxy's own harness classification when it has one (``compaction_summary``,
    ``post_compaction``, ``subagent``, ``side``, ``main``); the core also works without it.
    """

    agent_id: str | None = None
    parent_agent_id: str | None = None
    system_digest: str | None = None
    tools_digest: str | None = None
    role: str | None = None
    kind: str | None = None


@dataclass(frozen=True, eq=False)
class CallRecord:
    """One model call of one rollout, token-exact."""

    call_id: str
    rollout_id: str
    new_input_ids: Sequence[int]
    output_ids: Sequence[int]
    output_logprobs: Sequence[float]
    parent_call_id: str | None = None
    prefix_len: int = 0
    weight_spans: tuple[WeightSpan, ...] = ()
    weight_version: int = 0  # used for output tokens no span covers
    session_id: str = ""
    drift: DriftClass = "fresh"
    finish_reason: str | None = None
    delivered: bool = True
    hints: CallHints = field(default_factory=CallHints)
    # the temperature its output logprobs were taken under (the engine divided the logits
    # by it; CallRecorded.logprob_temperature): the trainer scores these tokens the same way
    logprob_temperature: float = 1.0

    @property
    def n_input_tokens(self) -> int:
        return self.prefix_len + len(self.new_input_ids)

    @property
    def n_tokens(self) -> int:
        return self.n_input_tokens + len(self.output_ids)

    def output_versions(self) -> array:
        """The weight version of every output token (spans win over ``weight_version``)."""
        versions = array("i", [self.weight_version]) * len(self.output_ids)
        for span in self.weight_spans:
            end = min(span.end, len(self.output_ids))
            if span.start < end:
                versions[span.start : end] = array("i", [span.version]) * (end - span.start)
        return versions

    def fingerprint(self) -> tuple:
        """Identity of the recorded content, to tell a harmless duplicate from a conflict:
        everything training reads (every token, logprob and version, the temperature, whether
        it was delivered), the arrays as a digest. O(call); asked only of a call id seen twice."""
        h = hashlib.sha256()
        for part in (array("i", self.new_input_ids), array("i", self.output_ids), array("f", self.output_logprobs),
                     self.output_versions()):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part.tobytes())
        # the temperature as its float32 bytes, as the arrays: a NaN equals itself (a float's == would not)
        return (self.parent_call_id, self.prefix_len, self.delivered, array("f", [self.logprob_temperature]).tobytes(),
                h.hexdigest())


def summary_role(role: BranchRole) -> BranchRole:
    """The summary role of an agent's line (main -> main_summary, ...)."""
    return "main_summary" if role in ("main", "main_summary") else "subagent_summary"


def line_role(role: BranchRole) -> BranchRole:
    """The working role of an agent's line (main_summary -> main, ...)."""
    return "main" if role in ("main", "main_summary") else "subagent"
