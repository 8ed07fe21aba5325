"""A cell agent that is subscribed but hung (it takes the switch command, never answers and
writes nothing) over a real nats-server: after ``max_resends`` unanswered re-sends the live
scheduler declares the switch failed on the cell's behalf, the cell is back in a safe role
and silent; the agent waking up later is taken at its word; the live fold is what a replay
of the log gives."""

from __future__ import annotations

import asyncio
import json

import pytest

from libs.common.events import (CellRegistered, Context, SwitchCompleted, SwitchFailed, SwitchPhaseEntered,
                                SwitchRequested)
from services.cell.agent import command_subject, request_switch
from services.scheduler.core import ColocatePolicy
from services.scheduler.core.translate import DECLARED
from services.scheduler.live import LiveScheduler
from services.scheduler.replay import CellsFold, compare, summary

from ._helpers import tick_until

TIMEOUT_S = 0.2  # the switch command's request timeout, and the watchdog's silence


async def _log(bus, run: str, *phases: str) -> SwitchRequested:
    """c0 (core) and c1 registered; c0's switch to training stored, its agent in ``phases``."""
    request = SwitchRequested(run_id=run, cell="c0", from_role="inference", to_role="training", water_level=0.0,
                              reason="backlog")
    for ev in (CellRegistered(run_id=run, cell="c0", role="inference", is_core=True, capacity=4),
               CellRegistered(run_id=run, cell="c1", role="inference", capacity=4), request,
               *(SwitchPhaseEntered(run_id=run, cell="c0", phase=p) for p in phases)):
        await bus.publish(ev)
    return request


def _scheduler(run: str, bus, max_resends: int = 2) -> LiveScheduler:
    async def proxy_stats() -> dict:
        return {"cells": [{"name": "c0", "in_flight": 0}, {"name": "c1", "in_flight": 0}]}

    async def send_switch(cell: str, to_role: str, causation: str) -> dict:
        return await request_switch(bus.nc, run, cell, to_role, causation_id=causation, timeout_s=TIMEOUT_S)

    return LiveScheduler(run_id=run, bus=bus, policy=ColocatePolicy(), proxy_stats=proxy_stats,
                         send_switch=send_switch, switch_timeout_s=TIMEOUT_S, max_resends=max_resends)


async def _hung_agent(bus, run: str, on_command=None) -> tuple[list[dict], object]:
    """A real subscription on c0's command subject that never answers."""
    got: list[dict] = []

    async def on_request(msg) -> None:
        got.append(json.loads(msg.data))
        if on_command is not None:
            await on_command(len(got))

    return got, await bus.nc.subscribe(command_subject(run, "c0"), cb=on_request)


async def _replayed(bus, run: str) -> CellsFold:
    fold = CellsFold()
    async for d in bus.read(Context.CELLS, filter_subject=f"gyre.{run}.cells.>"):
        fold.apply(d.event)
    return fold


async def test_a_hung_agent_is_declared_failed_after_its_resends_then_taken_at_its_word(js_bus) -> None:
    run, bus = "hung", js_bus
    request = await _log(bus, run, "draining", "migrating")
    got, sub = await _hung_agent(bus, run)
    live = _scheduler(run, bus, max_resends=2)
    await live.catch_up_cells()
    await tick_until(live, lambda: not live.state.cell("c0").switching)
    await sub.unsubscribe()
    # the first command and two re-sends, all of the same request, all unanswered
    assert [(g["to_role"], g["causation_id"]) for g in got] == [("training", request.event_id)] * 3
    c0 = live.state.cell("c0")
    assert c0.phase.value == "inference" and c0.silent
    assert c0.last_failure.startswith(DECLARED) and "answered none of 3 sends" in c0.last_failure
    failed = [d.event async for d in bus.read(Context.CELLS) if isinstance(d.event, SwitchFailed)]
    assert len(failed) == 1 and failed[0].phase == "migrating" and failed[0].role == "inference"
    assert failed[0].causation_id == request.event_id
    # nothing more is sent to it, however long it stays silent
    for _ in range(8):
        await live.tick()
        await asyncio.sleep(0.05)
    assert len(got) == 3
    assert not live.fold.errors and (await _replayed(bus, run)).state == live.state

    # the agent wakes up and goes on with its switch: the log takes it as it comes
    for ev in (SwitchPhaseEntered(run_id=run, cell="c0", phase="releasing", causation_id=request.event_id),
               SwitchPhaseEntered(run_id=run, cell="c0", phase="joining", causation_id=request.event_id),
               SwitchCompleted(run_id=run, cell="c0", role="training", weight_version=0,
                               causation_id=request.event_id)):
        await bus.publish(ev)
    final = await live.finish()
    c0 = live.state.cell("c0")
    assert c0.phase.value == "training" and not c0.silent and not live.fold.errors
    assert [p for _, p in final["timelines"]["c0"]] == ["inference", "draining", "migrating", "inference",
                                                        "releasing", "joining", "training"]
    assert compare(summary(await _replayed(bus, run)), final)["same_as_live"]


async def test_a_cell_heard_from_between_unanswered_commands_starts_the_count_again(js_bus) -> None:
    """The agent announces a phase after the second command (slow, not dead): the count
    starts again; the declaration names the phase the log has and its doubts."""
    run, bus = "slow", js_bus
    await _log(bus, run, "draining", "migrating")

    async def announce(n: int) -> None:
        if n == 2:
            await bus.publish(SwitchPhaseEntered(run_id=run, cell="c0", phase="releasing"))

    got, sub = await _hung_agent(bus, run, on_command=announce)
    live = _scheduler(run, bus, max_resends=1)
    await live.catch_up_cells()
    await tick_until(live, lambda: not live.state.cell("c0").switching)
    await sub.unsubscribe()
    assert len(got) == 4  # two, then the count starts again: two more
    c0 = live.state.cell("c0")
    assert c0.silent and c0.phase.value == "inference"
    assert "it releasing" in c0.last_failure and "no safe role is known" in c0.last_failure
    assert not live.fold.errors and (await _replayed(bus, run)).state == live.state


async def test_a_declaration_written_after_the_agent_answered_in_the_log_is_void(js_bus) -> None:
    """The agent's outcome lands between the scheduler's read and its declaration: the
    declaration changes nothing, live and in a replay, and is no error."""
    run, bus = "late", js_bus
    request = await _log(bus, run, "draining", "migrating", "releasing", "joining")
    got, sub = await _hung_agent(bus, run)
    live = _scheduler(run, bus, max_resends=0)
    await live.catch_up_cells()
    await asyncio.sleep(TIMEOUT_S * 1.5)  # silent for longer than the timeout: the watchdog sends
    live._send_again()
    for _ in range(100):
        if live._give_up:
            break
        await asyncio.sleep(0.02)
    assert len(got) == 1 and live._give_up  # unanswered, and no re-send allowed: to be declared
    await sub.unsubscribe()
    await bus.publish(SwitchCompleted(run_id=run, cell="c0", role="training", weight_version=0,
                                      causation_id=request.event_id))
    await live._declare_silent()  # decided on the fold before the outcome was read
    await live.catch_up_cells()
    failed = [d.event async for d in bus.read(Context.CELLS) if isinstance(d.event, SwitchFailed)]
    assert len(failed) == 1 and failed[0].declared_by_scheduler and failed[0].reason.startswith(DECLARED)
    c0 = live.state.cell("c0")
    assert c0.phase.value == "training" and not c0.silent and not live.fold.errors
    assert [p for _, p in live.fold.timelines["c0"]][-2:] == ["joining", "training"]
    assert (await _replayed(bus, run)).state == live.state


def test_max_resends_is_configured_from_the_environment(monkeypatch) -> None:
    from services.scheduler.main import max_resends_from_env

    monkeypatch.delenv("GYRE_SCHEDULER_MAX_RESENDS", raising=False)
    assert max_resends_from_env() == 2
    monkeypatch.setenv("GYRE_SCHEDULER_MAX_RESENDS", "5")
    assert max_resends_from_env() == 5
    for bad in ("-1", "two"):
        monkeypatch.setenv("GYRE_SCHEDULER_MAX_RESENDS", bad)
        with pytest.raises(ValueError, match="GYRE_SCHEDULER_MAX_RESENDS"):
            max_resends_from_env()
