"""Per-rollout proxy state, kept in step with the event log.

- Which rollouts exist, with their API-key digests, and which have ended (the runner's
  ``RolloutStarted`` / ``RolloutFinished`` / ``RolloutTimedOut``).
- Each rollout's TITO history (``core.tito.Tito``). Before matching a call, the book
  asks the log for the rollout's newest ``CallRecorded``; calls recorded by another
  replica, or before this process started, are loaded from their blobs. So a restarted
  proxy, or a second replica, stays exact.
"""

from __future__ import annotations

import array
import asyncio
import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from libs.common.blobs import decode_tokens
from libs.common.bus.port import BlobStore, EventBus
from libs.common.events import CallRecorded, Context, EventDecodeError, decode, subject_token
from libs.common.events.calls import DriftClass
from libs.common.events.rollouts import RolloutFinished, RolloutStarted, RolloutTimedOut

from .core.tito import Boundary, CallTokens, Renderer, Tito

log = logging.getLogger(__name__)


def key_digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


@dataclass
class RolloutState:
    rollout_id: str
    tito: Tito
    seq: int = 0  # newest CallRecorded stream sequence applied
    call_session: dict[str, str] = field(default_factory=dict)
    logged: set[str] = field(default_factory=set)  # calls seen in the log by sync
    # chain hashes of conversations up to a compacted history's opening (summary) message,
    # for the rollout's recorded calls (this process's, and from their match index blobs
    # those loaded from the log): a later request with the same opening is no new
    # compaction (hints.request_kind), even when TITO matched none of its messages
    summaries: set[bytes] = field(default_factory=set)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass
class RolloutInfo:
    key_digest: str
    ended: bool = False
    weight_version: int = 0


def encode_match_index(call_id: str, boundaries: list[tuple[bytes, Boundary]], continued: bytes | None,
                       summary: bytes | None = None) -> bytes:
    """The call's match index blob. ``summary``: the chain hash up to the compacted history's
    opening (summary) message the call sent, if it sent one (``RolloutState.summaries``), so
    that a replica that rebuilds the rollout from the log knows it as this one does."""
    rows = [[h.hex(), b.offset, b.kind, b.glue, b.drift.value] for h, b in boundaries]
    body: dict[str, Any] = {"call_id": call_id, "boundaries": rows, "continued": continued.hex() if continued else None}
    if summary is not None:
        body["summary"] = summary.hex()
    return json.dumps(body, separators=(",", ":")).encode()


@dataclass
class MatchIndex:
    boundaries: list[tuple[bytes, Boundary]]
    continued: bytes | None = None
    summary: bytes | None = None


def decode_match_index(data: bytes) -> MatchIndex:
    """Blobs written before a field existed decode with it unset."""
    obj = json.loads(data)
    cid = obj["call_id"]
    rows = [(bytes.fromhex(h), Boundary(cid, off, kind, glue, DriftClass(drift)))
            for h, off, kind, glue, drift in obj["boundaries"]]
    return MatchIndex(rows, bytes.fromhex(obj["continued"]) if obj.get("continued") else None,
                      bytes.fromhex(obj["summary"]) if obj.get("summary") else None)


class RolloutBook:
    def __init__(self, run_id: str, bus: EventBus, blobs: BlobStore, renderer: Renderer,
                 stop_texts: tuple[str, ...]) -> None:
        self.run_id = run_id
        self.bus = bus
        self.blobs = blobs
        self.renderer = renderer
        self.stop_texts = stop_texts
        self.rollouts: dict[str, RolloutInfo] = {}
        self.states: dict[str, RolloutState] = {}
        self.on_ended: list[Callable[[str], None]] = []  # told a rollout's id when it ends (routing forgets it)
        # the follower has read the rollouts stream to its end once: until then an entry not
        # ended may only be a start whose end the replay has not reached yet
        self.caught_up = False

    # -- rollouts ----------------------------------------------------------------------

    def apply_rollout_event(self, data: bytes) -> None:
        try:
            ev = decode(data)
        except EventDecodeError:
            return
        if isinstance(ev, RolloutStarted):
            if ev.rollout_id in self.rollouts:
                return  # the replay (or a lookup) met it already: an end known meanwhile stays
            self.rollouts[ev.rollout_id] = RolloutInfo(ev.api_key_digest, False, ev.weight_version)
        elif isinstance(ev, (RolloutFinished, RolloutTimedOut)):
            info = self.rollouts.get(ev.rollout_id)
            if info is not None:
                info.ended = True
            self.states.pop(ev.rollout_id, None)  # its history is in the log; free the memory
            for listener in self.on_ended:
                listener(ev.rollout_id)

    async def follow_rollouts(self, stop: asyncio.Event) -> None:
        """Keep the registry current (runs as a background task)."""
        follow = self.bus.follow(Context.ROLLOUTS, filter_subject=f"gyre.{self.run_id}.rollouts.>", idle_s=0.5)
        try:
            async for raw in follow:
                if raw is not None:
                    self.apply_rollout_event(raw.data)
                else:  # idle: at the stream's end
                    self.caught_up = True
                if stop.is_set():
                    return
        finally:
            await follow.aclose()

    async def lookup(self, rollout_id: str) -> RolloutInfo | None:
        """The rollout as the log says. Read from the log when the follower has not met it,
        or has met only its start while it has not yet read the stream to its end (a
        restarted proxy replays from the start: the rollout may have ended long ago)."""
        info = self.rollouts.get(rollout_id)
        if info is not None and (info.ended or self.caught_up):
            return info
        base = f"gyre.{self.run_id}.rollouts"
        tok = subject_token(rollout_id)
        if info is None:
            started = await self.bus.last_on_subject(Context.ROLLOUTS, f"{base}.RolloutStarted.{tok}")
            if started is None:
                return None
            self.apply_rollout_event(started.data)
        for kind in ("RolloutFinished", "RolloutTimedOut"):
            ended = await self.bus.last_on_subject(Context.ROLLOUTS, f"{base}.{kind}.{tok}")
            if ended is not None:
                self.apply_rollout_event(ended.data)
        return self.rollouts.get(rollout_id)

    # -- histories ---------------------------------------------------------------------

    def state(self, rollout_id: str) -> RolloutState:
        st = self.states.get(rollout_id)
        if st is None:
            st = RolloutState(rollout_id, Tito(self.renderer, stop_texts=self.stop_texts))
            self.states[rollout_id] = st
        return st

    async def sync(self, st: RolloutState) -> int:
        """Load calls of this rollout recorded elsewhere; returns how many were loaded."""
        subject = f"gyre.{self.run_id}.calls.CallRecorded.{subject_token(st.rollout_id)}"
        newest = await self.bus.last_on_subject(Context.CALLS, subject)
        if newest is None or newest.seq <= st.seq:
            return 0
        loaded = 0
        async for d in self.bus.read(Context.CALLS, start_seq=st.seq + 1, filter_subject=subject,
                                     until_seq=newest.seq):
            ev = d.event
            if isinstance(ev, CallRecorded):
                if ev.call_id not in st.tito.calls:
                    await self._restore(st, ev)
                    loaded += 1
                st.logged.add(ev.call_id)
            st.seq = max(st.seq, d.seq)
        return loaded

    async def _restore(self, st: RolloutState, ev: CallRecorded) -> None:
        new_ids, out_ids = await asyncio.gather(self.blobs.get(ev.new_input_digest), self.blobs.get(ev.output_digest))
        index = MatchIndex([])
        if ev.match_index_digest:
            index = decode_match_index(await self.blobs.get(ev.match_index_digest))
        tokens = CallTokens(ev.call_id, ev.parent_call_id, ev.prefix_len,
                            array.array("i", decode_tokens(new_ids)), array.array("i", decode_tokens(out_ids)))
        st.tito.restore(tokens, index.boundaries, index.continued)
        if index.summary is not None:
            st.summaries.add(index.summary)
        st.call_session[ev.call_id] = ev.session_id
