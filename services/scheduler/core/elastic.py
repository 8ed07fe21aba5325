"""The elastic policy (Gyre's): the water level moves cells between inference and training.

Rules, in order, each tick:

1. The step's update waits on the core: if every micro-step of the step is done and the
   core serves inference, the core switches to training now (no hold, no dwell), as long
   as ``min_inference_cells`` others serve without it. Only where the core applies updates
   only while it trains (``Tick.update_needs_training``: the seed's core cell and the
   simulator's model); Gyre's live trainer applies them in any role, so live this rule
   is off. A silent or unusable core is not switched: the update waits until it is heard
   from or repaired, and the rules below go on for the other cells (``LiveScheduler``
   logs it).
2. ``release``: training work waits and the water level fits in the serving cells minus
   one at ``low_watermark`` utilisation -> after ``hold_s`` one cell switches to training:
   the core first (it roots the training group), then the most idle satellite.
3. ``reclaim``: the level exceeds ``high_watermark`` of the serving (and returning)
   capacity -> after ``hold_s`` as many training satellites as the excess needs switch back,
   idle ones first; they leave after their current micro-step. The core goes last, and only
   when no training work is waiting.
4. ``idle_trainers``: no training work and demand waiting -> idle trainers return.

Hysteresis keeps cells from flapping: the watermarks leave a band (release at
``low * (cap - 1 cell)``, reclaim above ``high * cap``); a pressure must hold ``hold_s``
and every started switch restarts that clock; a cell keeps a role ``min_dwell_s``; at
most ``max_switches_in_flight`` switches run at once.

Silent and unusable cells (``Cell.held``) are never candidates: they are left out before the
candidates are cut to the switches wanted, so they take no slot. No satellite is released
while the core is silent, and the core is not sent back to inference while a satellite is
in the training group or silent where its seat may have joined (``Cell.may_train``); the
fold (``core.state``) refuses both too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .facts import Pressure, SwitchStarted, Tick
from .lifecycle import CellPhase, Role
from .policy import serving_capacity, start
from .state import Cell, SchedulerState


@dataclass(frozen=True)
class ElasticPolicy:
    name: str = "elastic"
    low_watermark: float = 1.0
    high_watermark: float = 1.2
    hold_s: float = 30.0
    min_dwell_s: float = 600.0
    max_switches_in_flight: int = 2
    min_inference_cells: int = 1
    between_calls_weight: float = 0.5
    smoothing_s: float = 120.0

    def __post_init__(self) -> None:
        if not 0 < self.low_watermark < self.high_watermark:
            raise ValueError("elastic policy needs 0 < low_watermark < high_watermark")
        if self.hold_s < 0 or self.min_dwell_s < 0 or self.max_switches_in_flight < 1:
            raise ValueError("elastic policy: hold_s, min_dwell_s >= 0 and max_switches_in_flight >= 1")
        if self.min_inference_cells < 1:
            raise ValueError("elastic policy: min_inference_cells >= 1 (a call must always find a serving cell)")

    def initial_role(self, index: int, is_core: bool) -> Role:
        return Role.INFERENCE

    # -- reading the water level ---------------------------------------------------------

    def assess(self, state: SchedulerState, tick: Tick, level: float) -> Pressure:
        capacity = serving_capacity(state) + _returning_capacity(state)
        if level > self.high_watermark * capacity and state.heading_to(Role.TRAINING):
            return Pressure.RECLAIM
        if tick.training_wanted:
            candidate = self._release_candidate(state, tick, ignore_dwell=True)
            if candidate and level <= self.low_watermark * (serving_capacity(state) - candidate.capacity):
                return Pressure.RELEASE
            return Pressure.STEADY
        if level > 0 and _idle_trainers(state, tick):
            return Pressure.IDLE_TRAINERS
        return Pressure.STEADY

    # -- choosing switches ---------------------------------------------------------------

    def switches(self, state: SchedulerState, tick: Tick, level: float) -> list[SwitchStarted]:
        out: list[SwitchStarted] = []
        core = state.core
        if tick.update_waits_on_core and core is not None and core.phase is CellPhase.INFERENCE and not core.held:
            others_serving = sum(1 for c in state.serving if not c.is_core)
            if others_serving >= self.min_inference_cells:  # else: once a returning cell serves
                out.append(start(core, Role.TRAINING, tick, "core applies the step's update", level))
            return out
        if state.pressure_held(tick.at) < self.hold_s:
            return out
        budget = self.max_switches_in_flight - len(state.switching)
        if budget <= 0:
            return out
        if state.pressure is Pressure.RELEASE:
            cell = self._release_candidate(state, tick, ignore_dwell=False)
            if cell is not None:
                out.append(start(cell, Role.TRAINING, tick, "water level low, training work waiting", level))
        elif state.pressure is Pressure.RECLAIM:
            per_cell = max(1, max((c.capacity for c in state.cells), default=1))
            excess = level / self.high_watermark - serving_capacity(state) - _returning_capacity(state)
            wanted = min(budget, max(1, math.ceil(excess / per_cell)))
            for cell in self._reclaimable(state, tick)[:wanted]:
                out.append(start(cell, Role.INFERENCE, tick, "water level above inference capacity", level))
        elif state.pressure is Pressure.IDLE_TRAINERS:
            for cell in [c for c in _idle_trainers(state, tick) if self._dwelt(c, tick)][:budget]:
                out.append(start(cell, Role.INFERENCE, tick, "no training work, demand waiting", level))
        return out

    def _dwelt(self, cell: Cell, tick: Tick) -> bool:
        return tick.at - cell.since >= self.min_dwell_s

    def _release_candidate(self, state: SchedulerState, tick: Tick, *, ignore_dwell: bool) -> Cell | None:
        serving = state.serving  # a silent cell neither counts as serving nor is released
        if len(serving) - 1 < self.min_inference_cells:
            return None
        ready = [c for c in serving if ignore_dwell or self._dwelt(c, tick)]
        for c in ready:
            if c.is_core:
                return c
        if not state.training_group_open:
            return None  # satellites join only a training group the core roots (and is heard from)
        return min(ready, key=lambda c: (tick.cell_calls.get(c.name, 0), c.name), default=None)

    def _reclaimable(self, state: SchedulerState, tick: Tick) -> list[Cell]:
        training = [c for c in state.in_phase(CellPhase.TRAINING) if not c.held and self._dwelt(c, tick)]
        satellites = [c for c in training if not c.is_core]
        # idle first, then the one whose micro-step ends soonest, then the latest to join
        left = tick.micro_step_left_s
        satellites.sort(key=lambda c: (c.name in tick.busy_trainers, left.get(c.name, 0.0), -c.since, c.name))
        core = [c for c in training if c.is_core and not tick.training_wanted and not state.training_satellites]
        return satellites + core


def _returning_capacity(state: SchedulerState) -> int:
    return sum(c.capacity for c in state.in_phase(CellPhase.LEAVING, CellPhase.RESUMING))


def _idle_trainers(state: SchedulerState, tick: Tick) -> list[Cell]:
    """Training cells with nothing to claim; the core only once it trains alone."""
    idle = [c for c in state.in_phase(CellPhase.TRAINING) if c.name not in tick.busy_trainers and not c.held]
    satellites = sorted((c for c in idle if not c.is_core), key=lambda c: c.name)
    if satellites or state.training_satellites:
        return satellites
    return [c for c in idle if c.is_core]
