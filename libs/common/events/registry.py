"""Event type registry, decoding and upcasters (old schema versions -> current)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from .envelope import Context, Event

Upcaster = Callable[[dict[str, Any]], dict[str, Any]]

_TYPES: dict[str, type[Event]] = {}
# (type name, from version) -> function producing the payload at from version + 1
_UPCASTERS: dict[tuple[str, int], Upcaster] = {}


class EventDecodeError(ValueError):
    """Raised for bytes that are not a valid event of a known type and version."""


def register(cls: type[Event]) -> type[Event]:
    if cls.TYPE in _TYPES and _TYPES[cls.TYPE] is not cls:
        raise ValueError(f"event type {cls.TYPE!r} registered twice")
    _TYPES[cls.TYPE] = cls
    _PREFIXES[_fast_prefix(cls)] = cls
    return cls


def upcaster(type_name: str, from_version: int) -> Callable[[Upcaster], Upcaster]:
    """Register a function that lifts a payload of ``type_name`` from ``from_version``."""

    def deco(fn: Upcaster) -> Upcaster:
        _UPCASTERS[(type_name, from_version)] = fn
        return fn

    return deco


def event_types() -> dict[str, type[Event]]:
    return dict(_TYPES)


def types_in(context: Context) -> list[type[Event]]:
    return [c for c in _TYPES.values() if c.CONTEXT is context]


def decode_dict(data: dict[str, Any]) -> Event:
    data = dict(data)
    type_name = data.pop("type", None)
    version = data.pop("schema_version", None)
    cls = _TYPES.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise EventDecodeError(f"unknown event type {type_name!r}")
    if not isinstance(version, int) or version < 1:
        raise EventDecodeError(f"{type_name}: bad schema_version {version!r}")
    if version > cls.SCHEMA_VERSION:
        raise EventDecodeError(
            f"{type_name}: schema_version {version} is newer than this Gyre knows ({cls.SCHEMA_VERSION})"
        )
    while version < cls.SCHEMA_VERSION:
        step = _UPCASTERS.get((type_name, version))
        if step is None:
            raise EventDecodeError(f"{type_name}: no upcaster from schema_version {version}")
        data = step(data)
        version += 1
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise EventDecodeError(f"{type_name}: {exc.error_count()} invalid field(s): {_brief(exc)}") from exc


_PREFIXES: dict[bytes, type[Event]] = {}


def _fast_prefix(cls: type[Event]) -> bytes:
    return f'{{"type":"{cls.TYPE}","schema_version":{cls.SCHEMA_VERSION},'.encode()


def decode(raw: bytes | str) -> Event:
    if isinstance(raw, str):
        raw = raw.encode()
    # Fast path: exactly what Event.to_json writes for the current schema version.
    end = raw.find(b",", raw.find(b'"schema_version"')) + 1
    cls = _PREFIXES.get(raw[:end]) if end > 0 else None
    if cls is not None:
        try:
            return cls.model_validate_json(b"{" + raw[end:])
        except ValidationError:
            pass  # the slow path gives the readable error
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise EventDecodeError(f"not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise EventDecodeError("event JSON must be an object")
    return decode_dict(data)


def _brief(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err["loc"]) or "<root>"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)
