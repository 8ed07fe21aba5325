"""Projections: rows and stream position commit together; SQLite and PostgreSQL alike."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from libs.common.bus.memory import InMemoryBus
from libs.common.db.engine import current_revision, make_engine, upgrade
from libs.common.db.models import CallRow, CellRow, EventCount, EventRow, RolloutRow, RunRow, StepRow
from libs.common.db.projection import ProjectionRunner, offsets
from libs.common.db.readmodels import readmodels
from libs.common.events import (
    CallRecorded, CellRegistered, Context, RolloutScored, RolloutStarted, RolloutTimedOut, RunStarted, StepApplied,
    SwitchCompleted, SwitchRequested,
)

D = "ef" * 32
RUN = "proj"


def run_events() -> list:
    evs = [RunStarted(run_id=RUN, config={"lr": 1e-6})]
    for i in range(3):
        rid = f"ro-{i}"
        evs.append(RolloutStarted(run_id=RUN, rollout_id=rid, task_id=f"t{i}", group_id="g0", harness="gyre",
                                  weight_version=0, api_key_digest=D))
        evs.append(CallRecorded(run_id=RUN, call_id=f"c{i}", rollout_id=rid, session_id=f"s{i}", api="openai_chat",
                                new_input_digest=D, n_new_input_tokens=7, output_digest=D, logprobs_digest=D,
                                n_output_tokens=3))
        evs.append(RolloutTimedOut(run_id=RUN, rollout_id=rid, snapshot_digest=D, wall_time_s=10.0 + i))
        evs.append(RolloutScored(run_id=RUN, rollout_id=rid, score=0.25 * i, partial=True))
    evs += [
        CellRegistered(run_id=RUN, cell="cell-0", role="inference", is_core=True, capacity=8),
        SwitchRequested(run_id=RUN, cell="cell-0", from_role="inference", to_role="training", water_level=0.1,
                        reason="low water"),
        SwitchCompleted(run_id=RUN, cell="cell-0", role="training", phase_timings={"drain": 0.1}, weight_version=0),
        StepApplied(run_id=RUN, step=0, weight_version=1, micro_steps_used=["0.0", "0.1"], loss={"mean": 0.5}),
    ]
    return evs


@pytest.fixture
def engine(db_url: str):
    upgrade(db_url)
    eng = make_engine(db_url)
    yield eng
    eng.dispose()


@pytest.fixture(params=["jetstream", "memory"])
async def bus(request: pytest.FixtureRequest, tmp_path) -> AsyncIterator[object]:
    if request.param == "memory":
        yield InMemoryBus()
        return
    from libs.common.bus.jetstream import JetStreamBus
    from libs.common.natsserver import EmbeddedNats

    with EmbeddedNats(tmp_path / "nats") as server:
        js = await JetStreamBus.connect(server.url)
        yield js
        await js.close()


def count(engine, model) -> int:
    with Session(engine) as s:
        return s.scalar(select(func.count()).select_from(model))


def test_migrations_are_idempotent(db_url: str) -> None:
    upgrade(db_url)
    upgrade(db_url)
    assert current_revision(db_url) == "0001"


async def test_read_models_follow_the_log(engine, bus) -> None:
    events = run_events()
    await bus.publish_many(events)
    runner = ProjectionRunner(engine, bus, readmodels)
    assert await runner.catch_up() == len(events)
    with Session(engine) as s:
        ro = s.get(RolloutRow, "ro-2")
        assert (ro.status, ro.score, ro.partial, ro.n_calls, ro.n_output_tokens) == ("timed_out", 0.5, True, 1, 3)
        assert s.get(RunRow, RUN).config == {"lr": 1e-6}
        cell = s.get(CellRow, (RUN, "cell-0"))
        assert (cell.role, cell.state, cell.switches, cell.is_core) == ("training", "ready", 1, True)
        assert s.get(StepRow, (RUN, 0)).micro_steps_used == 2
        assert s.get(CallRow, "c1").drift == "fresh"
        assert s.get(EventCount, (RUN, "RolloutScored")).count == 3
    assert count(engine, EventRow) == len(events)
    assert offsets(engine, "readmodels")[Context.ROLLOUTS.stream] == await bus.last_seq(Context.ROLLOUTS)


async def test_a_second_pass_applies_nothing_twice(engine, bus) -> None:
    await bus.publish_many(run_events())
    await ProjectionRunner(engine, bus, readmodels).catch_up()
    again = ProjectionRunner(engine, bus, readmodels)
    assert await again.catch_up() == 0
    more = [RolloutStarted(run_id=RUN, rollout_id="ro-9", task_id="t", group_id="g1", harness="gyre",
                           weight_version=1, api_key_digest=D)]
    await bus.publish_many(more)
    assert await again.catch_up() == 1
    with Session(engine) as s:
        assert s.get(EventCount, (RUN, "RolloutStarted")).count == 4


async def test_bad_event_is_dead_lettered_not_applied_and_projection_goes_on(engine, bus) -> None:
    from datetime import UTC, datetime

    await bus.publish(RunStarted(run_id=RUN))
    bogus = b'{"type":"RolloutStarted","schema_version":1,"run_id":"proj","rollout_id":""}'
    if isinstance(bus, InMemoryBus):
        bus.append(Context.ROLLOUTS.stream, "gyre.proj.rollouts.RolloutStarted.x", bogus, "bad-1", datetime.now(UTC))
    else:
        await bus.publish_raw("gyre.proj.rollouts.RolloutStarted.x", bogus, {"Nats-Msg-Id": "bad-1"})
    good = RolloutStarted(run_id=RUN, rollout_id="ro-ok", task_id="t", group_id="g", harness="gyre",
                          weight_version=0, api_key_digest=D)
    await bus.publish(good)
    runner = ProjectionRunner(engine, bus, readmodels, retry_delay_s=0.01)
    assert await runner.catch_up() == 2
    assert runner.dead_lettered == 1
    with Session(engine) as s:
        assert s.get(RolloutRow, "ro-ok") is not None
        assert s.scalar(select(func.count()).select_from(EventRow).where(EventRow.stream == "GYRE_ROLLOUTS")) == 1
    assert offsets(engine, "readmodels")["GYRE_ROLLOUTS"] == 2
    if isinstance(bus, InMemoryBus):
        assert "rollout_id" in bus.dead_letters[0].reason
    else:
        reasons = [m.headers["Gyre-Dead-Reason"] async for m in bus.read_raw("GYRE_DEADLETTER")]
        assert len(reasons) == 1 and "rollout_id" in reasons[0]


async def test_every_drift_class_fits_the_calls_read_model(engine, bus) -> None:
    """PostgreSQL enforces the column's length (SQLite does not): each class the proxy can
    record is stored, none dead-lettered."""
    from libs.common.events.calls import DriftClass

    calls = [CallRecorded(run_id=RUN, call_id=f"d-{d.value}", rollout_id="ro-d", session_id="s", api="openai_chat",
                          new_input_digest=D, n_new_input_tokens=1, output_digest=D, logprobs_digest=D,
                          n_output_tokens=1, drift=d) for d in DriftClass]
    await bus.publish_many(calls)
    assert await ProjectionRunner(engine, bus, readmodels).catch_up() == len(calls)
    with Session(engine) as s:
        assert sorted(r.drift for r in s.scalars(select(CallRow))) == sorted(d.value for d in DriftClass)


async def test_an_unreachable_database_stalls_the_projection_and_skips_nothing(engine, bus) -> None:
    """A connection error is no fault of the event's: it is tried again until the database
    answers (it was dead-lettered after three tries, and the read model lost it)."""
    from sqlalchemy.exc import OperationalError

    from libs.common.db.projection import Projection

    seen: list[int] = []
    outage = {"left": 6}

    def apply(session, d) -> None:
        if outage["left"]:
            outage["left"] -= 1
            raise OperationalError("INSERT ...", {}, ConnectionRefusedError("the server is gone"))
        seen.append(d.seq)

    flaky = Projection("flaky")
    flaky.on(RunStarted)(apply)
    await bus.publish(RunStarted(run_id=RUN))
    runner = ProjectionRunner(engine, bus, flaky, retry_delay_s=0.001)
    assert await runner.catch_up() == 1
    assert (seen, runner.dead_lettered, outage["left"]) == ([1], 0, 0)
    assert offsets(engine, "flaky")["GYRE_RUNS"] == 1


def test_only_connection_and_server_errors_count_as_an_unavailable_database() -> None:
    from sqlalchemy.exc import IntegrityError, OperationalError

    from libs.common.db.projection import database_unavailable

    class PgError(Exception):
        def __init__(self, sqlstate: str) -> None:
            self.sqlstate = sqlstate

    def op(orig) -> OperationalError:
        return OperationalError("SELECT 1", {}, orig)

    assert database_unavailable(op(ConnectionRefusedError("gone")))  # no SQLSTATE: SQLite, a lost socket
    assert database_unavailable(op(PgError("08006")))  # connection failure
    assert database_unavailable(op(PgError("57P01")))  # admin shutdown
    assert database_unavailable(op(PgError("53300")))  # too many connections
    assert not database_unavailable(op(PgError("57014")))  # this statement was cancelled
    assert not database_unavailable(op(PgError("54000")))  # this statement's program limit
    assert not database_unavailable(IntegrityError("INSERT", {}, PgError("23505")))
    assert not database_unavailable(ValueError("a handler's bug"))


async def _store_again(bus, event, msg_id: str) -> None:
    """A second stored copy of ``event`` (same id, same bytes), as a publisher's retry past
    the bus's de-duplication window leaves it: here under another message id."""
    if isinstance(bus, InMemoryBus):
        bus.append(event.CONTEXT.stream, event.subject, event.to_json(), msg_id, event.time)
    else:
        await bus.publish_raw(event.subject, event.to_json(), {"Nats-Msg-Id": msg_id, "Gyre-Type": event.TYPE})


async def test_a_twice_stored_event_is_applied_once_not_dead_lettered(engine, bus) -> None:
    started = RolloutStarted(run_id=RUN, rollout_id="ro-d", task_id="t", group_id="g", harness="gyre",
                             weight_version=0, api_key_digest=D)
    await bus.publish(RunStarted(run_id=RUN))
    await bus.publish(started)
    await _store_again(bus, started, "retry-in-batch")  # a first copy earlier in the same batch
    runner = ProjectionRunner(engine, bus, readmodels, retry_delay_s=0.01)
    assert await runner.catch_up() == 2
    await _store_again(bus, started, "retry-next-batch")  # a first copy in an earlier batch
    assert await runner.catch_up() == 0
    assert (runner.dead_lettered, runner.duplicates) == (0, 2)
    with Session(engine) as s:
        assert s.get(EventCount, (RUN, "RolloutStarted")).count == 1
    assert count(engine, EventRow) == 2
    assert offsets(engine, "readmodels")[Context.ROLLOUTS.stream] == await bus.last_seq(Context.ROLLOUTS)


async def test_a_different_event_under_a_taken_id_is_still_an_integrity_error(engine, bus) -> None:
    first = RolloutStarted(run_id=RUN, rollout_id="ro-a", task_id="t", group_id="g", harness="gyre",
                           weight_version=0, api_key_digest=D, event_id="same-id")
    other = RolloutStarted(run_id=RUN, rollout_id="ro-b", task_id="t", group_id="g", harness="gyre",
                           weight_version=0, api_key_digest=D, event_id="same-id")
    await bus.publish(first)
    await _store_again(bus, other, "other-msg")
    runner = ProjectionRunner(engine, bus, readmodels, retry_delay_s=0.01)
    await runner.catch_up()
    assert (runner.dead_lettered, runner.duplicates) == (1, 0)
    with Session(engine) as s:
        assert s.get(RolloutRow, "ro-b") is None
