"""The policy seam: one pure ``decide(state, tick, policy) -> facts`` for every mode.

A policy is a strategy (``elastic``, ``colocate``, ``async``), not a copy of the
scheduler: it reads the state and one :class:`Tick` and returns the facts it decides, a
``WaterLevelObserved`` first and then zero or more ``SwitchStarted`` (each is the switch
command, recorded). The caller applies them with ``evolve`` and sends the commands; the
simulator does exactly the same, which is why its schedules mean something.

Worked example (elastic, 3 cells of 8 slots, core ``c0``; run as a doctest)::

    >>> from services.scheduler.core import (CellAdded, ElasticPolicy, Role, SchedulerState,
    ...     Tick, decide, evolve_all)
    >>> state = evolve_all(SchedulerState(), [
    ...     CellAdded("c0", Role.INFERENCE, 8, is_core=True),
    ...     CellAdded("c1", Role.INFERENCE, 8), CellAdded("c2", Role.INFERENCE, 8)])
    >>> policy = ElasticPolicy()
    >>> def tick(state, **seen):
    ...     facts = decide(state, Tick(**seen), policy)
    ...     print([getattr(f, "pressure", None) or f"{f.cell} -> {f.to_role.value}" for f in facts])
    ...     return evolve_all(state, facts)
    >>> state = tick(state, at=0, running_calls=20)       # 20 calls need all three cells
    [<Pressure.STEADY: 'steady'>]
    >>> state = tick(state, at=600, running_calls=6, training_backlog=4)   # demand fell
    [<Pressure.RELEASE: 'release'>]
    >>> state = tick(state, at=630, running_calls=6, training_backlog=4)   # held hold_s
    [<Pressure.RELEASE: 'release'>, 'c0 -> training']
    >>> state.cell("c0").phase.value                        # the core goes first
    'draining'
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Protocol

from .facts import Fact, Pressure, SwitchStarted, Tick, WaterLevelObserved
from .lifecycle import IllegalTransition, Role
from .state import Cell, SchedulerState, evolve


class Policy(Protocol):
    """A scheduling strategy. ``name`` is what reports and the CLI call it."""

    name: str
    between_calls_weight: float  # share of a rollout's time in model calls (water level)
    smoothing_s: float  # time constant of the water level's smoothing (0: raw)

    def initial_role(self, index: int, is_core: bool) -> Role:
        """Role a cell registers in (index: its position in the cluster, core first)."""
        ...

    def assess(self, state: SchedulerState, tick: Tick, level: float) -> Pressure:
        """Which way the (smoothed) water level pushes now."""
        ...

    def switches(self, state: SchedulerState, tick: Tick, level: float) -> list[SwitchStarted]:
        """Switches to start now, given a state that already holds this tick's pressure."""
        ...


def water_level(tick: Tick, call_share: float) -> float:
    """Unfinished inference demand, in calls: what is queued and running now, or, if more,
    what the unfinished rollouts will ask on average (each spends ``call_share`` of its
    time in model calls), so rollouts busy in tools still hold cells for their next call."""
    now = tick.queued_calls + tick.running_calls
    expected = call_share * (now + tick.rollouts_between_calls)
    return float(max(now, expected))


def smooth(state: SchedulerState, raw: float, at: float, tau_s: float) -> float:
    """Exponential smoothing over time (time constant ``tau_s``): noise in the level does
    not reach the decisions, a sustained change does within a few ``tau_s``."""
    prev = state.smoothed_level
    if prev is None or tau_s <= 0:
        return raw
    alpha = 1.0 - math.exp(-max(0.0, at - state.level_at) / tau_s)
    return prev + alpha * (raw - prev)


def serving_capacity(state: SchedulerState) -> int:
    """Calls the cells in inference serve at once; a silent cell (its agent stopped
    answering half-way through a switch) is not counted: its engine may be released; nor is
    an unusable one (its rollback failed: the proxy does not route to it)."""
    return sum(c.capacity for c in state.serving)


def observe(state: SchedulerState, tick: Tick, pressure: Pressure, raw: float, level: float) -> WaterLevelObserved:
    return WaterLevelObserved(
        at=tick.at,
        level=round(raw, 6),
        smoothed=round(level, 6),
        inference_capacity=serving_capacity(state),
        queued_calls=tick.queued_calls,
        running_calls=tick.running_calls,
        unfinished_rollouts=tick.rollouts_between_calls + tick.running_calls + tick.queued_calls,
        training_backlog=tick.training_backlog,
        pressure=pressure,
    )


def decide(state: SchedulerState, tick: Tick, policy: Policy) -> list[Fact]:
    """The scheduler's decision for one tick: the observation, then the switches."""
    raw = water_level(tick, policy.between_calls_weight)
    level = smooth(state, raw, tick.at, policy.smoothing_s)
    pressure = policy.assess(state, tick, level)
    observed = observe(state, tick, pressure, raw, level)
    facts: list[Fact] = [observed]
    current = evolve(state, observed)
    held_back = False
    for switch in policy.switches(current, tick, level):
        cell = current.cell(switch.cell)
        if cell.last_failure is not None and tick.at - cell.since < RETRY_AFTER_FAILURE_S:
            held_back = True  # its last switch failed just now: do not drain it again every tick
            continue
        if cell.held:
            # silent (its agent never answered the last command: not until it is heard from) or
            # unusable (its agent refuses every switch until it is repaired)
            held_back = True
            continue
        try:
            current = evolve(current, switch)  # each decision sees the ones before it
        except IllegalTransition:
            if not held_back:
                raise
            continue  # it needed a switch held back above (a satellite behind the core)
        facts.append(switch)
    return facts


RETRY_AFTER_FAILURE_S = 60.0  # a cell whose switch failed keeps its role at least this long


def start(cell: Cell, to_role: Role, tick: Tick, reason: str, level: float = 0.0) -> SwitchStarted:
    return SwitchStarted(cell=cell.name, to_role=to_role, at=tick.at, reason=reason, water_level=round(level, 6))


def ordered_for_training(cells: Iterable[Cell]) -> list[Cell]:
    """Core first (it roots the training group), then by name."""
    return sorted(cells, key=lambda c: (not c.is_core, c.name))


def ordered_for_inference(cells: Iterable[Cell]) -> list[Cell]:
    """Satellites first, core last (it may leave only once they have)."""
    return sorted(cells, key=lambda c: (c.is_core, c.name))
