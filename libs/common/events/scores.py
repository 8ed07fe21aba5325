"""Score context (owner: evaluator): finished and timed-out rollouts, scored from artifacts."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .envelope import Context, Event
from .registry import register


class TestOutcome(BaseModel):
    __test__ = False  # not a pytest class
    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    outcome: Literal["passed", "failed", "error", "skipped", "missing"]
    weight: float = Field(default=1.0, ge=0)
    message: str = ""  # the failure line, when there is one


@register
class RolloutScored(Event):
    CONTEXT = Context.SCORES
    KEY = "rollout_id"
    rollout_id: str = Field(min_length=1)
    score: float = Field(ge=0, le=1)
    components: dict[str, float] = Field(default_factory=dict)
    tests: list[TestOutcome] = Field(default_factory=list)
    partial: bool = False  # scored from a timed-out rollout's artifacts
    isolation: str = ""  # which sandbox was in force
    reason: str = ""  # why the score is what it is, when notable (e.g. "collection error: ...")


@register
class RolloutScoringFailed(Event):
    CONTEXT = Context.SCORES
    KEY = "rollout_id"
    rollout_id: str = Field(min_length=1)
    reason: str = Field(min_length=1)
    partial: bool = False
