"""In-memory adapter of the bus port: the same contract as JetStream, in one process.

For pure unit tests of services and for replaying an exported log without a server.
Streams are lists; a durable consumer's position is kept by name for the bus's lifetime;
event ids are de-duplicated like ``Nats-Msg-Id`` (for the whole lifetime, not a window).
One difference: a ``Deferred`` event is tried again in place, as any failure (JetStream
hands it back and lets the events after it go first); as there, it is never dead-lettered
and its tries do not count toward ``max_deliver``.
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from datetime import datetime

from ..events import Context, Event, EventDecodeError, decode
from .port import (ConcurrencyConflict, ConsumerConfig, Deferred, Delivery, Handler, PermanentError, RawMessage,
                   StopSignal, skip_undecodable)


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS wildcard match: ``*`` one token, ``>`` the rest."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


@dataclass
class _Stored:
    seq: int
    subject: str
    data: bytes
    time: datetime


@dataclass
class DeadLetter:
    consumer: str
    stream: str
    seq: int
    reason: str
    data: bytes


@dataclass
class InMemoryBus:
    streams: dict[str, list[_Stored]] = field(default_factory=dict)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    _ids: dict[str, tuple[str, int]] = field(default_factory=dict)
    _positions: dict[str, int] = field(default_factory=dict)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def publish(self, event: Event, *, expect_last_subject_seq: int | None = None,
                      expect_subject: str | None = None) -> int:
        if expect_last_subject_seq is not None and event.event_id not in self._ids:
            last = await self.last_on_subject(event.CONTEXT, expect_subject or event.subject)
            if (last.seq if last else 0) != expect_last_subject_seq:
                raise ConcurrencyConflict(f"{event.subject}: newer than {expect_last_subject_seq}")
        return self.append(event.CONTEXT.stream, event.subject, event.to_json(), event.event_id, event.time)

    async def publish_many(self, events: Iterable[Event]) -> list[int]:
        return [await self.publish(ev) for ev in events]

    def append(self, stream: str, subject: str, data: bytes, msg_id: str, time: datetime) -> int:
        if msg_id in self._ids:
            return self._ids[msg_id][1]
        log = self.streams.setdefault(stream, [])
        seq = (log[-1].seq if log else 0) + 1
        log.append(_Stored(seq, subject, data, time))
        self._ids[msg_id] = (stream, seq)
        self._changed.set()
        return seq

    def load(self, stream: str, seq: int, subject: str, data: bytes, time: datetime) -> None:
        """Put back an exported message at its original sequence (for replay)."""
        log = self.streams.setdefault(stream, [])
        if log and seq <= log[-1].seq:
            raise ValueError(f"{stream}: sequence {seq} after {log[-1].seq}; exports must be in order")
        log.append(_Stored(seq, subject, data, time))
        self._changed.set()

    def _index(self, stream: str, seq: int) -> int:
        return bisect.bisect_left([m.seq for m in self.streams.get(stream, [])], seq)

    async def last_seq(self, context: Context) -> int:
        log = self.streams.get(context.stream, [])
        return log[-1].seq if log else 0

    async def run_consumer(self, config: ConsumerConfig, handler: Handler, *, stop: StopSignal) -> None:
        stream = config.context.stream
        pattern = config.filter_subject or config.context.subjects
        pos = self._positions.setdefault(config.name, self._index(stream, config.start_seq or 1))
        attempts: dict[int, int] = {}
        failures: dict[int, int] = {}  # tries that failed (not deferred): what max_deliver counts
        while not stop.is_set():
            log = self.streams.get(stream, [])
            if pos >= len(log):
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), 0.05)
                except TimeoutError:
                    pass
                continue
            item = log[pos]
            if subject_matches(pattern, item.subject) and (config.start_time is None or item.time >= config.start_time):
                attempts[item.seq] = attempts.get(item.seq, 0) + 1
                ok = await self._deliver(config, handler, item, attempts[item.seq], failures)
                if not ok:
                    await asyncio.sleep(config.retry_delay_s)
                    continue
            pos += 1
            self._positions[config.name] = pos

    async def _deliver(self, config: ConsumerConfig, handler: Handler, item: _Stored, n: int,
                       failures: dict[int, int]) -> bool:
        try:
            event = decode(item.data)
        except EventDecodeError as exc:
            self._dead(config, item, f"undecodable: {exc}")
            return True
        try:
            await handler(Delivery(event, config.context.stream, item.seq, item.subject, n))
        except PermanentError as exc:
            self._dead(config, item, f"rejected: {exc}")
        except Deferred:
            return False  # waits on something else: never dead-lettered
        except Exception as exc:
            failures[item.seq] = failures.get(item.seq, 0) + 1
            if failures[item.seq] >= config.max_deliver:
                self._dead(config, item, f"failed {failures[item.seq]} times: {exc!r}")
                return True
            return False
        return True

    def _dead(self, config: ConsumerConfig, item: _Stored, reason: str) -> None:
        self.dead_letters.append(DeadLetter(config.name, config.context.stream, item.seq, reason, item.data))

    async def last_on_subject(self, context: Context, subject: str) -> RawMessage | None:
        for item in reversed(self.streams.get(context.stream, [])):
            if subject_matches(subject, item.subject):
                return RawMessage(context.stream, item.seq, item.subject, item.data)
        return None

    async def dead_letter(self, consumer: str, message: RawMessage, reason: str) -> None:
        key = (consumer, message.stream, message.seq)
        if all((d.consumer, d.stream, d.seq) != key for d in self.dead_letters):
            self.dead_letters.append(DeadLetter(consumer, message.stream, message.seq, reason, message.data))

    async def follow(
        self, context: Context, *, start_seq: int = 1, filter_subject: str | None = None, idle_s: float = 0.05
    ) -> AsyncIterator[RawMessage | None]:
        pattern = filter_subject or context.subjects
        pos = self._index(context.stream, start_seq)
        while True:
            log = self.streams.get(context.stream, [])
            if pos >= len(log):
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), idle_s)
                except TimeoutError:
                    yield None
                continue
            item = log[pos]
            pos += 1
            if subject_matches(pattern, item.subject):
                yield RawMessage(context.stream, item.seq, item.subject, item.data)

    async def follow_dead_letters(self, consumer: str, *, idle_s: float = 0.05) -> AsyncIterator[RawMessage | None]:
        """As ``JetStreamBus.follow_dead_letters``: the dead letters of ``consumer``, oldest
        first, forever (``None`` after ``idle_s`` without one)."""
        pos = 0
        while True:
            mine = [d for d in self.dead_letters if d.consumer == consumer]
            if pos < len(mine):
                d = mine[pos]
                pos += 1
                yield RawMessage(d.stream, d.seq, "", d.data)
                continue
            await asyncio.sleep(idle_s)
            yield None

    async def read(
        self,
        context: Context,
        *,
        start_seq: int = 1,
        start_time: datetime | None = None,
        filter_subject: str | None = None,
        until_seq: int | None = None,
    ) -> AsyncIterator[Delivery]:
        pattern = filter_subject or context.subjects
        log = list(self.streams.get(context.stream, []))
        for item in log[self._index(context.stream, start_seq):]:
            if until_seq is not None and item.seq > until_seq:
                break
            if start_time is not None and item.time < start_time:
                continue
            if subject_matches(pattern, item.subject):
                try:
                    event = decode(item.data)
                except EventDecodeError as exc:
                    skip_undecodable(context.stream, item.seq, item.subject, exc)
                    continue
                yield Delivery(event, context.stream, item.seq, item.subject, 1)


__all__ = ["DeadLetter", "InMemoryBus", "subject_matches"]
