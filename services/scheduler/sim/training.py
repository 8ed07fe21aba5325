"""Simulated training side: the step's micro-step queue and the core's update.

Every finished rollout (completed or timed out, the latter partially scored) becomes one
micro-step whose cost is proportional to its model-call time (its tokens). Step ``k``
takes the next ``batch`` finished rollouts in finishing order; with carry-over, rollouts
started for an earlier step may land in a later one. Micro-steps of step ``k + 1`` are
claimable only once the core has applied step ``k`` (they need its weights).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class MicroStep:
    rollout: int
    cost_s: float  # cell-seconds of training


class StepQueue:
    def __init__(self, batch: int, steps: int, *, streaming: bool = True) -> None:
        self.batch = batch
        self.steps = steps
        self.streaming = streaming
        self.version = 0  # steps applied so far = the current weight version
        self.finished: deque[MicroStep] = deque()  # waiting for a later step
        self.claimable: deque[MicroStep] = deque()
        self.assigned = 0  # micro-steps given to the current step
        self.done = 0
        self.in_progress: dict[str, MicroStep] = {}
        self.updating = False
        self.work_s = 0.0  # training cell-seconds spent (micro-steps and updates)

    @property
    def complete(self) -> bool:
        return self.version >= self.steps

    def add(self, micro: MicroStep) -> None:
        self.finished.append(micro)
        self._fill()

    def _fill(self) -> None:
        if not self.streaming and self.assigned == 0 and len(self.finished) < self.batch:
            return  # a conventional trainer waits for the whole batch
        while self.assigned < self.batch and self.finished and not self.complete:
            self.claimable.append(self.finished.popleft())
            self.assigned += 1

    # -- what the scheduler sees ---------------------------------------------------------

    @property
    def batch_ready(self) -> bool:
        return self.assigned >= self.batch and not self.complete

    @property
    def update_pending(self) -> bool:
        return self.done >= self.batch and not self.complete

    # -- trainers ------------------------------------------------------------------------

    def claim(self, cell: str) -> MicroStep | None:
        if not self.claimable or cell in self.in_progress:
            return None
        micro = self.claimable.popleft()
        self.in_progress[cell] = micro
        return micro

    def complete_micro(self, cell: str) -> MicroStep:
        micro = self.in_progress.pop(cell)
        self.done += 1
        self.work_s += micro.cost_s
        return micro

    def hand_back(self, cell: str) -> None:
        """A leaving cell returns its unfinished micro-step to the head of the queue."""
        micro = self.in_progress.pop(cell, None)
        if micro is not None:
            self.claimable.appendleft(micro)

    def start_update(self) -> bool:
        if self.updating or not self.update_pending:
            return False
        self.updating = True
        return True

    def apply_update(self, update_s: float) -> int:
        self.updating = False
        self.version += 1
        self.work_s += update_s
        self.assigned = self.done = 0
        self._fill()
        return self.version
