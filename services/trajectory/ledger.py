"""The trajectory service's state and decisions, pure: facts in, events and blobs out.

The adapter (``service.py``) feeds it what the log says (rollout started, call recorded
with its token arrays fetched, rollout ended, scored or not) and publishes what it
returns. Nothing here awaits, reads a clock or draws a random number, so replaying the
same log gives the same events with the same ids and the same sample digests.

Lifecycle of a rollout (``RolloutPhase``)::

    RECORDING --(finished / timed out)--> ENDED --(scored | scoring failed)--> SEALED
    (a score may be seen before the end: the evaluator only scores ended rollouts)

A rollout is sealed only once its ``RolloutStarted`` has been read too: the start names
the harness whose rules classify the calls (a rebuild reads the rollouts stream first, so
a seal before the start would label the tree by other rules live than on a replay). A
start read after the score seals the rollout then.

Sealing emits ``ForkDetected`` for every fork, ``TreeSealed`` (its digest names a JSON
summary blob for ``gyre tree show``) and ``SamplesSelected`` (digests of the packed trees,
stored as blobs). When every rollout of a group is sealed, the group's advantages are
computed and its samples queued as ``MicroStepQueued`` events of at most
``micro_step_tokens`` tokens each (a bigger sample gets a micro-step of its own). The
trainer lays a micro-step's samples out with their shared untrained prefixes once (the
group's prompt: ``packing.merge_forest``), so a batch's
``n_tokens`` is that merged size and samples are added while it stays in the budget.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
from dataclasses import dataclass, field

from libs.common.events import (CallRecorded, Event, ForkDetected, GroupQueued, MicroStepQueued, RolloutScored,
                                RolloutScoringFailed, RolloutStarted, SamplesSelected, TreeSealed)
from libs.common.events.trees import SampleRef

from .advantages import AdvantageConfig, group_advantages
from .codec import encode_packed, sha256_hex
from .forks import HARNESS_RULES, HarnessRules
from .packing import PackedTree, plan_micro_steps
from .records import CallRecord
from .rollout_tree import CallOutcome, RolloutTree, SealedTree, TreeConfig

log = logging.getLogger(__name__)


class RolloutPhase(str, enum.Enum):
    RECORDING = "recording"
    ENDED = "ended"
    SEALED = "sealed"


@dataclass(frozen=True)
class LedgerConfig:
    run_id: str
    budget: int = 5
    seed: int = 0
    max_piece_tokens: int | None = None  # None: micro_step_tokens
    micro_step_tokens: int = 65536
    group_size: int | None = None  # None: the rollouts started in the group
    train_undelivered: bool = False
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    rules: dict[str, HarnessRules] = field(default_factory=lambda: dict(HARNESS_RULES))
    default_harness: str = "generic"

    def tree_config(self, harness: str) -> TreeConfig:
        """A tree bigger than a micro-step is split into pieces of at most that size."""
        rules = self.rules.get(harness) or self.rules[self.default_harness]
        pieces = self.max_piece_tokens or self.micro_step_tokens
        return TreeConfig(rules, self.budget, self.seed, pieces, self.train_undelivered)


@dataclass
class Effects:
    """What a decision asks the adapter to do: store blobs, then publish events."""

    blobs: list[bytes] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    rejected: list[CallOutcome] = field(default_factory=list)
    settled_calls: list[str] = field(default_factory=list)  # in a sealed tree: the adapter may forget them
    # a call id met again with other content, with that copy's message (the adapter's): the
    # copy is dead-lettered as itself, the call recorded first is kept
    conflicts: list[tuple[CallOutcome, object]] = field(default_factory=list)

    def extend(self, other: Effects) -> None:
        self.blobs += other.blobs
        self.events += other.events
        self.rejected += other.rejected
        self.settled_calls += other.settled_calls
        self.conflicts += other.conflicts


@dataclass
class RolloutState:
    rollout_id: str
    group_id: str | None = None
    step: int = 0
    harness: str = ""
    started: bool = False  # its RolloutStarted was read (group, step and harness are known)
    purpose: str = "train"  # "eval" rollouts are sealed and shown, never queued for training
    phase: RolloutPhase = RolloutPhase.RECORDING
    score: float | None = None
    scoring_failed: str | None = None
    tree: RolloutTree | None = None  # while recording; dropped at the seal
    sealed_calls: frozenset[str] = frozenset()  # the sealed tree's call ids (redeliveries)
    samples: list[SampleRef] = field(default_factory=list)
    packed: list[PackedTree] = field(default_factory=list)  # parallel to samples, until queued

    @property
    def judged(self) -> bool:
        return self.score is not None or self.scoring_failed is not None


def event_id(run_id: str, kind: str, key: str) -> str:
    """Deterministic ids: a replayed decision re-publishes the same id (de-duplicated)."""
    return hashlib.sha256(f"{run_id}:{kind}:{key}".encode()).hexdigest()[:32]


class TrajectoryLedger:
    def __init__(self, config: LedgerConfig) -> None:
        self.config = config
        self.rollouts: dict[str, RolloutState] = {}
        self.groups: dict[str, list[str]] = {}
        self.group_sizes: dict[str, int] = {}  # group -> its size as its RolloutStarted events state it
        self.queued_groups: set[str] = set()

    def _rollout(self, rollout_id: str) -> RolloutState:
        state = self.rollouts.get(rollout_id)
        if state is None:
            state = self.rollouts[rollout_id] = RolloutState(rollout_id)
        return state

    def _tree(self, state: RolloutState) -> RolloutTree:
        if state.tree is None:
            state.tree = RolloutTree(state.rollout_id, self.config.tree_config(state.harness))
        return state.tree

    # ------------------------------------------------------------------ facts in

    def rollout_started(self, ev: RolloutStarted) -> Effects:
        state = self._rollout(ev.rollout_id)
        state.group_id, state.step, state.harness = ev.group_id, ev.step, ev.harness
        state.purpose = ev.purpose
        state.started = True
        if state.tree is not None:  # calls came first: classify with the harness's rules
            state.tree.config = self.config.tree_config(ev.harness)
        members = self.groups.setdefault(ev.group_id, [])
        if ev.rollout_id not in members:
            members.append(ev.rollout_id)
        if ev.group_size is not None:  # the runner says how many rollouts the group will have
            self.group_sizes[ev.group_id] = max(ev.group_size, self.group_sizes.get(ev.group_id, 0))
        if state.phase is RolloutPhase.ENDED and state.judged:  # its start was read after its score
            return self.seal(ev.rollout_id, ev)
        if state.phase is RolloutPhase.SEALED:  # a redelivered start: the group may still be waiting
            return self.queue_group_if_complete(ev.group_id, ev)
        return Effects()

    def call_recorded(self, call: CallRecord) -> Effects:
        state = self._rollout(call.rollout_id)
        if state.phase is RolloutPhase.SEALED:
            if call.call_id in state.sealed_calls:
                return Effects()
            return Effects(rejected=[CallOutcome(call.call_id, "rejected", "call after the tree was sealed")])
        outcome = self._tree(state).add(call)
        rejected = [outcome] if outcome.outcome == "rejected" else []
        return Effects(rejected=rejected + list(outcome.also_rejected))

    def has_call(self, rollout_id: str, call_id: str) -> bool:
        state = self.rollouts.get(rollout_id)
        if state is None:
            return False
        return call_id in state.sealed_calls or bool(state.tree and state.tree.knows(call_id))

    def is_sealed(self, rollout_id: str) -> bool:
        state = self.rollouts.get(rollout_id)
        return state is not None and state.phase is RolloutPhase.SEALED

    def rollout_ended(self, rollout_id: str) -> None:
        state = self._rollout(rollout_id)
        if state.phase is RolloutPhase.RECORDING:
            state.phase = RolloutPhase.ENDED

    def rollout_judged(self, ev: RolloutScored | RolloutScoringFailed) -> None:
        state = self._rollout(ev.rollout_id)
        if state.phase is RolloutPhase.SEALED:
            return
        if isinstance(ev, RolloutScored):
            state.score = ev.score
        else:
            state.scoring_failed = ev.reason
        state.phase = RolloutPhase.ENDED  # only ended rollouts are judged

    def ready_to_seal(self, rollout_id: str) -> bool:
        state = self.rollouts.get(rollout_id)
        return bool(state) and state.started and state.phase is RolloutPhase.ENDED and state.judged

    # ------------------------------------------------------------------ decisions

    def seal(self, rollout_id: str, cause: Event) -> Effects:
        """Seal a judged, started rollout; queue its group if that completes it."""
        state = self.rollouts[rollout_id]
        if state.phase is RolloutPhase.SEALED or not state.judged or not state.started:
            return Effects()  # not started: its start seals it (rollout_started)
        tree = self._tree(state)
        sealed = tree.seal()
        state.phase = RolloutPhase.SEALED
        effects = Effects(rejected=list(sealed.rejected))
        effects.extend(self._sealed_events(state, sealed, cause))
        # The tree's tokens are in the blobs now; a long run must not hold every rollout's
        # tree (hundreds of thousands of tokens each) for its whole length. Keep the ids,
        # so redeliveries are still told from late calls.
        state.sealed_calls = frozenset(tree.tree.index)
        state.tree = None
        effects.settled_calls += list(tree.tree.index)
        if state.group_id is not None:
            effects.extend(self.queue_group_if_complete(state.group_id, cause))
        return effects

    def _sealed_events(self, state: RolloutState, sealed: SealedTree, cause: Event) -> Effects:
        run = self.config.run_id
        env = {"run_id": run, "causation_id": cause.event_id,
               "correlation_id": cause.correlation_id or cause.event_id, "time": cause.time}
        out = Effects()
        calls = state.tree.tree.calls
        for lab in sealed.forks:
            out.events.append(ForkDetected(
                event_id=event_id(run, "ForkDetected", f"{state.rollout_id}:{lab.call_id}"), rollout_id=state.rollout_id,
                call_id=lab.call_id, fork_type=lab.fork, position=lab.position, role=lab.role,
                drift=calls[lab.call_index].drift,
                parent_call_id=calls[lab.forked_from].call_id if lab.forked_from is not None else None,
                **env))
        summary = tree_summary(state, sealed)
        out.blobs.append(summary)
        t = state.tree.tree
        out.events.append(TreeSealed(
            event_id=event_id(run, "TreeSealed", state.rollout_id), rollout_id=state.rollout_id,
            tree_digest=sha256_hex(summary), n_calls=len(t.calls), n_nodes=t.n_nodes,
            n_tokens=t.n_stored_tokens, branch_roles=[b.role for b in sealed.branches], **env))
        if state.score is None:
            return out  # scoring failed: nothing to learn from this rollout
        for packed in sealed.packed:
            data = encode_packed(packed)
            out.blobs.append(data)
            state.samples.append(SampleRef(digest=sha256_hex(data), role=packed.role,
                                           n_tokens=packed.n_tokens,
                                           n_trained_tokens=packed.n_trained_tokens))
            if state.purpose != "eval":  # evaluation rollouts are never queued
                state.packed.append(packed)
        for k in range(0, max(1, len(state.samples)), 64):  # the event holds 64 at most
            key = state.rollout_id if k == 0 else f"{state.rollout_id}:{k // 64}"
            out.events.append(SamplesSelected(
                event_id=event_id(run, "SamplesSelected", key), rollout_id=state.rollout_id,
                samples=state.samples[k : k + 64], **env))
        return out

    def queue_group_if_complete(self, group_id: str, cause: Event) -> Effects:
        members = self.groups.get(group_id, [])
        # The group's size: what its RolloutStarted events state (a runner starts a group's
        # rollouts as its slots free up, so the first one may be scored before the last has
        # started), else the run's setting, else the rollouts started so far.
        expected = self.group_sizes.get(group_id) or self.config.group_size or len(members)
        states = [self.rollouts[r] for r in members]
        if group_id in self.queued_groups:
            for s in states:  # started after its group settled (no size stated): never trained
                if s.packed:
                    log.warning("rollout %s: group %s was queued before this rollout started (no group size "
                                "stated, none configured): its %d sample(s) are kept in SamplesSelected, "
                                "not queued for training", s.rollout_id, group_id, len(s.packed))
                    s.packed = []
            return Effects()
        if len(states) < expected:
            return Effects()
        if any(s.purpose == "eval" for s in states):
            return Effects()  # evaluation only: scored, never trained on
        if any(s.phase is not RolloutPhase.SEALED for s in states):
            return Effects()
        self.queued_groups.add(group_id)
        scored = {s.rollout_id: s.score for s in states if s.score is not None}
        advantages = group_advantages(scored, self.config.advantage)
        return Effects(events=self._micro_steps(group_id, states, advantages, cause))

    def _micro_steps(self, group_id, states, advantages, cause) -> list[Event]:
        run = self.config.run_id
        samples = []
        for s in states:
            pairs = list(zip(s.samples, s.packed))
            if pairs and not any(p.n_execution_trained_tokens for _, p in pairs):
                # Nothing of this execution is trained (every token masked: context-only or
                # undelivered calls): queued, it would count as an execution in the trainer's
                # divisor with no loss of its own. Its score still enters the group's
                # advantages; its samples stay listed in SamplesSelected.
                log.warning("rollout %s: no trained token in its %d sample(s): not queued for training "
                            "(its score still counts in group %s's advantages)", s.rollout_id, len(pairs), group_id)
                pairs = []
            samples += [(ref, advantages[s.rollout_id], packed) for ref, packed in pairs]
            s.packed = []  # queued (or left out): the blobs hold them from here on
        plans = plan_micro_steps([p for _, _, p in samples], self.config.micro_step_tokens)
        step = states[0].step if states else 0
        env = {"run_id": run, "causation_id": cause.event_id,
               "correlation_id": cause.correlation_id or cause.event_id, "time": cause.time}
        events: list[Event] = []
        for k, (members, size) in enumerate(plans):
            name = f"{group_id}-m{k}"
            batch = [samples[i] for i in members]
            events.append(MicroStepQueued(
                event_id=event_id(run, "MicroStepQueued", name), step=step,
                micro_step=name, group_id=group_id, sample_digests=[r.digest for r, _, _ in batch],
                advantages=[a for _, a, _ in batch], n_tokens=size, group_micro_steps=len(plans), **env))
        events.append(GroupQueued(event_id=event_id(run, "GroupQueued", group_id), step=step, group_id=group_id,
                                  micro_steps=len(plans), rollout_ids=[s.rollout_id for s in states],
                                  samples=len(samples), **env))
        return events


def tree_summary(state: RolloutState, sealed: SealedTree) -> bytes:
    """The JSON a ``gyre tree show`` reads: forks, roles, branches, selection, score. Per
    call also the proxy's drift class and ``by_drift`` (its relation was taken from that
    class, see ``forks.py``); ``ForkDetected`` carries the drift class of each fork's call."""
    tree = state.tree.tree
    chosen = {b.call_id for b in sealed.selected}
    doc = {
        "rollout_id": state.rollout_id, "group_id": state.group_id, "step": state.step,
        "harness": state.harness, "score": state.score, "scoring_failed": state.scoring_failed,
        "content_digest": sealed.tree_digest, "stored_tokens": tree.n_stored_tokens,
        "flattened_tokens": tree.n_flattened_tokens(),
        "calls": [{"call_id": lab.call_id, "line": lab.lineage, "role": lab.role,
                   "relation": lab.relation, "fork": lab.fork, "position": lab.position,
                   "drift": tree.calls[lab.call_index].drift, "by_drift": lab.by_drift,
                   "n_tokens": tree.call_length(lab.call_index),
                   "delivered": tree.calls[lab.call_index].delivered} for lab in sealed.labels],
        "branches": [{"call_id": b.call_id, "role": b.role, "n_tokens": b.n_tokens,
                      "selected": b.call_id in chosen} for b in sealed.branches],
        "samples": [{"piece": p.piece, "role": p.role, "n_tokens": p.n_tokens,
                     "n_trained_tokens": p.n_trained_tokens, "n_context_tokens": p.n_context_tokens}
                    for p in sealed.packed],
        "rejected": [{"call_id": r.call_id, "reason": r.reason} for r in sealed.rejected],
    }
    if sealed.untrained:  # only then: a summary (so TreeSealed's digest) stays as before without one
        doc["untrained"] = [{"call_id": r.call_id, "reason": r.reason} for r in sealed.untrained]
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def call_from_event(ev: CallRecorded, new_input, output, logprobs) -> CallRecord:
    """The seam: a ``CallRecorded`` event plus its fetched token arrays -> a call record."""
    from .records import CallHints, WeightSpan

    h = ev.hints
    return CallRecord(
        call_id=ev.call_id, rollout_id=ev.rollout_id, new_input_ids=new_input, output_ids=output,
        output_logprobs=logprobs, parent_call_id=ev.parent_call_id, prefix_len=ev.prefix_len,
        weight_spans=tuple(WeightSpan(s.start, s.end, s.version) for s in ev.weight_spans),
        weight_version=ev.weight_spans[0].version if ev.weight_spans else 0,
        session_id=ev.session_id, drift=ev.drift.value, finish_reason=ev.finish_reason,
        delivered=ev.delivered,
        logprob_temperature=1.0 if ev.logprob_temperature is None else ev.logprob_temperature,
        hints=CallHints(agent_id=h.agent_id, system_digest=h.system_digest, tools_digest=h.tools_digest,
                        role=h.role, parent_agent_id=h.parent_agent_id,
                        kind=getattr(h, "kind", None)),  # kind: requested, not in the catalogue yet
    )
