"""Sampling parameters and `/generate` requests, validated with SGLang's field names (pure).

SGLang answers 400 to an unknown key inside ``sampling_params`` and accepts unknown
top-level keys; both rules are kept here. Fields SGLang knows but this engine does not
implement (penalties, regex/json constraints, ``n`` > 1) are accepted only at their
neutral values, so a client never silently gets a different sampler than it asked for.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, ValidationError, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError


class InvalidRequest(ValueError):
    """A request the engine answers with HTTP 400."""


# Below this temperature a request samples greedily (as SGLang does: it turns
# ``0 <= temperature < 1e-6`` into temperature 1, top_k 1). Dividing logits by a smaller
# one overflows.
GREEDY_TEMPERATURE_EPS = 1e-6
DEFAULT_TEMPERATURE = 1.0  # a request that names none (the embedded engine's and SGLang's default)
SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes seeds in [0, 2**64)


def logprob_temperature(temperature: float | None) -> float:
    """The temperature a sampled token's logprob is taken under: its logits are divided by
    it before the softmax. The one rule the engine's sampler, the proxy's record
    (``CallRecorded.logprob_temperature``) and so the trainer share.

    SGLang returns logprobs of ``log_softmax(logits / temperature)`` and turns a
    temperature below ``GREEDY_TEMPERATURE_EPS`` into temperature 1 (top_k 1), so: below
    it 1.0, else the temperature itself. None (not sent): the default, 1.0.

    A ``top_k`` 1 request at another temperature has no single answer in SGLang: its pick
    is the argmax, but its logprobs are tempered only when its batch also holds a request
    that samples (a batch of greedy requests, all ``top_k`` <= 1, gets
    ``log_softmax(logits)``). So the proxy sends every ``top_k`` 1 call temperature 1.0
    (``ChatRequest.sampling_params``), where both cases agree and this rule gives 1.0. The
    embedded engine's sampler tempers such a request's logprobs by its temperature (as
    SGLang does in a mixed batch).
    """
    if temperature is None:
        return DEFAULT_TEMPERATURE
    return 1.0 if temperature < GREEDY_TEMPERATURE_EPS else float(temperature)


def _no_bool_or_str(kind: str):
    """A before-check for a number field: JSON ``true`` and ``"7"`` are refused (pydantic's
    lax mode would make them 1 and 7). Numbers go on to the usual check: ints stay ints (an
    integral float such as 1.0 is still taken, as before), a float field takes ints too."""
    error, text = ("int_type", "Input should be a valid integer") if kind == "int" else \
        ("float_type", "Input should be a valid number")

    def check(value: Any) -> Any:
        if isinstance(value, (bool, str, bytes)):
            raise PydanticCustomError(error, text + ", got {got}", {"got": type(value).__name__})
        return value

    return BeforeValidator(check)


# Number fields of a request: no booleans or strings standing in for numbers. Booleans are
# strict too (only JSON true/false).
Int = Annotated[int, _no_bool_or_str("int")]
Float = Annotated[float, _no_bool_or_str("float")]
Bool = StrictBool


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_new_tokens: Int = Field(default=128, ge=0)
    min_new_tokens: Int = Field(default=0, ge=0)
    # bounded by float32's range: logits / a larger one are NaN, and a NaN row samples padding or banned ids
    temperature: Float = Field(default=DEFAULT_TEMPERATURE, ge=0.0, le=3.0e38, allow_inf_nan=False)
    top_p: Float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: Int = -1  # -1 (or 0): no top-k cut
    min_p: Float = Field(default=0.0, ge=0.0, le=1.0)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[Int] = Field(default_factory=list)
    ignore_eos: Bool = False
    skip_special_tokens: Bool = True
    spaces_between_special_tokens: Bool = True
    no_stop_trim: Bool = False
    sampling_seed: Int | None = None
    n: Int = 1
    frequency_penalty: Float = 0.0
    presence_penalty: Float = 0.0
    repetition_penalty: Float = 1.0
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    custom_params: dict[str, Any] | None = None
    stream_interval: Int | None = None
    logit_bias: dict[str, Float] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        if value is None:
            return []
        return [value] if isinstance(value, str) else value

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _ids_as_list(cls, value: Any) -> Any:
        return [] if value is None else value

    @field_validator("sampling_seed")
    @classmethod
    def _seed(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value < SEED_LIMIT:
            raise ValueError("sampling_seed must be in [0, 2**64)")
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        if value < -1:
            raise ValueError("top_k must be -1 (off) or a positive number")
        return -1 if value == 0 else value

    @model_validator(mode="after")
    def _supported(self) -> "SamplingParams":
        unsupported = {
            "n": self.n != 1,
            "frequency_penalty": self.frequency_penalty != 0.0,
            "presence_penalty": self.presence_penalty != 0.0,
            "repetition_penalty": self.repetition_penalty != 1.0,
            "json_schema": self.json_schema is not None,
            "regex": self.regex is not None,
            "ebnf": self.ebnf is not None,
            "structural_tag": self.structural_tag is not None,
            "logit_bias": bool(self.logit_bias),
        }
        bad = [name for name, used in unsupported.items() if used]
        if bad:
            raise ValueError(f"not supported by the embedded engine: {', '.join(bad)}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    @property
    def logprob_temperature(self) -> float:
        """See :func:`logprob_temperature`: the request's own temperature, for a ``top_k`` 1 pick too."""
        return logprob_temperature(self.temperature)


def parse_sampling_params(raw: Any) -> SamplingParams:
    if raw is None:
        return SamplingParams()
    if not isinstance(raw, dict):
        raise InvalidRequest("sampling_params must be an object")
    try:
        return SamplingParams.model_validate(raw)
    except ValidationError as exc:
        raise InvalidRequest(_describe(exc)) from None


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "sampling_params"
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown field {where}")
        else:
            parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def parse_generate_request(body: Any) -> "GenerateRequest":
    """A `/generate` body, or :class:`InvalidRequest` naming each bad field."""
    try:
        return GenerateRequest.model_validate(body)
    except ValidationError as exc:
        raise InvalidRequest(_describe_union(exc)) from None


def _describe_union(exc: ValidationError) -> str:
    """One part per bad top-level field. A field that takes one value or a list (or a list
    of lists) fails once per union member; the member that got furthest is the one meant."""
    by_field: dict[str, list[dict]] = {}
    for err in exc.errors():
        by_field.setdefault(str(err["loc"][0]) if err["loc"] else "body", []).append(err)

    def reach(err: dict) -> tuple[bool, int]:  # a value's own error over "not a list", then depth
        return err["type"] != "list_type", sum(isinstance(p, int) for p in err["loc"])

    parts = []
    for field, errs in by_field.items():
        best = max(errs, key=reach)  # max keeps the first of equals
        where = ".".join([field, *(str(p) for p in best["loc"][1:] if isinstance(p, int))])
        parts.append(f"{where}: {best['msg']}")
    return "; ".join(parts)


class GenerateRequest(BaseModel):
    """One `/generate` body; unknown top-level keys are ignored, as SGLang does."""

    model_config = ConfigDict(extra="ignore")

    input_ids: list[Int] | list[list[Int]] | None = None
    text: str | list[str] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: Bool | list[Bool] = False
    logprob_start_len: Int | list[Int] = -1
    top_logprobs_num: Int | list[Int] = 0
    stream: Bool = False
    rid: str | list[str] | None = None


def check_input_ids(ids: list[int], vocab_size: int, max_context: int) -> None:
    if not ids:
        raise InvalidRequest("input_ids is empty")
    bad = [t for t in ids if t < 0 or t >= vocab_size]
    if bad:
        raise InvalidRequest(f"input_ids out of vocabulary (size {vocab_size}): {bad[:5]}")
    if len(ids) >= max_context:
        raise InvalidRequest(f"The input ({len(ids)} tokens) is longer than the model's context length "
                             f"({max_context} tokens).")


def check_context_budget(n_input: int, max_new_tokens: int, max_context: int) -> None:
    """SGLang's rule and wording: input plus max_new_tokens must stay below the context
    length (a client that parses SGLang's 400 parses this one)."""
    total = n_input + max_new_tokens
    if total >= max_context:
        raise InvalidRequest(
            f"Requested token count exceeds the model's maximum context length of {max_context} tokens. "
            f"You requested a total of {total} tokens: {n_input} tokens from the input messages and "
            f"{max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input "
            f"messages or the completion to fit within the limit.")
