"""Tree context (owner: trajectory): prefix trees, forks, selected samples, micro-steps."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .calls import DriftClass
from .envelope import Context, Digest, Event
from .registry import register

ForkType = Literal["compaction", "subagent", "retry", "edit"]
BranchRole = Literal["main", "main_summary", "subagent", "subagent_summary"]


@register
class ForkDetected(Event):
    CONTEXT = Context.TREES
    KEY = "rollout_id"
    rollout_id: str = Field(min_length=1)
    call_id: str = Field(min_length=1)
    parent_call_id: str | None = None
    fork_type: ForkType
    position: int = Field(ge=0)  # token depth where the branches part
    role: BranchRole | None = None  # role of the branch that starts here
    # why: the proxy's drift class of the call (None in logs written before it was recorded)
    drift: DriftClass | None = None


class SampleRef(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
    digest: Digest
    role: BranchRole
    n_tokens: int = Field(ge=0)
    n_trained_tokens: int = Field(ge=0)


@register
class TreeSealed(Event):
    CONTEXT = Context.TREES
    KEY = "rollout_id"
    rollout_id: str = Field(min_length=1)
    tree_digest: Digest  # the sealed tree's summary blob
    content_digest: Digest | None = None  # canonical digest of the tree's content (order-free)
    n_calls: int = Field(ge=0)
    n_nodes: int = Field(ge=0)
    n_tokens: int = Field(ge=0)
    branch_roles: list[BranchRole] = Field(default_factory=list)


@register
class SamplesSelected(Event):
    CONTEXT = Context.TREES
    KEY = "rollout_id"
    rollout_id: str = Field(min_length=1)
    samples: list[SampleRef] = Field(max_length=64)


@register
class MicroStepQueued(Event):
    CONTEXT = Context.TREES
    KEY = "micro_step"
    step: int = Field(ge=0)
    micro_step: str = Field(min_length=1)
    group_id: str = Field(min_length=1)
    sample_digests: list[Digest] = Field(min_length=1)
    advantages: list[float] = Field(min_length=1)
    n_tokens: int = Field(ge=0)
    rollout_ids: list[str] = Field(default_factory=list)  # parallel to sample_digests
    micro_steps_in_step: int | None = Field(default=None, ge=1)  # when known: the step is complete at this count
    # micro-steps its group was queued as (all published together); None in older logs
    group_micro_steps: int | None = Field(default=None, ge=1)


@register
class GroupQueued(Event):
    """A training group is settled: its micro-steps (zero when none of its rollouts left
    a sample: every score failed, or no rollout made a call) are queued. Counts the group
    toward its step, so a step never waits on a group that has nothing to train."""

    CONTEXT = Context.TREES
    KEY = "group_id"
    step: int = Field(ge=0)
    group_id: str = Field(min_length=1)
    micro_steps: int = Field(ge=0)
    rollout_ids: list[str] = Field(default_factory=list)
    samples: int = Field(default=0, ge=0)
