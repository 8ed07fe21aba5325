"""The JetStream adapter of the bus port (nats-py).

- One stream per bounded context (``GYRE_CALLS`` holds ``gyre.*.calls.>``, ...), file
  storage, server-side de-duplication by ``Nats-Msg-Id`` (= event id).
- ``publish_many`` pipelines acks (``publish_async``, at most ``max_pending`` in flight).
- ``run_consumer`` is a durable pull consumer with explicit acks after the handler
  returns; a failing handler is retried in place, so failures keep stream order and the
  events behind it are not charged deliveries, and poison messages go to the
  dead-letter stream ``GYRE_DEADLETTER`` (``gyredlq.<consumer>``).
- ``read`` replays a stream in order from a sequence or a time with an ordered consumer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable
from datetime import datetime
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.js import api
from nats.js.errors import BadRequestError, NotFoundError

from ..events import Context, Event, EventDecodeError, decode
from .port import (ConcurrencyConflict, ConsumerConfig, Deferred, Delivery, Handler, PermanentError, RawMessage,
                   StopSignal, skip_undecodable)

log = logging.getLogger(__name__)


def _raise_if_cancelled() -> None:
    """Python 3.11's ``asyncio.wait_for`` (inside nats-py's ``fetch`` and ``next_msg``) can
    swallow a cancel that lands as its wait completes: the task is left cancelling but
    running, and a loop that polls would go on for ever (its owner waiting on it too). The
    loops ask at each turn."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError()


DEADLETTER_STREAM = "GYRE_DEADLETTER"
DEADLETTER_PREFIX = "gyredlq"
HDR_TYPE = "Gyre-Type"
HDR_REASON = "Gyre-Dead-Reason"


class BusError(RuntimeError):
    pass


class PublishError(BusError):
    """Some events of a batch were not stored. Re-publishing the whole batch is safe:
    the stored ones are de-duplicated by event id."""

    def __init__(self, failures: list[tuple[str, BaseException]]) -> None:
        self.failures = failures
        first = failures[0]
        super().__init__(f"{len(failures)} event(s) not stored, first {first[0]}: {first[1]!r}")


def ack_position(msg: Any) -> tuple[str, int, int]:
    """(stream, stream sequence, times delivered) from a JetStream message's reply subject.

    Parsing the two ack-subject layouts directly costs a fraction of ``msg.metadata``
    (which also builds timestamps); anything else falls back to it.
    """
    parts = (msg.reply or "").split(".")
    if len(parts) == 9 and parts[0] == "$JS":  # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>
        return parts[2], int(parts[5]), int(parts[4])
    if len(parts) >= 12 and parts[0] == "$JS":  # with domain and account hash
        return parts[4], int(parts[7]), int(parts[6])
    meta = msg.metadata
    return meta.stream, meta.sequence.stream, meta.num_delivered


async def _heartbeat(msgs: list[Any], every_s: float) -> None:
    """Tells the server, every ``every_s``, that ``msgs`` are still being worked on."""
    while True:
        await asyncio.sleep(every_s)
        for msg in msgs:
            try:
                await msg.in_progress()
            except Exception as exc:  # a reconnecting client: the next beat tries again
                log.debug("heartbeat for %s failed: %r", msg.subject, exc)


def headers_for(event: Event) -> dict[str, str]:
    return {"Nats-Msg-Id": event.event_id, HDR_TYPE: event.TYPE}


async def connect_nats(url: str, *, name: str = "gyre", creds: str | None = None, timeout_s: float = 5.0,
                       tries: int = 0) -> NATS:
    """Connect to ``url``. ``tries`` > 0 (the CLI's tools): give up after that many failed
    attempts with ``BusError("cannot connect to NATS at <url>: <reason>")``; 0 (services):
    keep trying until NATS answers, so that a service outlives a NATS restart. Either way a
    failed attempt is one log line (no traceback), and reconnects after a lost connection
    never stop."""
    last: list[BaseException] = []

    def reason(exc: BaseException) -> str:
        return str(exc) or type(exc).__name__

    async def on_error(exc: Exception) -> None:
        last[:] = [exc]
        if tries > 0:
            log.debug("nats %s: %s", url, reason(exc))
        else:
            log.warning("cannot reach NATS at %s: %s (retrying)", url, reason(exc))

    async def on_disconnect() -> None:
        if nc.is_reconnecting:  # not a close of ours
            log.warning("disconnected from NATS at %s; reconnecting", url)

    async def on_reconnect() -> None:
        log.info("reconnected to NATS at %s", url)

    nc = NATS()
    try:
        await nc.connect(
            url,
            name=name,
            user_credentials=creds,
            connect_timeout=timeout_s,
            allow_reconnect=tries != 1,
            # nats-py counts the first connect against the same limit: a tool stops after
            # ``tries`` attempts; once connected the limit is lifted below
            max_reconnect_attempts=tries - 1 if tries > 1 else -1,
            reconnect_time_wait=0.5,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
        )
    except Exception as exc:  # nats raises several unrelated types here
        cause = last[0] if last else exc
        with contextlib.suppress(Exception):
            await nc.close()
        raise BusError(f"cannot connect to NATS at {url}: {reason(cause)}") from exc
    nc.options["max_reconnect_attempts"] = -1
    return nc


class JetStreamBus:
    def __init__(self, nc: NATS, *, replicas: int = 1, max_age_s: float = 0, max_pending: int = 4000) -> None:
        self.nc = nc
        self.js = nc.jetstream(publish_async_max_pending=max_pending)
        self.replicas = replicas
        self.max_age_s = max_age_s
        self.max_pending = max_pending
        self.consumers: set[tuple[str, str]] = set()  # (stream, durable) run here; for libs/common/bus_metrics.py

    @classmethod
    async def connect(cls, url: str, *, name: str = "gyre", creds: str | None = None, update_streams: bool = True,
                      **kw: Any) -> "JetStreamBus":
        """``update_streams=False`` (the CLI's tools): create missing streams, leave existing
        ones as their services configured them (replicas, max age)."""
        bus = cls(await connect_nats(url, name=name, creds=creds), **kw)
        await bus.ensure_streams(update=update_streams)
        return bus

    async def close(self) -> None:
        if not self.nc.is_closed:
            await self.nc.drain()

    # -- streams ---------------------------------------------------------------

    def _stream_config(self, name: str, subjects: list[str]) -> api.StreamConfig:
        return api.StreamConfig(
            name=name,
            subjects=subjects,
            storage=api.StorageType.FILE,
            retention=api.RetentionPolicy.LIMITS,
            num_replicas=self.replicas,
            max_age=self.max_age_s or None,
            duplicate_window=120.0,
        )

    async def ensure_streams(self, *, update: bool = True) -> None:
        """Creates each stream; one that exists with another configuration is updated to
        this bus's (``update``) or left as it is."""
        wanted = [(c.stream, [c.subjects]) for c in Context]
        wanted.append((DEADLETTER_STREAM, [f"{DEADLETTER_PREFIX}.>"]))
        for name, subjects in wanted:
            cfg = self._stream_config(name, subjects)
            try:
                await self.js.add_stream(cfg)
            except BadRequestError:
                if update:
                    await self.js.update_stream(cfg)

    async def last_seq(self, context: Context) -> int:
        info = await self.js.stream_info(context.stream)
        return int(info.state.last_seq or 0)

    # -- publishing ------------------------------------------------------------

    async def publish(self, event: Event, *, expect_last_subject_seq: int | None = None,
                      expect_subject: str | None = None) -> int:
        headers = headers_for(event)
        if expect_last_subject_seq is not None:
            headers["Nats-Expected-Last-Subject-Sequence"] = str(expect_last_subject_seq)
            if expect_subject is not None:
                headers["Nats-Expected-Last-Subject-Sequence-Subject"] = expect_subject
        try:
            ack = await self.js.publish(event.subject, event.to_json(), headers=headers, timeout=10)
        except BadRequestError as exc:
            if expect_last_subject_seq is not None and "wrong last sequence" in str(exc).lower():
                raise ConcurrencyConflict(f"{event.subject}: newer than {expect_last_subject_seq}") from exc
            raise
        return int(ack.seq)

    async def publish_many(self, events: Iterable[Event], *, timeout_s: float = 30.0) -> list[int]:
        batch = list(events)
        futures = []
        for ev in batch:
            futures.append(await self.js.publish_async(ev.subject, ev.to_json(), headers=headers_for(ev)))
        done = await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), timeout_s)
        failures = [(ev.event_id, r) for ev, r in zip(batch, done) if isinstance(r, BaseException)]
        if failures:
            raise PublishError(failures)
        return [int(r.seq) for r in done]

    async def publish_raw(self, subject: str, data: bytes, headers: dict[str, str]) -> int:
        ack = await self.js.publish(subject, data, headers=headers, timeout=10)
        return int(ack.seq)

    # -- consuming -------------------------------------------------------------

    def _consumer_config(self, cfg: ConsumerConfig) -> api.ConsumerConfig:
        deliver = api.DeliverPolicy.ALL
        if cfg.start_seq is not None:
            deliver = api.DeliverPolicy.BY_START_SEQUENCE
        elif cfg.start_time is not None:
            deliver = api.DeliverPolicy.BY_START_TIME
        return api.ConsumerConfig(
            durable_name=cfg.name,
            ack_policy=api.AckPolicy.EXPLICIT,
            deliver_policy=deliver,
            opt_start_seq=cfg.start_seq,
            opt_start_time=cfg.start_time.isoformat() if cfg.start_time else None,
            ack_wait=cfg.ack_wait_s,
            max_deliver=-1,  # Gyre counts deliveries itself and dead-letters
            filter_subject=cfg.filter_subject or cfg.context.subjects,
            max_ack_pending=max(cfg.batch * 2, 1000),
        )

    async def run_consumer(self, config: ConsumerConfig, handler: Handler, *, stop: StopSignal) -> None:
        sub = await self.js.pull_subscribe_bind(
            durable=await self._ensure_consumer(config), stream=config.context.stream
        )
        self.consumers.add((config.context.stream, config.name))
        try:
            while not stop.is_set():
                _raise_if_cancelled()
                try:
                    msgs = await sub.fetch(config.batch, timeout=0.5)
                except (nats.errors.TimeoutError, asyncio.TimeoutError):
                    continue
                await self._handle_batch(config, handler, msgs, stop)
        finally:
            with contextlib.suppress(Exception):  # the connection may be closing already
                await sub.unsubscribe()

    async def _ensure_consumer(self, config: ConsumerConfig) -> str:
        wanted = self._consumer_config(config)
        try:
            info = await self.js.consumer_info(config.context.stream, config.name)
        except NotFoundError:
            await self.js.add_consumer(config.context.stream, wanted)
            return config.name
        have = info.config.filter_subject or None
        if have != wanted.filter_subject and not info.config.filter_subjects:
            # e.g. a service of another run (another GYRE_RUN_ID) on this server made it:
            # bound to it, this one would never see its own events
            raise BusError(f"durable consumer {config.name!r} of stream {config.context.stream} follows "
                           f"{have!r}, not {wanted.filter_subject!r}; consumers are named per run, so this one "
                           f"was made by another service or an older Gyre: delete it (nats consumer rm "
                           f"{config.context.stream} {config.name}) or name this consumer differently")
        return config.name

    async def _handle_batch(self, config: ConsumerConfig, handler: Handler, msgs: list[Any],
                            stop: StopSignal) -> None:
        """Each message in order. A handler that fails is tried again here, after
        ``retry_delay_s``, with the message and the batch's rest kept claimed meanwhile: the
        events behind it wait their turn without being charged a delivery, and no event
        fetched later overtakes them. ``num_delivered`` counts the server's deliveries plus
        these tries (only these with ``count_redeliveries=False``); at ``max_deliver`` the
        event is dead-lettered and the batch goes on. A :class:`Deferred` event (it waits on
        something else) is handed back instead, for redelivery after ``retry_delay_s``, and
        the batch goes on: what it waits on may come after it. A hand-back is never
        dead-lettered (JetStream counts it as a delivery: a consumer that defers does not
        count redeliveries)."""
        for i, msg in enumerate(msgs):
            stream, seq, delivered = ack_position(msg)
            try:
                event = decode(msg.data)
            except EventDecodeError as exc:
                await self._dead_letter(config, msg, f"undecodable: {exc}")
                continue
            tries = 0
            while True:
                tries += 1
                attempt = delivered + tries - 1  # the server's deliveries and the tries here
                failure = await self._attempt(config, handler, msgs[i:],
                                              Delivery(event, stream, seq, msg.subject, attempt))
                if failure is None:
                    await msg.ack()
                    break
                if isinstance(failure, PermanentError):
                    await self._dead_letter(config, msg, f"rejected: {failure}")
                    break
                if isinstance(failure, Deferred):  # handed back: another consumer or a later event goes first
                    log.debug("consumer %s: seq %s deferred (%s)", config.name, seq, failure)
                    await msg.nak(delay=config.retry_delay_s)
                    break
                counted = attempt if config.count_redeliveries else tries
                if counted >= config.max_deliver:
                    await self._dead_letter(config, msg, f"failed {counted} times: {failure!r}")
                    break
                log.warning("consumer %s: seq %s failed (%r); retrying", config.name, seq, failure)
                if not await self._wait_to_retry(config, msgs[i:], stop):
                    for rest in msgs[i:]:  # stopping: hand them back for whoever consumes next
                        with contextlib.suppress(Exception):
                            await rest.nak()
                    return

    async def _attempt(self, config: ConsumerConfig, handler: Handler, held: list[Any],
                       delivery: Delivery) -> BaseException | None:
        """Runs the handler once: None if it returned, else what it raised."""
        # this event and the batch's rest, which wait their turn
        beat = asyncio.create_task(_heartbeat(held, config.heartbeat_s)) if config.heartbeat_s else None
        try:
            await handler(delivery)
        except Exception as exc:
            return exc
        finally:
            if beat is not None:
                beat.cancel()
        return None

    @staticmethod
    async def _wait_to_retry(config: ConsumerConfig, held: list[Any], stop: StopSignal) -> bool:
        """Waits ``retry_delay_s`` while keeping ``held`` claimed (their claim is renewed as
        the wait starts, then every ``heartbeat_s``, or a third of ``ack_wait_s``): so the
        server never hands them to another fetcher while they wait here. False if ``stop``
        came first."""
        every = config.heartbeat_s or max(config.ack_wait_s / 3, 0.05)
        for msg in held:
            try:
                await msg.in_progress()
            except Exception as exc:  # a reconnecting client: the beats below try again
                log.debug("claim renewal for %s failed: %r", msg.subject, exc)
        beat = asyncio.create_task(_heartbeat(held, every)) if config.retry_delay_s > every else None
        try:
            await asyncio.wait_for(stop.wait(), config.retry_delay_s)
            return False
        except (TimeoutError, asyncio.TimeoutError):
            return not stop.is_set()
        finally:
            if beat is not None:
                beat.cancel()

    async def _dead_letter(self, config: ConsumerConfig, msg: Any, reason: str) -> None:
        meta = msg.metadata
        raw = RawMessage(meta.stream, meta.sequence.stream, msg.subject, msg.data)
        await self.dead_letter(config.name, raw, reason)
        await msg.ack()  # only after the dead letter is stored

    async def last_on_subject(self, context: Context, subject: str) -> RawMessage | None:
        try:
            m = await self.js.get_last_msg(context.stream, subject)
        except NotFoundError:
            return None
        return RawMessage(context.stream, int(m.seq), m.subject, m.data or b"")

    async def dead_letter(self, consumer: str, message: RawMessage, reason: str) -> None:
        headers = {
            "Nats-Msg-Id": f"dlq-{consumer}-{message.stream}-{message.seq}",
            HDR_REASON: reason[:2000],
            "Gyre-Dead-Stream": message.stream,
            "Gyre-Dead-Seq": str(message.seq),
            "Gyre-Dead-Subject": message.subject,
        }
        await self.publish_raw(f"{DEADLETTER_PREFIX}.{consumer}", message.data, headers)
        log.error("consumer %s: %s seq %s dead-lettered: %s", consumer, message.stream, message.seq, reason)

    async def follow(
        self, context: Context, *, start_seq: int = 1, filter_subject: str | None = None, idle_s: float = 0.05
    ) -> AsyncIterator[RawMessage | None]:
        async for msg in self._tail(context.stream, filter_subject or context.subjects, start_seq, idle_s):
            yield None if msg is None else RawMessage(context.stream, msg.metadata.sequence.stream, msg.subject,
                                                      msg.data)

    async def follow_dead_letters(self, consumer: str, *, idle_s: float = 0.05) -> AsyncIterator[RawMessage | None]:
        """The dead letters of ``consumer`` (``gyredlq.<consumer>``), oldest first, forever:
        each as the message it was (its stream, sequence, subject and data); ``None`` after
        ``idle_s`` without one. Not part of the port: a reader that must notice what a
        consumer gave up on (the trainer core, for its work queue) asks for it."""
        async for msg in self._tail(DEADLETTER_STREAM, f"{DEADLETTER_PREFIX}.{consumer}", 1, idle_s):
            if msg is None:
                yield None
                continue
            h = msg.headers or {}
            try:
                seq = int(h.get("Gyre-Dead-Seq", "0"))
            except ValueError:
                seq = 0
            yield RawMessage(h.get("Gyre-Dead-Stream", ""), seq, h.get("Gyre-Dead-Subject", ""), msg.data)

    async def _tail(self, stream: str, subject: str, start_seq: int, idle_s: float) -> AsyncIterator[Any]:
        sub = await self.js.subscribe(
            subject, stream=stream, ordered_consumer=True,
            config=api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
                                      opt_start_seq=max(start_seq, 1)),
            pending_msgs_limit=-1,
        )
        try:
            while True:
                _raise_if_cancelled()
                try:
                    msg = await sub.next_msg(timeout=idle_s)
                except (nats.errors.TimeoutError, asyncio.TimeoutError):
                    yield None
                    continue
                yield msg
        finally:
            with contextlib.suppress(Exception):  # the connection may be closing already
                await sub.unsubscribe()

    # -- replay ----------------------------------------------------------------

    async def read(
        self,
        context: Context,
        *,
        start_seq: int = 1,
        start_time: datetime | None = None,
        filter_subject: str | None = None,
        until_seq: int | None = None,
    ) -> AsyncIterator[Delivery]:
        async for msg in self.read_raw(context.stream, start_seq=start_seq, start_time=start_time,
                                       filter_subject=filter_subject or context.subjects, until_seq=until_seq):
            meta = msg.metadata
            try:
                event = decode(msg.data)
            except EventDecodeError as exc:
                skip_undecodable(meta.stream, meta.sequence.stream, msg.subject, exc)
                continue
            yield Delivery(event, meta.stream, meta.sequence.stream, msg.subject, 1)

    async def read_raw(
        self,
        stream: str,
        *,
        start_seq: int = 1,
        start_time: datetime | None = None,
        filter_subject: str | None = None,
        until_seq: int | None = None,
    ) -> AsyncIterator[Any]:
        """Raw messages of a stream, in order, up to its end when called."""
        info = await self.js.stream_info(stream)
        end = int(info.state.last_seq or 0)
        if until_seq is not None:
            end = min(end, until_seq)
        if end < start_seq or int(info.state.messages or 0) == 0:
            return
        kwargs: dict[str, Any] = {"deliver_policy": api.DeliverPolicy.BY_START_SEQUENCE, "opt_start_seq": start_seq}
        if start_time is not None:
            kwargs = {"deliver_policy": api.DeliverPolicy.BY_START_TIME, "opt_start_time": start_time.isoformat()}
        subjects = info.config.subjects or [">"]
        sub = await self.js.subscribe(
            filter_subject or (subjects[0] if len(subjects) == 1 else ">"), stream=stream, ordered_consumer=True,
            config=api.ConsumerConfig(**kwargs), pending_msgs_limit=-1,
        )
        try:
            cinfo = await sub.consumer_info()
            delivered = cinfo.delivered.consumer_seq if cinfo.delivered else 0
            if not cinfo.num_pending and not delivered:
                return  # nothing matches from start_seq on
            while True:
                msg = await sub.next_msg(timeout=30)
                seq = msg.metadata.sequence.stream
                if seq > end:
                    return
                yield msg
                if seq >= end or msg.metadata.num_pending == 0:
                    return
        finally:
            with contextlib.suppress(Exception):  # the connection may be closing already
                await sub.unsubscribe()
