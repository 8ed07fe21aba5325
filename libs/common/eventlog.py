"""Export the event log to JSON Lines and load it back, for replay and debugging.

One line per stored message, in stream order::

    {"stream": "GYRE_ROLLOUTS", "seq": 7, "subject": "gyre.demo.rollouts.RolloutStarted.r-1",
     "time": "2026-11-29T12:00:00.123456+00:00", "event": {"type": "RolloutStarted", ...}}

A message that is not JSON is kept byte-exact as ``"data_b64"`` so that replay can
dead-letter it just as the live consumer did.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from sqlalchemy import Engine, MetaData, select

from .bus.memory import InMemoryBus
from .events import Context


def line_for(stream: str, seq: int, subject: str, time: datetime, data: bytes) -> str:
    rec: dict[str, Any] = {"stream": stream, "seq": seq, "subject": subject, "time": time.isoformat()}
    try:
        obj = json.loads(data)
        if not isinstance(obj, dict):
            raise ValueError
        rec["event"] = obj
    except (ValueError, UnicodeDecodeError):
        rec["data_b64"] = base64.b64encode(data).decode()
    return json.dumps(rec, separators=(",", ":"), ensure_ascii=False)


async def export_stream(bus: Any, context: Context, out: IO[str], *, run_id: str | None = None,
                        start_seq: int = 1, start_time: datetime | None = None) -> int:
    """Write one stream's messages (optionally one run's) to ``out``; returns the count."""
    subject = f"gyre.{run_id}.{context.value}.>" if run_id else context.subjects
    n = 0
    async for msg in bus.read_raw(context.stream, start_seq=start_seq, start_time=start_time, filter_subject=subject):
        meta = msg.metadata
        ts = meta.timestamp or datetime.now(UTC)
        out.write(line_for(context.stream, meta.sequence.stream, msg.subject, ts, msg.data) + "\n")
        n += 1
    return n


def iter_lines(path: Path) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                rec["stream"], rec["seq"], rec["subject"]  # noqa: B018  (presence check)
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not an exported event line ({exc})") from exc
            yield rec


def record_bytes(rec: dict[str, Any]) -> bytes:
    if "event" in rec:
        return json.dumps(rec["event"], separators=(",", ":"), ensure_ascii=False).encode()
    return base64.b64decode(rec["data_b64"])


def load_memory_bus(paths: Iterable[Path]) -> InMemoryBus:
    """An in-memory bus holding the exported messages at their original sequences."""
    records = [rec for p in paths for rec in iter_lines(Path(p))]
    records.sort(key=lambda r: (r["stream"], r["seq"]))
    bus = InMemoryBus()
    for rec in records:
        bus.load(rec["stream"], int(rec["seq"]), rec["subject"], record_bytes(rec),
                 datetime.fromisoformat(rec.get("time") or datetime.now(UTC).isoformat()))
    return bus


# Columns that record when a projection ran, not what the log says; left out of digests.
_VOLATILE = {("projection_offsets", "updated_at")}


def readmodel_digest(engine: Engine, *, exclude_tables: Iterable[str] = ("alembic_version",)) -> dict[str, str]:
    """sha256 per table over its rows in primary-key order (and ``"*"`` over all)."""
    md = MetaData()
    md.reflect(bind=engine)
    out: dict[str, str] = {}
    total = hashlib.sha256()
    with engine.connect() as conn:
        for name in sorted(md.tables):
            if name in set(exclude_tables):
                continue
            table = md.tables[name]
            cols = [c for c in table.columns if (name, c.name) not in _VOLATILE]
            order = list(table.primary_key.columns) or cols
            h = hashlib.sha256()
            for row in conn.execute(select(*cols).order_by(*order)):
                h.update(json.dumps([_norm(v) for v in row], default=str).encode())
            out[name] = h.hexdigest()
            total.update(f"{name}:{out[name]}".encode())
    out["*"] = total.hexdigest()
    return out


def _norm(v: Any) -> Any:
    if isinstance(v, datetime):  # SQLite drops tzinfo; compare as UTC wall time
        return (v.astimezone(UTC) if v.tzinfo else v.replace(tzinfo=UTC)).isoformat()
    if isinstance(v, str):
        try:
            return json.loads(v) if v[:1] in "{[" else v
        except ValueError:
            return v
    return v
