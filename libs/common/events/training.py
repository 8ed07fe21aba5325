"""Training context (owner: trainer; StepApplied, WeightsPublished and WeightsRetired by the core cell)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from .envelope import Context, Digest, Event
from .registry import register


@register
class MicroStepClaimed(Event):
    CONTEXT = Context.TRAINING
    KEY = "micro_step"
    step: int = Field(ge=0)
    micro_step: str = Field(min_length=1)
    cell: str = Field(min_length=1)
    weight_version: int = Field(ge=0)


@register
class MicroStepDone(Event):
    CONTEXT = Context.TRAINING
    KEY = "micro_step"
    step: int = Field(ge=0)
    micro_step: str = Field(min_length=1)
    cell: str = Field(min_length=1)
    weight_version: int = Field(ge=0)
    n_tokens: int = Field(ge=0)
    loss: float
    gradient: dict[str, Any] = Field(default_factory=dict)  # transfer descriptor


@register
class StepApplied(Event):
    CONTEXT = Context.TRAINING
    step: int = Field(ge=0)
    weight_version: int = Field(ge=0)
    micro_steps_used: list[str] = Field(default_factory=list)
    micro_steps_dropped: list[str] = Field(default_factory=list)
    loss: dict[str, float] = Field(default_factory=dict)


@register
class WeightsPublished(Event):
    CONTEXT = Context.TRAINING
    weight_version: int = Field(ge=0)
    target_cells: list[str] = Field(default_factory=list)
    checkpoint_digest: Digest | None = None


@register
class WeightsRetired(Event):
    """The core is deleting the weight blobs of these published versions (its
    ``keep_weights``): their ``WeightsPublished`` digests name nothing from now on. Written
    before the deletes, so no blob goes without a record; a delete that then fails leaves a
    blob the log calls retired (space, not correctness)."""

    CONTEXT = Context.TRAINING
    weight_versions: list[int] = Field(min_length=1)
    digests: list[Digest] = Field(min_length=1)  # the blobs deleted (versions may share one)
    kept_from: int = Field(ge=0)  # the oldest version whose blob is kept
