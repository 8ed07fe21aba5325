"""Which inference cell serves a call: session affinity, least load, drain and moves.

A *session* is one conversation of a rollout (the chain of calls that continue each
other); it stays on the cell that holds its KV cache. New sessions go to the active cell
with the lowest load (in-flight calls / capacity). A draining cell takes no new sessions;
the scheduler moves its live sessions elsewhere (their next call goes to the new cell,
calls in flight finish where they are). A cell marked down is skipped; its sessions move
on their next call.

    >>> r = Router()
    >>> r.add_cell("a", capacity=2); r.add_cell("b", capacity=2)
    >>> r.pick("s1")
    'a'
    >>> r.begin("a"); r.pick("s2")          # a is busier now
    'b'
    >>> r.end("a"); r.pick("s3")            # a tie on load: the cell with fewer sessions
    'a'
    >>> r.drain("a"); r.pick("s1")          # s1 leaves a draining cell
    'b'
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class CellState(str, enum.Enum):
    ACTIVE = "active"
    DRAINING = "draining"
    DOWN = "down"


class NoCellAvailable(RuntimeError):
    pass


@dataclass
class Cell:
    name: str
    capacity: int = 1
    state: CellState = CellState.ACTIVE
    in_flight: int = 0

    @property
    def load(self) -> float:
        return self.in_flight / max(self.capacity, 1)


@dataclass
class Router:
    cells: dict[str, Cell] = field(default_factory=dict)
    sessions: dict[str, str] = field(default_factory=dict)  # session -> cell

    def add_cell(self, name: str, capacity: int = 1) -> None:
        cell = self.cells.get(name)
        if cell is None:
            self.cells[name] = Cell(name, capacity)
        else:
            cell.capacity, cell.state = capacity, CellState.ACTIVE

    def remove_cell(self, name: str) -> None:
        self.cells.pop(name, None)
        self.sessions = {s: c for s, c in self.sessions.items() if c != name}

    def drain(self, name: str) -> None:
        self._cell(name).state = CellState.DRAINING

    def activate(self, name: str) -> None:
        self._cell(name).state = CellState.ACTIVE

    def mark_down(self, name: str) -> None:
        if name in self.cells:
            self.cells[name].state = CellState.DOWN

    def move_session(self, session: str, to_cell: str) -> str | None:
        """Pin a session to another cell; returns the cell it was on."""
        if self._cell(to_cell).state is not CellState.ACTIVE:
            raise NoCellAvailable(f"cell {to_cell} is {self.cells[to_cell].state.value}, not active")
        before = self.sessions.get(session)
        self.sessions[session] = to_cell
        return before

    def sessions_on(self, name: str) -> list[str]:
        return [s for s, c in self.sessions.items() if c == name]

    def pick(self, session: str, *, exclude: set[str] = frozenset()) -> str:  # type: ignore[assignment]
        current = self.sessions.get(session)
        if current is not None and current not in exclude:
            cell = self.cells.get(current)
            if cell is not None and cell.state is CellState.ACTIVE:
                return current
        candidates = [c for c in self.cells.values() if c.state is CellState.ACTIVE and c.name not in exclude]
        if not candidates:
            raise NoCellAvailable("no active inference cell")
        pinned: dict[str, int] = {}
        for cell_name in self.sessions.values():
            pinned[cell_name] = pinned.get(cell_name, 0) + 1
        # least busy now; on a tie, the cell holding fewer sessions (their KV caches)
        best = min(candidates, key=lambda c: (c.load, pinned.get(c.name, 0) / max(c.capacity, 1), c.name))
        self.sessions[session] = best.name
        return best.name

    def begin(self, name: str) -> None:
        self._cell(name).in_flight += 1

    def end(self, name: str) -> None:
        if name in self.cells:
            self.cells[name].in_flight = max(0, self.cells[name].in_flight - 1)

    def _cell(self, name: str) -> Cell:
        try:
            return self.cells[name]
        except KeyError:
            raise NoCellAvailable(f"unknown cell {name!r}") from None
