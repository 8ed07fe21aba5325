"""The core cell: authoritative weights and optimizer; one update per step.

It reads the log: ``MicroStepQueued`` (trees stream, from the start: cheap, and it
learns every step's micro-steps whatever was checkpointed) and ``MicroStepDone``
(training stream, from the checkpoint's position). A result computed on the core's
current weight version is added to the step's :class:`StepReducer`; any other version
is dropped and the core computes that micro-step again itself (its requeue). When
every micro-step of the step is in, it applies one update (or none when a loss or the
gradient is not finite: weights unchanged, the step marked), publishes ``StepApplied``,
the new weights (blob + ``WeightsPublished``, then to the inference cells), and writes
a checkpoint with the consumed training-stream position. Step ``s`` always trains on
weight version ``s``: a skipped update still moves the version on (same weights).

Weight blobs: every version's weights go to the blob store (a whole model each), named by
its ``WeightsPublished``. Only the newest ``keep_weights`` published versions (default
:data:`DEFAULT_KEEP_WEIGHTS`, at least 2; None keeps all) keep their blob: what reads them
is a cell resuming or joining (the newest ``WeightsPublished``'s version) and an inference
cell one version behind; replay reads checkpoints, not these. Older ones are deleted once
a newer ``WeightsPublished`` is in the log, a blob shared by a kept version (a skipped
step republishes the same bytes) never; a restarted core finds the older ones in the log.
Each blob carries the run's id in its safetensors metadata, so runs sharing a blob bucket
never share (and delete) one another's weight blobs.

A step's size: ``MicroStepQueued.micro_steps_in_step`` when set, else every micro-step
of ``groups_per_step`` groups, each read in full: ``MicroStepQueued.group_micro_steps``
and ``GroupQueued`` say how many micro-steps a group has (``GroupQueued`` also settles a
group with none, whose rollouts left nothing to learn; such a step may hold no micro-step
at all, and is then closed without an update, the version moving on). Logs written
before those fields count a group as soon as one of its micro-steps is read.

Completeness watchdog: a micro-step of the current step that the work queue gave up on
(its dead letter on ``gyredlq.trainer-work-<run>``: it failed ``MAX_DELIVER`` tries in a
row) is computed here, as a dropped one is; so is one that no cell finished within
``requeue_after_s`` of the later of its step's weights being published, the core reading
it, and its last ``MicroStepClaimed`` (a cell hung while it kept its claim alive, or a
queue message lost otherwise); and so is one claimed ``max_claims`` times without a result
(each cell that took it died with it). Nothing is applied twice: a micro-step is computed here
only while it is not among the step's used ones, and a cell's result that comes after is
passed over as a duplicate. A computation that fails (the blob store down) is tried again
later; the core does not stop for it (``watchdog.py``).

A core never resumes behind the log: if the newest readable checkpoint is older than the
log's last ``StepApplied`` (``LATEST`` lost or unreadable, the checkpoint folder wiped), it
would train those steps again and publish their versions a second time, with other bytes;
it refuses to start, unless ``resume_behind_log`` (``GYRE_TRAINER_RESUME_BEHIND_LOG``) is set.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from libs.common.bus.port import BlobStore, EventBus
from libs.common.events import (Context, Event, EventDecodeError, GroupQueued, MicroStepClaimed, MicroStepDone,
                                MicroStepQueued, StepApplied, WeightsPublished, WeightsRetired, decode)

from .backends.base import PolicyBackend
from .batch import tree_batch
from .checkpoint import TrainerState, load_latest_checkpoint, save_checkpoint
from .step import MicroResult, StepReducer, TrainConfig, compute_micro_step, make_optimizer
from .transfer import GradientSink
from .watchdog import DEFAULT_MAX_CLAIMS, CompletenessWatch
from .worker import load_samples, objective_key, result_from_done, work_queue_name

log = logging.getLogger(__name__)
Publisher = Callable[[int, dict[str, torch.Tensor]], Awaitable[list[str]]]

# newest published weight versions whose blobs are kept: the newest (what a cell resuming
# or joining pulls), the one before (an inference cell may lag one version behind), and
# one more for a reader that looked up the newest event just before two publications
DEFAULT_KEEP_WEIGHTS = 3
MIN_KEEP_WEIGHTS = 2
# The watchdog's timer is off by default (dead letters only): in colocate, or under high
# demand, no cell trains for hours while micro-steps wait, and a core that computed them
# then would train while its cell serves (against GYRE_TRAINER_FOLLOW_ROLE). Set it (e.g.
# 1800 s) where a cell that hangs with its claim alive is the greater risk.
DEFAULT_REQUEUE_AFTER_S: float | None = None
RESUME_BEHIND_LOG_ENV = "GYRE_TRAINER_RESUME_BEHIND_LOG"


class BehindTheLog(RuntimeError):
    """The checkpoint to resume from is older than the log's last ``StepApplied``."""


@dataclass(frozen=True)
class CoreSettings:
    run_id: str
    cell: str = "core"
    train: TrainConfig = TrainConfig()
    checkpoint_dir: Path | None = None
    groups_per_step: int | None = None
    max_staleness: int | None = None  # as the workers': a micro-step computed here refuses the same samples
    keep_checkpoints: int | None = None  # newest checkpoints kept (None: all; replay of step N needs step N's)
    keep_weights: int | None = DEFAULT_KEEP_WEIGHTS  # newest published weight blobs kept (None: all; >= 2)
    requeue_after_s: float | None = DEFAULT_REQUEUE_AFTER_S  # the watchdog's wait (None or 0, default: dead letters only)
    max_claims: int | None = DEFAULT_MAX_CLAIMS  # claims without a result before the core computes it (None/0: off)
    watch_every_s: float = 1.0  # how often the watchdog looks
    work_queue: str = "trainer-work"  # the workers' queue_name: whose dead letters the core reads
    resume_behind_log: bool = False  # operator's override: resume from a checkpoint behind the log

    def __post_init__(self) -> None:
        if self.keep_weights is not None and self.keep_weights < MIN_KEEP_WEIGHTS:
            raise ValueError(f"keep_weights must be at least {MIN_KEEP_WEIGHTS} (the newest published version "
                             f"and the one before it), not {self.keep_weights}")


@dataclass
class _StepPlan:
    queued: dict[str, MicroStepQueued] = field(default_factory=dict)
    groups: set[str] = field(default_factory=set)
    expected: int | None = None
    sizes: dict[str, int] = field(default_factory=dict)  # group -> its micro-steps, where the log says
    cause: Event | None = None  # the first event of the step (StepApplied's causation)


class CoreTrainer:
    def __init__(self, settings: CoreSettings, backend: PolicyBackend, *, bus: EventBus, blobs: BlobStore,
                 gradients: GradientSink, publish: Publisher | None = None) -> None:
        self.settings, self.backend = settings, backend
        self.bus, self.blobs, self.gradients, self.publish_to_cells = bus, blobs, gradients, publish
        self.optimizer = make_optimizer(backend, settings.train)
        self.state = TrainerState()
        # the newest version whose checkpoint is on disk and whose weights are out: what the
        # core's own worker may train on (state.weight_version moves on before the checkpoint)
        self.published_version = -1
        self.plans: dict[int, _StepPlan] = {}
        self._applied_here: dict[int, frozenset[str]] = {}  # the last steps this process applied: their micro-steps
        self.reducer = StepReducer(0, 0)
        self._lock = asyncio.Lock()
        # step -> digests of gradient blobs (satellites' micro-steps) read or passed over for
        # it: deleted once the step is in a checkpoint (a full fp32 gradient each, which the
        # blob store would otherwise keep for good); a restart before that reads them again
        self._spent: dict[int, set[str]] = {}
        # (version, weights digest) of each WeightsPublished whose blob is not deleted yet,
        # oldest first (insertion order), one entry per pair
        self._weight_blobs: dict[tuple[int, str], None] = {}
        self.watch = CompletenessWatch(settings.requeue_after_s, max_claims=settings.max_claims)  # which micro-steps no cell will finish

    # -------------------------------------------------------------------- start / resume
    async def start(self) -> None:
        found = load_latest_checkpoint(self.settings.checkpoint_dir) if self.settings.checkpoint_dir else None
        await self._refuse_to_resume_behind_the_log(found[0] if found is not None else None,
                                                    found[1] if found is not None else TrainerState())
        if found is not None:
            ckpt, self.state, weights, opt = found
            self.backend.load_hf_state_dict(weights)
            self.optimizer.load_state_dict(opt)
            log.info("core resumes at step %d (v%d) from %s", self.state.step, self.state.weight_version, ckpt)
        elif self.settings.checkpoint_dir:  # step 0's starting point, for replay
            await asyncio.to_thread(save_checkpoint, self.settings.checkpoint_dir, self.state,
                                    self.backend.hf_state_dict(), self.optimizer, keep=self.settings.keep_checkpoints)
        # what the log gives again (the trees stream is re-read from its start, the training
        # stream from the checkpoint's position): nothing of an earlier run() is kept
        self.plans = {}
        self._spent = {}
        self.reducer = StepReducer(self.state.step, self.state.weight_version)
        self._weight_blobs = await self._published_weight_blobs()
        await self._publish_pending()  # killed between its checkpoint and publishing it
        await self._publish_weights(cause=None)
        self.published_version = self.state.weight_version
        self.watch = CompletenessWatch(self.settings.requeue_after_s, max_claims=self.settings.max_claims)  # the step's weights are out

    async def _refuse_to_resume_behind_the_log(self, ckpt: Path | None, state: TrainerState) -> None:
        """Raises :class:`BehindTheLog` if the log has a ``StepApplied`` of ``state.step`` or
        later: resuming there would train applied steps again and publish their weight
        versions a second time, with other bytes, to cells that may hold the first ones."""
        subject = f"gyre.{self.settings.run_id}.{Context.TRAINING.value}.{StepApplied.TYPE}"
        last = await self.bus.last_on_subject(Context.TRAINING, subject)
        if last is None:
            return
        try:
            applied = decode(last.data)
        except EventDecodeError:
            return
        if not isinstance(applied, StepApplied) or applied.step < state.step:
            return
        where = f"checkpoint {ckpt}" if ckpt is not None else (
            f"no checkpoint in {self.settings.checkpoint_dir}" if self.settings.checkpoint_dir else "no checkpoint")
        message = (f"core: the log has applied step {applied.step} (weights v{applied.weight_version}), but the newest "
                   f"readable checkpoint is at step {state.step} ({where}); resuming there would train steps "
                   f"{state.step}..{applied.step} again and publish their weight versions a second time with other "
                   f"bytes. Restore the newer checkpoint (LATEST, step-{applied.step + 1:06d}.pt), or set "
                   f"{RESUME_BEHIND_LOG_ENV}=1 to resume from it anyway")
        if not self.settings.resume_behind_log:
            raise BehindTheLog(message)
        log.warning("%s (%s is set: resuming)", message, RESUME_BEHIND_LOG_ENV)

    async def run(self, stop) -> None:
        """Follows the log until ``stop``. Any error while handling an event (a weights
        upload, a publication, the checkpoint's write, a recompute) ends it at once with
        that error: the core is not left half-way through a step, and its supervisor
        restarts it, which resumes from the newest checkpoint and publishes what that
        checkpoint has and the log lacks (the step's ``StepApplied``, its weights)."""
        await self.start()
        since = self.state.consumed.get("training", 0) + 1
        # the followers stop on ``halt``: set by ``stop`` and whenever run() ends, so each one
        # returns at its next message or idle tick even if a library's wait swallowed its cancel
        halt = asyncio.Event()

        async def relay() -> None:
            await stop.wait()
            halt.set()

        tasks = [asyncio.create_task(self._follow(Context.TREES, 1, MicroStepQueued, self.on_queued, halt)),
                 asyncio.create_task(self._follow(Context.TREES, 1, GroupQueued, self.on_group, halt)),
                 asyncio.create_task(self._follow(Context.TRAINING, since, MicroStepDone, self.on_done, halt)),
                 asyncio.create_task(self._follow(Context.TRAINING, since, MicroStepClaimed, self.on_claimed, halt)),
                 asyncio.create_task(self._follow_dead_letters(halt)),
                 asyncio.create_task(self._watch(halt))]
        stopped = asyncio.create_task(relay())
        try:
            while not stop.is_set():
                done, _ = await asyncio.wait([*tasks, stopped], return_when=asyncio.FIRST_COMPLETED)
                for t in tasks:
                    if t in done and not t.cancelled() and t.exception() is not None:
                        log.error("core: handling the log failed (%r); stops, to be restarted from its checkpoint",
                                  t.exception())
                        raise t.exception()
                if not stop.is_set() and any(t in done for t in tasks):
                    raise RuntimeError("core: the log stopped being followed before the core was stopped")
        finally:
            halt.set()
            stopped.cancel()
            async with self._lock:  # let a step being applied finish (update, events, checkpoint)
                for t in tasks:
                    t.cancel()
            pending = set(tasks)
            while pending:  # bounded: a task whose cancel was lost is cancelled again
                _, pending = await asyncio.wait(pending, timeout=2.0)
                for t in pending:
                    t.cancel()
            for t in tasks:  # retrieved, so none is logged as never retrieved
                if not t.cancelled():
                    t.exception()

    async def _follow(self, context: Context, start: int, kind, handler, stop) -> None:
        subject = f"gyre.{self.settings.run_id}.{context.value}.{kind.TYPE}.>"
        async for raw in self.bus.follow(context, start_seq=start, filter_subject=subject):
            if stop.is_set():
                return
            if raw is None:
                continue
            try:
                event = decode(raw.data)
            except EventDecodeError as exc:
                # as any consumer does: kept on the dead-letter stream, and the core goes on (raising
                # would stop it, and every restart from the checkpoint would stop on it again)
                log.error("core: %s seq %d is not an event this core can read (%s); dead-lettered, skipped",
                          raw.stream, raw.seq, exc)
                await self.bus.dead_letter(f"trainer-core-{self.settings.run_id}", raw, f"undecodable: {exc}")
                if kind is MicroStepDone:  # passed, as a handled one would be
                    async with self._lock:  # (a checkpoint may be being written from the state)
                        self.state.consumed["training"] = raw.seq
                continue
            async with self._lock:
                await handler(event, raw.seq)

    # -------------------------------------------------------------------- events in
    async def on_queued(self, ev: MicroStepQueued, seq: int = 0) -> None:
        if ev.step < self.state.step:
            used = self._applied_here.get(ev.step)
            if used is not None and ev.micro_step not in used:  # not a replay of the log: it came too late
                log.warning("core: %s (group %s) was queued after step %d was applied (groups_per_step=%s "
                            "reached): it is not trained", ev.micro_step, ev.group_id, ev.step,
                            self.settings.groups_per_step)
            return
        plan = self.plans.setdefault(ev.step, _StepPlan())
        plan.queued[ev.micro_step] = ev
        plan.groups.add(ev.group_id)
        plan.cause = plan.cause or ev
        if ev.group_micro_steps:
            plan.sizes[ev.group_id] = ev.group_micro_steps
        if ev.micro_steps_in_step:
            plan.expected = ev.micro_steps_in_step
        self.watch.read(ev.step, ev.micro_step)
        r = self.reducer
        if ev.step == self.state.step and ev.micro_step in r.dropped and ev.micro_step not in r.used:
            await self._recompute(ev)  # its stale result came in before this event
        await self._maybe_finish()

    async def on_claimed(self, ev: MicroStepClaimed, seq: int = 0) -> None:
        """A cell took the micro-step: the watchdog waits ``requeue_after_s`` from now."""
        if ev.step >= self.state.step:
            self.watch.claimed(ev.step, ev.micro_step)

    async def _follow_dead_letters(self, stop) -> None:
        """Notes each micro-step the work queue dead-lettered (from the first: a restarted
        core sees those its predecessor had not computed yet)."""
        follow = getattr(self.bus, "follow_dead_letters", None)
        if follow is None:  # a bus without it: the watchdog's timer alone
            await stop.wait()
            return
        async for raw in follow(work_queue_name(self.settings.run_id, self.settings.work_queue)):
            if stop.is_set():
                return
            if raw is None:
                continue
            try:
                ev = decode(raw.data)
            except EventDecodeError:
                continue  # nobody could read it: no step counts it
            if isinstance(ev, MicroStepQueued) and ev.step >= self.state.step:
                log.warning("core: the work queue gave up on %s of step %d (%s seq %d); the core computes it",
                            ev.micro_step, ev.step, raw.stream, raw.seq)
                self.watch.dead_lettered(ev.step, ev.micro_step)

    async def _watch(self, stop) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.settings.watch_every_s)
                return
            except (TimeoutError, asyncio.TimeoutError):
                pass
            async with self._lock:
                await self._requeue_lost()

    async def _requeue_lost(self) -> None:
        """Computes here each lost micro-step of the current step (under the core's lock: no
        result of it can be added meanwhile, and one that comes later is a duplicate)."""
        plan = self.plans.get(self.state.step)
        if plan is None:
            return
        for key in self.watch.lost([(self.state.step, ms) for ms in plan.queued], self.reducer.used):
            ev = plan.queued[key[1]]
            if self.watch.is_dead(key):
                why = "dead-lettered by the work queue"
            elif self.watch.too_often_claimed(key):
                why = (f"claimed {self.watch.claims(key)} times without a result (the cells that took it "
                       "stopped with it)")
            else:
                why = f"not finished by any cell within {self.settings.requeue_after_s:.0f}s"
            log.warning("core: %s of step %d was %s; computes it itself", ev.micro_step, ev.step, why)
            try:
                await self._recompute(ev, count_rejected=True)
            except Exception as exc:  # e.g. the blob store is down: the core goes on, and tries again
                log.error("core: computing %s failed (%r); tries again later", ev.micro_step, exc)
                self.watch.failed(key)
        await self._maybe_finish()

    async def on_group(self, ev: GroupQueued, seq: int = 0) -> None:
        """A settled group; one with no micro-steps (nothing to learn from) still counts
        toward its step's ``groups_per_step``."""
        if ev.step < self.state.step:
            return
        plan = self.plans.setdefault(ev.step, _StepPlan())
        plan.groups.add(ev.group_id)
        plan.sizes[ev.group_id] = ev.micro_steps
        plan.cause = plan.cause or ev
        await self._maybe_finish()

    async def on_done(self, ev: MicroStepDone, seq: int = 0) -> None:
        if seq:
            self.state.consumed["training"] = seq
        transfer = ev.gradient.get("transfer")
        if isinstance(transfer, dict) and transfer.get("kind") == "blob" and transfer.get("digest"):
            self._spent.setdefault(ev.step, set()).add(transfer["digest"])
        if ev.step != self.state.step or ev.micro_step in self.reducer.used:
            await self._discard(ev)  # an applied step's straggler, or a duplicate
            return
        theirs, ours = ev.gradient.get("objective"), objective_key(self.settings.train, self.backend)
        try:
            if theirs != ours:  # none: a cell that does not say, so its gradient's layout is unknown
                log.error("core: %s from cell %s was computed under %s, not the core's %s (a satellite configured "
                          "apart from the core: objective, backend or model?); computes it again", ev.micro_step,
                          ev.cell, theirs, ours)
                result = replace(await result_from_done(_without_transfer(ev), self.gradients), weight_version=-1)
            else:
                result = await result_from_done(ev, self.gradients)
        except Exception as exc:  # lost with a restart, or its sender gone: compute it here instead
            log.info("core: gradient of %s unavailable (%s); computes it again", ev.micro_step, exc)
            result = replace(await result_from_done(_without_transfer(ev), self.gradients), weight_version=-1)
        if not self.reducer.add(result):
            log.info("core: drops %s (v%d, current v%d) and computes it again", ev.micro_step,
                     ev.weight_version, self.state.weight_version)
            queued = self.plans.get(ev.step, _StepPlan()).queued.get(ev.micro_step)
            if queued is not None:
                await self._recompute(queued)
        self.reducer.rejected.extend(ev.gradient.get("rejected", []))
        await self._maybe_finish()

    async def _discard(self, ev: MicroStepDone) -> None:
        """Frees a gradient this process holds for a result it will not use (the core's own
        worker hands them over in memory: a whole model's fp32 gradient each)."""
        transfer = ev.gradient.get("transfer")
        if isinstance(transfer, dict) and transfer.get("kind") == "memory":
            try:
                await self.gradients.get(transfer)
            except Exception:  # not this process's, or read already
                pass

    async def _recompute(self, ev: MicroStepQueued, *, count_rejected: bool = False) -> None:
        """Computes ``ev`` here, at the current version. Its rejected samples were counted
        from the cell's ``MicroStepDone`` already (``count_rejected``: there was none, the
        watchdog's case); with none left it still counts as done (nothing to add), so the
        step can complete."""
        samples, rejected = await load_samples(self.blobs, ev, self.backend.vocab_size, self.state.weight_version,
                                               self.settings.max_staleness)
        if samples:
            result = await asyncio.to_thread(compute_micro_step, self.backend, tree_batch(samples),
                                             self.settings.train, micro_step=ev.micro_step,
                                             weight_version=self.state.weight_version)
        else:
            result = MicroResult(ev.micro_step, self.state.weight_version, (), 0.0, 0, 0, {}, None)
        if self.reducer.add(result) and count_rejected:
            self.reducer.rejected.extend(rejected)

    # -------------------------------------------------------------------- the update
    def _complete(self) -> bool:
        plan = self.plans.get(self.state.step)
        if plan is None:
            return False
        expected = plan.expected
        wanted = self.settings.groups_per_step
        if expected is None and wanted:
            if plan.sizes:  # the log says each group's size: count the groups read in full
                read: dict[str, int] = {}
                for q in plan.queued.values():
                    read[q.group_id] = read.get(q.group_id, 0) + 1
                settled = sum(1 for g, n in plan.sizes.items() if read.get(g, 0) >= n)
                # and no group of the step half read (a step re-run after a restart may hold
                # more groups than groups_per_step: one still arriving is waited for)
                if (settled >= wanted and plan.groups <= set(plan.sizes)
                        and all(read.get(g, 0) >= n for g, n in plan.sizes.items())):
                    expected = len(plan.queued)
            elif len(plan.groups) >= wanted:  # a log written before the sizes were recorded
                expected = len(plan.queued)
        return expected is not None and len(plan.queued) >= expected and set(plan.queued) <= set(self.reducer.used)

    async def _maybe_finish(self) -> None:
        """Applies the current step once complete, and the next while it is complete too (a
        step with nothing to train may have been settled while the one before was open)."""
        while self._complete():
            await self._finish_step()

    async def _finish_step(self) -> None:
        r = self.reducer
        applied = r.apply(self.backend, self.optimizer, self.settings.train)
        stats = r.loss_stats()
        stats["loss_finite"] = 1.0 if math.isfinite(stats["loss"]) else 0.0
        stats = {k: v for k, v in stats.items() if math.isfinite(v)}  # JSON has no NaN: left out
        stats["applied"] = 1.0 if applied else 0.0
        if not r.used:
            log.info("core: step %d had nothing to train (its groups left no samples); the version moves on", r.step)
        elif not applied:
            log.warning("core: step %d not applied (non-finite loss or gradient: %s)", r.step, r.non_finite)
        # The version moves on either way (a skipped step republishes the same weights), so
        # "step s trains on version s" holds and every cell can tell what to wait for.
        self.state.weight_version += 1
        plan = self.plans.pop(self.state.step)
        self._applied_here[r.step] = frozenset(plan.queued)
        for old in [k for k in self._applied_here if k < r.step - 3]:
            del self._applied_here[old]
        cause = plan.cause
        stats["rejected_samples"] = float(len(r.rejected))
        partial = r.partial_executions()
        if partial:  # (only then: the stats of steps without any stay as they were)
            stats["partial_executions"] = float(len(partial))
            log.warning("core: step %d trained %d execution(s) only in part (a piece of each was refused; each "
                        "counts by the share of its tokens kept): %s", r.step, len(partial), ", ".join(partial[:5]))
        applied_ev = StepApplied(**cause.caused(
            event_id=_event_id(self.settings.run_id, "StepApplied", r.step), step=r.step,
            weight_version=self.state.weight_version, micro_steps_used=list(r.used),
            micro_steps_dropped=list(r.dropped) + list(r.non_finite), loss=stats))
        self.state.history.append({"step": r.step, **stats})
        self.state.step += 1
        self.reducer = StepReducer(self.state.step, self.state.weight_version)
        # The checkpoint first: nothing of the new version (its StepApplied, its weights, so
        # no micro-step computed on it) is in the log before it is on disk, so a core killed
        # at any point resumes from a checkpoint the log has not gone past.
        self.state.pending_applied = applied_ev.model_dump(mode="json")
        if self.settings.checkpoint_dir:
            # off the event loop (a big model's write and fsync take long: NATS pings and the
            # claims' heartbeats go on), still under the core's lock, so no event is handled
            # and nothing touches the weights or the optimizer meanwhile; the state is copied
            await asyncio.to_thread(save_checkpoint, self.settings.checkpoint_dir, copy.deepcopy(self.state),
                                    self.backend.hf_state_dict(), self.optimizer, keep=self.settings.keep_checkpoints)
            await self._delete_spent(r.step)  # only once nothing would read them again
        await self._publish_pending()
        await self._publish_weights(cause)
        self.published_version = self.state.weight_version
        self.watch.step_opened(self.state.step)  # the new step's weights are out

    async def _delete_spent(self, through_step: int) -> None:
        """Deletes the gradient blobs of steps up to ``through_step``, now checkpointed (a
        MicroStepDone of such a step that comes again is a straggler: passed over)."""
        delete = getattr(self.blobs, "delete", None)
        for step in [k for k in self._spent if k <= through_step]:
            digests = self._spent.pop(step)
            if delete is None:
                continue
            for digest in digests:
                try:
                    await delete(digest)
                except Exception as exc:  # a leftover blob costs space, not correctness
                    log.warning("core: could not delete gradient blob %s of step %d: %r", digest[:12], step, exc)

    async def _publish_pending(self) -> None:
        """Publishes the checkpointed StepApplied unless the log has it already."""
        data = self.state.pending_applied
        if data is None:
            return
        ev = StepApplied.model_validate(data)
        last = await self.bus.last_on_subject(Context.TRAINING, ev.subject)
        if last is None or decode(last.data).step < ev.step:
            await self.bus.publish(ev)
        self.state.pending_applied = None

    async def _publish_weights(self, cause) -> None:
        from safetensors.torch import save

        weights = {k: v.contiguous() for k, v in self.backend.hf_state_dict().items()}
        # the run's id in the file's metadata: blobs are content-addressed and runs may share a
        # bucket, so two runs from the same model would otherwise share v0's blob, and one
        # run's keep_weights would delete what the other still names
        digest = await self.blobs.put(save(_untied(weights), metadata={"gyre_run_id": self.settings.run_id}))
        targets = await self.publish_to_cells(self.state.weight_version, weights) if self.publish_to_cells else []
        envelope = cause.caused() if cause is not None else {"run_id": self.settings.run_id}
        envelope["event_id"] = _event_id(self.settings.run_id, "WeightsPublished", self.state.weight_version)
        await self.bus.publish(WeightsPublished(**envelope, weight_version=self.state.weight_version,
                                                target_cells=targets, checkpoint_digest=digest))
        await self._delete_old_weights(self.state.weight_version, digest)

    def _weights_subject(self) -> str:
        return f"gyre.{self.settings.run_id}.{Context.TRAINING.value}.{WeightsPublished.TYPE}"

    async def _published_weight_blobs(self) -> dict[tuple[int, str], None]:
        """The weight blobs the log names that may still exist: those of versions from the
        checkpoint's ``weights_pruned_below`` on (older ones were deleted before)."""
        if self.settings.keep_weights is None:
            return {}
        found: dict[tuple[int, str], None] = {}
        async for d in self.bus.read(Context.TRAINING, filter_subject=self._weights_subject()):
            ev = d.event
            if (isinstance(ev, WeightsPublished) and ev.checkpoint_digest
                    and ev.weight_version >= self.state.weights_pruned_below):
                _note(found, (ev.weight_version, ev.checkpoint_digest))
        return found

    async def _delete_old_weights(self, version: int, digest: str) -> None:
        """Called once the WeightsPublished of ``version`` is in the log: deletes the blobs
        of all but the newest ``keep_weights`` published versions (never one that a kept
        version's blob also is). A ``WeightsRetired`` naming them is written first; if it
        cannot be, nothing is deleted and the next publish tries again. A failed delete
        costs space, not correctness."""
        keep = self.settings.keep_weights
        if keep is None:
            return
        _note(self._weight_blobs, (version, digest))
        if len(self._weight_blobs) <= keep:
            return
        entries = list(self._weight_blobs)
        old, kept = entries[:-keep], entries[-keep:]
        kept_digests = {d for _, d in kept}
        kept_from = min(v for v, _ in kept)
        retired = [(v, d) for v, d in old if d not in kept_digests]
        delete = getattr(self.blobs, "delete", None)
        doomed = list(dict.fromkeys(d for _, d in retired))
        if doomed and delete is not None:
            record = WeightsRetired(run_id=self.settings.run_id, weight_versions=sorted({v for v, _ in retired}),
                                    digests=doomed, kept_from=kept_from,
                                    event_id=_event_id(self.settings.run_id, "WeightsRetired", version))
            try:
                await self.bus.publish(record)
            except Exception as exc:
                log.warning("core: could not record the retirement of weight versions %s (their blobs are kept "
                            "until the next publish tries again): %r", record.weight_versions, exc)
                return
        self._weight_blobs = dict.fromkeys(kept)
        self.state.weights_pruned_below = max(self.state.weights_pruned_below, kept_from)
        if delete is None:
            return
        for old_digest in doomed:
            try:
                await delete(old_digest)
            except Exception as exc:
                log.warning("core: could not delete the retired weights blob %s: %r", old_digest[:12], exc)


class CoreWeightSource:
    """The core's own worker reads the core's weights directly (same process), the version
    the satellites see too: the newest one checkpointed and published. A step being applied
    (its update done, its checkpoint being written) is not offered yet, so no micro-step is
    computed on a version that a core killed meanwhile would not resume from."""

    def __init__(self, core: CoreTrainer) -> None:
        self.core = core

    async def current_version(self) -> int:
        return self.core.published_version

    async def fetch(self, version: int) -> dict[str, torch.Tensor]:
        published, held = self.core.published_version, self.core.state.weight_version
        if version != published or held != published:  # a step being applied: not these weights any more
            raise LookupError(f"the core holds v{held} (v{published} published), not v{version}")
        return {k: v.clone() for k, v in self.core.backend.hf_state_dict().items()}


def _note(entries: dict[tuple[int, str], None], entry: tuple[int, str]) -> None:
    """Moves ``entry`` to the end of ``entries`` (the newest), once."""
    entries.pop(entry, None)
    entries[entry] = None


def _without_transfer(ev: MicroStepDone) -> MicroStepDone:
    return ev.model_copy(update={"gradient": {k: v for k, v in ev.gradient.items() if k != "transfer"}})


def _event_id(run_id: str, kind: str, key: int) -> str:
    """Deterministic ids: a core that restarts and publishes again is de-duplicated."""
    return hashlib.sha256(f"{run_id}:{kind}:{key}".encode()).hexdigest()[:32]


def _untied(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied embeddings): copy the duplicates."""
    seen, out = set(), {}
    for k, v in weights.items():
        ptr = v.data_ptr()
        out[k] = v.clone() if ptr in seen else v
        seen.add(ptr)
    return out
