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
