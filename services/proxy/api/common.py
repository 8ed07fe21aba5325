"""What the three APIs share: the normalised request, generation events, errors, and the
mapping from API sampling fields to SGLang's ``sampling_params``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from services.engine.params import DEFAULT_TEMPERATURE

from ..core.messages import Msg, ToolCall, ToolSpec
from ..core.toolparse import CALL_CLOSE

MAX_STOP_SEQUENCES = 16
NO_TOP_K = -1  # SGLang's "no top-k limit"
# what a top_k 1 call is sent: its logprobs are then log_softmax(logits) in any batch
# (see ChatRequest.sampling_params), and logprob_temperature(1.0) records just that
GREEDY_PICK_TEMPERATURE = 1.0


MIN_TOP_P = 1e-9  # what a caller's top_p 0 is sent as: the nucleus holds only the likeliest token

class ApiError(Exception):
    """An error the caller sees, rendered in its own API's error shape.

    ``kind`` is one of: invalid_request, authentication, permission, not_found,
    too_large, rate_limit, overloaded, upstream, internal.
    """

    def __init__(self, status: int, kind: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.param = status, kind, message, param


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, "invalid_request", message, param)


@dataclass
class ChatRequest:
    api: str  # openai_chat | openai_responses | anthropic_messages
    model: str
    messages: list[Msg]
    tools: list[ToolSpec] = field(default_factory=list)
    tool_choice: str = "auto"  # auto | none (see ``tool_choice_mode``)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False  # OpenAI chat: return each output token's logprob
    top_logprobs: int = 0  # OpenAI chat: and this many likeliest alternatives at each position
    # False (OpenAI ``parallel_tool_calls: false``, Anthropic ``disable_parallel_tool_use``):
    # at most one tool call, honoured by ending the generation where the first call closes
    parallel_tool_calls: bool = True
    prefill: str = ""  # Anthropic: a last assistant message's text, which the reply continues
    extra: dict[str, Any] = field(default_factory=dict)

    def sampling_params(self, default_max_tokens: int, stop_token_ids: list[int]) -> dict[str, Any]:
        """SGLang's ``sampling_params`` for the call. The temperature is always sent (the
        engines' default, 1.0, when the caller named none): the behaviour logprobs are
        tempered by it and the record must say by what, whatever defaults a cell was
        started with (SGLang's ``--preferred-sampling-params``).

        A ``top_k`` 1 call is sent temperature 1.0, whatever it asked for: its pick is the
        argmax at any temperature, but SGLang tempers its logprobs only when its batch also
        holds a request that samples (a batch of greedy requests, all ``top_k`` <= 1, gets
        ``log_softmax(logits)``), so at any other temperature they would depend on what it
        was batched with. ``top_k`` is always sent too, for the same reason as the
        temperature (a cell's default ``top_k`` 1 would make a call greedy unseen): the
        caller's when 1 or more, else -1, no limit (Anthropic's ``top_k`` 0, which SGLang
        refuses, asks for no limit too)."""
        if self.top_k == 1:
            temperature = GREEDY_PICK_TEMPERATURE
        else:
            temperature = DEFAULT_TEMPERATURE if self.temperature is None else self.temperature
        sp: dict[str, Any] = {"max_new_tokens": self.max_tokens or default_max_tokens,
                              "stop_token_ids": list(stop_token_ids), "skip_special_tokens": False,
                              "no_stop_trim": True, "temperature": temperature,
                              "top_k": self.top_k if self.top_k is not None and self.top_k >= 1 else NO_TOP_K}
        if self.top_p is not None:  # the APIs allow 0 (the likeliest token only); SGLang wants > 0
            sp["top_p"] = max(self.top_p, MIN_TOP_P)
        if self.stop or self.single_call_stop:
            sp["stop"] = list(self.stop) + ([CALL_CLOSE] if self.single_call_stop else [])
        if self.seed is not None:  # OpenAI's seed is any int64; SGLang's sampling_seed is not negative
            sp["sampling_seed"] = self.seed % 2**63
        return sp

    @property
    def single_call_stop(self) -> bool:
        """The generation ends where the first tool call closes (no parallel calls): the
        model's own call markup, matched by the cell as a stop string (kept in the output,
        ``no_stop_trim``), so the reply holds that one call and the record every token. A
        stop there that closes no call (written inside the thinking) is not an end: the
        generation goes on from it (``generation.generate``'s ``resume``)."""
        return not self.parallel_tool_calls and bool(self.tools) and self.tool_choice != "none" \
            and CALL_CLOSE not in self.stop


# -- generation events, API-neutral -----------------------------------------------------


@dataclass(frozen=True)
class Accepted:
    """The call passed every check that answers with an HTTP error (validated, rendered,
    tokenised, within the context, a cell chosen): a stream may start now. Always the
    first event of ``ProxyService.serve``."""

    call_id: str


@dataclass
class StreamState:
    """What the HTTP layer tells a streamed call: ``opened`` once the stream's headers and
    opening events are out (after ``Accepted`` and its grace). Before, a failure is still an
    HTTP error the caller's SDK retries; after, while no content has gone out, the call
    waits for a cell instead (``ProxyConfig.cell_wait_s``)."""

    opened: bool = False


@dataclass(frozen=True)
class Keepalive:
    """Not a generation event: the HTTP layer puts one in a stream's events whenever
    nothing went out for ``keepalive_s``; each API's ``stream`` answers it with its own
    keepalive (Anthropic ``ping``, Responses ``response.in_progress``, an SSE comment)."""


@dataclass(frozen=True)
class TokenLogprobs:
    """Output tokens' logprobs in OpenAI's shape (only when the caller asked for them)."""

    entries: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ThinkingDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDone:
    call: ToolCall
    index: int


@dataclass(frozen=True)
class Finished:
    reason: str  # stop | length | tool_calls | stop_sequence | abort
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    content: str
    tool_calls: tuple[ToolCall, ...]
    reasoning: str | None
    call_id: str
    stop_sequence: str | None = None
    drift: str = ""  # the call's TITO drift class
    logprobs: tuple[dict[str, Any], ...] | None = None  # every output token's, when asked for


GenEvent = Accepted | TextDelta | ThinkingDelta | ToolCallDone | TokenLogprobs | Finished | Keepalive


# -- validation helpers -----------------------------------------------------------------


def expect(obj: Any, kind: type | tuple[type, ...], param: str) -> Any:
    if not isinstance(obj, kind) or (kind is int and isinstance(obj, bool)):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise bad_request(f"'{param}' must be {_article(names)}, got {type(obj).__name__}", param)
    return obj


def _article(name: str) -> str:
    words = {"dict": "an object", "list": "an array", "str": "a string", "int": "an integer",
             "float": "a number", "bool": "a boolean"}
    return " or ".join(words.get(n, n) for n in name.split(" or "))


def opt_number(body: dict[str, Any], key: str, lo: float, hi: float) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad_request(f"'{key}' must be a number", key)
    if not lo <= v <= hi:
        raise bad_request(f"'{key}' must be between {lo} and {hi}, got {v}", key)
    return float(v)


def opt_int(body: dict[str, Any], key: str, lo: int, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"'{key}' must be an integer", key)
    if not lo <= v <= hi:
        raise bad_request(f"'{key}' must be between {lo} and {hi}, got {v}", key)
    return v


def opt_bool(body: dict[str, Any], key: str) -> bool:
    """A boolean field (absent or null: false); any other JSON type is a 400."""
    v = body.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad_request(f"'{key}' must be a boolean, got {type(v).__name__}", key)
    return v


def tool_choice_mode(v: Any, param: str = "tool_choice") -> str:
    """``auto`` or ``none`` from a request's ``tool_choice`` (absent: auto). ``none``: the
    reply's tool-call markup stays text (the prompt, and so prefix reuse, is unchanged).
    Forcing a tool (``required``, Anthropic's ``any``, a named tool, OpenAI's
    ``allowed_tools``) would need constrained decoding, which the cells do not do for the
    proxy: a 400 rather than an answer that ignores it."""
    kind = v.get("type") if isinstance(v, dict) else v
    if v is None or kind == "auto":
        return "auto"
    if kind == "none":
        return "none"
    if not isinstance(kind, str):
        raise bad_request(f"'{param}' must be a string or an object with a 'type'", param)
    raise bad_request(f"'{param}' {kind!r} is not supported by this proxy: only 'auto' and 'none' "
                      "(the policy cannot be forced to call a tool)", param)


def refuse(param: str, why: str) -> ApiError:
    """A field this proxy cannot honour, named, in a 400 (rather than an answer that
    silently ignores it)."""
    return bad_request(f"'{param}'{' ' + why if why else ''} is not supported by this proxy", param)


def opt_parallel(v: Any, param: str = "parallel_tool_calls") -> bool:
    """OpenAI's ``parallel_tool_calls`` (absent or null: true)."""
    if v is None:
        return True
    if not isinstance(v, bool):
        raise bad_request(f"'{param}' must be a boolean, got {type(v).__name__}", param)
    return v


def refuse_structured_output(fmt: Any, param: str, plain: tuple[str, ...] = ("text",)) -> None:
    """A structured-output request (JSON mode, a JSON schema) needs constrained decoding,
    which the cells do not do for the proxy: a 400, not free text where JSON was promised.
    Absent, null, or the plain-text format is accepted."""
    if fmt is None:
        return
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if not isinstance(kind, str):
        raise bad_request(f"'{param}' must be an object with a 'type'", param)
    if kind not in plain:
        allowed = f"; only {' or '.join(repr(p) for p in plain)}" if plain else ""
        raise refuse(param, f"type {kind!r} (structured output needs constrained decoding{allowed})")


def stop_list(v: Any, param: str) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise bad_request(f"'{param}' must be a string or an array of non-empty strings", param)
    if len(v) > MAX_STOP_SEQUENCES:
        raise bad_request(f"'{param}' has more than {MAX_STOP_SEQUENCES} entries", param)
    return list(v)


def tool_spec(name: Any, description: Any, parameters: Any, param: str) -> ToolSpec:
    if not isinstance(name, str) or not name or len(name) > 128:
        raise bad_request(f"'{param}.name' must be a non-empty string of at most 128 characters", param)
    if description is not None and not isinstance(description, str):
        raise bad_request(f"'{param}.description' must be a string", param)
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise bad_request(f"'{param}' schema must be a JSON object", param)
    if parameters.get("type", "object") != "object":
        raise bad_request(f"'{param}' schema must have type 'object'", param)
    return ToolSpec(name, description or "", parameters)


def text_of(content: Any, param: str, allowed: tuple[str, ...] = ("text", "input_text", "output_text")) -> str:
    """Plain text from a string or an array of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"'{param}' must be a string or an array of content parts", param)
    parts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in allowed:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"'{param}[{i}]': content part type {kind!r} is not supported (text only)", param)
        t = part.get("text")
        if not isinstance(t, str):
            raise bad_request(f"'{param}[{i}].text' must be a string", param)
        parts.append(t)
    return "".join(parts)


def parse_arguments(raw: Any, param: str) -> dict[str, Any] | str:
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw) if raw.strip() else {}
        except (ValueError, RecursionError):
            return raw
        return parsed if isinstance(parsed, dict) else raw
    raise bad_request(f"'{param}' must be a JSON string or object", param)
