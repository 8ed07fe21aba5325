"""Which inference cell serves a call: session affinity, least load, drain and moves.

A *session* is one conversation of a rollout (the chain of calls that continue each
other); it stays on the cell that holds its KV cache. New sessions go to the active cell
with the lowest load (in-flight calls / capacity). A draining cell takes no new sessions;
the scheduler moves its live sessions elsewhere (their next call goes to the new cell,
calls in flight finish where they are). A cell marked down is skipped; its sessions move
on their next call.

Sessions are named ``<rollout>/<call>``; ``forget_rollout`` drops a finished rollout's
sessions, so the table holds live conversations only. Each cell keeps the set of its
sessions, so picking a cell costs O(cells) and evacuating one O(its sessions).

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
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType


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


class Router:
    def __init__(self) -> None:
        self.cells: dict[str, Cell] = {}
        self._sessions: dict[str, str] = {}  # session -> cell
        self._on_cell: dict[str, set[str]] = {}  # cell -> its sessions
        self._by_rollout: dict[str, set[str]] = {}  # rollout -> its sessions

    @property
    def sessions(self) -> Mapping[str, str]:
        """session -> cell (read-only: change it through pin/unpin so the indexes agree)."""
        return MappingProxyType(self._sessions)

    def add_cell(self, name: str, capacity: int = 1) -> None:
        cell = self.cells.get(name)
        if cell is None:
            self.cells[name] = Cell(name, capacity)
        else:
            cell.capacity, cell.state = capacity, CellState.ACTIVE

    def remove_cell(self, name: str) -> None:
        self.cells.pop(name, None)
        for session in list(self._on_cell.get(name, ())):
            self.unpin(session)
        self._on_cell.pop(name, None)

    def drain(self, name: str) -> None:
        self._cell(name).state = CellState.DRAINING

    def activate(self, name: str) -> None:
        self._cell(name).state = CellState.ACTIVE

    def mark_down(self, name: str) -> None:
        if name in self.cells:
            self.cells[name].state = CellState.DOWN

    # -- the session table ---------------------------------------------------------------

    def pin(self, session: str, cell: str) -> str | None:
        before = self.unpin(session)
        self._sessions[session] = cell
        self._on_cell.setdefault(cell, set()).add(session)
        self._by_rollout.setdefault(_rollout_of(session), set()).add(session)
        return before

    def unpin(self, session: str) -> str | None:
        cell = self._sessions.pop(session, None)
        if cell is not None:
            self._on_cell.get(cell, set()).discard(session)
            group = self._by_rollout.get(_rollout_of(session))
            if group is not None:
                group.discard(session)
                if not group:
                    del self._by_rollout[_rollout_of(session)]
        return cell

    def forget_rollout(self, rollout_id: str) -> int:
        """Drop the sessions of a rollout that has ended; returns how many."""
        sessions = list(self._by_rollout.get(rollout_id, ()))
        for session in sessions:
            self.unpin(session)
        return len(sessions)

    def pinned(self, name: str) -> int:
        return len(self._on_cell.get(name, ()))

    def move_session(self, session: str, to_cell: str) -> str | None:
        """Pin a session to another cell; returns the cell it was on."""
        if self._cell(to_cell).state is not CellState.ACTIVE:
            raise NoCellAvailable(f"cell {to_cell} is {self.cells[to_cell].state.value}, not active")
        return self.pin(session, to_cell)

    def sessions_on(self, name: str) -> list[str]:
        return sorted(self._on_cell.get(name, ()))

    def pick(self, session: str, *, exclude: set[str] = frozenset()) -> str:  # type: ignore[assignment]
        current = self._sessions.get(session)
        if current is not None and current not in exclude:
            cell = self.cells.get(current)
            if cell is not None and cell.state is CellState.ACTIVE:
                return current
        candidates = [c for c in self.cells.values() if c.state is CellState.ACTIVE and c.name not in exclude]
        if not candidates:
            raise NoCellAvailable("no active inference cell")
        # least busy now; on a tie, the cell holding fewer sessions (their KV caches)
        best = min(candidates, key=lambda c: (c.load, self.pinned(c.name) / max(c.capacity, 1), c.name))
        self.pin(session, best.name)
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


def _rollout_of(session: str) -> str:
    return session.split("/", 1)[0]
