"""Helpers for the scheduler tests: a cluster registered in the pure core, and a cell
agent that carries out switches instantly (the only edge faked here: real cell agents)."""

from __future__ import annotations

import asyncio
import time

from services.scheduler.core import (
    CellAdded,
    CellPhase,
    Fact,
    PhaseReached,
    Policy,
    Role,
    SchedulerState,
    SwitchFinished,
    SwitchStarted,
    Tick,
    decide,
    evolve,
    evolve_all,
)
from services.scheduler.core.lifecycle import SWITCH_PATH


def cluster(n: int = 4, capacity: int = 8, training: int = 0) -> SchedulerState:
    """``n`` cells c0..c{n-1}; c0 is the core; the first ``training`` cells train."""
    facts = [
        CellAdded(cell=f"c{i}", role=Role.TRAINING if i < training else Role.INFERENCE,
                  capacity=capacity, at=0.0, is_core=i == 0)
        for i in range(n)
    ]
    return evolve_all(SchedulerState(), facts)


def walk_switch(state: SchedulerState, switch: SwitchStarted, at: float) -> tuple[SchedulerState, list[Fact]]:
    """The rest of a started switch, as a cell agent would report it at time ``at``."""
    facts: list[Fact] = [PhaseReached(cell=switch.cell, phase=p, at=at) for p in SWITCH_PATH[switch.to_role][1:]]
    facts.append(SwitchFinished(cell=switch.cell, role=switch.to_role, at=at))
    return evolve_all(state, facts), facts


def step(state: SchedulerState, tick: Tick, policy: Policy) -> tuple[SchedulerState, list[Fact]]:
    """One scheduler tick with instant cell agents: decide, evolve, finish switches."""
    log: list[Fact] = []
    for fact in decide(state, tick, policy):
        state = evolve(state, fact)
        log.append(fact)
        if isinstance(fact, SwitchStarted):
            state, rest = walk_switch(state, fact, tick.at)
            log.extend(rest)
    return state, log


def phases(state: SchedulerState) -> dict[str, CellPhase]:
    return {c.name: c.phase for c in state.cells}


async def tick_until(live, done, limit_s: float = 15.0) -> None:
    """Ticks a ``LiveScheduler`` (reading the cells stream first) until ``done()``."""
    deadline = time.monotonic() + limit_s
    while not done():
        assert time.monotonic() < deadline, "gave up waiting"
        await live.catch_up_cells()
        await live.tick()
        await asyncio.sleep(0.05)
