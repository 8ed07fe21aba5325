"""Simulated inference side: the proxy's queue in front of the inference cells' slots.

A call holds one slot of one cell for its latency (GPU time ~ tokens). The proxy sends a
queued call to the accepting cell with the most free slots. A draining cell accepts no
new calls; migrating moves its running calls, with their KV (their remaining time is
kept, as with an RDMA KV transfer), to the front of the queue, so no call fails.

By default a call's latency does not depend on how many calls share its cell (decode is
memory-bound: a step reads the weights once for the whole batch), so a cell's throughput
grows with its calls up to ``slots``. ``full_batch_slowdown`` > 1 makes a decode step
grow with the batch (per-sequence work: KV reads and attention over long contexts): a
step with ``b`` calls takes ``1 + a (b - 1)`` times a lone call's step, with ``a`` set so
a full cell's step takes ``full_batch_slowdown`` times a lone call's. Call seconds in the
workload are latencies on a full cell, so a call on a lightly loaded cell runs faster,
and the work a call leaves (``executed_s``) is counted in full-cell seconds either way.
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
    rate: float = 1.0  # full-cell seconds served per second (batch-dependent model)
    since: float = 0.0  # when ``remaining`` was last brought up to date


class InferencePool:
    def __init__(self, slots_per_cell: int, full_batch_slowdown: float = 1.0) -> None:
        self.slots = slots_per_cell
        # per-extra-call growth of a decode step; 0: latency independent of the batch
        self.alpha = (full_batch_slowdown - 1.0) / (slots_per_cell - 1) if slots_per_cell > 1 else 0.0
        self.slowdown = full_batch_slowdown
        self.retimed: list[Call] = []  # running calls whose end moved (the engine re-schedules them)
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
            if self.alpha:
                self._settle(cell, now)
            call.cell, call.started_at, call.ends_at = cell, now, now + call.remaining
            call.since, call.rate = now, 1.0
            self.running[cell][call.id] = call
            started.append(call)
            if self.alpha:
                self._retime(cell, now)
        return started

    # -- batch-dependent latency (full_batch_slowdown > 1) -------------------------------

    def _speed(self, batch: int) -> float:
        """Full-cell seconds per second for each of ``batch`` calls on one cell."""
        return self.slowdown / (1.0 + self.alpha * (max(1, batch) - 1))

    def _settle(self, cell: str, now: float) -> None:
        """Bring every running call of ``cell`` up to ``now`` at its current rate."""
        for call in self.running.get(cell, {}).values():
            done = min(call.remaining, (now - call.since) * call.rate)
            call.remaining -= done
            self.executed_s += done
            call.since = now

    def _retime(self, cell: str, now: float) -> None:
        """New batch on ``cell``: new rates and ends for its (settled) calls."""
        calls = self.running.get(cell, {})
        rate = self._speed(len(calls))
        for call in calls.values():
            call.rate = rate
            call.ends_at = now + call.remaining / rate
            self.retimed.append(call)

    def take_retimed(self) -> list[Call]:
        out, self.retimed = self.retimed, []
        return out

    def finish(self, cell: str, call_id: int, now: float) -> Call | None:
        """The call's completion, or ``None`` if it had moved or been cancelled."""
        call = self.running.get(cell, {}).get(call_id)
        if call is None or call.ends_at > now + 1e-9:
            return None
        if self.alpha:
            self._settle(cell, now)
            del self.running[cell][call_id]
            self.executed_s += call.remaining  # rounding left by the settle
            call.remaining = 0.0
            self._retime(cell, now)
            return call
        del self.running[cell][call_id]
        self.executed_s += now - call.started_at
        call.remaining = 0.0
        return call

    def _stop(self, call: Call, now: float) -> None:
        if self.alpha:
            self._settle(call.cell or "", now)  # the whole cell is being emptied
            call.cell = None
            return
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
