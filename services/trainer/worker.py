"""A training cell's work loop (core or satellite): claim a micro-step, compute, send.

Micro-steps come from a JetStream work queue: every cell pulls ``MicroStepQueued`` from
one shared durable consumer, so each is delivered to one cell; a claim that is not
acked within ``ack_wait_s`` (the cell died) is delivered again to another. For step
``s`` a cell first makes sure it holds weight version ``s`` (from its
:class:`WeightSource`); it then publishes ``MicroStepClaimed``, computes the gradient of
the micro-step's weighted loss, puts it on the :class:`GradientSink` and publishes
``MicroStepDone`` with the descriptor. The message is acked after that. A cell publishes
one claim per delivery it computes (a failed try retried in place does not claim again), so
the core can tell a micro-step that every cell taking it died with (its watchdog's
``max_claims``).

A micro-step of a step the core has not reached yet (version ``s`` not published) is
held at most ``future_hold_s`` and then put back (the handler raises :class:`NotYet`, the
bus naks it with the queue's short retry delay, and never dead-letters it for that,
however often: only failed tries count toward ``MAX_DELIVER``): a cell never sits on a future claim
while a claim of the current step, redelivered from a cell that died, waits in the queue
for someone to fetch it. While a micro-step is computed the claim is kept alive (the
queue's heartbeat, every min(30 s, ``ack_wait_s`` / 3)), so a slow micro-step is not
computed twice; a dead cell's claim goes to another ``ack_wait_s`` after its last beat.

Each ``MicroStepDone`` carries :func:`objective_key`: the objective, the backend and a
hash of the parameter layout the flat gradient follows; the core adds only results whose
key is its own.

Bad samples are rejected one by one with their reason (listed in the descriptor under
``rejected``); the rest of the micro-step goes on.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from libs.common.bus.port import BlobStore, ConsumerConfig, Deferred, Delivery, EventBus
from libs.common.events import Context, MicroStepClaimed, MicroStepDone, MicroStepQueued, WeightsPublished
from services.trajectory.codec import CodecError, decode_packed
from services.trajectory.packing import PackedTree

from .backends.base import PolicyBackend
from .batch import BadSample, tree_batch, validate_sample
from .step import MicroResult, TrainConfig, compute_micro_step
from .transfer import GradientSink

log = logging.getLogger(__name__)


class WorkerStopped(RuntimeError):
    """Raised inside a claim when the cell leaves training: the message is not acked, so
    JetStream delivers it to another cell."""


class NotYet(Deferred):
    """Raised inside a claim of a step whose weights are not published yet: the claim
    goes back to the queue (nak) instead of being held until they are."""


class WeightSource(Protocol):
    """Where a cell gets the core's current weights."""

    async def current_version(self) -> int: ...

    async def fetch(self, version: int) -> dict[str, torch.Tensor]: ...


class BusWeightSource:
    """The newest ``WeightsPublished`` on the log names the weights blob (safetensors)."""

    def __init__(self, bus: EventBus, blobs: BlobStore, run_id: str) -> None:
        self.bus, self.blobs = bus, blobs
        self.subject = f"gyre.{run_id}.{Context.TRAINING.value}.{WeightsPublished.TYPE}"

    async def last_event(self) -> WeightsPublished | None:
        """The newest ``WeightsPublished`` (None before the first)."""
        return await self._last()

    async def _last(self) -> WeightsPublished | None:
        from libs.common.events import decode

        raw = await self.bus.last_on_subject(Context.TRAINING, self.subject)
        return None if raw is None else decode(raw.data)

    async def current_version(self) -> int:
        ev = await self._last()
        return -1 if ev is None else ev.weight_version

    async def fetch(self, version: int) -> dict[str, torch.Tensor]:
        from safetensors.torch import load

        ev = await self._last()
        if ev is None or ev.weight_version != version or ev.checkpoint_digest is None:
            raise LookupError(f"weights v{version} are not the published ones")
        return load(await self.blobs.get(ev.checkpoint_digest))


@dataclass(frozen=True)
class WorkerSettings:
    run_id: str
    cell: str
    train: TrainConfig = TrainConfig()
    max_staleness: int | None = None  # reject samples generated more than N versions back
    ack_wait_s: float = 600.0
    poll_s: float = 0.05
    queue_name: str = "trainer-work"
    # how long a claim of a future step waits for its weights before it goes back to the
    # queue (capped at a quarter of ack_wait_s)
    future_hold_s: float = 5.0
    retry_delay_s: float = 1.0  # a claim put back (or one that failed) is delivered again after this


def work_queue_name(run_id: str, queue_name: str = "trainer-work") -> str:
    """The work queue's durable consumer (its dead letters go to ``gyredlq.<this>``)."""
    # named per run: a durable of another run on the same server follows that run's subjects
    return f"{queue_name}-{run_id}"


def work_queue_config(settings: WorkerSettings) -> ConsumerConfig:
    # hand-backs (a future step's claim, a cell leaving while its claim waits for weights)
    # are redeliveries in the ordinary course: they never count toward MAX_DELIVER
    return ConsumerConfig(name=work_queue_name(settings.run_id, settings.queue_name), context=Context.TREES,
                          filter_subject=f"gyre.{settings.run_id}.trees.{MicroStepQueued.TYPE}.>",
                          batch=1, max_deliver=MAX_DELIVER, count_redeliveries=False,
                          ack_wait_s=settings.ack_wait_s, retry_delay_s=settings.retry_delay_s,
                          heartbeat_s=min(30.0, settings.ack_wait_s / 3))


# Failed tries of one delivery (retried in place, ``retry_delay_s`` apart: about 17 minutes
# at the defaults) before a micro-step is dead-lettered. Only real failures count: a claim
# handed back (``NotYet``, a cell leaving) does not, however often. A dead-lettered
# micro-step is not lost: the core reads the queue's dead letters and computes it itself.
MAX_DELIVER = 1000


async def load_samples(blobs: BlobStore, ev: MicroStepQueued, vocab: int, version: int,
                       max_staleness: int | None) -> tuple[list[tuple[PackedTree, float]], list[dict[str, str]]]:
    good, rejected = [], []
    if len(ev.advantages) != len(ev.sample_digests):
        return [], [{"digest": d, "reason": "advantages and samples differ in count"} for d in ev.sample_digests]
    for digest, advantage in zip(ev.sample_digests, ev.advantages):
        try:
            data = await blobs.get(digest)
        except KeyError as exc:  # not in the store: this sample cannot be trained (other errors: retried)
            rejected.append({"digest": digest, "reason": f"sample blob missing: {exc}"})
            continue
        try:  # pure checks of bytes anyone could have written: whatever they raise rejects the sample
            p = decode_packed(data)
            validate_sample(p, advantage, vocab)
            _check_staleness(p, version, max_staleness)
        except Exception as exc:
            if not isinstance(exc, (BadSample, CodecError, ValueError)):
                log.warning("sample %s of %s rejected: %r", digest[:12], ev.micro_step, exc)
            rejected.append({"digest": digest, "reason": str(exc) or type(exc).__name__})
            continue
        good.append((p, advantage))
    return good, rejected


def _check_staleness(p: PackedTree, version: int, bound: int | None) -> None:
    if bound is None:
        return
    versions = [v for v, m in zip(p.weight_versions, p.loss_mask) if m and v >= 0]
    if versions and version - min(versions) > bound:
        raise BadSample(f"generated by v{min(versions)}, more than {bound} versions before v{version}")


class MicroStepWorker:
    def __init__(self, settings: WorkerSettings, backend: PolicyBackend, *, bus: EventBus, blobs: BlobStore,
                 gradients: GradientSink, weights: WeightSource) -> None:
        self.settings, self.backend = settings, backend
        self.bus, self.blobs, self.gradients, self.weights = bus, blobs, gradients, weights
        self.version = -1
        self.done: list[str] = []
        self._stop: Any = None
        self._seq: int | None = None  # the stream sequence of the delivery in hand
        self._claimed_seq: int | None = None  # the delivery whose claim is published (its tries in place)

    async def run(self, stop: Any) -> None:
        self._stop = stop
        await self.bus.run_consumer(work_queue_config(self.settings), self.handle, stop=stop)

    async def handle(self, delivery: Delivery) -> None:
        ev = delivery.event
        if isinstance(ev, MicroStepQueued):
            self._seq = delivery.seq
            await self.train(ev)

    async def sync_weights(self, step: int, hold_s: float | None = None) -> bool:
        """Holds weight version ``step`` once it exists; False if the core is already past
        it. With ``hold_s``, raises :class:`NotYet` when it does not exist by then."""
        deadline = None if hold_s is None else time.monotonic() + hold_s
        while True:
            if self._stop is not None and self._stop.is_set():
                raise WorkerStopped("stopped while waiting for weights; the claim goes back to the queue")
            current = await self.weights.current_version()
            if current > step:
                return False
            if current == step:
                if self.version != step:
                    try:
                        weights = await self.weights.fetch(step)
                    except LookupError:
                        if await self.weights.current_version() != step:
                            continue  # a newer version came out between the two reads: ask again
                        raise
                    self.backend.load_hf_state_dict(weights)
                    self.version = step
                return True
            if deadline is not None and time.monotonic() >= deadline:
                raise NotYet(f"step {step} waits for weights v{step} (v{current} is published); "
                             "the claim goes back to the queue")
            await asyncio.sleep(self.settings.poll_s)

    def future_hold_s(self) -> float:
        return min(self.settings.future_hold_s, self.settings.ack_wait_s / 4)

    async def train(self, ev: MicroStepQueued) -> None:
        if not await self.sync_weights(ev.step, hold_s=self.future_hold_s()):
            return  # the step is applied already: a late redelivery
        s = self.settings
        if self._seq is None or self._seq != self._claimed_seq:  # a try in place of a claimed delivery: not again
            await self.bus.publish(MicroStepClaimed(**ev.caused(step=ev.step, micro_step=ev.micro_step, cell=s.cell,
                                                                 weight_version=self.version)))
            self._claimed_seq = self._seq
        samples, rejected = await load_samples(self.blobs, ev, self.backend.vocab_size, self.version,
                                               s.max_staleness)
        result = None
        if samples:
            batch = tree_batch(samples)
            result = await asyncio.to_thread(compute_micro_step, self.backend, batch, s.train,
                                             micro_step=ev.micro_step, weight_version=self.version)
        await self.bus.publish(await self._done_event(ev, result, rejected))
        self.done.append(ev.micro_step)
        self._claimed_seq = None

    async def _done_event(self, ev: MicroStepQueued, result: MicroResult | None,
                          rejected: list[dict[str, str]]) -> MicroStepDone:
        descriptor: dict[str, Any] = {"rejected": rejected, "executions": [], "stats": {}, "finite": True,
                                      "objective": objective_key(self.settings.train, self.backend)}
        loss, n_tokens = 0.0, 0
        if result is not None:
            descriptor.update(executions=list(result.executions), stats=result.stats,
                              shares={r: list(v) for r, v in result.shares.items()},
                              finite=result.gradient is not None and math.isfinite(result.loss_sum))
            if result.gradient is not None:
                descriptor["transfer"] = await self.gradients.put({"gradient": result.gradient})
            loss = result.loss_sum if math.isfinite(result.loss_sum) else 0.0
            n_tokens = result.n_tokens
        for r in rejected:
            log.warning("micro-step %s: sample %s rejected: %s", ev.micro_step, r["digest"][:12], r["reason"])
        return MicroStepDone(**ev.caused(step=ev.step, micro_step=ev.micro_step, cell=self.settings.cell,
                                         weight_version=self.version, n_tokens=n_tokens, loss=loss,
                                         gradient=descriptor))


def objective_key(train: TrainConfig, backend: PolicyBackend) -> str:
    """What a gradient depends on besides the weights and samples: the clip range, the TIS
    cap and the KL coefficient; and what its flat values mean: the backend and the layout
    of its parameters (names and shapes, in the order the gradient is flattened), so a
    megatron gradient is never added to a torch one, nor one of another model, however
    their sizes compare. A core adds only gradients computed under its own."""
    o = train.objective
    return (f"eps_low={o.eps_low!r} eps_high={o.eps_high!r} tis_cap={o.tis_cap!r} kl_coef={o.kl_coef!r} "
            f"backend={backend.name} layout={parameter_layout(backend)}")


def parameter_layout(backend: PolicyBackend) -> str:
    """A hash of the backend's parameter names and shapes in flatten order."""
    h = hashlib.sha256()
    for name, p in backend.named_parameters():
        h.update(f"{name}:{tuple(p.shape)};".encode())
    return h.hexdigest()[:16]


async def result_from_done(ev: MicroStepDone, gradients: GradientSink) -> MicroResult:
    """The core's view of a cell's ``MicroStepDone``."""
    d = ev.gradient
    grad = None  # none: every sample rejected (nothing to add), or a non-finite loss
    if d.get("finite", True) and "transfer" in d:
        grad = (await gradients.get(d["transfer"]))["gradient"]
    loss = ev.loss if d.get("finite", True) else float("nan")
    shares = {str(r): (int(v[0]), int(v[1])) for r, v in dict(d.get("shares") or {}).items()}
    return MicroResult(ev.micro_step, ev.weight_version, tuple(d.get("executions", [])), loss, ev.n_tokens, 0,
                       dict(d.get("stats", {})), grad, shares)
