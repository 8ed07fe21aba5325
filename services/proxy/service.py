"""The proxy's use case: serve one agent call token-exactly and record it.

``ProxyService.serve`` = authorise the rollout, bring its history up to date from the log,
plan the input ids (TITO), generate on a cell, stream API-neutral events, and record the
call (blobs first, then ``CallRecorded``) before the caller sees the end of the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace as dataclass_replace
from typing import Any, TypeVar

from libs.common.blobs import encode_logprobs, encode_tokens
from libs.common.bus.port import BlobStore, ConcurrencyConflict, EventBus
from libs.common.events import CallRecorded, SessionOpened
from libs.common.events.calls import CallTimings, SessionHints, WeightSpan
from services.engine.params import logprob_temperature

from .api.common import (
    Accepted, ApiError, ChatRequest, Finished, GenEvent, StreamState, TextDelta, ThinkingDelta, TokenLogprobs,
    ToolCallDone,
)
from .core.decode import IncrementalDecoder
from .core.hints import continuation_index, request_kind
from .core.messages import text_digest, tools_key
from .core.routing import CellState, NoCellAvailable, Router
from .core.tito import Plan, Renderer, TemplateError
from .core.toolparse import CALL_CLOSE, Parsed, StreamParser, call_opened, parse_output, partial_tail
from .generation import CellClient, CellFailure, CellRejected, Outcome, generate
from .history import RolloutBook, RolloutState, encode_match_index, key_digest

log = logging.getLogger(__name__)

CONTEXT_ASK_TIMEOUT_S = 5.0  # a call waits at most this for a new cell to tell its context length
CONTEXT_RETRY_S = 30.0  # a cell that did not tell is asked again after this
RENDER_THREADS = 2  # threads that render and tokenise off the event loop (see ProxyService.off_loop)
KEEPALIVE_S = 15.0  # a stream that sent nothing for this long gets a keepalive (see app._sse)
CELL_WAIT_S = 120.0  # an open stream that has shown nothing waits this long for a cell (ProxyConfig.cell_wait_s)
CELL_WAIT_PAUSE_S = (0.5, 5.0)  # its pause before trying the cells again: first, and most (doubling)
CELL_WAIT_POLL_S = 0.25  # how often a waiting call looks for an active cell

T = TypeVar("T")


@dataclass
class ProxyConfig:
    run_id: str
    policy_model: str = "policy"
    aliases: dict[str, str] = field(default_factory=dict)
    strict_models: bool = False  # unknown model names get a 404 instead of the policy
    # max_tokens for a call that names none (Codex, litellm); None: the room left in the context
    default_max_tokens: int | None = None
    # the most tokens (prompt + answer) a call may use; each cell's own context length (its
    # /server_info) caps it further. None: the cells' alone (the tokenizer's until one answers)
    max_context: int | None = None
    # threads for chat-template rendering and tokenisation (the CPU work that grows with a
    # history), so that the event loop keeps streaming every other session meanwhile
    render_threads: int = RENDER_THREADS
    # a streamed answer sends its API's keepalive (Anthropic's ping, Responses'
    # response.in_progress, a Chat Completions SSE comment) whenever nothing went out for
    # this long: Claude Code and Codex give up on a stream silent for about 5 minutes, and a
    # tool call is only streamed once it is complete
    keepalive_s: float = KEEPALIVE_S
    # a streamed call whose stream is open (its grace passed: a failure is no longer an HTTP
    # error the caller's SDK retries) and which has shown no content yet does not end when
    # its cell fails or no cell is active: it waits this long for one (keepalives hold the
    # caller), trying the active cells again with backoff, then ends with an overloaded
    # error; 0: it ends at once
    cell_wait_s: float = CELL_WAIT_S


@dataclass
class CallHints:
    agent_id: str | None = None
    parent_agent_id: str | None = None
    role: str | None = None


@dataclass
class CallStats:
    drift: dict[str, int] = field(default_factory=dict)
    calls: int = 0
    undelivered: int = 0


@dataclass
class CellWaits:
    """Streams waiting for a cell (``ProxyConfig.cell_wait_s``), for the metrics."""

    waiting: int = 0  # now (between the tries of the cells)
    waits: int = 0  # calls that began to wait, ever
    given_up: int = 0  # ... whose wait ended with no cell (its time up, or the proxy stopping)


class ProxyService:
    def __init__(self, config: ProxyConfig, *, bus: EventBus, blobs: BlobStore, renderer: Renderer,
                 router: Router, clients: dict[str, CellClient],
                 client_factory: Callable[[str], CellClient] | None = None) -> None:
        self.config = config
        self.client_factory = client_factory
        self.bus = bus
        self.blobs = blobs
        self.renderer = renderer
        self.router = router
        self.clients = clients
        stop_texts = tuple(getattr(renderer, "stop_texts", ("<|im_end|>",)))
        self.stop_texts = stop_texts
        self.stop_token_ids = list(getattr(renderer, "stop_token_ids", []))
        self._stop_ids = frozenset(self.stop_token_ids)
        self._token_bytes: dict[int, bytes] = {}  # token id -> its bytes, for OpenAI's logprobs
        self.tokenizer_context = int(getattr(renderer, "max_context", 32768) or 32768)
        self.cell_context: dict[str, int | None] = {}  # cell -> its context length (None: it does not say)
        self._context_asks: dict[str, asyncio.Task] = {}  # cell -> its /server_info question in flight
        self._context_retry_at: dict[str, float] = {}  # cell -> when to ask again after no answer
        self.book = RolloutBook(config.run_id, bus, blobs, renderer, stop_texts)
        self.book.on_ended.append(router.forget_rollout)  # an ended rollout's sessions pin no cell
        self.stats = CallStats()
        self.cell_waits = CellWaits()
        self.on_recorded: list[Callable[[str, str, bool], None]] = []  # (api, drift, delivered), e.g. metrics
        self._background: set[asyncio.Task] = set()
        self._render_pool = ThreadPoolExecutor(max_workers=max(1, config.render_threads),
                                               thread_name_prefix="gyre-proxy-render")
        self._closed = False
        # set when the proxy begins to stop: new calls are turned away (503, the caller's SDK
        # sends them again), so that the calls in flight can end and be recorded first
        self.stopping = False
        self._in_flight = 0  # serve() calls not finished yet
        self._idle = asyncio.Event()
        self._idle.set()

    def close(self) -> None:
        """Stop the render threads (work already handed to them finishes first). Calls still
        in flight go on and are recorded: ``off_loop`` then runs their work on the loop."""
        self._closed = True
        self._render_pool.shutdown(wait=False)

    async def wait_calls(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until no call is in flight and every record is written;
        True if so. Before stopping: a call that ends later may find the bus closed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        if not self._idle.is_set():
            try:
                await asyncio.wait_for(self._idle.wait(), timeout_s)
            except asyncio.TimeoutError:
                return False
        left = deadline - loop.time()
        if self._background and left > 0:
            await asyncio.wait(set(self._background), timeout=left)
        return self._idle.is_set() and not self._background

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a render thread: rendering a long history with the chat template
        and tokenising it takes tens to hundreds of milliseconds, which on the event loop
        would stall every other session's stream.

        Callers hold the rollout's lock, so a rollout's calls still plan and record one at a
        time, in order. If the caller is cancelled meanwhile, this still waits for the worker
        before the cancellation goes on: the lock must not be released while a thread is
        still using the rollout's history (the next call of the rollout would plan on it at
        the same time).

        After ``close()`` (the proxy is stopping; the pool takes no more work) it runs
        ``fn`` here, on the loop: the calls still in flight finish and are recorded."""
        if self._closed:
            return fn(*args)
        fut = asyncio.get_running_loop().run_in_executor(self._render_pool, functools.partial(fn, *args))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            while not fut.done():
                try:
                    await asyncio.wait({fut})
                except asyncio.CancelledError:
                    pass
            if not fut.cancelled():
                fut.exception()  # retrieved: the caller has gone, its error with it
            raise

    # -- cells -------------------------------------------------------------------------

    def add_cell(self, name: str, url: str, capacity: int = 8) -> None:
        if self.client_factory is None:
            raise ValueError("this proxy was built without a cell client factory")
        self.clients[name] = self.client_factory(url)
        self.router.add_cell(name, capacity)
        self._forget_context(name)  # (re-)added: maybe another engine; ask it before its first call

    # -- context length ------------------------------------------------------------------

    @property
    def max_context(self) -> int:
        """The context (prompt + answer) every cell can take: the smallest its cells report
        and ``GYRE_PROXY_MAX_CONTEXT``; the tokenizer's ``model_max_length`` (often larger than
        the engines') only while no cell has said and no limit is set."""
        known = [n for name, n in self.cell_context.items() if n and name in self.router.cells]
        if self.config.max_context:
            known.append(self.config.max_context)
        return min(known) if known else self.tokenizer_context

    @max_context.setter
    def max_context(self, value: int | None) -> None:
        """Set the limit (as ``GYRE_PROXY_MAX_CONTEXT`` does); the cells' own still cap it."""
        self.config.max_context = value

    def _forget_context(self, name: str) -> None:
        self.cell_context.pop(name, None)
        self._context_retry_at.pop(name, None)

    async def learn_contexts(self, timeout_s: float = CONTEXT_ASK_TIMEOUT_S) -> None:
        """Ask each cell whose context length is not known yet (its ``/server_info``
        ``context_length``), once at a time per cell; a cell that does not answer is asked
        again after ``CONTEXT_RETRY_S``. Waits at most ``timeout_s``."""
        now = time.monotonic()
        waiting = []
        for name in list(self.router.cells):
            if name in self.cell_context:
                continue
            task = self._context_asks.get(name)
            if task is None:
                if now < self._context_retry_at.get(name, 0.0):
                    continue
                task = self._context_asks[name] = asyncio.create_task(self._ask_context(name))
                task.add_done_callback(lambda _t, n=name: self._context_asks.pop(n, None))
            waiting.append(task)
        if waiting:
            await asyncio.wait(waiting, timeout=timeout_s)  # a late answer still lands for the next call

    async def _ask_context(self, name: str) -> None:
        client = self.clients.get(name)
        ask = getattr(client, "server_info", None)
        if ask is None:  # a client that cannot say: the override and the other cells decide
            self.cell_context[name] = None
            return
        try:
            info = await asyncio.wait_for(ask(), CONTEXT_ASK_TIMEOUT_S)
            n = context_length_of(info)
        except Exception as exc:  # down, not there yet, or not an engine that says
            log.warning("cell %s did not tell its context length (%r); asking again in %.0fs", name, exc,
                        CONTEXT_RETRY_S)
            self._context_retry_at[name] = time.monotonic() + CONTEXT_RETRY_S
            return
        if self.clients.get(name) is not client:
            return  # re-added behind another engine meanwhile: that one is asked afresh
        if n is None:
            log.warning("cell %s's /server_info names no context_length", name)
        else:
            log.info("cell %s: context length %d", name, n)
        self.cell_context[name] = n

    def _learn_from_rejection(self, cell: str | None, message: str) -> int | None:
        """A cell that refused a call for its context length names that length: keep it."""
        n = context_length_in(message)
        if n is None or cell is None or cell not in self.router.cells:
            return None
        known = self.cell_context.get(cell)
        if known is None or n < known:
            self.cell_context[cell] = n
            log.warning("cell %s refused a call for its context length: %d tokens from now on", cell, n)
        return n

    async def probe_cells(self, timeout_s: float = 5.0) -> list[str]:
        """Bring back cells this proxy marked down after a failed call, once their health
        check answers. A cell the scheduler drains (a role switch) is not down and stays
        as the scheduler left it. Returns the cells reactivated."""
        back = []
        for name, cell in list(self.router.cells.items()):
            client = self.clients.get(name)
            if cell.state is not CellState.DOWN or client is None or not hasattr(client, "health"):
                continue
            try:
                ok = await asyncio.wait_for(client.health(), timeout_s)
            except Exception:
                ok = False
            if ok and cell.state is CellState.DOWN:
                self.router.activate(name)
                self._forget_context(name)  # maybe restarted with another model or context length
                back.append(name)
                log.info("cell %s answers its health check again: active", name)
        return back

    async def watch_cells(self, stop: asyncio.Event, every_s: float = 10.0) -> None:
        """Probe down cells every ``every_s`` until ``stop`` (runs as a background task)."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), every_s)
            except asyncio.TimeoutError:
                await self.probe_cells()
                try:
                    await self.learn_contexts()
                except Exception:  # never stop the watch
                    log.exception("asking the cells for their context length failed")

    # -- models and auth ---------------------------------------------------------------

    def resolve_model(self, name: str) -> str:
        if name in self.config.aliases:
            return self.config.aliases[name]
        if name == self.config.policy_model or not self.config.strict_models:
            return self.config.policy_model
        raise ApiError(404, "not_found", f"model {name!r} not found; this proxy serves {self.config.policy_model!r}",
                       "model")

    async def authorize(self, rollout_id: str, api_key: str | None) -> None:
        info = await self.book.lookup(rollout_id)
        if info is None or info.ended or not api_key:
            raise ApiError(401, "authentication", "invalid API key or unknown/finished rollout")
        if not hmac.compare_digest(info.key_digest, key_digest(api_key)):
            raise ApiError(401, "authentication", "invalid API key or unknown/finished rollout")

    # -- planning ----------------------------------------------------------------------

    async def count_tokens(self, rollout_id: str, req: ChatRequest) -> int:
        st = self.book.state(rollout_id)
        async with st.lock:
            await self.book.sync(st)
            plan = await self.off_loop(self._plan, st, req)
        return plan.input_len

    def _plan(self, st: RolloutState, req: ChatRequest) -> Plan:
        """Runs in a render thread, under the rollout's lock."""
        try:
            return st.tito.plan(req.messages, req.tools, tools_key(req.tools), req.prefill)
        except TemplateError as exc:
            raise ApiError(400, "invalid_request", str(exc)) from exc

    def _plan_ids(self, st: RolloutState, req: ChatRequest) -> tuple[Plan, list[int]]:
        """The plan and the whole input ids (runs in a render thread, under the rollout's lock)."""
        plan = self._plan(st, req)
        return plan, st.tito.input_ids(plan)

    # -- serving -----------------------------------------------------------------------

    async def serve(self, rollout_id: str, req: ChatRequest, hints: CallHints,
                    stream: StreamState | None = None) -> AsyncIterator[GenEvent]:
        """The call's events, ``Accepted`` first. ``stream``: a streamed call's state, which
        the HTTP layer marks ``opened`` (a call waits for a cell only then)."""
        if self.stopping:
            raise ApiError(503, "overloaded", "the proxy is stopping; send the call again")
        self._in_flight += 1
        self._idle.clear()
        try:
            async with contextlib.aclosing(self._serve(rollout_id, req, hints, stream)) as events:
                async for ev in events:
                    yield ev
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    async def _serve(self, rollout_id: str, req: ChatRequest, hints: CallHints,
                     stream: StreamState | None = None) -> AsyncIterator[GenEvent]:
        self.resolve_model(req.model)
        st = self.book.state(rollout_id)
        async with st.lock:
            await self.book.sync(st)
            plan, input_ids = await self.off_loop(self._plan_ids, st, req)
        await self.learn_contexts()  # cells added since the last call tell their context length first
        max_new = self._budget(len(input_ids), req.max_tokens)
        call_id = uuid.uuid4().hex
        session = st.call_session.get(plan.parent_call_id or "", "") or f"{rollout_id}/{call_id}"
        try:
            self.router.pick(session)  # the cell generate() starts on (the session is pinned to it)
        except NoCellAvailable as exc:
            raise ApiError(529, "overloaded", f"no inference cell could serve the call: {exc}") from exc
        session_hints = self._hints(req, hints, self._reused(st, plan, req))
        if plan.parent_call_id is None:
            await self.bus.publish(SessionOpened(run_id=self.config.run_id, session_id=session, rollout_id=rollout_id,
                                                 hints=session_hints))
        req.max_tokens = max_new
        sampling = req.sampling_params(max_new, self.stop_token_ids)
        call = _Call(call_id, rollout_id, session, plan, input_ids, time.monotonic(), session_hints,
                     logprob_temperature=logprob_temperature(sampling.get("temperature")), stream=stream)
        try:
            # accepted: from here on a stream is under way, and errors go in it (app._sse)
            yield Accepted(call_id)
            async for ev in self._run(call, req, sampling):
                if isinstance(ev, Finished):
                    # shielded: a caller leaving now must not cut the append in half (the
                    # event may be stored with its ack still on the way)
                    await asyncio.shield(self._spawn(self._record(st, call, req, hints, delivered=True)))
                yield ev
        except CellFailure as exc:
            waited = "" if call.wait_from is None else \
                f" (it waited {time.monotonic() - call.wait_from:.0f}s for one)"
            raise ApiError(529, "overloaded", f"no inference cell could serve the call: {exc}{waited}") from exc
        except CellRejected as exc:
            raise ApiError(400, "invalid_request", f"the inference cell rejected the request: {exc.message}") from exc
        finally:
            if not call.committed:  # the caller went away (or we failed): stop the cell, keep the record honest
                self._spawn(self._abandon(st, call, req, hints))

    def _visible(self, ids: list[int]) -> list[int]:
        """The ids whose text the caller sees: all but the end-of-turn (stop) tokens, so that
        stop sequences are matched, and tags parsed, only in the reply's own text."""
        stops = self._stop_ids
        return [i for i in ids if i not in stops] if stops else list(ids)

    def _logprob_entries(self, ids: list[int], logprobs: list[float],
                         tops: list[list] | None = None) -> tuple[dict[str, Any], ...]:
        """OpenAI's logprobs entries for generated tokens (the stop tokens left out), each
        with its position's likeliest alternatives when the cell was asked for them
        (``tops``: SGLang's ``[logprob, token_id, text]`` lists, one per token)."""
        tops = tops or []
        alt_ids = [int(t[1]) for top in tops for t in (top or []) if t and t[1] is not None]
        new = [i for i in dict.fromkeys(list(ids) + alt_ids) if i not in self._token_bytes]
        if new:
            many = getattr(self.renderer, "token_bytes", None)
            got = many(new) if many is not None else [self.renderer.decode([i]).encode("utf-8") for i in new]
            self._token_bytes.update(zip(new, got))

        def entry(tok: int, lp: float) -> dict[str, Any]:
            raw = self._token_bytes[tok]
            return {"token": raw.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(raw)}

        out = []
        for k, (i, lp) in enumerate(zip(ids, logprobs)):
            if i in self._stop_ids:
                continue
            top = tops[k] if k < len(tops) and tops[k] else []
            alts = [entry(int(t[1]), float(t[0])) for t in top if t and t[1] is not None and t[0] is not None]
            out.append(entry(i, lp) | {"top_logprobs": alts})
        return tuple(out)

    async def _run(self, call: "_Call", req: ChatRequest, sampling: dict) -> AsyncIterator[GenEvent]:
        decoder = IncrementalDecoder(self.renderer.decode)
        cutter = StopCutter(req.stop)
        # its shown text adds up to exactly parser.content
        parser = StreamParser(self.stop_texts, parse_calls=req.tool_choice != "none")
        sent_calls = [0]
        streamed = [""]  # what the decoder let through, before stop sequences and parsing
        entries: list[dict[str, Any]] = []  # logprobs, when asked for

        def deltas(text: str, think: str) -> list[GenEvent]:
            out: list[GenEvent] = [ThinkingDelta(think)] if think else []
            if text:
                out.append(TextDelta(text))
            for i in range(sent_calls[0], len(parser.tool_calls)):
                out.append(ToolCallDone(parser.tool_calls[i], i))
            sent_calls[0] = len(parser.tool_calls)
            return out

        async for piece in self._generate(call, req, sampling):
            if call.first_token is None:
                call.first_token = time.monotonic()
            call.add(piece.ids, piece.logprobs, piece.weight_version)
            if req.logprobs:
                new = self._logprob_entries(piece.ids, piece.logprobs, piece.top_logprobs)
                if new:
                    entries.extend(new)
                    call.shown = True
                    yield TokenLogprobs(new)
            text = decoder.push(self._visible(piece.ids))
            streamed[0] += text
            for ev in deltas(*parser.feed(cutter.feed(text))):
                call.shown = True  # content may be on its way to the caller: no waiting for a cell now
                yield ev
        # the decoder holds back an unfinished character; the whole decode has the rest
        whole = await self.off_loop(self.renderer.decode, self._visible(call.output_ids))
        if whole.startswith(streamed[0]):
            for ev in deltas(*parser.feed(cutter.feed(whole[len(streamed[0]):]))):
                yield ev
        else:
            log.warning("call %s: the streamed decode is not a prefix of the whole decode", call.call_id)
        for ev in deltas(*parser.feed(cutter.finish())):
            yield ev
        for ev in deltas(*parser.finish()):
            yield ev
        # the record is what the caller was shown: its next request sends exactly this back
        call.parsed = Parsed(parser.content, list(parser.tool_calls), parser.reasoning)
        out = call.outcome
        reason = "tool_calls" if call.parsed.tool_calls and out.finish_reason == "stop" else out.finish_reason
        stop_seq = out.matched_stop if isinstance(out.matched_stop, str) else cutter.matched
        if req.single_call_stop and stop_seq == CALL_CLOSE:  # the proxy's stop, not the caller's
            stop_seq = cutter.matched
        yield Finished(reason if not stop_seq else "stop_sequence", len(call.input_ids), len(call.output_ids),
                       out.cached_tokens, call.parsed.content, tuple(call.parsed.tool_calls), call.parsed.reasoning,
                       call.call_id, stop_seq, call.plan.drift.value, tuple(entries) if req.logprobs else None)

    def _budget(self, n_input: int, asked: int | None, limit: int | None = None) -> int:
        """max_new_tokens for a prompt of ``n_input`` tokens: what the caller asked for (else
        the configured default, else all the room left), within the context."""
        limit = limit or self.max_context
        # SGLang's rule: input + max_new_tokens < context length; leave room for one token at least
        room = limit - 1 - n_input
        if room < 1:
            raise prompt_too_long(n_input, limit)
        return min(asked or self.config.default_max_tokens or room, room)

    async def _generate(self, call: "_Call", req: ChatRequest, sampling: dict) -> AsyncIterator:
        """``generate``, once more if the cell refused the call for a context length smaller
        than this proxy knew (it is learnt, and the call fits it or gets "prompt is too long").
        With no cell left to try, an open stream that has shown nothing waits for one
        (``_wait_for_cell``)."""
        again = functools.partial(self._wait_for_cell, call)
        top = req.top_logprobs if req.logprobs else 0
        resume = self._false_call_stop if req.single_call_stop else None
        try:
            async for piece in generate(self.router, self.clients, call.session, call.call_id, call.input_ids,
                                        sampling, call.outcome, again=again, top_logprobs=top, resume=resume):
                yield piece
            return
        except CellRejected as exc:
            limit = self._learn_from_rejection(call.outcome.cells[-1] if call.outcome.cells else None, exc.message)
            if limit is None or call.output_ids:
                raise
            max_new = self._budget(len(call.input_ids), req.max_tokens, min(limit, self.max_context))
            if max_new >= sampling.get("max_new_tokens", 0):
                raise  # not for want of room
        call.outcome = Outcome()
        async for piece in generate(self.router, self.clients, call.session, call.call_id, call.input_ids,
                                    dict(sampling, max_new_tokens=max_new), call.outcome, again=again,
                                    top_logprobs=top, resume=resume):
            yield piece

    async def _false_call_stop(self, produced: list[int], matched: Any) -> bool:
        """``generate``'s ``resume`` with parallel tool calls off: whether the cell's stop at
        the proxy's ``</tool_call>`` closed no call, because the model wrote it inside its
        thinking or in plain text (no ``<tool_call>`` opened after the thinking); then the
        generation goes on, as it would have without that stop."""
        if matched != CALL_CLOSE:
            return False
        text = await self.off_loop(self.renderer.decode, self._visible(produced))
        return not call_opened(text)

    async def _wait_for_cell(self, call: "_Call", why: str) -> bool:
        """``generate``'s ``again``: every cell failed the call, or none is active. A stream
        that is open (its failure is no longer an HTTP error the caller's SDK would retry)
        and has shown no content yet waits instead of ending: a pause (doubling from
        0.5 s, at most 5 s) and then until some cell is active, for at most ``cell_wait_s``
        in all; meanwhile keepalives hold the caller, and a caller that leaves cancels the
        wait (the call is aborted and recorded undelivered, as ever). True: try the cells
        again (still from the tokens already produced, so the record stays exact). False:
        the call ends (the caller gets the API's overloaded error)."""
        stream = call.stream
        limit = self.config.cell_wait_s
        if stream is None or not stream.opened or call.shown or self.stopping or limit <= 0:
            return False
        now = time.monotonic()
        if call.wait_from is None:
            call.wait_from = now
            self.cell_waits.waits += 1
            log.warning("call %s: %s; its stream (nothing shown yet) waits up to %.0fs for a cell", call.call_id,
                        why, limit)
        until = call.wait_from + limit
        pause_until = now + call.wait_pause
        call.wait_pause = min(call.wait_pause * 2, CELL_WAIT_PAUSE_S[1])
        self.cell_waits.waiting += 1
        try:
            while True:
                now = time.monotonic()
                if self.stopping or now >= until:
                    log.warning("call %s: no cell took it in %.0fs (%s); it ends overloaded", call.call_id,
                                now - call.wait_from, "the proxy is stopping" if self.stopping else why)
                    self.cell_waits.given_up += 1
                    return False
                if now >= pause_until and any(c.state is CellState.ACTIVE for c in self.router.cells.values()):
                    return True
                await asyncio.sleep(min(CELL_WAIT_POLL_S, until - now))
        finally:
            self.cell_waits.waiting -= 1

    def _parse(self, call: "_Call", req: ChatRequest):
        """The reply as the caller sees it: cut before a matched stop sequence (the
        recorded ids keep it: the model did generate it)."""
        return parse_output(cut_at_stop(self.renderer.decode(self._visible(call.output_ids)), req.stop),
                            self.stop_texts, parse_calls=req.tool_choice != "none")

    # -- recording ---------------------------------------------------------------------

    @staticmethod
    def _reused(st: RolloutState, plan: Plan, req: ChatRequest) -> int:
        """How many leading messages of the request an earlier call of the rollout sent:
        those its reused prefix covers, or, when it starts with a compacted history's
        summary that a call recorded here already sent, at least up to that summary."""
        n = plan.matched_messages if plan.parent_call_id is not None else 0
        at = continuation_index(req.messages)
        if at is not None and at >= n and plan.hashes[at + 1] in st.summaries:
            n = at + 1
        return n

    @staticmethod
    def _summary_hash(call: "_Call", req: ChatRequest) -> bytes | None:
        """The chain hash up to the compacted history's summary the call sent, if it sent
        one: kept in ``RolloutState.summaries`` and in the call's match index (a replica
        that rebuilds the rollout from the log learns it there)."""
        at = continuation_index(req.messages)
        return call.plan.hashes[at + 1] if at is not None else None

    def _hints(self, req: ChatRequest, hints: CallHints, reused: int = 0) -> SessionHints:
        system = req.messages[0].content if req.messages and req.messages[0].role == "system" else None
        kind = request_kind(req.messages, agent_id=hints.agent_id, has_tools=bool(req.tools), reused=reused)
        return SessionHints(agent_id=hints.agent_id, parent_agent_id=hints.parent_agent_id, role=hints.role, kind=kind,
                            system_digest=text_digest(system) if system is not None else None,
                            tools_digest=tools_key(req.tools) if req.tools else None)

    async def _record(self, st: RolloutState, call: "_Call", req: ChatRequest, hints: CallHints,
                      *, delivered: bool) -> None:
        """Blobs first, then the event, appended only if this replica has seen every call
        of the rollout before it (optimistic concurrency on the rollout's subject)."""
        parsed = call.parsed or await self.off_loop(self._parse, call, req)
        async with st.lock:
            if call.committed:
                return
            try:
                # the reply check renders and encodes the reply: O(reply), off the loop too
                reply = parsed.as_msg()
                if call.plan.prefill:  # the turn as the conversation goes on: the prefill, then the reply
                    reply = dataclass_replace(reply, content=call.plan.prefill + reply.content)
                boundaries = await self.off_loop(st.tito.record, call.call_id, call.plan, call.output_ids,
                                                 reply, req.tools, tools_key(req.tools),
                                                 call.outcome.finish_reason == "stop")
            except Exception:
                # The tokens are the training data: record the call without a match index
                # (a next turn forks instead of continuing it), and let the rollout's next
                # call rebuild this replica's history from the log.
                log.exception("call %s: could not index the reply; recorded without a match index", call.call_id)
                boundaries = []
                if self.book.states.get(st.rollout_id) is st:
                    del self.book.states[st.rollout_id]
            st.call_session[call.call_id] = call.session
            summary = self._summary_hash(call, req)
            if summary is not None:
                st.summaries.add(summary)
            digests = await asyncio.gather(
                self.blobs.put(encode_tokens(call.plan.new_ids)), self.blobs.put(encode_tokens(call.output_ids)),
                self.blobs.put(encode_logprobs(call.logprobs)),
                self.blobs.put(encode_match_index(
                    call.call_id, boundaries,
                    call.plan.hashes[call.plan.matched_messages] if call.plan.parent_call_id else None, summary)))
            ev = self._event(call, req, hints, digests, delivered)
            call.committed = True  # from here on the call is this event, whatever the ack says
            try:
                await self._append(st, ev)
            except BaseException:
                # Not in the log (or not known to be): this replica's history of the rollout
                # names the call, so later calls could take it as their parent. Forget the
                # history; the rollout's next call rebuilds it from the log.
                if self.book.states.get(st.rollout_id) is st:
                    del self.book.states[st.rollout_id]
                raise
        self.stats.calls += 1
        self.stats.drift[call.plan.drift.value] = self.stats.drift.get(call.plan.drift.value, 0) + 1
        if not delivered:
            self.stats.undelivered += 1
        for listener in self.on_recorded:
            listener(req.api, call.plan.drift.value, delivered)

    async def _append(self, st: RolloutState, ev: CallRecorded) -> None:
        """Append with optimistic concurrency. The event id is fixed per call, so a retry
        after a lost ack is dropped by JetStream's de-duplication instead of stored twice."""
        lost: Exception | None = None
        for attempt in range(APPEND_TRIES):
            try:
                if attempt < 5:
                    st.seq = await self.bus.publish(ev, expect_last_subject_seq=st.seq)
                else:
                    st.seq = await self.bus.publish(ev)
                return
            except ConcurrencyConflict:
                try:
                    await self.book.sync(st)  # another replica recorded a call of this rollout
                except Exception as exc:
                    lost = exc
                    continue
                if ev.call_id in st.logged:
                    return  # ... or our own append went through and its ack was lost
            except Exception as exc:  # a lost ack, a reconnecting or briefly absent server
                lost = exc
                delay = min(2.0, APPEND_BACKOFF_S * 2**attempt)
                log.warning("append of call %s: %r; again in %.1fs (de-duplicated by event id)", ev.call_id, exc,
                            delay)
                await asyncio.sleep(delay)
        raise lost or RuntimeError(f"could not append call {ev.call_id}")

    def _event(self, call: "_Call", req: ChatRequest, hints: CallHints, digests: list[str],
               delivered: bool) -> CallRecorded:
        new_d, out_d, lp_d, idx_d = digests
        now = time.monotonic()
        return CallRecorded(
            event_id=call_event_id(self.config.run_id, call.call_id),
            run_id=self.config.run_id, call_id=call.call_id, rollout_id=call.rollout_id, session_id=call.session,
            api=req.api, parent_call_id=call.plan.parent_call_id, prefix_len=call.plan.prefix_len,
            new_input_digest=new_d, n_new_input_tokens=len(call.plan.new_ids), output_digest=out_d,
            logprobs_digest=lp_d, n_output_tokens=len(call.output_ids), weight_spans=call.spans(),
            logprob_temperature=call.logprob_temperature,
            drift=call.plan.drift, match_index_digest=idx_d, model=req.model,
            finish_reason=call.outcome.finish_reason, delivered=delivered,
            hints=call.hints if call.hints is not None else self._hints(req, hints),
            timings=CallTimings(total_ms=(now - call.started) * 1000,
                                first_token_ms=(call.first_token - call.started) * 1000 if call.first_token else None),
            cell=call.outcome.cells[-1] if call.outcome.cells else None,
        )

    async def _abandon(self, st: RolloutState, call: "_Call", req: ChatRequest, hints: CallHints) -> None:
        for cell in call.outcome.cells[-1:]:
            try:
                await self.clients[cell].abort(f"{call.call_id}-{len(call.outcome.cells) - 1}")
            except Exception as exc:  # the cell may be gone; nothing more to stop
                log.info("abort of %s on %s failed: %r", call.call_id, cell, exc)
        if call.output_ids and not call.committed:
            try:
                await self._record(st, call, req, hints, delivered=False)
            except Exception:
                log.exception("could not record undelivered call %s", call.call_id)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_log_failure)
        return task

    async def drain_background(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)


def prompt_too_long(n_input: int, limit: int) -> ApiError:
    """The wording Claude Code answers by compacting its context (and others understand)."""
    return ApiError(400, "invalid_request", f"prompt is too long: {n_input} tokens > {limit - 2} maximum")


def context_length_of(info: object) -> int | None:
    """A cell's context length from its ``/server_info`` (Gyre's engine and SGLang:
    ``context_length``; SGLang also ``max_req_input_len``, one less)."""
    if not isinstance(info, dict):
        return None
    for key, extra in (("context_length", 0), ("max_req_input_len", 1)):
        v = info.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v + extra
    return None


_CONTEXT_IN = re.compile(r"context length(?: of| \()\s*(\d+)")


def context_length_in(message: str) -> int | None:
    """The context length an engine's refusal names ("... maximum context length of N
    tokens", "... the model's context length (N tokens)"), if it names one."""
    m = _CONTEXT_IN.search(message)
    return int(m.group(1)) if m else None


APPEND_TRIES = 8  # with APPEND_BACKOFF_S doubling (at most 2 s): about 9 s, enough for a NATS reconnect
APPEND_BACKOFF_S = 0.1


def _log_failure(task: asyncio.Task) -> None:
    """A background task's failure is logged, even when nobody awaits it any more."""
    if not task.cancelled() and task.exception() is not None:
        log.error("proxy background task failed: %r", task.exception(), exc_info=task.exception())


def call_event_id(run_id: str, call_id: str) -> str:
    """One event id per call: JetStream drops a second append of the same call."""
    return hashlib.sha256(f"{run_id}:CallRecorded:{call_id}".encode()).hexdigest()[:32]


class StopCutter:
    """Cut streamed text before the first of the request's stop sequences.

    The engine keeps a matched stop sequence in its output ids (``no_stop_trim``: the
    record must hold every generated token), but both APIs leave it out of the content;
    text that may be the start of one is held back until it is decided."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.matched: str | None = None
        self._buf = ""

    def feed(self, text: str) -> str:
        if not self.stops:
            return text
        if self.matched is not None:
            return ""
        self._buf += text
        cut = _first_stop(self._buf, self.stops)
        if cut is not None:
            i, self.matched = cut
            out, self._buf = self._buf[:i], ""
            return out
        keep = max(partial_tail(self._buf, s) for s in self.stops)
        out, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        return out

    def finish(self) -> str:
        out, self._buf = self._buf, ""
        return out


def _first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    found = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    return min(found) if found else None


def cut_at_stop(text: str, stops: list[str]) -> str:
    cut = _first_stop(text, [s for s in stops if s])
    return text if cut is None else text[: cut[0]]


@dataclass
class _Call:
    call_id: str
    rollout_id: str
    session: str
    plan: Plan
    input_ids: list[int]
    started: float
    hints: SessionHints | None = None  # what the call was recognised as when it was planned
    # what the engine tempered the logprobs by: the rule applied to the temperature sent
    logprob_temperature: float = 1.0
    first_token: float | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    outcome: Outcome = field(default_factory=Outcome)
    parsed: object | None = None
    committed: bool = False  # its CallRecorded is issued: never record it again
    stream: StreamState | None = None  # a streamed call's: whether its stream is open
    shown: bool = False  # content events went to the caller: a failure then no longer waits for a cell
    wait_from: float | None = None  # when it began to wait for a cell (cell_wait_s from then at most)
    wait_pause: float = CELL_WAIT_PAUSE_S[0]  # the next pause before the cells are tried again


    def add(self, ids: list[int], logprobs: list[float], version: int) -> None:
        self.output_ids.extend(ids)
        self.logprobs.extend(logprobs)
        self.versions.extend([version] * len(ids))

    def spans(self) -> list[WeightSpan]:
        out: list[WeightSpan] = []
        for i, v in enumerate(self.versions):
            if out and out[-1].version == v:
                out[-1] = WeightSpan(start=out[-1].start, end=i + 1, version=v)
            else:
                out.append(WeightSpan(start=i, end=i + 1, version=v))
        return out

