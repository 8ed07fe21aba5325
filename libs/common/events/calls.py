"""Call context (owner: proxy): every model call, recorded token-exactly (TITO).

Token arrays never travel in events: the blob store holds them, events carry digests.
"""

from __future__ import annotations

import enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .envelope import Context, Digest, Event
from .registry import register, upcaster


class DriftClass(str, enum.Enum):
    """How a call's request relates to the rollout's earlier calls (TITO matching).

    Whatever the class, the engine receives the recorded ids for the reused part.
    """

    FRESH = "fresh"  # first call of the rollout: nothing to match
    APPEND = "append"  # an earlier call's messages + reply, then new messages: clean
    TEMPLATE_DRIFT = "template_drift"  # the template re-renders the reply as other text (e.g. tool-call JSON spacing)
    # the template re-renders the reply without its <think> block (Qwen3 drops earlier turns'
    # reasoning) and otherwise as generated
    THINK_STRIPPED = "think_stripped"
    RETOKEN_DRIFT = "retoken_drift"  # same text, but re-encoding it gives other ids than generated
    FORK = "fork"  # history rewritten: compaction, edit, retry, a new sub-agent conversation


class WeightSpan(BaseModel):
    """Output tokens [start, end) were produced by weight ``version``."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
    start: int = Field(ge=0)
    end: int = Field(ge=0)
    version: int = Field(ge=0)


class SessionHints(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
    agent_id: str | None = None  # e.g. Claude Code's x-claude-code-agent-id (sub-agents only)
    parent_agent_id: str | None = None  # x-claude-code-parent-agent-id (nested sub-agents)
    system_digest: Digest | None = None
    tools_digest: Digest | None = None
    role: str | None = None  # explicit x-gyre-role header, if any
    # what the proxy recognised the request as, when it could tell (harness-specific rules)
    kind: Literal["main", "subagent", "compaction_summary", "post_compaction", "side"] | None = None


class CallTimings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
    queued_ms: float = Field(default=0.0, ge=0)
    first_token_ms: float | None = Field(default=None, ge=0)
    total_ms: float = Field(default=0.0, ge=0)


@register
class SessionOpened(Event):
    CONTEXT = Context.CALLS
    KEY = "session_id"
    session_id: str = Field(min_length=1)
    rollout_id: str = Field(min_length=1)
    cell: str | None = None
    hints: SessionHints = Field(default_factory=SessionHints)


@register
class CallRecorded(Event):
    CONTEXT = Context.CALLS
    KEY = "rollout_id"
    # 2: ``drift`` may be ``think_stripped``, and ``logprob_temperature`` is new (a version 1
    # event reads as None: 1.0). A reader that knows only version 1 then fails on every newer
    # call with "newer than this Gyre knows" (and dead-letters it, keeping its bytes) instead
    # of on some calls with an invalid enum value or an unknown field: upgrade the proxy and
    # the readers of the calls stream (trajectory, projection) together.
    SCHEMA_VERSION = 2
    call_id: str = Field(min_length=1)
    rollout_id: str = Field(min_length=1)
    session_id: str = Field(min_length=1)
    api: Literal["openai_chat", "openai_responses", "anthropic_messages", "native"]
    parent_call_id: str | None = None
    prefix_len: int = Field(default=0, ge=0)
    new_input_digest: Digest
    n_new_input_tokens: int = Field(ge=0)
    output_digest: Digest
    logprobs_digest: Digest
    n_output_tokens: int = Field(ge=0)
    # The temperature the output logprobs were taken under: the engine divided the logits by
    # it before the softmax (SGLang's default; the proxy records the temperature it sent, 1.0
    # for a greedy call, services/engine/params.logprob_temperature). The trainer divides its
    # logits by the same before scoring these tokens, so the ratio is 1 on-policy.
    # None: 1.0 (untempered), as for every version 1 event.
    logprob_temperature: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    weight_spans: list[WeightSpan] = Field(default_factory=list)
    drift: DriftClass = DriftClass.FRESH
    # message-boundary index of this call (hash chain -> token offset), so another proxy
    # replica or a restarted one can match later calls against it exactly
    match_index_digest: Digest | None = None
    model: str | None = None  # the model name the agent asked for
    finish_reason: str | None = None
    delivered: bool = True
    hints: SessionHints = Field(default_factory=SessionHints)
    timings: CallTimings = Field(default_factory=CallTimings)
    cell: str | None = None


@upcaster("CallRecorded", 1)
def _call_recorded_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    """Version 1 had the same fields but ``logprob_temperature`` (absent: None, read as 1.0);
    the set of drift classes grew."""
    return payload


@register
class RequestRouted(Event):
    CONTEXT = Context.CALLS
    KEY = "session_id"
    call_id: str = Field(min_length=1)
    session_id: str = Field(min_length=1)
    cell: str = Field(min_length=1)
    reason: str = "affinity"


@register
class SessionRerouted(Event):
    CONTEXT = Context.CALLS
    KEY = "session_id"
    session_id: str = Field(min_length=1)
    from_cell: str = Field(min_length=1)
    to_cell: str = Field(min_length=1)
    reason: str = Field(min_length=1)
    kv: Literal["migrated", "reprefilled"]
    migrated_tokens: int = Field(default=0, ge=0)
