"""Optional inference model where KV memory, not call slots alone, binds (``--sessions-per-cell``).

Long-horizon agents carry 0.7-1M-token contexts. A rollout's session keeps its KV blocks
on one cell between calls (while its tools run), so a cell holds at most
``sessions_per_cell`` sessions, and a call must run on its session's cell. A new rollout
waits until some cell has room. A draining cell moves its sessions, KV included, to cells
with room (the seed's RDMA migration); sessions that fit nowhere are evicted and pay
``reprefill_s`` on their next call. This is what the design's water level "or unfinished
rollouts" measures; the elastic policy then counts sessions, not calls.
"""

from __future__ import annotations

from collections import deque

from .inference import Call, InferencePool


class SessionPool(InferencePool):
    def __init__(self, slots_per_cell: int, sessions_per_cell: int, reprefill_s: float) -> None:
        super().__init__(slots_per_cell)
        self.sessions = sessions_per_cell
        self.reprefill_s = reprefill_s
        self.home: dict[int, str] = {}  # rollout -> cell holding its session
        self.resident: dict[str, set[int]] = {}
        self.local: dict[str, deque[Call]] = {}  # calls waiting for a slot on their home cell
        self.evicted: set[int] = set()
        self.session_s = 0.0  # session-seconds held (memory work)
        self._held_since = 0.0
        self.evictions = 0

    def _account(self, now: float) -> None:
        self.session_s += sum(len(s) for s in self.resident.values()) * (now - self._held_since)
        self._held_since = now

    def add_cell(self, cell: str, now: float, paused_until: float = 0.0) -> None:
        super().add_cell(cell, now, paused_until)
        self.resident.setdefault(cell, set())
        self.local.setdefault(cell, deque())

    def submit(self, call: Call) -> None:
        home = self.home.get(call.rollout)
        if home is not None and self.accepting.get(home):
            self.local[home].append(call)
            return
        if call.rollout in self.evicted:
            self.evicted.discard(call.rollout)
            call.remaining += self.reprefill_s
        self.queue.append(call)

    def dispatch(self, now: float) -> list[Call]:
        started: list[Call] = []
        for cell, ok in self.accepting.items():
            if ok and self.paused_until.get(cell, 0.0) <= now:
                while self.local[cell] and len(self.running[cell]) < self.slots:
                    started.append(self._start(self.local[cell].popleft(), cell, now))
        while self.queue:
            cell = self._roomiest(now)
            if cell is None:
                break
            call = self.queue.popleft()
            self._account(now)
            old = self.home.get(call.rollout)
            if old is not None:  # its cell is draining: the session moves with this call
                self.resident[old].discard(call.rollout)
            self.home[call.rollout] = cell
            self.resident[cell].add(call.rollout)
            started.append(self._start(call, cell, now))
        return started

    def _start(self, call: Call, cell: str, now: float) -> Call:
        call.cell, call.started_at, call.ends_at = cell, now, now + call.remaining
        self.running[cell][call.id] = call
        return call

    def _roomiest(self, now: float) -> str | None:
        best, best_room = None, 0
        for cell, ok in self.accepting.items():
            if not ok or self.paused_until.get(cell, 0.0) > now or len(self.running[cell]) >= self.slots:
                continue
            room = self.sessions - len(self.resident[cell])
            if room > best_room:
                best, best_room = cell, room
        return best

    def end_session(self, rollout: int, now: float) -> None:
        cell = self.home.pop(rollout, None)
        self.evicted.discard(rollout)
        if cell is not None:
            self._account(now)
            self.resident[cell].discard(rollout)

    def migrate_out(self, cell: str, now: float) -> int:
        """Move the cell's sessions (KV and pending calls) to cells with room; evict the rest."""
        moved_calls = super().migrate_out(cell, now)  # running calls -> head of the queue
        pending = [c for c in self.queue if self.home.get(c.rollout) == cell]
        pending += list(self.local.get(cell, ()))
        self.local[cell] = deque()
        self.queue = deque(c for c in self.queue if self.home.get(c.rollout) != cell)
        self._account(now)
        by_rollout = {c.rollout: c for c in pending}
        for rollout in sorted(self.resident.get(cell, ())):
            self.home.pop(rollout, None)
            target = self._room_elsewhere(cell)
            call = by_rollout.get(rollout)
            if target is None:
                self.evictions += 1
                if call is not None:
                    call.remaining += self.reprefill_s
                    self.queue.appendleft(call)
                else:
                    self.evicted.add(rollout)
                continue
            self.home[rollout] = target
            self.resident[target].add(rollout)
            if call is not None:
                self.local[target].appendleft(call)
        self.resident[cell] = set()
        return moved_calls

    def _room_elsewhere(self, cell: str) -> str | None:
        rooms = [(self.sessions - len(self.resident[c]), c) for c, ok in self.accepting.items() if ok and c != cell]
        rooms = [(r, c) for r, c in rooms if r > 0]
        return max(rooms)[1] if rooms else None

    def remove_cell(self, cell: str, now: float) -> None:
        self.migrate_out(cell, now)
        super().remove_cell(cell, now)

    @property
    def queued_count(self) -> int:
        return len(self.queue) + sum(len(q) for q in self.local.values())

    def calls_by_cell(self) -> dict[str, int]:
        """Sessions per cell: what makes a cell busy in this model."""
        return {cell: len(s) for cell, s in self.resident.items() if cell in self.running}
