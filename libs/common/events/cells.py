"""Cell context (owners: scheduler and cells): roles, switches, water level."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .envelope import Context, Event
from .registry import register

Role = Literal["inference", "training"]


@register
class CellRegistered(Event):
    CONTEXT = Context.CELLS
    KEY = "cell"
    cell: str = Field(min_length=1)
    role: Role
    is_core: bool = False
    capacity: int = Field(ge=1)  # concurrent calls it serves in the inference role
    devices: int = Field(default=1, ge=0)


@register
class SwitchRequested(Event):
    CONTEXT = Context.CELLS
    KEY = "cell"
    cell: str = Field(min_length=1)
    from_role: Role
    to_role: Role
    water_level: float = Field(ge=0)
    reason: str = Field(min_length=1)


@register
class SwitchCompleted(Event):
    CONTEXT = Context.CELLS
    KEY = "cell"
    cell: str = Field(min_length=1)
    role: Role
    phase_timings: dict[str, float] = Field(default_factory=dict)  # seconds per phase
    weight_version: int = Field(ge=0)


@register
class SwitchFailed(Event):
    CONTEXT = Context.CELLS
    KEY = "cell"
    cell: str = Field(min_length=1)
    role: Role  # the role the cell is left in
    phase: str = Field(min_length=1)
    reason: str = Field(min_length=1)
    # written by the scheduler on the cell's behalf: its agent took the switch command and
    # answered none of its sends (the cell is then "silent" until it is heard from).
    # Written only when set: every SwitchFailed an agent writes reads as it did before the
    # field existed (a reader without it forbids unknown fields), so the schema version
    # stays 1; one without it reads as False.
    declared_by_scheduler: bool = Field(default=False, exclude_if=lambda v: not v)
    # written by the cell's agent: a step of its rollback failed (e.g. the engine would not
    # resume), so the cell is in ``role`` but cannot do it (the proxy does not route to it)
    # until a ``CellRepaired``. Written only when set, as ``declared_by_scheduler``.
    unusable: bool = Field(default=False, exclude_if=lambda v: not v)


@register
class CellRepaired(Event):
    """A cell left unusable by a failed rollback step (``SwitchFailed.unusable``) is whole
    again in ``role``: its agent ran the steps left (and the proxy routes to it, if it serves)."""

    CONTEXT = Context.CELLS
    KEY = "cell"
    cell: str = Field(min_length=1)
    role: Role


@register
class WaterLevelSampled(Event):
    CONTEXT = Context.CELLS
    level: float = Field(ge=0)
    inference_capacity: int = Field(ge=0)
    queued_calls: int = Field(ge=0)
    running_calls: int = Field(ge=0)
    unfinished_rollouts: int = Field(default=0, ge=0)
    cells_by_role: dict[str, int] = Field(default_factory=dict)
    # the policy's own state, so a replay rebuilds its hysteresis exactly
    pressure: str | None = None  # steady | release | reclaim | idle_trainers
    smoothed_level: float | None = None
    training_backlog: int | None = Field(default=None, ge=0)


@register
class SwitchPhaseEntered(Event):
    """A cell moved into a transitional phase of a switch (draining, migrating, ...)."""

    CONTEXT = Context.CELLS
    KEY = "cell"
    cell: str = Field(min_length=1)
    phase: str = Field(min_length=1)
