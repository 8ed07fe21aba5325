"""SQL read models: projections of the event log. The log is the truth; these tables can
always be dropped and rebuilt by ``gyre replay``."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, DateTime, Float, Integer, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class ProjectionOffset(Base):
    """Last stream sequence a projection applied, committed with the rows it wrote."""

    __tablename__ = "projection_offsets"
    projection: Mapped[str] = mapped_column(String(64), primary_key=True)
    stream: Mapped[str] = mapped_column(String(64), primary_key=True)
    last_seq: Mapped[int] = mapped_column(BigInteger, default=0)
    applied: Mapped[int] = mapped_column(BigInteger, default=0)
    updated_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class EventRow(Base):
    """Every event, as stored in its stream (the audit view of the log)."""

    __tablename__ = "events"
    stream: Mapped[str] = mapped_column(String(64), primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    event_id: Mapped[str] = mapped_column(String(128), unique=True)
    type: Mapped[str] = mapped_column(String(64), index=True)
    run_id: Mapped[str] = mapped_column(String(128), index=True)
    subject: Mapped[str] = mapped_column(String(512))
    time: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    causation_id: Mapped[str | None] = mapped_column(String(128))
    correlation_id: Mapped[str | None] = mapped_column(String(128))
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)


class EventCount(Base):
    """Events applied per run and type (a non-idempotent counter: proves exactly-once)."""

    __tablename__ = "event_counts"
    run_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    type: Mapped[str] = mapped_column(String(64), primary_key=True)
    count: Mapped[int] = mapped_column(BigInteger, default=0)


class RunRow(Base):
    __tablename__ = "runs"
    run_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    config: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    config_digest: Mapped[str | None] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(32), default="running")
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    steps_applied: Mapped[int] = mapped_column(Integer, default=0)


class RolloutRow(Base):
    __tablename__ = "rollouts"
    rollout_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    run_id: Mapped[str] = mapped_column(String(128), index=True)
    task_id: Mapped[str] = mapped_column(String(128))
    group_id: Mapped[str] = mapped_column(String(128), index=True)
    harness: Mapped[str] = mapped_column(String(64))
    step: Mapped[int] = mapped_column(Integer, default=0)
    weight_version: Mapped[int] = mapped_column(Integer, default=0)
    status: Mapped[str] = mapped_column(String(32), default="running")
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    wall_time_s: Mapped[float | None] = mapped_column(Float)
    exit_status: Mapped[int | None] = mapped_column(Integer)
    snapshot_digest: Mapped[str | None] = mapped_column(String(64))
    n_calls: Mapped[int] = mapped_column(Integer, default=0)
    n_output_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    score: Mapped[float | None] = mapped_column(Float)
    partial: Mapped[bool | None] = mapped_column(Boolean)
    scoring_error: Mapped[str | None] = mapped_column(String(2000))


class CallRow(Base):
    __tablename__ = "calls"
    call_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    run_id: Mapped[str] = mapped_column(String(128), index=True)
    rollout_id: Mapped[str] = mapped_column(String(128), index=True)
    session_id: Mapped[str] = mapped_column(String(128))
    api: Mapped[str] = mapped_column(String(32))
    parent_call_id: Mapped[str | None] = mapped_column(String(128))
    prefix_len: Mapped[int] = mapped_column(Integer, default=0)
    n_new_input_tokens: Mapped[int] = mapped_column(Integer, default=0)
    n_output_tokens: Mapped[int] = mapped_column(Integer, default=0)
    drift: Mapped[str] = mapped_column(String(16))
    finish_reason: Mapped[str | None] = mapped_column(String(32))
    cell: Mapped[str | None] = mapped_column(String(128))
    total_ms: Mapped[float] = mapped_column(Float, default=0.0)
    time: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class CellRow(Base):
    __tablename__ = "cells"
    run_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    cell: Mapped[str] = mapped_column(String(128), primary_key=True)
    role: Mapped[str] = mapped_column(String(16))
    state: Mapped[str] = mapped_column(String(32), default="ready")
    is_core: Mapped[bool] = mapped_column(Boolean, default=False)
    capacity: Mapped[int] = mapped_column(Integer, default=1)
    weight_version: Mapped[int] = mapped_column(Integer, default=0)
    switches: Mapped[int] = mapped_column(Integer, default=0)
    updated_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class StepRow(Base):
    __tablename__ = "steps"
    run_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    weight_version: Mapped[int] = mapped_column(Integer)
    micro_steps_used: Mapped[int] = mapped_column(Integer, default=0)
    micro_steps_dropped: Mapped[int] = mapped_column(Integer, default=0)
    loss: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    applied_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
