"""Projection runner: apply events to SQL read models, exactly once, in stream order.

For each stream a projection reads, the runner tails the stream from the sequence stored
in ``projection_offsets`` (+1) and applies events in batches; each batch's rows and the new
offset commit in ONE transaction. A crash anywhere rolls the batch back, and the restart
resumes from the committed offset: nothing is skipped, nothing applied twice. The
database, not the server, holds the position, so this works the same for replay from an
exported file.

An event that does not decode, or whose handler keeps failing (``max_attempts``), is
dead-lettered with the reason and its offset is passed; the projection keeps going. A
database that cannot be reached (a connection error, a locked SQLite file) is no fault
of the event's: the runner waits and tries again for as long as it takes (backing off
up to ``DB_RETRY_MAX_S``), so an outage stalls the read models and skips nothing.

The log may hold one event twice at two sequences (a publisher's retry after a lost ack,
past the bus's de-duplication window: same event id, same bytes). A projection with an
``already_applied`` check (the read models look the event id up in ``events``) skips
such a second copy, earlier batches' or its own batch's, and its offset still advances;
an event whose id is taken by a *different* event is not skipped, so that integrity
error still fails and is dead-lettered.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from sqlalchemy import Engine, select
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.orm import Session

from ..bus.port import Delivery, EventBus, RawMessage
from ..events import Context, Event, EventDecodeError, decode, event_types
from .models import ProjectionOffset

log = logging.getLogger(__name__)

Apply = Callable[[Session, Delivery], None]

DB_RETRY_MAX_S = 30.0  # the longest wait between tries while the database is unreachable


def database_unavailable(exc: BaseException) -> bool:
    """An error of the connection or the server (not of the event or the handler).

    Where the driver gives a SQLSTATE (PostgreSQL), only connection exceptions (class 08),
    an operator or crash shutdown (57P01-57P03) and insufficient resources (class 53)
    count: psycopg also files errors one event's statement causes (a cancelled or too
    large query) as operational, and those must not stall the projection for good."""
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    if not isinstance(exc, (OperationalError, InterfaceError)):
        return False
    state = getattr(getattr(exc, "orig", None), "sqlstate", None)
    if isinstance(state, str) and state:
        return state.startswith(("08", "53")) or state in ("57P01", "57P02", "57P03")
    return True  # no SQLSTATE (SQLite: a locked or unreadable file; a lost connection)


@dataclass
class Projection:
    """A named set of handlers, by event type name; the runner reads their streams."""

    name: str
    handlers: dict[str, Apply] = field(default_factory=dict)
    # called for every event of the projection's streams, before its typed handler
    on_any: Apply | None = None
    # True for a second stored copy of an event already applied (same event id): the
    # runner skips it. Sees the rows of the events before it in the same batch.
    already_applied: Callable[[Session, Event], bool] | None = None

    def on(self, *types: type[Event]) -> Callable[[Apply], Apply]:
        def deco(fn: Apply) -> Apply:
            for t in types:
                self.handlers[t.TYPE] = fn
            return fn

        return deco

    def contexts(self) -> list[Context]:
        if self.on_any is not None:
            return list(Context)
        types = event_types()
        return sorted({types[t].CONTEXT for t in self.handlers}, key=lambda c: c.value)


def read_offset(session: Session, projection: str, stream: str) -> int:
    row = session.get(ProjectionOffset, (projection, stream))
    return row.last_seq if row else 0


def offsets(engine: Engine, projection: str) -> dict[str, int]:
    with Session(engine) as s:
        rows = s.scalars(select(ProjectionOffset).where(ProjectionOffset.projection == projection))
        return {r.stream: r.last_seq for r in rows}


class ProjectionRunner:
    def __init__(
        self,
        engine: Engine,
        bus: EventBus,
        projection: Projection,
        *,
        batch_max: int = 500,
        max_attempts: int = 3,
        retry_delay_s: float = 0.5,
        filter_run: str | None = None,
    ) -> None:
        self.engine = engine
        self.bus = bus
        self.projection = projection
        self.batch_max = batch_max
        self.max_attempts = max_attempts
        self.retry_delay_s = retry_delay_s
        self.filter_run = filter_run
        self.applied = 0
        self.dead_lettered = 0
        self.duplicates = 0  # second stored copies of an event, skipped

    @property
    def consumer_name(self) -> str:
        return f"projection-{self.projection.name}"

    def _filter(self, context: Context) -> str | None:
        return f"gyre.{self.filter_run}.{context.value}.>" if self.filter_run else None

    async def run(self, stop: asyncio.Event) -> None:
        """Tail every stream of the projection until ``stop`` is set."""
        tasks = [asyncio.create_task(self._run_stream(c, stop, until=None)) for c in self.projection.contexts()]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()

    async def catch_up(self) -> int:
        """Apply everything stored now, then return how many events were applied."""
        before = self.applied
        for c in self.projection.contexts():
            end = await self.bus.last_seq(c)
            await self._run_stream(c, asyncio.Event(), until=end)
        return self.applied - before

    async def _run_stream(self, context: Context, stop: asyncio.Event, until: int | None) -> None:
        stream = context.stream
        with Session(self.engine) as s:
            start = read_offset(s, self.projection.name, stream) + 1
        if until is not None and start > until:
            return
        batch: list[RawMessage] = []
        # catching up: only a long silence means the (filtered) stream has nothing more
        idle = 1.0 if until is not None else 0.05
        follow = self.bus.follow(context, start_seq=start, filter_subject=self._filter(context), idle_s=idle)
        try:
            async for raw in follow:
                if raw is not None:
                    batch.append(raw)
                done = until is not None and (raw is None or raw.seq >= until)
                if batch and (raw is None or len(batch) >= self.batch_max or done):
                    await self._apply(stream, batch)
                    batch = []
                if done or stop.is_set():
                    return
        finally:
            await follow.aclose()

    async def _apply(self, stream: str, batch: list[RawMessage]) -> None:
        try:
            await asyncio.to_thread(self._commit_batch, stream, batch)
            return
        except Exception as exc:  # a bad event poisons the batch: redo one by one
            log.warning("projection %s: batch on %s failed (%r); applying one by one", self.projection.name, stream, exc)
        for raw in batch:
            await self._apply_one(stream, raw)

    async def _apply_one(self, stream: str, raw: RawMessage) -> None:
        attempt, outage = 0, 0
        while True:
            try:
                await asyncio.to_thread(self._commit_batch, stream, [raw])
                return
            except EventDecodeError as exc:
                reason = f"undecodable: {exc}"
                break
            except Exception as exc:
                if database_unavailable(exc):  # not the event's fault: wait for the database
                    outage += 1
                    wait = min(self.retry_delay_s * 2 ** min(outage, 10), DB_RETRY_MAX_S)
                    (log.error if outage in (1, 10) or outage % 100 == 0 else log.debug)(
                        "projection %s: the database is unavailable (%r); %s seq %d waits, try %d, next in %.1fs",
                        self.projection.name, exc, stream, raw.seq, outage, wait)
                    await asyncio.sleep(wait)
                    continue
                attempt += 1
                reason = f"handler failed {attempt} times: {exc!r}"
                if attempt >= self.max_attempts:
                    break
                await asyncio.sleep(self.retry_delay_s)
        await self.bus.dead_letter(self.consumer_name, raw, reason)
        await asyncio.to_thread(self._commit_batch, stream, [raw], skip=True)
        self.dead_lettered += 1

    def _commit_batch(self, stream: str, batch: list[RawMessage], *, skip: bool = False) -> None:
        with Session(self.engine) as s, s.begin():
            row = s.get(ProjectionOffset, (self.projection.name, stream), with_for_update=True)
            if row is None:
                row = ProjectionOffset(projection=self.projection.name, stream=stream, last_seq=0, applied=0)
                s.add(row)
            n = dups = 0
            for raw in batch:
                if raw.seq <= row.last_seq:
                    continue  # already applied (e.g. a second runner raced us)
                if not skip:
                    event = decode(raw.data)
                    seen = self.projection.already_applied
                    if seen is not None and seen(s, event):
                        log.info("projection %s: %s seq %d is a second stored copy of event %s; skipped",
                                 self.projection.name, stream, raw.seq, event.event_id)
                        dups += 1
                    else:
                        self._dispatch(s, Delivery(event, stream, raw.seq, raw.subject))
                        n += 1
                row.last_seq = raw.seq
            row.applied = (row.applied or 0) + n
            row.updated_at = datetime.now(UTC)
        self.applied += n
        self.duplicates += dups

    def _dispatch(self, s: Session, d: Delivery) -> None:
        if self.projection.on_any is not None:
            self.projection.on_any(s, d)
        handler = self.projection.handlers.get(d.event.TYPE)
        if handler is not None:
            handler(s, d)
        s.flush()
