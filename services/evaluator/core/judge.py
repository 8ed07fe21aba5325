"""The LLM judge, pure parts: the prompt it gets and reading a 0-1 score from its answer.

Judges answer in many shapes (JSON, "Score: 0.7", "7/10", "85%", prose around any of
these). Reading is tolerant of the shape and strict about the value: a number outside
0-1 without an explicit scale, NaN, or no number at all is an error, never a guess.
"""

from __future__ import annotations

import json
import math
import re

from .spec import TaskEvaluatorSpec

SYSTEM_PROMPT = (
    "You grade the work of a coding agent against a rubric. Answer with one JSON object "
    'and nothing else: {"score": <number from 0 to 1>, "reason": "<one sentence>"}.'
)


class JudgeReplyError(ValueError):
    """The judge's answer holds no usable 0-1 score."""


_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_SCORE_RE = re.compile(rf"score\"?\s*(?:is|[:=])?\s*\"?({_NUM})\s*(%|/\s*({_NUM}))?", re.IGNORECASE)
_BARE_RE = re.compile(rf"^\s*({_NUM})\s*(%|/\s*({_NUM}))?\s*\.?\s*$")
_FENCE_RE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)


def build_messages(spec: TaskEvaluatorSpec, workspace_view: str, tests_summary: str | None) -> list[dict[str, str]]:
    parts = [f"Rubric:\n{spec.rubric}"]
    if spec.prompt:
        parts.append(f"Task given to the agent:\n{spec.prompt}")
    if tests_summary:
        parts.append(f"Hidden test results:\n{tests_summary}")
    parts.append(f"The agent's workspace (truncated):\n{workspace_view}")
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "\n\n".join(parts)}]


def parse_judge_score(text: str) -> float:
    if not isinstance(text, str) or not text.strip():
        raise JudgeReplyError("empty answer")
    candidates = [m.group(1) for m in _FENCE_RE.finditer(text)] + [text]
    for chunk in candidates:
        value = _from_json(chunk)
        if value is not None:
            return _check(value)
    matches = list(_SCORE_RE.finditer(text))
    if matches:  # the last one: judges reason first and conclude last
        m = matches[-1]
        return _check(_scaled(m.group(1), m.group(2), m.group(3)))
    m = _BARE_RE.match(text)
    if m:
        return _check(_scaled(m.group(1), m.group(2), m.group(3)))
    raise JudgeReplyError(f"no score in answer: {text.strip()[:120]!r}")


def _from_json(chunk: str) -> float | None:
    start = chunk.find("{")
    while start != -1:
        end = chunk.rfind("}")
        while end > start:
            try:
                obj = json.loads(chunk[start : end + 1])
            except ValueError:
                end = chunk.rfind("}", start, end)
                continue
            if isinstance(obj, dict):
                for key, val in obj.items():
                    if str(key).lower() == "score":
                        return _as_number(val)
            break
        start = chunk.find("{", start + 1)
    return None


def _as_number(val: object) -> float:
    if isinstance(val, bool):
        raise JudgeReplyError(f"score is not a number: {val!r}")
    if isinstance(val, (int, float)):
        return float(val)
    if isinstance(val, str):
        m = _BARE_RE.match(val)
        if m:
            return _scaled(m.group(1), m.group(2), m.group(3))
    raise JudgeReplyError(f"score is not a number: {val!r}")


def _scaled(num: str, suffix: str | None, denom: str | None) -> float:
    value = float(num)
    if suffix == "%":
        return value / 100.0
    if denom is not None:
        d = float(denom)
        if d <= 0:
            raise JudgeReplyError(f"bad scale /{denom}")
        return value / d
    return value


def _check(value: float) -> float:
    if math.isnan(value) or math.isinf(value):
        raise JudgeReplyError("score is not finite")
    if not 0.0 <= value <= 1.0:
        raise JudgeReplyError(f"score {value:g} is outside 0-1")
    return value
