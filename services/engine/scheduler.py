"""Continuous batching: which sequences run in the next forward step, and when each ends (pure).

A :class:`Sequence` is one generation request. Its lifecycle::

    WAITING --admit--> RUNNING --(stop | length | abort)--> FINISHED
       ^                  |
       +----retract-------+      (pause mode "retract": KV dropped, re-prefilled later)

Every step feeds each running sequence the tokens it has no KV for yet
(``all_ids[kv_len:]``): a whole or chunked prompt right after admission, one token while
decoding. A sequence whose fed run reaches the end of its ids gets a next token sampled from
the step's logits. Prompts are chunked so one step stays within ``step_token_budget``;
decoding sequences always go first, so a long prompt never stalls the others.

Pause modes, as SGLang's ``/pause_generation``: ``abort`` ends everything in flight with
finish type abort; ``retract`` sends running sequences back to the queue (their KV goes to
the prefix cache, so resuming re-prefills cheaply); ``in_place`` just stops stepping.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

from .params import SamplingParams


class Phase(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class PauseMode(str, enum.Enum):
    ABORT = "abort"
    RETRACT = "retract"
    IN_PLACE = "in_place"


@dataclass(eq=False)
class Sequence:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    eos_ids: frozenset[int] = frozenset()
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list] = field(default_factory=list)
    # (index of the first output token, weight version) for each version that produced tokens
    version_spans: list[tuple[int, str]] = field(default_factory=list)
    kv_len: int = 0  # leading tokens of all_ids whose KV this sequence holds
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at (first) admission
    admitted_once: bool = False
    retractions: int = 0
    phase: Phase = Phase.WAITING
    finish_reason: dict | None = None
    stop_text: str | None = None  # the stop string that ended it, if any

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    def ids_between(self, start: int, end: int) -> list[int]:
        """``all_ids[start:end]`` without building ``all_ids`` (a step feeds one token of a long sequence)."""
        prompt = len(self.input_ids)
        if end <= prompt:
            return self.input_ids[start:end]
        if start >= prompt:
            return self.output_ids[start - prompt : end - prompt]
        return self.input_ids[start:] + self.output_ids[: end - prompt]

    @property
    def total_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def pending(self) -> int:
        return self.total_len - self.kv_len


@dataclass(frozen=True)
class Feed:
    """One sequence's share of a step: feed ``count`` tokens starting at ``kv_len``."""

    seq: Sequence
    start: int
    count: int

    @property
    def samples(self) -> bool:
        return self.start + self.count == self.seq.total_len


class Scheduler:
    def __init__(self, max_running: int, step_token_budget: int, max_context: int,
                 max_running_tokens: int | None = None) -> None:
        self.max_running = max_running
        self.step_token_budget = step_token_budget
        self.max_context = max_context
        # KV room for running sequences, counted at their worst case (prompt + max_new_tokens)
        self.max_running_tokens = max_running_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.paused: PauseMode | None = None
        self.hold_admission = False  # set while a weight update waits for in-flight work

    # -- queue -----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        if self.paused is not None:
            return False
        return bool(self.running) or (bool(self.waiting) and not self.hold_admission)

    def busy(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    def admit(self) -> list[Sequence]:
        """Moves waiting sequences to running while there is room; the caller attaches KV."""
        admitted: list[Sequence] = []
        if self.paused is not None or self.hold_admission:
            return admitted
        reserved = sum(worst_case_tokens(s, self.max_context) for s in self.running)
        while self.waiting and len(self.running) < self.max_running:
            need = worst_case_tokens(self.waiting[0], self.max_context)
            if self.max_running_tokens is not None and self.running and reserved + need > self.max_running_tokens:
                break  # waits for room; a lone sequence is always admitted
            reserved += need
            seq = self.waiting.popleft()
            seq.phase = Phase.RUNNING
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def plan(self) -> list[Feed]:
        if self.paused is not None:
            return []
        decoding = [s for s in self.running if s.pending == 1]
        feeds = [Feed(s, s.kv_len, 1) for s in decoding]
        budget = self.step_token_budget - len(feeds)
        for seq in self.running:
            if seq.pending <= 1 or budget <= 0:
                continue
            count = min(seq.pending, budget)
            feeds.append(Feed(seq, seq.kv_len, count))
            budget -= count
        return feeds

    # -- outcomes --------------------------------------------------------------------
    def finish(self, seq: Sequence, reason: dict) -> None:
        seq.finish_reason = reason
        seq.phase = Phase.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def abort(self, rids: Iterable[str] | None, message: str) -> list[Sequence]:
        """Aborts the given rids (all when None); returns the sequences it ended."""
        wanted = None if rids is None else set(rids)
        ended = [s for s in [*self.running, *self.waiting] if wanted is None or s.rid in wanted]
        for seq in ended:
            self.finish(seq, {"type": "abort", "message": message})
        return ended

    def pause(self, mode: PauseMode) -> tuple[list[Sequence], list[Sequence]]:
        """Returns (aborted, retracted) sequences; the caller frees their KV."""
        aborted: list[Sequence] = []
        retracted: list[Sequence] = []
        if mode is PauseMode.ABORT:
            aborted = self.abort(None, "aborted by pause_generation")
        elif mode is PauseMode.RETRACT:
            retracted = list(self.running)
            self.running.clear()
            for seq in reversed(retracted):
                seq.phase = Phase.WAITING
                self.waiting.appendleft(seq)
        self.paused = mode
        return aborted, retracted

    def resume(self) -> None:
        self.paused = None


def worst_case_tokens(seq: Sequence, max_context: int) -> int:
    """The KV tokens admission counts for ``seq`` (its buffer never grows past them)."""
    return min(len(seq.input_ids) + seq.params.max_new_tokens, max_context)


def banned_before_min_tokens(seq: Sequence) -> tuple[int, ...]:
    """Ids the next pick may not be: while fewer than ``min_new_tokens`` are out, the stop
    token ids and (unless ``ignore_eos``) the EOS ids, so the minimum is really produced."""
    params = seq.params
    if len(seq.output_ids) >= params.min_new_tokens:
        return ()
    banned = set(params.stop_token_ids)
    if not params.ignore_eos:
        banned |= seq.eos_ids
    return tuple(sorted(banned))


def check_stop(
    seq: Sequence,
    token: int,
    decode_tail: Callable[[list[int]], str] | None,
    max_context: int,
) -> dict | None:
    """Finish reason once ``token`` has been appended to ``seq.output_ids``, else None."""
    params = seq.params
    produced = len(seq.output_ids)
    may_stop = produced >= params.min_new_tokens
    if may_stop and token in params.stop_token_ids:
        return {"type": "stop", "matched": token}
    if may_stop and not params.ignore_eos and token in seq.eos_ids:
        return {"type": "stop", "matched": token}
    if may_stop and params.stop and decode_tail is not None:
        matched = _match_stop_string(seq, params.stop, decode_tail)
        if matched is not None:
            seq.stop_text = matched
            return {"type": "stop", "matched": matched}
    if produced >= params.max_new_tokens:
        return {"type": "length", "length": params.max_new_tokens}
    if seq.total_len >= max_context:
        return {"type": "length", "length": produced}
    return None


def _match_stop_string(seq: Sequence, stops: list[str], decode_tail: Callable[[list[int]], str]) -> str | None:
    """The first of ``stops`` in the decoded tail of the output, else None.

    ``decode_tail`` must keep special tokens (as SGLang checks stops), so a stop string that
    is a special token (``"<|im_end|>"``) matches whatever ``skip_special_tokens`` says. The
    window is sized in UTF-8 bytes: every token decodes to at least one byte, so a stop of
    ``n`` bytes lies within the last ``n`` tokens (``+ 2``: the token it starts in may begin
    mid-character). A stop that ended in an earlier step was matched then, unless that step
    came before ``min_new_tokens``: the first eligible step looks at the whole window, so a
    stop produced just before the minimum still ends the sequence (SGLang's rule too).
    """
    window = max(len(s.encode("utf-8")) for s in stops) + 2
    tail = decode_tail(seq.output_ids[-window:])
    for stop in stops:
        if stop in tail:
            return stop
    return None


def trim_stop_text(text: str, stop_text: str | None, keep: bool) -> str:
    if stop_text is None or keep:
        return text
    cut = text.find(stop_text)
    return text if cut < 0 else text[:cut]
