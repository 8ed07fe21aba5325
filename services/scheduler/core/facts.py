"""What the scheduler core reads and writes: frozen facts and the observation it decides on.

Facts are past-tense and carry their time ``at`` (seconds on whatever clock drives the
core: the wall clock live, the simulated clock in ``gyre sim``). ``translate.py`` maps
them to and from the cells events of ``libs.common.events``.

``Tick`` is not a fact: it is what the scheduler sees of the world when it decides
(demand from the proxy and runner, training work from the trainer), sampled each tick.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from .lifecycle import CellPhase, Role

_EMPTY: Mapping[str, int] = MappingProxyType({})
_NO_TIMES: Mapping[str, float] = MappingProxyType({})


class Pressure(str, enum.Enum):
    """Which way the water level pushes the cells, as the policy read it."""

    STEADY = "steady"
    RELEASE = "release"  # demand fits in fewer inference cells and training work waits
    RECLAIM = "reclaim"  # demand exceeds what the inference cells serve
    IDLE_TRAINERS = "idle_trainers"  # training cells have nothing to claim


@dataclass(frozen=True)
class Tick:
    """One observation of demand and training work.

    ``rollouts_between_calls`` are unfinished rollouts not in a model call right now
    (running tools or tests); they will call again, so they weigh on the water level.
    ``busy_trainers`` are training cells working on a micro-step; ``micro_step_left_s``
    (optional) estimates the seconds each has left, so a reclaim picks the one that frees
    soonest.

    ``update_needs_training`` says how the core applies a step's update: only while it
    trains (the seed's core cell, and the simulator's model: ``sim.engine`` applies it only
    with the core in training), or in any role (the live trainer, which applies each step's
    update whatever its cell does: ``services/trainer/gate.py``). Only in the first case
    does a pending update want training: the elastic policy's first rule pulls the core in
    for it; otherwise moving the core would drain it for nothing.
    """

    at: float
    queued_calls: int = 0
    running_calls: int = 0
    rollouts_between_calls: int = 0
    training_backlog: int = 0  # micro-steps claimable now
    update_pending: bool = False  # the step's micro-steps are done; the core must apply it
    batch_ready: bool = False  # the step's whole batch is collected (colocate's trigger)
    update_needs_training: bool = True  # the core applies an update only while it trains
    cell_calls: Mapping[str, int] = field(default_factory=lambda: _EMPTY)
    busy_trainers: frozenset[str] = frozenset()
    micro_step_left_s: Mapping[str, float] = field(default_factory=lambda: _NO_TIMES)

    @property
    def training_wanted(self) -> bool:
        return self.training_backlog > 0 or self.update_waits_on_core

    @property
    def update_waits_on_core(self) -> bool:
        """A step's update is pending and only a core in training applies it."""
        return self.update_pending and self.update_needs_training


@dataclass(frozen=True)
class CellAdded:
    cell: str
    role: Role
    capacity: int  # concurrent calls it serves in the inference role
    at: float = 0.0
    is_core: bool = False


@dataclass(frozen=True)
class SwitchStarted:
    """The scheduler asked ``cell`` to switch to ``to_role`` (the command, as a fact)."""

    cell: str
    to_role: Role
    at: float
    reason: str
    water_level: float = 0.0
    # the id of the SwitchRequested that records it (None for a fact not read from the log);
    # not compared: a decided fact and the same fact read back are equal
    request: str | None = field(default=None, compare=False)


@dataclass(frozen=True)
class PhaseReached:
    """The cell agent reports entering the next transitional phase of its switch."""

    cell: str
    phase: CellPhase
    at: float


@dataclass(frozen=True)
class SwitchFinished:
    cell: str
    role: Role
    at: float
    weight_version: int = 0
    phase_timings: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class SwitchAborted:
    """A switch failed part-way; the cell reports the safe role it is left in and why.

    ``phase`` None: the cell refused the command before any phase (it was not in the role
    the scheduler thought, e.g. after a restart); the role it reports is taken as is.

    ``declared``: not the cell's word but the scheduler's, written on its behalf because its
    agent took the command and never answered (``live.LiveScheduler``, the hung-agent
    watchdog). The cell is then *silent* (``Cell.silent``) until it is heard from again;
    a declaration that lands after the cell's own outcome is void (``state``), and so is
    one whose ``causation`` (the id of the request of the switch it gives up on) is not
    the cell's current switch."""

    cell: str
    role: Role
    phase: CellPhase | None
    reason: str
    at: float
    declared: bool = False
    causation: str | None = field(default=None, compare=False)  # SwitchFailed.causation_id
    # the cell's agent says a step of its rollback failed: it is in ``role`` but cannot do
    # it (``Cell.unusable``) until it reports :class:`CellRepaired`. In a schedule's digest
    # only when set (``sim.report.schedule_digest``).
    unusable: bool = field(default=False, metadata={"digest": "if set"})


@dataclass(frozen=True)
class CellRepaired:
    """A cell left unusable by a failed rollback step is whole again in ``role``."""

    cell: str
    role: Role
    at: float


@dataclass(frozen=True)
class WaterLevelObserved:
    at: float
    level: float
    inference_capacity: int
    queued_calls: int
    running_calls: int
    unfinished_rollouts: int
    training_backlog: int
    pressure: Pressure
    smoothed: float = 0.0  # the level the policy acted on (time-smoothed)


Fact = CellAdded | SwitchStarted | PhaseReached | SwitchFinished | SwitchAborted | CellRepaired | WaterLevelObserved
