"""Token-in, token-out: build each call's exact input ids from the rollout's earlier calls.

The rule: never re-tokenize what the model generated, nor what an earlier call already
sent. A rollout's calls register *boundaries*: the chain hash of a conversation prefix
(``messages.chain_hashes``) -> a position in an earlier call's token sequence (its input
ids followed by its output ids). A new request is matched by looking up its own chain
hashes from the longest prefix down; the matched position gives the reused ids, and only
the messages after it are rendered and tokenized. So a 50-turn, 256k-token conversation
tokenizes only each turn's new messages, and every reused id is the one the engine saw or
produced.

Drift classes (``DriftClass``) for the call that continues at a boundary:

- after an earlier call's *reply*: ``append`` when the chat template would re-render that
  reply as exactly the generated ids; ``retoken_drift`` when it renders the same text but
  re-encoding it gives other ids; ``think_stripped`` when the only difference is the
  reply's ``<think>...</think>`` block, which the template leaves out of earlier turns
  (Qwen3's documented behaviour; the reasoning never comes back in the messages either);
  ``template_drift`` when it renders other text than that. The engine gets the generated
  ids in all four cases.
- inside an earlier call's *input* (the same messages sent again and then something else:
  a retry or an edit): ``fork``; no match at all in a rollout that has calls: ``fork`` (a
  compaction's rewritten history, a new sub-agent conversation); the first call: ``fresh``.

Pure: no HTTP, NATS or torch; the chat template and tokenizer come in as a ``Renderer``.
"""

from __future__ import annotations

import array
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Protocol

from libs.common.events.calls import DriftClass

from .messages import Msg, ToolSpec, chain_hashes, extend_hash

SENTINEL = "\u2063gyre-sentinel\u2063"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class Renderer(Protocol):
    """The model's chat template and tokenizer."""

    def render(self, msgs: list[Msg], tools: list[ToolSpec], *, add_generation_prompt: bool) -> str: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class TemplateError(ValueError):
    """The chat template could not render the conversation."""


@dataclass(frozen=True)
class Boundary:
    call_id: str
    offset: int  # position in the call's token sequence (input ids + output ids)
    kind: str  # "input" (between two request messages) or "reply" (after the call's reply)
    glue: str = ""  # text the template puts after the reply that the model did not write
    drift: DriftClass = DriftClass.APPEND  # for "reply" boundaries: class of a continuing call


@dataclass
class CallTokens:
    call_id: str
    parent_call_id: str | None
    prefix_len: int
    new_ids: array.array
    output_ids: array.array

    @property
    def input_len(self) -> int:
        return self.prefix_len + len(self.new_ids)


@dataclass(frozen=True)
class Plan:
    """How to build one call's input: a reused prefix plus newly rendered tokens."""

    parent_call_id: str | None
    prefix_len: int
    new_ids: list[int]
    drift: DriftClass
    hashes: tuple[bytes, ...]  # chain hashes of the request's messages (len = messages + 1)
    matched_messages: int  # how many request messages the reused prefix covers
    suffix_offsets: tuple[int, ...]  # end offset (within new_ids) of each newly rendered message; -1: none
    # (a tool result the template renders in one block with the next one)
    encoded_tokens: int  # tokens this plan tokenized (the proxy's own work)
    prefill: str = ""  # text the reply's turn starts with (Anthropic's last assistant message): the
    # last of new_ids, after the generation prompt; the model writes on from there

    @property
    def input_len(self) -> int:
        return self.prefix_len + len(self.new_ids)


@dataclass
class TemplateShape:
    """What a chat template adds around messages, measured once per (tools, system)."""

    base_msgs: list[Msg]
    base_text: str  # the stand-in context's text as it renders when a next turn follows
    last_text: str  # ... and as it renders when it ends the conversation
    generation_prompt: str
    reply_tail: str  # text after an assistant message's content (e.g. "<|im_end|>\n")
    heads: dict[str, str] | None = None  # role -> header before a closing turn's content
    groups_tools: bool = False  # consecutive tool results render as one block


class Tito:
    """Per-rollout token history and matching. One instance per rollout."""

    def __init__(self, renderer: Renderer, *, stop_texts: tuple[str, ...] = (), cache_calls: int = 8) -> None:
        self.renderer = renderer
        self.stop_texts = stop_texts
        self.calls: dict[str, CallTokens] = {}
        self.boundaries: dict[bytes, Boundary] = {}
        self._full_cache: OrderedDict[str, array.array] = OrderedDict()
        # plans and records run in the proxy's render threads under the rollout's lock; a
        # reader outside that lock (the KV migration's session_tokens) may meet them here
        self._cache_lock = threading.Lock()
        self._cache_calls = cache_calls
        self._shapes: dict[tuple[str, str], TemplateShape] = {}
        self._continued: set[bytes] = set()  # reply boundaries some call has already continued

    # -- token sequences ---------------------------------------------------------------

    def full_ids(self, call_id: str) -> array.array:
        """Input ids followed by output ids of a recorded call.

        Walks up the parent chain to the nearest cached call (iteratively: a rollout may
        chain thousands of calls), then builds the sequences back down."""
        chain: list[CallTokens] = []
        cid: str | None = call_id
        base = array.array("i")
        while cid is not None:
            with self._cache_lock:
                cached = self._full_cache.get(cid)
                if cached is not None:
                    self._full_cache.move_to_end(cid)
            if cached is not None:
                base = cached
                break
            c = self.calls[cid]
            chain.append(c)
            cid = c.parent_call_id
        if not chain:
            return base
        seq = array.array("i", base)  # a copy: cached sequences are shared
        for c in reversed(chain):  # each call's prefix is a prefix of its parent's sequence
            del seq[c.prefix_len if c.parent_call_id is not None else 0:]
            seq.extend(c.new_ids)
            seq.extend(c.output_ids)
        with self._cache_lock:
            self._full_cache[call_id] = seq
            while len(self._full_cache) > self._cache_calls:
                self._full_cache.popitem(last=False)
        return seq

    def input_ids(self, plan: Plan) -> list[int]:
        if plan.parent_call_id is None:
            return list(plan.new_ids)
        prefix = self.full_ids(plan.parent_call_id)[: plan.prefix_len]
        prefix.extend(plan.new_ids)
        return prefix.tolist()

    # -- template shape ----------------------------------------------------------------

    def shape(self, tools: list[ToolSpec], system: Msg | None, tools_key: str) -> TemplateShape:
        """Measure the template once per (tools, system).

        A message's text is cut out of a render in which a *closing turn* (a sentinel
        message) follows it, never one in which it is the last message: templates render a
        last message differently (Qwen3 gives a last assistant message an empty think
        block) and close a run of tool results only after its last one (Qwen2.5/3). The
        closing turn's header is measured here; each cut falls where that header starts."""
        key = (tools_key, system.canonical() if system else "")
        found = self._shapes.get(key)
        if found is not None:
            return found
        r = self.renderer
        base = ([system] if system else []) + [Msg("user", "."), Msg("assistant", ".")]
        last_text = r.render(base, tools, add_generation_prompt=False)
        with_prompt = r.render(base, tools, add_generation_prompt=True)
        gen_prompt = _suffix(last_text, with_prompt)
        user, asst = Msg("user", SENTINEL), Msg("assistant", SENTINEL)
        sample = r.render(base + [user, asst], tools, add_generation_prompt=False).split(SENTINEL)
        if len(sample) != 3:
            raise TemplateError("the chat template dropped an assistant message's content")
        reply_tail = sample[2]
        shape = TemplateShape(base, last_text, last_text, gen_prompt, reply_tail)
        heads = self._closing_heads(base, tools, sample)
        if heads is not None:
            shape.heads = heads
            base_text = self._closed_text(shape, base, tools)
            if base_text is None:
                shape.heads = None
            else:
                shape.base_text = base_text
                shape.groups_tools = self._groups_tools(shape, tools)
        self._shapes[key] = shape
        return shape

    def _closing_heads(self, base: list[Msg], tools: list[ToolSpec], sample: list[str]) -> dict[str, str] | None:
        """The header a last user / last assistant message's content follows, or None when
        it cannot be told apart from the footer before it."""
        r = self.renderer
        try:
            one = r.render(base + [Msg("user", SENTINEL)], tools, add_generation_prompt=False).split(SENTINEL)
            three = r.render(base + [Msg("user", SENTINEL), Msg("assistant", SENTINEL), Msg("user", SENTINEL)], tools,
                             add_generation_prompt=False).split(SENTINEL)
        except TemplateError:
            return None
        if len(one) != 2 or len(three) != 4:
            return None
        user_foot, asst_foot = one[1], sample[2]  # footers of a last user / assistant message
        if not sample[1].startswith(user_foot) or not three[2].startswith(asst_foot):
            return None
        return {"assistant": sample[1][len(user_foot):], "user": three[2][len(asst_foot):]}

    def _closed_text(self, shape: TemplateShape, ctx: list[Msg], tools: list[ToolSpec]) -> str | None:
        """The text of ``ctx`` as it renders when a next turn follows: render it with a
        closing turn (assistant after a user or tool message, user after an assistant, so
        that roles alternate) and cut where that turn starts. None when the closing turn's
        header is not where it should be."""
        assert shape.heads is not None
        role = "user" if ctx and ctx[-1].role == "assistant" else "assistant"
        head = shape.heads[role]
        try:
            text = self.renderer.render(ctx + [Msg(role, SENTINEL)], tools, add_generation_prompt=False)
        except TemplateError:
            return None
        at = text.rfind(SENTINEL)
        if at < 0 or not text.endswith(head, 0, at):
            return None
        return text[: at - len(head)]

    def _groups_tools(self, shape: TemplateShape, tools: list[ToolSpec]) -> bool:
        """Whether the template renders a tool result differently when another follows
        (one block for a run of results): then only a run's end is a message boundary."""
        one = self._closed_text(shape, shape.base_msgs + [Msg("tool", SENTINEL)], tools)
        two = self._closed_text(shape, shape.base_msgs + [Msg("tool", SENTINEL), Msg("tool", SENTINEL)], tools)
        return one is not None and two is not None and not two.startswith(one)

    def message_texts(self, shape: TemplateShape, msgs: list[Msg], tools: list[ToolSpec]) -> list[str | None] | None:
        """Each message's text as the template renders it after an ordinary turn, or None
        when the template is not prefix-stable for these messages. A tool result the
        template renders in one block with the next has no text of its own (None): its
        run's last result carries the whole block."""
        if shape.heads is not None:
            texts = self._closed_texts(shape, msgs, tools)
            if texts is not None:
                return texts
        return self._last_texts(shape, msgs, tools)

    def _closed_texts(self, shape: TemplateShape, msgs: list[Msg], tools: list[ToolSpec]) -> list[str | None] | None:
        texts: list[str | None] = []
        prev = shape.base_text
        for i in range(len(msgs)):
            if self._inside_run(shape, msgs, i + 1):
                texts.append(None)
                continue
            cur = self._closed_text(shape, shape.base_msgs + msgs[: i + 1], tools)
            if cur is None or not cur.startswith(prev):
                return None
            texts.append(cur[len(prev):])
            prev = cur
        return texts

    def _last_texts(self, shape: TemplateShape, msgs: list[Msg], tools: list[ToolSpec]) -> list[str | None] | None:
        """Fallback for templates whose closing turn cannot be measured: cut renders that
        end on each message (works for templates that render a last message as any other)."""
        texts: list[str | None] = []
        prev = shape.last_text
        for i in range(len(msgs)):
            try:
                cur = self.renderer.render(shape.base_msgs + msgs[: i + 1], tools, add_generation_prompt=False)
            except TemplateError:  # a template that rejects the conversation says so on the full render
                return None
            if not cur.startswith(prev):
                return None
            texts.append(cur[len(prev):])
            prev = cur
        return texts

    @staticmethod
    def _inside_run(shape: TemplateShape, msgs: list[Msg], i: int) -> bool:
        """Whether position i (after msgs[:i]) splits a run of tool results rendered as one block."""
        return shape.groups_tools and 0 < i < len(msgs) and msgs[i - 1].role == "tool" and msgs[i].role == "tool"

    # -- matching ----------------------------------------------------------------------

    def plan(self, msgs: list[Msg], tools: list[ToolSpec], tools_key: str, prefill: str = "") -> Plan:
        """How to build the input for ``msgs``; with ``prefill``, the reply's turn is opened
        with that text (tokenized on its own, after the generation prompt) and the model
        continues it."""
        planned = self._plan(msgs, tools, tools_key)
        if not prefill:
            return planned
        ids = self.renderer.encode(prefill)
        return replace(planned, new_ids=planned.new_ids + ids, encoded_tokens=planned.encoded_tokens + len(ids),
                       prefill=prefill)

    def _plan(self, msgs: list[Msg], tools: list[ToolSpec], tools_key: str) -> Plan:
        hashes = chain_hashes(msgs, tools_key)
        shape: TemplateShape | None = None
        for i in range(len(msgs), 0, -1):
            b = self.boundaries.get(hashes[i])
            if b is None:
                continue
            if shape is None:
                system = msgs[0] if msgs[0].role == "system" else None
                shape = self.shape(tools, system, tools_key)
            if self._inside_run(shape, msgs, i):
                continue  # the template renders msgs[i - 1] and msgs[i] as one block
            planned = self._plan_from(b, i, msgs, tools, shape, hashes)
            if planned is None:
                # the template cannot render msgs[i:] message by message; every shorter
                # boundary would render those same messages again: render all at once
                break
            if b.kind == "reply" and hashes[i] in self._continued:
                planned = replace(planned, drift=DriftClass.FORK)  # a second continuation: an edit
            return planned
        return self._plan_fresh(msgs, tools, hashes)

    def _plan_from(self, b: Boundary, i: int, msgs: list[Msg], tools: list[ToolSpec], shape: TemplateShape,
                   hashes: list[bytes]) -> Plan | None:
        texts = self.message_texts(shape, msgs[i:], tools)
        if texts is None:
            return None
        enc = self.renderer.encode
        new_ids: list[int] = []
        offsets: list[int] = []
        encoded = 0
        if b.glue:
            g = enc(b.glue)
            new_ids.extend(g)
            encoded += len(g)
        for t in texts:
            if t is None:  # rendered in one block with the next message: no boundary here
                offsets.append(-1)
                continue
            ids = enc(t)
            encoded += len(ids)
            new_ids.extend(ids)
            offsets.append(len(new_ids))
        gp = enc(shape.generation_prompt)
        new_ids.extend(gp)
        encoded += len(gp)
        # new messages after an earlier reply continue that conversation; anything else
        # (a retry or edit inside an earlier input, a request ending on the reply) forks it
        drift = b.drift if b.kind == "reply" and i < len(msgs) else DriftClass.FORK
        return Plan(b.call_id, b.offset, new_ids, drift, tuple(hashes), i, tuple(offsets), encoded)

    def _plan_fresh(self, msgs: list[Msg], tools: list[ToolSpec], hashes: list[bytes]) -> Plan:
        try:
            body = self.renderer.render(msgs, tools, add_generation_prompt=False)
            whole = self.renderer.render(msgs, tools, add_generation_prompt=True)
        except TemplateError:
            raise
        except Exception as exc:  # jinja raises many types for templates that reject input
            raise TemplateError(f"chat template failed: {exc}") from exc
        ids = self.renderer.encode(body)
        gp = self.renderer.encode(_suffix(body, whole))
        drift = DriftClass.FORK if self.calls else DriftClass.FRESH
        return Plan(None, 0, ids + gp, drift, tuple(hashes), 0, (len(ids),), len(ids) + len(gp))

    # -- recording ---------------------------------------------------------------------

    def record(self, call_id: str, plan: Plan, output_ids: list[int], reply: Msg, tools: list[ToolSpec],
               tools_key: str, finish_stop: bool) -> list[tuple[bytes, Boundary]]:
        """Register a finished call; returns the boundaries it added (its match index)."""
        self.calls[call_id] = CallTokens(call_id, plan.parent_call_id, plan.prefix_len,
                                         array.array("i", plan.new_ids), array.array("i", output_ids))
        added: list[tuple[bytes, Boundary]] = []
        n = len(plan.hashes) - 1
        if plan.parent_call_id is None:
            # a fresh render: only the end of the messages is a clean boundary
            added.append((plan.hashes[n], Boundary(call_id, plan.suffix_offsets[-1], "input")))
        else:
            for j, end in enumerate(plan.suffix_offsets):
                if end < 0:
                    continue
                h = plan.hashes[plan.matched_messages + j + 1]
                added.append((h, Boundary(call_id, plan.prefix_len + end, "input")))
        reply_hash = extend_hash(plan.hashes[n], reply)
        try:
            glue, drift = self._reply_check(output_ids, reply, tools, tools_key, finish_stop, plan.prefill)
        except TemplateError:  # the template cannot render this reply: a next turn forks instead
            pass
        else:
            added.append((reply_hash, Boundary(call_id, plan.input_len + len(output_ids), "reply", glue, drift)))
        for h, b in added:
            self.boundaries[h] = b
        if plan.parent_call_id is not None:
            self._continued.add(plan.hashes[plan.matched_messages])
        return added

    def restore(self, tokens: CallTokens, boundaries: list[tuple[bytes, Boundary]],
                continued: bytes | None = None) -> None:
        """Put back a call recorded elsewhere (another replica, or before a restart)."""
        self.calls[tokens.call_id] = tokens
        for h, b in boundaries:
            self.boundaries[h] = b
        if continued is not None:
            self._continued.add(continued)

    def _reply_check(self, output_ids: list[int], reply: Msg, tools: list[ToolSpec], tools_key: str,
                     finish_stop: bool, prefill: str = "") -> tuple[str, DriftClass]:
        """Glue after the reply, and how the template would re-render it (costs O(reply)).
        ``reply`` is the whole message, ``prefill`` included; ``output_ids`` what the model
        wrote after it."""
        shape = self.shape(tools, None, tools_key)  # a reply renders the same whatever the system
        generated = prefill + self.renderer.decode(output_ids)
        stop = next((s for s in self.stop_texts if finish_stop and generated.endswith(s)), "")
        tail = shape.reply_tail
        glue = tail[len(stop):] if stop and tail.startswith(stop) else tail
        before = shape.base_msgs + [Msg("user", ".")]
        if shape.heads is not None:  # the reply as it renders when the conversation goes on
            prev = self._closed_text(shape, before, tools)
            cur = self._closed_text(shape, before + [reply], tools)
        else:
            prev = self.renderer.render(before, tools, add_generation_prompt=False)
            cur = self.renderer.render(before + [reply], tools, add_generation_prompt=False)
        rendered = cur[len(prev):] if prev is not None and cur is not None and cur.startswith(prev) else None
        if rendered != shape.generation_prompt + generated + glue:
            if rendered is not None and rendered in without_thinking(shape.generation_prompt + generated, glue):
                return glue, DriftClass.THINK_STRIPPED
            return glue, DriftClass.TEMPLATE_DRIFT
        gp = self.renderer.encode(shape.generation_prompt)
        written = self.renderer.encode(prefill) + list(output_ids) if prefill else list(output_ids)
        if self.renderer.encode(rendered) != gp + written + self.renderer.encode(glue):
            return glue, DriftClass.RETOKEN_DRIFT
        return glue, DriftClass.APPEND


def without_thinking(text: str, glue: str = "") -> tuple[str, ...]:
    """``text`` (a generation prompt and the reply written after it) with its thinking
    block left out as chat templates leave it out of earlier turns, then ``glue``: the
    span from ``<think>`` (which the generation prompt may hold) to the first ``</think>``,
    with the newlines after it (Qwen3: ``content.split('</think>')[-1].lstrip('\\n')``, as
    the reply parser takes the text after the block). Only newlines: a template that also
    drops other leading whitespace (``content | trim``) changes the reply whether or not it
    thought, a template drift. Empty when there is no complete thinking block."""
    close = text.find(THINK_CLOSE)
    start = text.rfind(THINK_OPEN, 0, close) if close >= 0 else -1
    if start < 0:
        return ()
    head, rest = text[:start], text[close + len(THINK_CLOSE):]
    return (head + rest.lstrip("\n") + glue,)


def _suffix(prefix: str, whole: str) -> str:
    if not whole.startswith(prefix):
        raise TemplateError("the generation prompt does not extend the rendered conversation")
    return whole[len(prefix):]
