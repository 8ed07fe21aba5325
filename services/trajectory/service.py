"""The trajectory service: the ledger wired to the bus and the blob store.

Consumes ``CallRecorded`` (calls), ``RolloutStarted/Finished/TimedOut`` (rollouts) and
``RolloutScored/ScoringFailed`` (scores); publishes ``ForkDetected``, ``TreeSealed``,
``SamplesSelected`` and ``MicroStepQueued`` (trees), after storing the blobs they name.

Exactly once by construction: every published event has a deterministic id, and on
start the service rebuilds its state by replaying the log, publishing only events whose
ids the trees stream does not hold yet. Calls that can never be applied (broken, or
their parent never arrived) go to the bus's dead-letter subject with the reason, as does a
copy of a known call id with other content (the call recorded first is kept).

Streams are consumed separately, so a score can be handled before the last calls of
its rollout; before sealing, the service reads that rollout's calls from the log to the
end (they were all recorded before the rollout ended, hence before it was scored).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
from array import array
from dataclasses import dataclass

from libs.common.blobs import BlobCorrupt, BlobNotFound
from libs.common.bus.port import BlobStore, ConsumerConfig, Delivery, EventBus, RawMessage, StopSignal
from libs.common.events import (CallRecorded, Context, Event, RolloutFinished, RolloutScored,
                                RolloutScoringFailed, RolloutStarted, RolloutTimedOut, TreeSealed, subject_token)

from .codec import CodecError, decode_ids, decode_logprobs
from .ledger import Effects, LedgerConfig, RolloutPhase, TrajectoryLedger, call_from_event
from .rollout_tree import CallOutcome

log = logging.getLogger(__name__)

CARRY_OUT_RETRY_S = 0.5  # the first wait before a failed store/publish is tried again, doubling
CARRY_OUT_RETRY_MAX_S = 30.0

_CONSUMED = (Context.ROLLOUTS, Context.CALLS, Context.SCORES)


@dataclass(frozen=True)
class DeadCall:
    call_id: str
    reason: str
    seq: int | None = None  # the dead-lettered message's (a call id may have two: see ``_call``)


def content_key(ev: CallRecorded) -> bytes:
    """What ``CallRecord.fingerprint`` compares, read off the event without fetching a
    blob: the token blobs are raw int32 / float32 arrays, so their digests stand for the
    arrays; the weight version of every output token (as runs: nothing the size of the
    output is built before its blobs are checked), the parent, the prefix, the temperature
    (as the float32 the tree keeps) and whether it was delivered."""
    n = ev.n_output_tokens
    default = ev.weight_spans[0].version if ev.weight_spans else 0  # as call_from_event
    cuts = sorted({0, n} | {min(max(x, 0), n) for s in ev.weight_spans for x in (s.start, s.end)})
    runs: list[tuple[int, int]] = []  # (start, version) where the version changes: output_versions, run-length
    for a, b in zip(cuts, cuts[1:]):
        if a < b:
            v = next((s.version for s in reversed(ev.weight_spans) if s.start <= a and b <= s.end), default)
            if not runs or runs[-1][1] != v:
                runs.append((a, v))
    temperature = 1.0 if ev.logprob_temperature is None else ev.logprob_temperature
    return hashlib.sha256(repr((ev.parent_call_id, ev.prefix_len, ev.delivered, array("f", [temperature]).tobytes(),
                                ev.new_input_digest, ev.n_new_input_tokens, ev.output_digest, n,
                                ev.logprobs_digest, runs)).encode()).digest()


class TrajectoryService:
    def __init__(self, config: LedgerConfig, *, bus: EventBus, blobs: BlobStore,
                 consumer: str = "trajectory") -> None:
        self.config = config
        self.bus = bus
        self.blobs = blobs
        self.consumer = consumer
        self.ledger = TrajectoryLedger(config)
        self.dead: list[DeadCall] = []
        self._lock = asyncio.Lock()
        self._published: set[str] = set()
        # what a decision asked for and was not all carried out yet (see ``handle``)
        self._unsent: Effects | None = None
        self._stop: StopSignal | None = None
        self._call_msgs: dict[str, RawMessage] = {}
        # (rollout, call) -> content_key of the copy the ledger holds (or held: sealed), to
        # tell a redelivery from another call under the same id without fetching its blobs
        self._call_keys: dict[tuple[str, str], bytes] = {}
        # rollout -> the calls its logged TreeSealed holds (from the tree's summary blob): a
        # rebuild seals it with those, not with a call recorded after the live seal
        self.seal_boundaries: dict[str, frozenset[str]] = {}

    def consumer_configs(self) -> list[ConsumerConfig]:
        run = self.config.run_id
        # named per run: a durable of another run on the same server follows that run's subjects
        return [ConsumerConfig(name=f"{self.consumer}-{run}-{ctx.value}", context=ctx,
                               filter_subject=f"gyre.{run}.{ctx.value}.>") for ctx in _CONSUMED]

    async def run(self, stop: StopSignal) -> None:
        """Rebuild from the log, then follow the three streams until ``stop``."""
        self._stop = stop
        await self.rebuild()
        await asyncio.gather(*(self.bus.run_consumer(cfg, self.handle, stop=stop)
                               for cfg in self.consumer_configs()))

    async def rebuild(self) -> None:
        """Replay the log into the ledger; publish what the trees stream lacks."""
        run = self.config.run_id
        sealed: dict[str, str] = {}
        async for d in self.bus.read(Context.TREES, filter_subject=f"gyre.{run}.trees.>"):
            self._published.add(d.event.event_id)
            if isinstance(d.event, TreeSealed):
                sealed[d.event.rollout_id] = d.event.tree_digest
        await self.load_seal_boundaries(sealed, self.blobs)
        # Scores before calls: a judged rollout reads its own calls and is sealed (its tree
        # freed) at once, so the rebuild holds only the trees of rollouts still open; the
        # calls pass then builds those, and meets the rest as redeliveries.
        for ctx in (Context.ROLLOUTS, Context.SCORES, Context.CALLS):
            async for d in self.bus.read(ctx, filter_subject=f"gyre.{run}.{ctx.value}.>"):
                await self.handle(d)

    async def load_seal_boundaries(self, sealed: dict[str, str], blobs: BlobStore) -> None:
        """For each rollout the log shows sealed (rollout -> its TreeSealed summary digest),
        the calls its tree held. The live service rejects a call recorded after the seal
        (e.g. the proxy's record of a call cut off at the time limit, landing after the
        score); a rebuild reads every call of the rollout before sealing it, so without the
        boundary it would seal a different tree than the one the log announced."""
        for rollout_id, digest in sealed.items():
            try:
                summary = json.loads(await blobs.get(digest))
                # the calls it held and those it rejected (a rejection is part of the summary too)
                self.seal_boundaries[rollout_id] = frozenset(
                    [c["call_id"] for c in summary["calls"]] + [c["call_id"] for c in summary.get("rejected", [])])
            except (BlobNotFound, BlobCorrupt, ValueError, KeyError, TypeError) as exc:
                log.warning("rollout %s: its sealed tree's summary %s cannot be read (%r); it is rebuilt "
                            "from all of its calls in the log", rollout_id, digest, exc)

    async def handle(self, delivery: Delivery) -> None:
        """Decides on one event, then stores and publishes what it asks for. The ledger
        changes as it decides; what that asks for waits in ``_unsent`` until it is all
        carried out, tried again with backoff for as long as the blob store or the bus
        stays down (``_carry_out_patiently``): the event is past the ledger, so failing it
        would lose its effects (a seal's ``TreeSealed``, samples and micro-steps) to the
        live run, and charging the outage to the events behind it would dead-letter events
        never decided on. If the service stops meanwhile, what is unsent is carried out
        before the next event is decided (a restart rebuilds it from the log). Carrying out
        twice is harmless: blobs are content-addressed, events have deterministic ids
        (``_published`` and JetStream's de-duplication drop a copy), and dead letters have
        fixed ids."""
        async with self._lock:
            if self._unsent is not None:
                await self._carry_out_patiently(self._unsent)
                self._unsent = None
            self._unsent = Effects()
            effects = await self._decide(delivery)
            self._unsent.extend(effects)
            await self._carry_out_patiently(self._unsent)
            self._unsent = None

    async def _carry_out_patiently(self, effects: Effects) -> None:
        failures = 0
        while True:
            try:
                await self._carry_out(effects)
                return
            except Exception as exc:
                failures += 1
                if self._stop is not None and self._stop.is_set():
                    raise  # stopping: the event is handed back, the effects stay in _unsent
                wait = min(CARRY_OUT_RETRY_S * 2 ** min(failures - 1, 8), CARRY_OUT_RETRY_MAX_S)
                (log.error if failures == 1 or failures % 20 == 0 else log.warning)(
                    "storing or publishing a decision's effects failed (%r, %d time(s)); tried again in %.1fs",
                    exc, failures, wait)
                if self._stop is None:
                    await asyncio.sleep(wait)
                else:
                    with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                        await asyncio.wait_for(self._stop.wait(), wait)

    async def _decide(self, d: Delivery) -> Effects:
        ev = d.event
        if ev.run_id != self.config.run_id:
            return Effects()
        if isinstance(ev, CallRecorded):
            return await self._call(ev, RawMessage(d.stream, d.seq, d.subject, ev.to_json()))
        if isinstance(ev, RolloutStarted):
            state = self.ledger.rollouts.get(ev.rollout_id)
            if state is not None and not state.started and state.phase is RolloutPhase.ENDED and state.judged:
                # read after its end and its score: this start seals it, so its calls are read
                # from the log first (as for a seal caused by the score)
                effects = await self._catch_up_calls(ev.rollout_id)
                effects.extend(self.ledger.rollout_started(ev))
                return effects
            return self.ledger.rollout_started(ev)
        if isinstance(ev, (RolloutFinished, RolloutTimedOut)):
            self.ledger.rollout_ended(ev.rollout_id)
        elif isinstance(ev, (RolloutScored, RolloutScoringFailed)):
            self.ledger.rollout_judged(ev)
        else:
            return Effects()
        return await self._seal_if_ready(ev.rollout_id, ev)

    async def _call(self, ev: CallRecorded, msg: RawMessage) -> Effects:
        key = content_key(ev)
        if self.ledger.has_call(ev.rollout_id, ev.call_id):  # a redelivery, the catch-up read or a conflict
            held = self._call_keys.get((ev.rollout_id, ev.call_id))
            if held is None or held == key:  # the same content: a harmless duplicate
                sealed = self.ledger.is_sealed(ev.rollout_id)
                return Effects(settled_calls=[ev.call_id] if sealed else [])
            # Same id, other content (tokens, logprobs, weight versions, temperature, delivery
            # or place): this copy is dead-lettered as itself; the call first recorded stays
            # (in the tree, or in the sealed one) and its own message is kept.
            reason = (f"same call id, other content: a call {ev.call_id} is recorded already with other tokens, "
                      f"logprobs, weight versions, temperature, delivery or parent/prefix; that one is kept, "
                      f"this copy (seq {msg.seq}) is not applied")
            return Effects(conflicts=[(CallOutcome(ev.call_id, "rejected", reason), msg)])
        self._call_msgs.setdefault(ev.call_id, msg)
        try:
            new_input = decode_ids(await self.blobs.get(ev.new_input_digest))
            output = decode_ids(await self.blobs.get(ev.output_digest))
            logprobs = decode_logprobs(await self.blobs.get(ev.logprobs_digest))
        except (CodecError, BlobNotFound, BlobCorrupt) as exc:
            # The proxy stores blobs before it records the call: a missing or broken
            # blob will not heal by waiting.
            return Effects(rejected=[CallOutcome(ev.call_id, "rejected", f"token blob: {exc!r}")])
        if (len(new_input), len(output)) != (ev.n_new_input_tokens, ev.n_output_tokens):
            reason = (f"blobs hold {len(new_input)} new input / {len(output)} output tokens, "
                      f"the event says {ev.n_new_input_tokens} / {ev.n_output_tokens}")
            return Effects(rejected=[CallOutcome(ev.call_id, "rejected", reason)])
        effects = self.ledger.call_recorded(call_from_event(ev, new_input, output, logprobs))
        if self.ledger.has_call(ev.rollout_id, ev.call_id):  # applied or buffered: this copy is the call
            self._call_keys[(ev.rollout_id, ev.call_id)] = key
        return effects

    async def _seal_if_ready(self, rollout_id: str, cause: Event) -> Effects:
        if not self.ledger.ready_to_seal(rollout_id):
            return Effects()
        effects = await self._catch_up_calls(rollout_id)
        effects.extend(self.ledger.seal(rollout_id, cause))
        return effects

    async def _catch_up_calls(self, rollout_id: str) -> Effects:
        run = self.config.run_id
        effects = Effects()
        subject = f"gyre.{run}.calls.{CallRecorded.TYPE}.{subject_token(rollout_id)}"
        boundary = self.seal_boundaries.get(rollout_id)
        async for d in self.bus.read(Context.CALLS, filter_subject=subject):
            ev = d.event
            if isinstance(ev, CallRecorded) and ev.rollout_id == rollout_id:
                if boundary is not None and ev.call_id not in boundary:
                    continue  # recorded after the live seal: it meets the sealed tree later, as then
                effects.extend(await self._call(ev, RawMessage(d.stream, d.seq, d.subject, ev.to_json())))
                if self._unsent is not None:  # the ledger has these calls now: keep what they ask for
                    self._unsent.extend(effects)
                    effects = Effects()
        return effects

    async def _carry_out(self, effects: Effects) -> None:
        for data in effects.blobs:
            await self.blobs.put(data)
        fresh = [e for e in effects.events if e.event_id not in self._published]
        if fresh:
            await self.bus.publish_many(fresh)
            self._published.update(e.event_id for e in fresh)
        for outcome in effects.rejected:
            await self._dead_letter(outcome)
            self._call_msgs.pop(outcome.call_id, None)
        for outcome, msg in effects.conflicts:  # the recorded call's own message stays
            await self._dead_letter(outcome, msg)
        for call_id in effects.settled_calls:  # in a sealed tree: its message is not needed again
            self._call_msgs.pop(call_id, None)

    async def _dead_letter(self, outcome: CallOutcome, msg: RawMessage | None = None) -> None:
        if msg is None:
            msg = self._call_msgs.get(outcome.call_id)
        seq = msg.seq if msg is not None else None
        if any(d.call_id == outcome.call_id and (seq is None or d.seq in (None, seq)) for d in self.dead):
            return
        if msg is not None:  # noted as dead only once stored: a failed write is tried again
            await self.bus.dead_letter(f"{self.consumer}-calls", msg, outcome.reason)
        self.dead.append(DeadCall(outcome.call_id, outcome.reason, seq))
        log.warning("call %s rejected: %s", outcome.call_id, outcome.reason)


def create_service(config: LedgerConfig, *, bus: EventBus, blobs: BlobStore) -> TrajectoryService:
    """App factory: configuration is data, live handles are passed in."""
    return TrajectoryService(config, bus=bus, blobs=blobs)
