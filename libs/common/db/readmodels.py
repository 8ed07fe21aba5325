"""The standard read models (see ``models.py``), as one projection named ``readmodels``.

Handlers only write rows; they never publish or call out. Rows are upserted by key so
that the projection stays correct even when events of one entity arrive out of their
causal order across streams (e.g. a score before the rollout's end). An event stored twice
(same id, same content: a publisher's retry past the bus's de-duplication window) is
applied once: ``already_applied`` finds its id in ``events`` and the runner skips the copy.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from ..bus.port import Delivery
from ..events import calls, cells, rollouts, runs, scores, training
from .models import CallRow, CellRow, EventCount, EventRow, RolloutRow, RunRow, StepRow
from .projection import Projection

readmodels = Projection("readmodels")


def _log_event(s: Session, d: Delivery) -> None:
    ev = d.event
    s.add(
        EventRow(
            stream=d.stream, seq=d.seq, event_id=ev.event_id, type=ev.TYPE, run_id=ev.run_id,
            subject=d.subject, time=ev.time, causation_id=ev.causation_id,
            correlation_id=ev.correlation_id, payload=ev.payload(),
        )
    )
    count = s.get(EventCount, (ev.run_id, ev.TYPE))
    if count is None:
        s.add(EventCount(run_id=ev.run_id, type=ev.TYPE, count=1))
    else:
        count.count += 1


readmodels.on_any = _log_event


def _already_logged(s: Session, ev: Any) -> bool:
    """The same event (id, type, run and payload) is in ``events`` already: a second
    stored copy. A different event under a taken id is not, and fails on insert."""
    row = s.execute(select(EventRow.type, EventRow.run_id, EventRow.payload)
                    .where(EventRow.event_id == ev.event_id)).first()
    return row is not None and (row.type, row.run_id, row.payload) == (ev.TYPE, ev.run_id, ev.payload())


readmodels.already_applied = _already_logged


def _rollout(s: Session, run_id: str, rollout_id: str, **defaults: Any) -> RolloutRow:
    row = s.get(RolloutRow, rollout_id)
    if row is None:
        row = RolloutRow(rollout_id=rollout_id, run_id=run_id, task_id=defaults.pop("task_id", "?"),
                         group_id=defaults.pop("group_id", "?"), harness=defaults.pop("harness", "?"),
                         n_calls=0, n_output_tokens=0, **defaults)
        s.add(row)
    return row


@readmodels.on(runs.RunStarted)
def _run_started(s: Session, d: Delivery) -> None:
    ev: runs.RunStarted = d.event  # type: ignore[assignment]
    row = s.get(RunRow, ev.run_id) or RunRow(run_id=ev.run_id, steps_applied=0)
    row.config, row.config_digest, row.started_at, row.status = ev.config, ev.config_digest, ev.time, "running"
    s.add(row)


@readmodels.on(runs.RunFinished)
def _run_finished(s: Session, d: Delivery) -> None:
    ev: runs.RunFinished = d.event  # type: ignore[assignment]
    row = s.get(RunRow, ev.run_id) or RunRow(run_id=ev.run_id)
    row.status, row.finished_at, row.steps_applied = ev.status, ev.time, ev.steps_applied
    s.add(row)


@readmodels.on(rollouts.RolloutStarted)
def _rollout_started(s: Session, d: Delivery) -> None:
    ev: rollouts.RolloutStarted = d.event  # type: ignore[assignment]
    row = _rollout(s, ev.run_id, ev.rollout_id)
    row.task_id, row.group_id, row.harness = ev.task_id, ev.group_id, ev.harness
    row.step, row.weight_version, row.started_at = ev.step, ev.weight_version, ev.time
    if row.status is None:
        row.status = "running"


@readmodels.on(rollouts.RolloutFinished, rollouts.RolloutTimedOut)
def _rollout_ended(s: Session, d: Delivery) -> None:
    ev: rollouts._RolloutEnded = d.event  # type: ignore[assignment]
    row = _rollout(s, ev.run_id, ev.rollout_id)
    row.status = "finished" if isinstance(ev, rollouts.RolloutFinished) else "timed_out"
    row.ended_at, row.wall_time_s = ev.time, ev.wall_time_s
    row.exit_status, row.snapshot_digest = ev.exit_status, ev.snapshot_digest


@readmodels.on(scores.RolloutScored)
def _scored(s: Session, d: Delivery) -> None:
    ev: scores.RolloutScored = d.event  # type: ignore[assignment]
    row = _rollout(s, ev.run_id, ev.rollout_id)
    row.score, row.partial, row.scoring_error = ev.score, ev.partial, None


@readmodels.on(scores.RolloutScoringFailed)
def _scoring_failed(s: Session, d: Delivery) -> None:
    ev: scores.RolloutScoringFailed = d.event  # type: ignore[assignment]
    row = _rollout(s, ev.run_id, ev.rollout_id)
    row.scoring_error = ev.reason[:2000]


@readmodels.on(calls.CallRecorded)
def _call(s: Session, d: Delivery) -> None:
    ev: calls.CallRecorded = d.event  # type: ignore[assignment]
    s.merge(
        CallRow(
            call_id=ev.call_id, run_id=ev.run_id, rollout_id=ev.rollout_id, session_id=ev.session_id,
            api=ev.api, parent_call_id=ev.parent_call_id, prefix_len=ev.prefix_len,
            n_new_input_tokens=ev.n_new_input_tokens, n_output_tokens=ev.n_output_tokens,
            drift=ev.drift.value, finish_reason=ev.finish_reason, cell=ev.cell,
            total_ms=ev.timings.total_ms, time=ev.time,
        )
    )
    row = _rollout(s, ev.run_id, ev.rollout_id)
    row.n_calls = (row.n_calls or 0) + 1
    row.n_output_tokens = (row.n_output_tokens or 0) + ev.n_output_tokens


def _cell(s: Session, run_id: str, cell: str) -> CellRow:
    row = s.get(CellRow, (run_id, cell))
    if row is None:
        row = CellRow(run_id=run_id, cell=cell, role="inference", state="ready", is_core=False,
                      capacity=1, weight_version=0, switches=0)
        s.add(row)
    return row


@readmodels.on(cells.CellRegistered)
def _cell_registered(s: Session, d: Delivery) -> None:
    ev: cells.CellRegistered = d.event  # type: ignore[assignment]
    row = _cell(s, ev.run_id, ev.cell)
    row.role, row.is_core, row.capacity, row.state, row.updated_at = ev.role, ev.is_core, ev.capacity, "ready", ev.time


@readmodels.on(cells.SwitchRequested)
def _switch_requested(s: Session, d: Delivery) -> None:
    ev: cells.SwitchRequested = d.event  # type: ignore[assignment]
    row = _cell(s, ev.run_id, ev.cell)
    row.state, row.updated_at = f"switching_to_{ev.to_role}", ev.time


@readmodels.on(cells.SwitchCompleted)
def _switch_completed(s: Session, d: Delivery) -> None:
    ev: cells.SwitchCompleted = d.event  # type: ignore[assignment]
    row = _cell(s, ev.run_id, ev.cell)
    row.role, row.state, row.weight_version, row.updated_at = ev.role, "ready", ev.weight_version, ev.time
    row.switches = (row.switches or 0) + 1


@readmodels.on(cells.SwitchFailed)
def _switch_failed(s: Session, d: Delivery) -> None:
    ev: cells.SwitchFailed = d.event  # type: ignore[assignment]
    row = _cell(s, ev.run_id, ev.cell)
    row.role, row.state, row.updated_at = ev.role, f"failed:{ev.phase}", ev.time


@readmodels.on(training.StepApplied)
def _step_applied(s: Session, d: Delivery) -> None:
    ev: training.StepApplied = d.event  # type: ignore[assignment]
    s.merge(
        StepRow(
            run_id=ev.run_id, step=ev.step, weight_version=ev.weight_version,
            micro_steps_used=len(ev.micro_steps_used), micro_steps_dropped=len(ev.micro_steps_dropped),
            loss=ev.loss, applied_at=ev.time,
        )
    )
