"""Simulated inference side: the proxy's queue in front of the inference cells' slots.

A call holds one slot of one cell for its latency (GPU time ~ tokens). The proxy sends a
queued call to the accepting cell with the most free slots. A draining cell accepts no
new calls; migrating moves its running calls, with their KV (their remaining time is
kept, as with an RDMA KV transfer), to the front of the queue, so no call fails.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class Call:
    id: int
    rollout: int
    remaining: float  # seconds of service left
    cell: str | None = None
    started_at: float = 0.0
    ends_at: float = 0.0


class InferencePool:
    def __init__(self, slots_per_cell: int) -> None:
        self.slots = slots_per_cell
        self.running: dict[str, dict[int, Call]] = {}  # cells holding calls (serving or draining)
        self.accepting: dict[str, bool] = {}
        self.paused_until: dict[str, float] = {}
        self.queue: deque[Call] = deque()
        self.executed_s = 0.0  # slot-seconds of model calls served
        self.migrated = 0  # calls moved off a switching cell

    # -- cells ---------------------------------------------------------------------------

    def add_cell(self, cell: str, now: float, paused_until: float = 0.0) -> None:
        self.running.setdefault(cell, {})
        self.accepting[cell] = True
        self.paused_until[cell] = paused_until

    def stop_accepting(self, cell: str) -> None:
        self.accepting[cell] = False

    def migrate_out(self, cell: str, now: float) -> int:
        """Move the cell's running calls to the head of the queue, keeping their progress."""
        moved = sorted(self.running.get(cell, {}).values(), key=lambda c: c.id)
        for call in reversed(moved):
            self._stop(call, now)
            self.queue.appendleft(call)
        self.running[cell] = {}
        self.migrated += len(moved)
        return len(moved)

    def remove_cell(self, cell: str, now: float) -> None:
        self.migrate_out(cell, now)
        self.running.pop(cell, None)
        self.accepting.pop(cell, None)
        self.paused_until.pop(cell, None)

    def pause_all(self, until: float) -> list[str]:
        """New weights: accepting cells start no call until ``until``."""
        cells = [c for c, ok in self.accepting.items() if ok]
        for c in cells:
            self.paused_until[c] = until
        return cells

    # -- calls ---------------------------------------------------------------------------

    def submit(self, call: Call) -> None:
        self.queue.append(call)

    def dispatch(self, now: float) -> list[Call]:
        """Start queued calls on free slots; returns the started calls."""
        started: list[Call] = []
        while self.queue:
            cell = self._freest(now)
            if cell is None:
                break
            call = self.queue.popleft()
            call.cell, call.started_at, call.ends_at = cell, now, now + call.remaining
            self.running[cell][call.id] = call
            started.append(call)
        return started

    def finish(self, cell: str, call_id: int, now: float) -> Call | None:
        """The call's completion, or ``None`` if it had moved or been cancelled."""
        call = self.running.get(cell, {}).get(call_id)
        if call is None or call.ends_at > now + 1e-9:
            return None
        del self.running[cell][call_id]
        self.executed_s += now - call.started_at
        call.remaining = 0.0
        return call

    def _stop(self, call: Call, now: float) -> None:
        self.executed_s += now - call.started_at
        call.remaining = max(0.0, call.ends_at - now)
        call.cell = None

    def _freest(self, now: float) -> str | None:
        best, best_free = None, 0
        for cell, ok in self.accepting.items():
            if not ok or self.paused_until.get(cell, 0.0) > now:
                continue
            free = self.slots - len(self.running[cell])
            if free > best_free:
                best, best_free = cell, free
        return best

    def end_session(self, rollout: int, now: float) -> None:
        """A rollout ended; this model keeps no per-session state (see ``sessions.py``)."""

    # -- what the scheduler sees ---------------------------------------------------------

    @property
    def queued_count(self) -> int:
        return len(self.queue)

    @property
    def running_count(self) -> int:
        return sum(len(calls) for calls in self.running.values())

    def calls_by_cell(self) -> dict[str, int]:
        return {cell: len(calls) for cell, calls in self.running.items()}
