"""Moving live sessions off a cell: the proxy's half of a role switch.

``evacuate(service, cell)``: the cell takes no new sessions (drain), calls in flight
finish there (bounded wait), then every session pinned to it moves to the least-loaded
active cell. With ``migrate`` the session's cached prefix (its newest call's input and
output ids) is exported from the old cell's KV cache and imported into the new one, so
the session's next call computes only its new tokens; if that fails, the session is
re-prefilled (its next call recomputes the prefix). Either way one ``SessionRerouted``
records the move. A ``KvMover`` can carry the blocks another way (the transfer port);
the default goes through the engines' HTTP export/import.

``deadline_s`` bounds the whole evacuation (the cell agent passes one shorter than its own
HTTP timeout, so the proxy has stopped before the agent gives up and rolls the switch
back): the drain waits at most until then, no move starts past it, and the KV copy of the
move under way gets only the time left (cut short, the session is re-prefilled on its new
cell: slower, never wrong). A cell re-activated meanwhile (its switch rolled back) keeps
the sessions not moved yet, too. The answer says what moved (``moves``), what stayed on
the cell (``left``), whether every session is off it (``complete``) and why it stopped
early (``stopped``): the agent then rolls back to inference, and the sessions left are
served where their KV cache is.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from libs.common.events import SessionRerouted

from .core.routing import CellState

log = logging.getLogger(__name__)


class KvMover(Protocol):
    async def move(self, source: Any, target: Any, input_ids: list[int]) -> int:
        """Copy the cached prefix of ``input_ids`` from source to target; tokens moved."""


class KvNotMoved(RuntimeError):
    """The copy ran, but the target holds none of the session's prefix (the source had none
    cached, or the target's cache could not keep it): the session is re-prefilled."""


class HttpKvMover:
    """Export from the source engine, import into the target (Gyre's engine extension).
    Raises :class:`KvNotMoved` unless the target holds the whole exported prefix, so a copy
    that kept nothing is recorded as a re-prefill, not as a migration."""

    async def move(self, source: Any, target: Any, input_ids: list[int]) -> int:
        blob = await source.kv_export(input_ids)
        answer = await target.kv_import(blob)
        if answer.get("success") is False:
            raise KvNotMoved(answer.get("message") or "the target did not keep the prefix")
        if not answer.get("tokens", 1):
            raise KvNotMoved("the source cell had none of the session's prefix cached")
        return int(answer.get("added_tokens", 0) or 0)


@dataclass
class MoveResult:
    session: str
    to_cell: str
    kv: str  # migrated | reprefilled
    tokens: int = 0
    error: str | None = None


@dataclass
class Evacuation:
    cell: str
    drained: bool
    in_flight: int
    seconds: float
    moves: list[MoveResult] = field(default_factory=list)
    deadline_s: float | None = None  # the overall bound asked for (None: none)
    left: list[str] = field(default_factory=list)  # sessions still pinned to the cell (not moved)
    stopped: str | None = None  # why it stopped before moving every session: deadline | reactivated

    @property
    def complete(self) -> bool:
        """Calls drained and no session left on the cell."""
        return self.drained and not self.left


def check_deadline(value: Any) -> float | None:
    """``deadline_s`` of an evacuation request: None, or a positive, finite number of seconds."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"'deadline_s' must be a positive number of seconds, got {value!r}")
    return float(value)


def session_tokens(service: Any, session: str) -> list[int] | None:
    """Input + output ids of the newest recorded call of ``session`` (None if unknown)."""
    rollout = session.split("/", 1)[0]
    st = service.book.states.get(rollout)
    if st is None:
        return None
    calls = [c for c, s in st.call_session.items() if s == session and c in st.tito.calls]
    if not calls:
        return None
    return st.tito.full_ids(calls[-1]).tolist()


async def drain(router: Any, cell: str, timeout_s: float) -> int:
    """No new sessions on ``cell``; wait (bounded) for its calls in flight; returns how
    many are still running."""
    router.drain(cell)
    deadline = time.monotonic() + timeout_s
    while router.cells[cell].in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return router.cells[cell].in_flight


async def evacuate(service: Any, cell: str, *, timeout_s: float = 30.0, migrate: bool = True,
                   mover: KvMover | None = None, deadline_s: float | None = None) -> Evacuation:
    router = service.router
    start = time.monotonic()
    deadline = math.inf if deadline_s is None else start + check_deadline(deadline_s)
    busy = await drain(router, cell, min(timeout_s, deadline - start))
    out = Evacuation(cell, busy == 0, busy, 0.0, deadline_s=deadline_s)
    if busy:  # calls still running: the switch fails and rolls back, so its sessions stay
        out.left = router.sessions_on(cell)
        out.seconds = time.monotonic() - start
        return out
    mover = mover or HttpKvMover()
    for session in router.sessions_on(cell):
        if router.sessions.get(session) != cell:  # a new turn already took it elsewhere meanwhile
            continue
        if out.stopped is None and time.monotonic() >= deadline:
            out.stopped = "deadline"
        elif out.stopped is None and getattr(router.cells.get(cell), "state", None) is CellState.ACTIVE:
            out.stopped = "reactivated"  # its switch rolled back meanwhile: the rest stays
        if out.stopped is not None:
            continue
        out.moves.append(await _move_one(service, session, cell, migrate, mover, deadline))
    out.left = router.sessions_on(cell)  # not moved: still served here once it is active again
    out.seconds = time.monotonic() - start
    if out.stopped is not None:
        log.warning("evacuation of %s stopped (%s) after %.1fs: %d session(s) moved, %d left on the cell", cell,
                    out.stopped, out.seconds, len(out.moves), len(out.left))
    return out


async def _move_one(service: Any, session: str, cell: str, migrate: bool, mover: KvMover,
                    deadline: float = math.inf) -> MoveResult:
    router = service.router
    router.unpin(session)
    target = router.pick(session)  # least-loaded active cell; pins the session there
    result = MoveResult(session, target, "reprefilled")
    ids = session_tokens(service, session) if migrate else None
    if ids:
        try:
            copy = mover.move(service.clients[cell], service.clients[target], ids)
            left_s = deadline - time.monotonic()
            result.tokens = await (copy if math.isinf(left_s) else asyncio.wait_for(copy, max(left_s, 0.0)))
            result.kv = "migrated"
        except Exception as exc:  # the next call re-prefills: slower, never wrong
            result.error = repr(exc)
            log.warning("KV migration of %s from %s to %s failed: %r", session, cell, target, exc)
    await service.bus.publish(SessionRerouted(
        run_id=service.config.run_id, session_id=session, from_cell=cell, to_cell=target,
        reason="cell switching to training" if migrate else "cell drained", kv=result.kv,
        migrated_tokens=result.tokens))
    return result
