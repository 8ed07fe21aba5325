"""The two baselines, as strategies of the same scheduler so comparisons are fair.

``colocate``: every cell generates until the step's batch is collected, then every cell
trains until the update is applied, then all return to inference.

``async``: a fixed split, ``training_cells`` cells (core first) train and the rest serve
inference for the whole run; the policy only restores the split if a switch failed.
"""

from __future__ import annotations

from dataclasses import dataclass

from .facts import Pressure, SwitchStarted, Tick
from .lifecycle import CellPhase, Role
from .policy import ordered_for_inference, ordered_for_training, start
from .state import SchedulerState


@dataclass(frozen=True)
class ColocatePolicy:
    name: str = "colocate"
    between_calls_weight: float = 0.5
    smoothing_s: float = 0.0

    def initial_role(self, index: int, is_core: bool) -> Role:
        return Role.INFERENCE

    def assess(self, state: SchedulerState, tick: Tick, level: float) -> Pressure:
        if tick.batch_ready and state.in_phase(CellPhase.INFERENCE):
            return Pressure.RELEASE
        training_done = not (tick.training_wanted or tick.batch_ready or tick.busy_trainers)
        if training_done and state.in_phase(CellPhase.TRAINING):
            return Pressure.IDLE_TRAINERS
        return Pressure.STEADY

    def switches(self, state: SchedulerState, tick: Tick, level: float) -> list[SwitchStarted]:
        core = state.core
        if state.pressure is Pressure.RELEASE:
            if core is not None and core.phase is not CellPhase.INFERENCE and core.heading_to is not Role.TRAINING:
                return []  # the core is still on its way back; start the group with it next tick
            if core is not None and core.held:
                return []  # a silent or unusable core roots no training group: not until heard from or repaired
            cells = ordered_for_training(c for c in state.in_phase(CellPhase.INFERENCE) if not c.held)
            return [start(c, Role.TRAINING, tick, "batch collected: all cells train", level) for c in cells]
        if state.pressure is Pressure.IDLE_TRAINERS:
            cells = ordered_for_inference(c for c in state.in_phase(CellPhase.TRAINING) if not c.held)
            # satellites that do not leave with this tick's switches (on their way in, or silent
            # where their seat may have joined): the core leaves last, so it waits for them
            staying = [c for c in state.training_satellites if c not in cells]
            if staying:
                cells = [c for c in cells if not c.is_core]
            return [start(c, Role.INFERENCE, tick, "update applied: all cells generate", level) for c in cells]
        return []


@dataclass(frozen=True)
class AsyncPolicy:
    training_cells: int = 1
    name: str = "async"
    between_calls_weight: float = 0.5
    smoothing_s: float = 0.0

    def __post_init__(self) -> None:
        if self.training_cells < 1:
            raise ValueError("async policy needs at least one training cell (the core)")

    def initial_role(self, index: int, is_core: bool) -> Role:
        return Role.TRAINING if (is_core or index < self.training_cells) else Role.INFERENCE

    def assess(self, state: SchedulerState, tick: Tick, level: float) -> Pressure:
        return Pressure.STEADY

    def switches(self, state: SchedulerState, tick: Tick, level: float) -> list[SwitchStarted]:
        """Restore the fixed split (only needed after a failed switch or a late cell)."""
        toward = len(state.heading_to(Role.TRAINING))
        if toward < self.training_cells:
            # silent and unusable cells are left out before the cut, so they take no slot
            cells = ordered_for_training(c for c in state.in_phase(CellPhase.INFERENCE) if not c.held)
            core = state.core
            if core is not None and core.heading_to is not Role.TRAINING and core not in cells:
                return []
            if core is not None and core.held:
                return []  # a silent or unusable core roots no training group: not until heard from or repaired
            missing = cells[: self.training_cells - toward]
            return [start(c, Role.TRAINING, tick, "restore the fixed split") for c in missing]
        if toward > self.training_cells:
            cells = [c for c in ordered_for_inference(state.in_phase(CellPhase.TRAINING))
                     if not c.is_core and not c.held]
            extra = cells[: toward - self.training_cells]
            return [start(c, Role.INFERENCE, tick, "restore the fixed split") for c in extra]
        return []
