"""The bus port: what services need from the event log, whatever carries it.

Adapters: ``jetstream.JetStreamBus`` (NATS JetStream; the real one, always used by the
services) and ``memory.InMemoryBus`` (same contract, for pure unit tests and replay of an
exported log). Both pass ``tests/foundation/test_bus_contract.py``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol, runtime_checkable

from ..events import Context, Event


@dataclass(frozen=True)
class Delivery:
    """One event as read from its stream, with its position there."""

    event: Event
    stream: str
    seq: int  # stream sequence, 1-based, dense per stream
    subject: str
    num_delivered: int = 1


Handler = Callable[[Delivery], Awaitable[None]]


@dataclass(frozen=True)
class RawMessage:
    """A stored message before decoding (projections decode it themselves so that a bad
    one can be dead-lettered with its reason)."""

    stream: str
    seq: int
    subject: str
    data: bytes


class ConcurrencyConflict(Exception):
    """An optimistic append found a newer message on the subject than expected."""


class PermanentError(Exception):
    """A handler raises this for an event it can never apply: it is dead-lettered, not retried."""


class Deferred(Exception):
    """A handler raises this for an event it cannot apply yet (it waits on something else):
    unlike another failure, which the consumer tries again in place, it is handed back to
    the server and redelivered after ``retry_delay_s``, while the events after it go on
    (what it waits on may be one of them; another consumer of the durable may take it).
    It is logged quietly (no error) and never dead-lettered, however often it comes back:
    waiting says nothing against the event. (JetStream counts each hand-back as a
    delivery; a consumer whose handler defers sets ``count_redeliveries=False`` so that
    ``max_deliver`` counts only real failures.)"""


@dataclass(frozen=True)
class ConsumerConfig:
    """A durable consumer: the server remembers its position under ``name``.

    ``filter_subject`` narrows the stream (e.g. ``gyre.run1.rollouts.>``). A handler that
    returns normally gets its message acked; one that raises is tried again after
    ``retry_delay_s``, in stream order (the events behind it wait and are not charged),
    up to ``max_deliver`` tries in all, then dead-lettered (with ``heartbeat_s`` a
    running handler keeps its event however long it takes); an event that does
    not decode, or a ``PermanentError``, is dead-lettered at once. Dead letters go to
    ``gyredlq.<name>`` with the reason in the ``Gyre-Dead-Reason`` header.
    """

    name: str
    context: Context
    filter_subject: str | None = None
    batch: int = 1000
    max_deliver: int = 5
    retry_delay_s: float = 1.0
    ack_wait_s: float = 30.0
    # While a handler runs, tell the server every this many seconds that the event is in
    # progress (JetStream's +WPI): a long handler keeps its claim however long it takes,
    # and a dead one loses it ``ack_wait_s`` after its last word. None: no heartbeat (a
    # handler slower than ack_wait_s sees its event delivered again elsewhere).
    heartbeat_s: float | None = None
    # Whether the server's earlier deliveries of an event count toward ``max_deliver``
    # (True: a handler that kills its process each time is dead-lettered at last). False
    # for a consumer whose events are handed back in the ordinary course (``Deferred``,
    # a worker leaving): there ``max_deliver`` counts only the failed tries of the current
    # delivery, so hand-backs never use up an event's tries.
    count_redeliveries: bool = True
    start_seq: int | None = None  # for a new consumer: deliver from this sequence
    start_time: datetime | None = None  # ... or from this time


@runtime_checkable
class EventBus(Protocol):
    async def publish(self, event: Event, *, expect_last_subject_seq: int | None = None,
                      expect_subject: str | None = None) -> int:
        """Append one event; returns its stream sequence once the server has stored it.

        With ``expect_last_subject_seq`` the append happens only if the newest message on
        the event's subject has that sequence (0: none); else ``ConcurrencyConflict``.
        ``expect_subject`` (wildcards allowed) is where that newest message is looked for
        instead of the event's own subject: several event types of one key under one
        expectation. JetStream honours it from nats-server 2.11; an older server checks
        the event's own subject."""

    async def publish_many(self, events: Iterable[Event]) -> list[int]:
        """Append many events with pipelined acks; all stored when it returns."""

    async def run_consumer(self, config: ConsumerConfig, handler: Handler, *, stop: "StopSignal") -> None:
        """Deliver events to ``handler`` until ``stop`` is set; ack after it returns."""

    def read(
        self,
        context: Context,
        *,
        start_seq: int = 1,
        start_time: datetime | None = None,
        filter_subject: str | None = None,
        until_seq: int | None = None,
    ) -> AsyncIterator[Delivery]:
        """Replay a stream in order, from a sequence or a time, up to its current end.

        A message that is no event this Gyre can read is skipped, with a warning
        (:func:`skip_undecodable`), as every consumer dead-letters it: a fold of ``read``
        then matches what the live consumers applied, and a rebuild does not stop on it.
        Callers that must see such messages use ``read_raw`` or ``follow``."""

    async def last_seq(self, context: Context) -> int:
        """The stream's last sequence (0 when empty)."""

    def follow(
        self, context: Context, *, start_seq: int = 1, filter_subject: str | None = None, idle_s: float = 0.05
    ) -> AsyncIterator[RawMessage | None]:
        """Tail a stream in order from ``start_seq``, forever; yields ``None`` after ``idle_s``
        without a message so the caller can commit and check for stop."""

    async def last_on_subject(self, context: Context, subject: str) -> RawMessage | None:
        """The newest message stored on exactly ``subject`` (None if there is none)."""

    async def dead_letter(self, consumer: str, message: RawMessage, reason: str) -> None:
        """Store ``message`` on ``gyredlq.<consumer>`` with its reason (idempotent)."""


class StopSignal(Protocol):
    def is_set(self) -> bool: ...

    async def wait(self) -> object: ...


@runtime_checkable
class BlobStore(Protocol):
    """Content-addressed bytes (sha256 hex digests): token arrays, snapshots, checkpoints."""

    async def put(self, data: bytes) -> str: ...

    async def get(self, digest: str) -> bytes: ...

    async def has(self, digest: str) -> bool: ...



def skip_undecodable(stream: str, seq: int, subject: str, exc: Exception) -> None:
    """What ``EventBus.read`` does with a message that does not decode: logs it and goes on."""
    logging.getLogger("libs.common.bus").warning(
        "%s seq %d (%s) is not an event this Gyre can read, skipped (its consumers dead-letter it): %s",
        stream, seq, subject, exc)
