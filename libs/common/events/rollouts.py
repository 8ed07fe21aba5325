"""Rollout context (owner: runner). A rollout is one harness working on one task."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .envelope import Context, Digest, Event
from .registry import register


@register
class RolloutStarted(Event):
    CONTEXT = Context.ROLLOUTS
    KEY = "rollout_id"
    rollout_id: str = Field(min_length=1)
    task_id: str = Field(min_length=1)
    group_id: str = Field(min_length=1)
    harness: str = Field(min_length=1)
    weight_version: int = Field(ge=0)
    api_key_digest: Digest
    step: int = Field(default=0, ge=0)
    time_limit_s: float | None = Field(default=None, gt=0)
    group_size: int | None = Field(default=None, ge=1)  # rollouts in the group, when known up front
    # "train": its samples are learnt from; "eval": scored only (greedy held-out success),
    # never queued for training
    purpose: Literal["train", "eval"] = "train"


class _RolloutEnded(Event):
    CONTEXT = Context.ROLLOUTS
    KEY = "rollout_id"
    rollout_id: str = Field(min_length=1)
    task_id: str | None = None  # repeated from RolloutStarted so the evaluator needs no look-up
    snapshot_digest: Digest | None = None  # tar archive of the workspace in the blob store
    exit_status: int | None = None
    wall_time_s: float = Field(ge=0)


@register
class RolloutFinished(_RolloutEnded):
    pass


@register
class RolloutTimedOut(_RolloutEnded):
    pass
