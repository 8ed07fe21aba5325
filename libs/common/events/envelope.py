"""The event envelope: every fact Gyre records is one frozen, typed, versioned event.

Wire form (JSON, flat): the envelope fields, the payload fields, plus ``type`` and
``schema_version``::

    {"type": "RolloutStarted", "schema_version": 1, "event_id": "9f0c...",
     "run_id": "demo", "time": "2026-11-29T12:00:00Z", "causation_id": null,
     "correlation_id": null, "rollout_id": "r-1", "task_id": "t-3", ...}

``event_id`` doubles as the JetStream ``Nats-Msg-Id``, so a re-publish of the same event
inside the stream's duplicate window is dropped by the server.
"""

from __future__ import annotations

import enum
import hashlib
import re
import uuid
from datetime import UTC, datetime
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints
from pydantic_core import PydanticSerializationError

# Ids that end up as NATS subject tokens: no dots, wildcards or whitespace.
_TOKEN_RE = r"^[A-Za-z0-9_\-:]{1,128}$"
RunId = Annotated[str, StringConstraints(pattern=_TOKEN_RE)]
Digest = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
_UNSAFE = re.compile(r"[^A-Za-z0-9_\-:]")


class Context(str, enum.Enum):
    """Bounded contexts; one JetStream stream each."""

    RUNS = "runs"
    CALLS = "calls"
    ROLLOUTS = "rollouts"
    TREES = "trees"
    SCORES = "scores"
    CELLS = "cells"
    TRAINING = "training"

    @property
    def stream(self) -> str:
        return f"GYRE_{self.value.upper()}"

    @property
    def subjects(self) -> str:
        return f"gyre.*.{self.value}.>"


def new_event_id() -> str:
    return uuid.uuid4().hex


def utcnow() -> datetime:
    return datetime.now(UTC)


def subject_token(value: str) -> str:
    """Make any id safe to stand as one NATS subject token. A safe id stands as itself; any
    other gets its unsafe characters replaced and a digest of the whole id appended, so two
    ids never share a token ("a.b" and "a_b" did: readers that take the last event on a
    rollout's subject, or publish expecting it empty, took one rollout's events for the
    other's and one rollout went unscored)."""
    if value and not _UNSAFE.search(value):
        return value
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{_UNSAFE.sub('_', value)}-x{digest}"


class Event(BaseModel):
    """Base of every event. Subclasses add the payload fields and set the class vars."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    TYPE: ClassVar[str] = ""
    CONTEXT: ClassVar[Context]
    SCHEMA_VERSION: ClassVar[int] = 1
    # Payload field whose value becomes the last subject token (e.g. the rollout id),
    # so consumers can filter one entity's events by subject.
    KEY: ClassVar[str | None] = None

    event_id: str = Field(default_factory=new_event_id, min_length=1, max_length=128)
    run_id: RunId
    time: datetime = Field(default_factory=utcnow)
    causation_id: str | None = None
    correlation_id: str | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.__dict__.get("TYPE"):
            cls.TYPE = cls.__name__

    @property
    def subject(self) -> str:
        base = f"gyre.{self.run_id}.{self.CONTEXT.value}.{self.TYPE}"
        if self.KEY is None:
            return base
        return f"{base}.{subject_token(str(getattr(self, self.KEY)))}"

    def caused(self, **fields: Any) -> dict[str, Any]:
        """Envelope fields for an event caused by this one (same run and correlation)."""
        return {
            "run_id": self.run_id,
            "causation_id": self.event_id,
            "correlation_id": self.correlation_id or self.event_id,
            **fields,
        }

    def to_json(self) -> bytes:
        """The wire form. Text that UTF-8 cannot carry (lone surrogates: a non-UTF-8 file
        name decoded with ``surrogateescape``, a ``"\\udcff"`` escape in a client's JSON)
        is written escaped (``\\xff``, ``\\ud800``) rather than failing the publish, which
        would lose the event."""
        try:
            body = self.model_dump_json()
        except PydanticSerializationError:
            body = type(self).model_validate(_encodable(self.model_dump(mode="json"))).model_dump_json()
        return (f'{{"type":"{self.TYPE}","schema_version":{self.SCHEMA_VERSION},' + body[1:]).encode()

    def payload(self) -> dict[str, Any]:
        """Payload fields only (no envelope), JSON-compatible."""
        data = self.model_dump(mode="json")
        for k in ("event_id", "run_id", "time", "causation_id", "correlation_id"):
            data.pop(k, None)
        return data


def encodable_text(text: str) -> str:
    """``text`` as UTF-8 can carry it: a surrogate-escaped byte becomes ``\\xNN``, any
    other lone surrogate ``\\uDxxx``; text that encodes is returned as it is."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _encodable(value: Any) -> Any:
    if isinstance(value, str):
        return encodable_text(value)
    if isinstance(value, dict):
        return {_encodable(k): _encodable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_encodable(v) for v in value]
    return value
