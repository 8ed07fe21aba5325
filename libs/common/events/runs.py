"""Run context: the resolved run configuration is the first event of every run."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from .envelope import Context, Digest, Event
from .registry import register


@register
class RunStarted(Event):
    CONTEXT = Context.RUNS
    config: dict[str, Any] = Field(default_factory=dict)
    config_digest: Digest | None = None
    gyre_version: str = ""


@register
class RunFinished(Event):
    CONTEXT = Context.RUNS
    status: str = "completed"
    steps_applied: int = Field(default=0, ge=0)


@register
class WarmStartCompleted(Event):
    """The warm-start phase (supervised fine-tuning on a scripted solver's demonstrations
    of the train tasks) finished before RL; RL starts from ``model_dir``."""

    CONTEXT = Context.RUNS
    base_model: str = Field(min_length=1)
    model_dir: str = Field(min_length=1)
    tasks: list[str] = Field(default_factory=list)  # train-split task ids only
    demos: int = Field(default=0, ge=0)
    steps: int = Field(default=0, ge=0)
    loss_first: float | None = None
    loss_last: float | None = None
    seconds: float = Field(default=0.0, ge=0)
    reused: bool = False  # an earlier phase's output with the same inputs was kept
    flaw_rate: float = Field(default=0.0, ge=0, lt=1)  # share of drawn demonstrations that were the flawed variant


@register
class HeldoutEvaluated(Event):
    """Greedy success of the current weights on the held-out split, measured in the run
    (``phase`` before / after the RL steps); never trained on."""

    CONTEXT = Context.RUNS
    phase: str = Field(min_length=1)
    split: str = "heldout"
    weight_version: int = Field(default=0, ge=0)
    tasks: int = Field(default=0, ge=0)
    success: float = Field(ge=0, le=1)  # share of tasks whose hidden tests all pass
    mean_score: float = Field(ge=0, le=1)  # mean share of hidden tests passed
    per_task: dict[str, float] = Field(default_factory=dict)
