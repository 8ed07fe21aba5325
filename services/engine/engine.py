"""The engine loop: one thread owns the model, the prefix cache and the scheduler.

Everything that touches them (new requests, aborts, pauses, weight updates, memory
release) is a command run on that thread between two forward steps, so a step never sees
half-applied weights and no lock is needed. HTTP handlers talk to it through
:meth:`Engine.call` (returns a future) and per-request subscribers fed with
``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from .kv_cache import PrefixKVCache
from .metrics import EngineMetrics
from .model_runner import ForwardItem, KVBuffer, ModelRunner
from .params import InvalidRequest, SamplingParams, check_context_budget, check_input_ids
from .sampler import SampleSpec, sample
from .scheduler import (PauseMode, Scheduler, Sequence, banned_before_min_tokens, check_stop, trim_stop_text,
                        worst_case_tokens)
from .settings import EngineSettings

log = logging.getLogger(__name__)


class EngineBusy(RuntimeError):
    """An operation that needs an idle (or paused) engine found work in flight."""


class MemoryReleased(RuntimeError):
    """Generation was asked for while weights or KV memory are released."""


@dataclass
class Subscriber:
    """Receives a request's snapshots on the caller's event loop."""

    loop: asyncio.AbstractEventLoop
    stream: bool
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    def post(self, snapshot: dict, final: bool) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (snapshot, final))
        except RuntimeError:  # the caller's event loop is gone; nobody is listening
            pass

    async def updates(self):
        while True:
            snapshot, final = await self.queue.get()
            yield snapshot, final
            if final:
                return


@dataclass
class _Live:
    """What the engine thread keeps beside a pure Sequence."""

    subscriber: Subscriber
    started: float
    kv: KVBuffer | None = None
    # Engine.weight_generation when ``kv`` was attached: KV computed (even partly) under
    # older weights never goes back to the prefix cache.
    kv_generation: int = 0
    # streaming: the text decoded so far, and output_ids[prefix_offset:read_offset], the
    # tokens decoded again as context for the next ones (see Engine._stream_text)
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0


@dataclass
class _PendingWhenIdle:
    action: Callable[[], Any]
    future: Future


class Engine:
    def __init__(self, runner: ModelRunner, tokenizer, settings: EngineSettings) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.settings = settings
        self.max_context = min(settings.max_context or runner.shape.max_positions, runner.shape.max_positions)
        self.scheduler = Scheduler(
            settings.max_running_requests,
            settings.step_token_budget,
            self.max_context,
            max_running_tokens=settings.running_kv_bytes // runner.shape.kv_bytes_per_token,
        )
        self.prefix_cache = PrefixKVCache(runner.shape, settings.kv_cache_bytes)
        # +1 on every write of weight values (weights.WeightManager._write); the version label
        # can stay while values change, so staleness of KV is judged by this counter.
        self.weight_generation = 0
        self.weight_version = settings.weight_version  # (after weight_generation: see its setter)
        self.eos_ids = _eos_ids(runner, tokenizer)
        self.vocab_limit = min(runner.shape.vocab_size, max(len(tokenizer), 1))
        self.released: set[str] = set()  # memory tags released ("weights", "kv_cache")
        self._live: dict[str, _Live] = {}
        self._commands: queue.Queue = queue.Queue()
        self._when_idle: list[_PendingWhenIdle] = []
        self._thread = threading.Thread(target=self._run, name="gyre-engine", daemon=True)
        self._stopping = False
        self.steps = 0
        self.generated_tokens = 0
        self.metrics = EngineMetrics()

    # -- the weight version label ------------------------------------------------------
    @property
    def weight_version(self) -> str:
        """The label of the weights being served (SGLang's ``weight_version``)."""
        return self._weight_version

    @weight_version.setter
    def weight_version(self, value: str) -> None:
        # setting the label vouches for the values as they are now
        self._weight_version = value
        self._label_generation = self.weight_generation

    @property
    def weight_label_stale(self) -> bool:
        """True when weight values were written since the label was last set: an update
        sent without ``weight_version`` changes the values and keeps the old label. Set by
        any unlabelled write, cleared by a labelled one (or ``/update_weight_version``)."""
        return self._label_generation != self.weight_generation

    def check_weight_label(self, what: str) -> None:
        """Refuses KV traffic (``what``) that trusts the label while the label is stale: KV
        from another cell under the same label was computed with other weights."""
        if self.weight_label_stale:
            raise InvalidRequest(
                f"{what} refused: this cell's weights were changed by an update without weight_version "
                f"since its label {self._weight_version!r} was set, so the label no longer says which weights "
                f"it runs; set one (update_weight_version, or an update with weight_version) first")

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self.alive:  # answer whoever still waits, then end the loop
            self.call(lambda: self.abort(None, "engine stopping")).result(timeout=30)
        self._stopping = True
        self._commands.put(None)
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- commands (any thread) ---------------------------------------------------------
    def call(self, fn: Callable[[], Any]) -> Future:
        """Runs ``fn`` on the engine thread between steps."""
        future: Future = Future()
        self._commands.put((fn, future))
        return future

    async def acall(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self.call(fn))

    def call_when_idle(self, fn: Callable[[], Any]) -> Future:
        """Runs ``fn`` once nothing is running: at once when idle or paused; otherwise new
        admissions are held and it runs right after the last running sequence ends."""
        future: Future = Future()

        def park() -> None:
            if self.scheduler.paused is not None or not self.scheduler.running:
                _resolve(future, fn)
            else:
                self.scheduler.hold_admission = True
                self._when_idle.append(_PendingWhenIdle(fn, future))

        self._commands.put((park, Future()))
        return future

    def new_sequence(
        self,
        input_ids: list[int],
        params: SamplingParams,
        return_logprob: bool,
        rid: str | None,
        top_logprobs_num: int = 0,
    ) -> Sequence:
        check_input_ids(input_ids, self.vocab_limit, self.max_context)
        check_context_budget(len(input_ids), params.max_new_tokens, self.max_context)
        if not 0 <= top_logprobs_num <= 100:
            raise InvalidRequest("top_logprobs_num must be between 0 and 100")
        return Sequence(
            rid=rid or uuid.uuid4().hex,
            input_ids=list(input_ids),
            params=params,
            return_logprob=return_logprob,
            top_logprobs_num=top_logprobs_num if return_logprob else 0,
            eos_ids=self.eos_ids,
        )

    async def submit(self, seq: Sequence, stream: bool) -> Subscriber:
        subscriber = Subscriber(asyncio.get_running_loop(), stream)

        def add() -> None:
            if self.released:
                raise MemoryReleased(f"memory released ({', '.join(sorted(self.released))}); resume first")
            if seq.rid in self._live:
                raise InvalidRequest(f"rid {seq.rid!r} is already in flight")
            self._live[seq.rid] = _Live(subscriber, time.monotonic())
            self.scheduler.add(seq)

        try:
            await self.acall(add)
        except asyncio.CancelledError:
            # The caller left while ``add`` was queued or running: commands run in order, so
            # this runs after it and ends the request if it was admitted (and is still this one).
            def undo() -> None:
                live = self._live.get(seq.rid)
                if live is not None and live.subscriber is subscriber:
                    self.abort([seq.rid], "client disconnected")

            self.call(undo)
            raise
        return subscriber

    def abort(self, rids: list[str] | None, message: str = "aborted") -> int:
        """Engine thread only: ends the given requests (all when None)."""
        ended = self.scheduler.abort(rids, message)
        for seq in ended:
            self._complete(seq)
        return len(ended)

    def pause(self, mode: PauseMode) -> int:
        aborted, retracted = self.scheduler.pause(mode)
        for seq in aborted:
            self._complete(seq)
        for seq in retracted:
            seq.retractions += 1
            self._drop_kv(seq, keep_in_cache=True)
        self._run_idle_actions()
        return len(aborted) + len(retracted)

    def resume(self) -> None:
        self.scheduler.resume()

    def flush_cache(self) -> None:
        if self.scheduler.busy():
            raise EngineBusy("cannot flush the cache while requests are in flight")
        self.prefix_cache.flush()

    # -- the loop (engine thread) ------------------------------------------------------
    def _run(self) -> None:
        import torch

        # OpenMP thread counts are per calling thread. This one runs on one: its own tensor
        # work (KV copies, sampling) is small or memory bound, and a parallel region on a
        # shared CPU can wait a whole scheduler slice for its second thread (a 4 MB KV copy:
        # 0.1 ms on one thread, 8-12 ms on two while another job ran). The model's big ops
        # use up to ``runner.threads`` (see model_runner.ThreadChoice; by default the count
        # of the thread that built the runner).
        if self.settings.num_threads:
            self.runner.threads = self.settings.num_threads
        torch.set_num_threads(1)
        while not self._stopping:
            block = not self.scheduler.has_work()
            try:
                command = self._commands.get(block=block, timeout=None)
            except queue.Empty:
                command = None
            else:
                if command is None:
                    continue
                self._execute(*command)
                # dropped now: it holds its future and so its result (exported KV, say) alive
                # until the next command would replace it
                command = None
                self._drain_commands()
            if self.scheduler.has_work():
                try:
                    self._step()
                except Exception:  # a bug in a step must not kill the cell: fail the batch
                    log.exception("engine step failed; aborting running requests")
                    self.abort(None, "engine error")
            self._run_idle_actions()

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command is not None:
                self._execute(*command)

    @staticmethod
    def _execute(fn: Callable[[], Any], future: Future) -> None:
        _resolve(future, fn)

    def _run_idle_actions(self) -> None:
        if not self._when_idle:
            return
        if self.scheduler.running and self.scheduler.paused is None:
            return
        pending, self._when_idle = self._when_idle, []
        self.scheduler.hold_admission = False
        for item in pending:
            _resolve(item.future, item.action)

    def _step(self) -> None:
        for seq in self.scheduler.admit():
            self._attach(seq)
        feeds = self.scheduler.plan()
        if not feeds:
            return
        items = []
        for feed in feeds:
            live = self._live[feed.seq.rid]
            ids = feed.seq.ids_between(feed.start, feed.start + feed.count)
            items.append(ForwardItem(live.kv, ids, feed.samples))
        logits = self.runner.forward(items)
        self.steps += 1
        for feed in feeds:
            feed.seq.kv_len = self._live[feed.seq.rid].kv.length
        sampling = [feed.seq for feed in feeds if feed.samples]
        # a seeded pick's noise comes from (seed, output position), so a redo below or another
        # batch composition never shifts a request's later draws
        specs = [SampleSpec(s.params, s.return_logprob, None, s.top_logprobs_num,
                            banned_before_min_tokens(s), step=len(s.output_ids)) for s in sampling]
        try:
            picks = list(zip(*sample(logits, specs, self.vocab_limit)))  # on this thread's one thread (see _run)
        except Exception:  # one row's parameters must not end the others: redo row by row
            log.exception("sampling the batch failed; sampling row by row")
            picks = [self._sample_row(logits, row, spec) for row, spec in enumerate(specs)]
        for seq, pick in zip(sampling, picks):
            if isinstance(pick, Exception):
                self.scheduler.finish(seq, {"type": "abort", "message": f"sampling failed: {pick}"})
                self._complete(seq)
                continue
            token, logprob, top = pick
            if seq.top_logprobs_num:
                seq.output_top_logprobs.append(top)
            self._append(seq, token, logprob)

    def _sample_row(self, logits, row: int, spec: SampleSpec) -> tuple | Exception:
        try:
            tokens, logprobs, tops = sample(logits[row : row + 1].clone(), [spec], self.vocab_limit)
        except Exception as exc:
            log.warning("sampling failed for one sequence: %s", exc)
            return exc
        return tokens[0], logprobs[0], tops[0]

    def _attach(self, seq: Sequence) -> None:
        live = self._live[seq.rid]
        if seq.params.max_new_tokens == 0 and not seq.output_ids:
            self.metrics.admitted(len(seq.input_ids), 0)
            self.scheduler.finish(seq, {"type": "length", "length": 0})
            self._complete(seq)
            return
        ids = seq.all_ids
        live.kv = self.runner.new_kv(len(ids) + min(seq.params.max_new_tokens, 512),
                                     limit=worst_case_tokens(seq, self.max_context))
        live.kv_generation = self.weight_generation
        cached = self.prefix_cache.attach_prefix(ids, live.kv)
        seq.kv_len = cached
        if not seq.admitted_once:
            seq.cached_tokens = cached
            seq.admitted_once = True
            self.metrics.admitted(len(seq.input_ids), cached)

    def _append(self, seq: Sequence, token: int, logprob: float | None) -> None:
        seq.output_ids.append(token)
        self.generated_tokens += 1
        self.metrics.generated_tokens.inc()
        if seq.return_logprob:
            seq.output_logprobs.append(float(logprob))
        if not seq.version_spans or seq.version_spans[-1][1] != self.weight_version:
            seq.version_spans.append((len(seq.output_ids) - 1, self.weight_version))
        # stop strings are matched with special tokens kept (as SGLang), whatever the output shows
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)
        reason = check_stop(seq, token, decode, self.max_context)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self._complete(seq)
        elif (live := self._live[seq.rid]).subscriber.stream:
            live.subscriber.post(self.snapshot(seq, text=self._stream_text(seq, live)), final=False)

    def _stream_text(self, seq: Sequence, live: _Live) -> str:
        """The output's text for a streamed snapshot, decoded incrementally: only the tokens
        since the last complete character, plus a few before them as context (a whole decode
        each token made a stream quadratic in its length). Bytes of a character still
        incomplete are held back until it is. The final snapshot decodes the whole output."""
        ids, skip = seq.output_ids, seq.params.skip_special_tokens
        before = self.tokenizer.decode(ids[live.prefix_offset:live.read_offset], skip_special_tokens=skip)
        upto = self.tokenizer.decode(ids[live.prefix_offset:], skip_special_tokens=skip)
        if len(upto) > len(before) and not upto.endswith("\ufffd"):
            live.text += upto[len(before):]
            live.prefix_offset, live.read_offset = live.read_offset, len(ids)
        return live.text

    def _complete(self, seq: Sequence) -> None:
        live = self._live.pop(seq.rid, None)
        if live is None:
            return
        self._drop_kv(seq, keep_in_cache=True, live=live)
        finish = (seq.finish_reason or {}).get("type", "abort")
        self.metrics.ended(finish, time.monotonic() - live.started)
        live.subscriber.post(self.snapshot(seq, started=live.started), final=True)

    def _drop_kv(self, seq: Sequence, keep_in_cache: bool, live: _Live | None = None) -> None:
        live = live or self._live.get(seq.rid)
        if live is None or live.kv is None:
            return
        fresh = live.kv_generation == self.weight_generation  # no weight write since it was attached
        if keep_in_cache and fresh and "kv_cache" not in self.released:
            self.prefix_cache.store(seq.all_ids, live.kv)
        live.kv = None
        seq.kv_len = 0

    # -- responses ---------------------------------------------------------------------
    def snapshot(self, seq: Sequence, started: float | None = None, text: str | None = None) -> dict:
        """The SGLang-shaped response for ``seq`` as it stands (``text``: its output's text,
        when the caller has it)."""
        if text is None:
            text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=seq.params.skip_special_tokens)
        text = trim_stop_text(text, seq.stop_text, seq.params.no_stop_trim)
        if started is None:
            live = self._live.get(seq.rid)
            started = live.started if live else time.monotonic()
        meta: dict[str, Any] = {
            "id": seq.rid,
            "finish_reason": seq.finish_reason,
            "prompt_tokens": len(seq.input_ids),
            "completion_tokens": len(seq.output_ids),
            "cached_tokens": seq.cached_tokens,
            "weight_version": seq.version_spans[-1][1] if seq.version_spans else self.weight_version,
            "e2e_latency": time.monotonic() - started,
            # the version that produced each run of output tokens, as SGLang 0.5.23 reports it
            "weight_versions": _version_runs(seq.version_spans, len(seq.output_ids)),
            "num_retractions": seq.retractions,
        }
        if seq.return_logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [
                [lp, tok, None] for lp, tok in zip(seq.output_logprobs, seq.output_ids)
            ]
            if seq.top_logprobs_num:
                meta["input_top_logprobs"] = []
                meta["output_top_logprobs"] = [list(top) for top in seq.output_top_logprobs]
        return {"text": text, "output_ids": list(seq.output_ids), "meta_info": meta}

    def refresh_metrics(self) -> None:
        """Engine thread: sets the metrics' gauges from the current state."""
        running_kv = sum(live.kv.nbytes for live in self._live.values() if live.kv is not None)
        self.metrics.set_state(
            running=len(self.scheduler.running),
            queued=len(self.scheduler.waiting),
            prefix_kv_bytes=self.prefix_cache.cached_tokens * self.runner.shape.kv_bytes_per_token,
            running_kv_bytes=running_kv,
            capacity_bytes=self.prefix_cache.capacity_tokens * self.runner.shape.kv_bytes_per_token,
            weight_version=str(self.weight_version),
        )

    def stats(self) -> dict:
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "paused": self.scheduler.paused.value if self.scheduler.paused else None,
            "cached_tokens": self.prefix_cache.cached_tokens,
            "cache_capacity_tokens": self.prefix_cache.capacity_tokens,
            "cache_hits": self.prefix_cache.hits,
            "cache_lookups": self.prefix_cache.lookups,
            "steps": self.steps,
            "generated_tokens": self.generated_tokens,
            "released": sorted(self.released),
        }


def _version_runs(spans: list[tuple[int, str]], produced: int) -> list[dict]:
    ends = [start for start, _ in spans[1:]] + [produced]
    return [{"version": version, "start": start, "end": end} for (start, version), end in zip(spans, ends)]


def _resolve(future: Future, fn: Callable[[], Any]) -> None:
    try:
        result = fn()
    except BaseException as exc:  # handed to the caller, who turns it into an HTTP error
        future.set_exception(exc)
    else:
        future.set_result(result)


def _eos_ids(runner: ModelRunner, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(runner.model, "generation_config", None), runner.model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)
