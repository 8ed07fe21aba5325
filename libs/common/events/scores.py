"""Score context (owner: evaluator): finished and timed-out rollouts, scored from artifacts."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .envelope import Context, Digest, Event
from .registry import register


class TestOutcome(BaseModel):
    __test__ = False  # not a pytest class
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
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
    # A large suite's full list would not fit one NATS message (1 MB). Then ``tests`` holds
    # only the outcomes that did not pass, up to a cap, ``tests_truncated`` is set, and the
    # whole list (a JSON array of TestOutcome objects) is in the blob store at
    # ``tests_digest`` (None if it could not be stored). ``test_counts``: outcome -> number
    # of tests, over the whole list.
    test_counts: dict[str, int] = Field(default_factory=dict)
    tests_truncated: bool = False
    tests_digest: Digest | None = None


@register
class RolloutScoringFailed(Event):
    CONTEXT = Context.SCORES
    KEY = "rollout_id"
    rollout_id: str = Field(min_length=1)
    reason: str = Field(min_length=1)
    partial: bool = False
