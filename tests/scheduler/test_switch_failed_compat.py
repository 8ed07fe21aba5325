"""``SwitchFailed.declared_by_scheduler`` on the wire: written only when set, so a reader
from before the field (which forbids unknown fields) still reads every ``SwitchFailed`` an
agent writes, and events written before it read with the field False."""

from __future__ import annotations

import json

from pydantic import Field

from libs.common.events import SwitchFailed, decode
from libs.common.events.envelope import Context, Event


class _SwitchFailedBefore(Event):
    """The class as it was before the field (schema version 1 too)."""

    CONTEXT = Context.CELLS
    KEY = "cell"
    TYPE = "SwitchFailed"
    cell: str = Field(min_length=1)
    role: str
    phase: str = Field(min_length=1)
    reason: str = Field(min_length=1)


def _read_as_before(raw: bytes) -> _SwitchFailedBefore:
    data = json.loads(raw)
    assert data.pop("type") == "SwitchFailed" and data.pop("schema_version") == 1
    return _SwitchFailedBefore.model_validate(data)


def test_an_agents_switch_failed_reads_with_the_class_before_the_field() -> None:
    ev = SwitchFailed(run_id="r", cell="c1", role="inference", phase="draining", reason="x", causation_id="q")
    raw = ev.to_json()
    assert b"declared_by_scheduler" not in raw and SwitchFailed.SCHEMA_VERSION == 1
    old = _read_as_before(raw)
    assert (old.event_id, old.cell, old.phase, old.causation_id) == (ev.event_id, "c1", "draining", "q")
    assert "declared_by_scheduler" not in ev.payload()
    assert decode(raw) == ev  # and the new code reads it back unchanged


def test_a_declaration_carries_the_field() -> None:
    ev = SwitchFailed(run_id="r", cell="c1", role="inference", phase="draining", reason="x",
                      declared_by_scheduler=True)
    raw = ev.to_json()
    assert json.loads(raw)["declared_by_scheduler"] is True
    assert decode(raw).declared_by_scheduler and decode(raw) == ev


def test_an_event_written_before_the_field_reads_as_not_declared() -> None:
    old = _SwitchFailedBefore(run_id="r", cell="c1", role="inference", phase="migrating", reason="x")
    ev = decode(old.to_json())
    assert isinstance(ev, SwitchFailed) and not ev.declared_by_scheduler and ev.event_id == old.event_id
    # as an older SwitchFailed wrote it, the field present and False, reads too
    body = json.loads(old.to_json())
    body["declared_by_scheduler"] = False
    assert not decode(json.dumps(body)).declared_by_scheduler
