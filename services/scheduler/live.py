"""The live scheduler: the pure policy (``core``) wired to the log, the proxy and the cells.

On start it rebuilds its state from the cells stream. Then every ``tick_s`` it reads the
demand (calls in flight from the proxy, unfinished rollouts and training work from the
log), runs ``decide``, appends the resulting events (``WaterLevelSampled``,
``SwitchRequested``) and sends each switch to its cell agent as a NATS request. The
cells' own events (``CellRegistered``, ``SwitchPhaseEntered``, ``SwitchCompleted``,
``SwitchFailed``) come back through the log and move the state on. The scheduler's own
events are applied only as the log returns them: it publishes, then reads the cells
stream to its end (``catch_up_cells``), so its state is always the fold of the log in
stream order (``replay.CellsFold``), whatever a cell wrote while it decided, and a publish
that fails leaves no trace in the state. A switch command is sent only once its
``SwitchRequested`` has been read back and accepted by the fold (a cell event that landed
first can make it illegal: then nothing is sent, as a replay refuses it too). At stop it
keeps that fold's summary (``final``), which ``gyre replay --cells`` compares with a
rebuild from the log alone.

A command nobody answers (no cell agent subscribed: it is down) is recorded as a
``SwitchFailed`` on the cell's behalf, back in the role it had, so the cell does not stay
half-way for good; a restarted agent registers again and the fold takes the role it
states. That record is only for a switch no agent ever took: this scheduler's first send
of it, the log has the cell in the switch's first phase, and no event of the cell's names
the request. Where an agent may have taken it (a re-send, the cell past the first phase,
or an event of its own for it), no subscriber now means the agent dropped off the bus
(a hung agent whose connection the server closed): the switch is *declared* failed, as
below.

No switch is left half-way by a scheduler that stopped: before its first tick it reads
the demand streams and the cells stream to their ends (``catch_up_demand``,
``catch_up_cells``), then sends again the command of every cell the log shows in the first
phase of a switch (a request stored whose command may never have gone out). A watchdog
does the same for any cell half-way through a switch that no command of ours is waiting
on and no event of the cell's has come from for ``switch_timeout_s`` (the request's own
timeout): the command goes again, with the causation id of the request that started the
switch, so an agent that carried it out already answers it from memory
(``CellAgent.switch``), one that is idle carries it out, and no agent at all gets a
``SwitchFailed`` recorded for it.

An agent that is subscribed but hung (it takes the command, never answers and writes
nothing) is not waited on for ever. A command of the switch that times out while nothing
was read from the cell counts as unanswered; any event of the cell's own read meanwhile
starts the count again (an agent slow in a long phase still announces its phases). Once
the command went unanswered ``max_resends + 1`` times (the first send and ``max_resends``
re-sends; default :data:`MAX_RESENDS`, ``GYRE_SCHEDULER_MAX_RESENDS``), the scheduler
declares the switch failed on the cell's behalf: at its next tick, if the fold still has
the cell in that switch, it writes a ``SwitchFailed`` with ``declared_by_scheduler`` set
(its reason starts with ``translate.DECLARED``), in the phase the log has, back in the lifecycle's safe role for
that phase (``ROLLBACK``): ``inference`` on the way to training, ``training`` on the way
back (conservative: the cell's training seat may still hold a micro-step, or its engine
may not have its memory back); where the cell's real state is not known (its engine may
have released its memory, its seat may have joined) the reason says so. The fold then has
the cell *silent* (``core.state``): the policies start no switch for it and do not count
it as serving until it is heard from. If the agent wakes up, its own events are taken as
it writes them (a later phase of that switch, its outcome, a new registration), live as in
a replay; a declaration that lands after the cell's own outcome is void, and so is one
whose causation id is not the request of the cell's current switch (a late copy for an
older switch). A declaration is built once, with an event id fixed by its request
(:func:`declaration_id`), and published as is until stored, so JetStream drops a late
copy. The agent itself looks for a ``SwitchFailed`` of its switch before each phase it
starts and, if it finds one, rolls back and reports where it is (``CellAgent``).

Where the core applies a step's update only while it trains (``update_needs_training``;
not Gyre's trainer, which applies it in any role), the update waits on the core; while the
core is silent the policies do not switch it, and the scheduler logs once that the update
waits on it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from libs.common.bus.port import EventBus
from libs.common.events import Context, EventDecodeError, SwitchFailed, SwitchRequested, decode

from .core import SchedulerState, Tick, decide
from .core.facts import SwitchStarted
from .core.lifecycle import ROLLBACK, SWITCH_PATH, CellPhase, Role
from .core.state import Cell
from .core.translate import declared_reason, to_event
from .demand import ORPHAN_GRACE_S, Demand
from .replay import CellsFold

log = logging.getLogger(__name__)

ProxyStats = Callable[[], Awaitable[dict[str, Any]]]
SendSwitch = Callable[[str, str, str], Awaitable[dict[str, Any]]]  # cell, to_role, causation id

DEMAND_STREAMS = (Context.ROLLOUTS, Context.TREES, Context.TRAINING)
SWITCH_TIMEOUT_S = 300.0  # a switch command's request timeout (services.cell.agent.request_switch)
CATCH_UP_TIMEOUT_S = 60.0  # at start, for reading the demand streams to their ends
MAX_RESENDS = 2  # re-sends of a switch's command that may go unanswered before it is declared failed


class LiveScheduler:
    def __init__(self, *, run_id: str, bus: EventBus, policy: Any, proxy_stats: ProxyStats, send_switch: SendSwitch,
                 tick_s: float = 2.0, clock: Callable[[], float] = time.time,
                 groups_per_step: int | None = None, switch_timeout_s: float = SWITCH_TIMEOUT_S,
                 catch_up_timeout_s: float = CATCH_UP_TIMEOUT_S, max_resends: int = MAX_RESENDS,
                 update_needs_training: bool = False) -> None:
        if max_resends < 0:
            raise ValueError(f"max_resends must be >= 0, got {max_resends}")
        self.run_id, self.bus, self.policy = run_id, bus, policy
        self.proxy_stats, self.send_switch = proxy_stats, send_switch
        self.tick_s, self.clock = tick_s, clock
        self.switch_timeout_s, self.catch_up_timeout_s = switch_timeout_s, catch_up_timeout_s
        self.max_resends = max_resends
        # the core's trainer applies a step's update only while its cell trains: off for
        # Gyre's trainer, which applies it in any role (services/trainer/gate.py), so the
        # policy does not drain the core for an update (``Tick.update_needs_training``)
        self.update_needs_training = update_needs_training
        self.fold = CellsFold()  # the state, and each cell's timeline (what a replay must rebuild)
        self.demand = Demand(groups_per_step=groups_per_step)
        self._to_send: dict[str, tuple[str, str]] = {}  # SwitchRequested id -> (cell, role), until read back
        self._read_back: dict[str, bool] = {}  # of those: id -> accepted by the fold
        self._tasks: set[asyncio.Task] = set()
        self.switch_answers: list[dict[str, Any]] = []
        self.last_tick: Tick | None = None
        self.cells_seq = 0  # last cells-stream sequence applied (the fold is the log up to there)
        self.demand_seq: dict[Context, int] = {}  # last sequence applied of each demand stream
        self._request: dict[str, str] = {}  # cell -> id of the SwitchRequested that started its switch
        self._heard: dict[str, float] = {}  # cell -> clock when its last event (or our last command) was seen
        self._sending: set[str] = set()  # cells with a command of ours waiting for its answer
        self._looked_back = False  # the commands the log may have left unsent were sent again
        self._reports: dict[str, int] = {}  # cell -> events of the cell's own read (not ours)
        self._unanswered: dict[str, int] = {}  # cell -> commands of its switch that timed out unheard
        # cell -> (request, to role, what went unanswered): switches to declare failed
        self._give_up: dict[str, tuple[str, str, str]] = {}
        self._declaring: dict[str, SwitchFailed] = {}  # cell -> its declaration, built once, tried until stored
        self._sends: dict[str, int] = {}  # request id -> commands of it sent by this scheduler
        self._taken: set[str] = set()  # request ids an event of their cell's own names (an agent took it)
        self._declared_for: dict[str, int] = {}  # request id -> declarations of it read from the log
        self._update_waits_on: str | None = None  # the silent core an update waits on (logged once)
        self.final: dict[str, Any] | None = None  # the fold's summary once stopped

    def _apply(self, data: bytes) -> None:
        try:
            ev = decode(data)
        except EventDecodeError:
            return
        self._apply_event(ev)

    def _apply_event(self, ev: Any) -> None:
        if ev.run_id != self.run_id:
            return
        self.demand.apply(ev)
        if ev.CONTEXT is not Context.CELLS:
            return
        if self.fold.repeated(ev):  # a second stored copy (a publisher's retry past the duplicate window)
            self.fold.duplicates += 1
            log.info("scheduler: %s %s read again (a second stored copy); nothing applied", ev.TYPE, ev.event_id)
            return
        errors = len(self.fold.errors)
        accepted = self.fold.apply(ev)
        if len(self.fold.errors) > errors:
            log.error("scheduler: cannot apply %s", self.fold.errors[-1])
        if ev.event_id in self._to_send:
            self._read_back[ev.event_id] = accepted
        if getattr(ev, "cell", None):  # every cells event but the water level's is one cell's
            self._heard[ev.cell] = self.clock()
            if _declared(ev) and ev.causation_id is not None:
                self._declared_for[ev.causation_id] = self._declared_for.get(ev.causation_id, 0) + 1
            elif not isinstance(ev, SwitchRequested):  # the cell's own word
                self._reports[ev.cell] = self._reports.get(ev.cell, 0) + 1
                self._unanswered.pop(ev.cell, None)
                self._drop_give_up(ev.cell)
                if ev.causation_id is not None:
                    self._taken.add(ev.causation_id)
        if accepted and isinstance(ev, SwitchRequested):
            self._request[ev.cell] = ev.event_id
            self._unanswered.pop(ev.cell, None)
            self._drop_give_up(ev.cell)

    def _drop_give_up(self, cell: str) -> None:
        self._give_up.pop(cell, None)
        self._declaring.pop(cell, None)

    @property
    def state(self) -> SchedulerState:
        return self.fold.state

    async def _follow(self, context: Context, stop: asyncio.Event) -> None:
        follow = self.bus.follow(context, start_seq=self.demand_seq.get(context, 0) + 1,
                                 filter_subject=f"gyre.{self.run_id}.{context.value}.>", idle_s=0.2)
        try:
            async for raw in follow:
                if raw is not None:
                    self._apply(raw.data)
                    self.demand_seq[context] = raw.seq
                if stop.is_set():
                    return
        finally:
            await follow.aclose()

    async def catch_up_demand(self) -> None:
        """Reads the demand streams to their ends (the followers go on from there), so the
        first decisions see the history: an update pending, the training work waiting.
        Gives up after ``catch_up_timeout_s`` with a warning; the followers read the rest."""
        async def read(context: Context) -> None:
            async for d in self.bus.read(context, start_seq=self.demand_seq.get(context, 0) + 1,
                                         filter_subject=f"gyre.{self.run_id}.{context.value}.>"):
                self._apply_event(d.event)
                self.demand_seq[context] = d.seq

        start = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.gather(*(read(c) for c in DEMAND_STREAMS)), self.catch_up_timeout_s)
        except asyncio.TimeoutError:
            log.warning("scheduler: the demand streams were not read to their ends in %.0fs; deciding on what "
                        "was read (at %s), the followers read the rest", self.catch_up_timeout_s,
                        {c.value: self.demand_seq.get(c, 0) for c in DEMAND_STREAMS})
            return
        log.info("scheduler: demand read to the streams' ends in %.2fs (%s)", time.monotonic() - start,
                 {c.value: self.demand_seq.get(c, 0) for c in DEMAND_STREAMS})

    async def tick(self) -> list[Any]:
        stats = await self.proxy_stats()
        overdue = self.demand.expire(self.clock())
        if overdue:  # e.g. a `gyre run` restarted mid-step: its runner died with these rollouts
            log.warning("scheduler: %d rollout(s) still running in the log past their time limit (+%.0fs) no longer "
                        "count in the water level, e.g. %s", len(overdue), ORPHAN_GRACE_S, overdue[0])
        cell_calls = {c["name"]: int(c.get("in_flight", 0)) for c in stats.get("cells", [])}
        running = sum(cell_calls.values())
        # The proxy holds no queue of its own: it hands every call to a cell at once, and calls
        # beyond a cell's capacity wait inside its engine, so they count in "in_flight" and the
        # water level (queued + running) already holds them; "queued" is for a proxy that queues.
        tick = Tick(at=self.clock(), queued_calls=int(stats.get("queued", 0)), running_calls=running,
                    rollouts_between_calls=max(0, len(self.demand.running_rollouts) - running),
                    training_backlog=self.demand.backlog, update_pending=self.demand.update_pending,
                    batch_ready=self.demand.batch_ready, update_needs_training=self.update_needs_training,
                    cell_calls=cell_calls,
                    busy_trainers=self.demand.busy_trainers)
        facts = decide(self.state, tick, self.policy)
        self.last_tick = tick
        self._log_update_waiting(tick)
        for fact in facts:
            # the roles count in a water-level event is the state's before the tick's switches
            event = to_event(fact, self.run_id, state=self.state)
            if event is None:
                continue
            if isinstance(fact, SwitchStarted):
                # kept even when the publish fails: a lost ack may hide a stored request,
                # which must then be sent once it is read back
                self._to_send[event.event_id] = (fact.cell, fact.to_role.value)
            await self.bus.publish(event)  # a failure drops the tick's other facts; the next tick decides again
        await self.catch_up_cells()  # our events, in stream order after whatever came first
        self._send_accepted()
        await self._declare_silent()
        self._send_again()
        return facts

    def _log_update_waiting(self, tick: Tick) -> None:
        """The step's update waits on the core; a silent core is not switched (the policies
        leave it alone until it is heard from): say so once each time it starts."""
        core = self.state.core
        waits_on = core.name if tick.update_waits_on_core and core is not None and core.held else None
        if waits_on is not None and waits_on != self._update_waits_on:
            silent = core is not None and core.silent
            log.error("scheduler: the step's update waits on the core %s, which is %s; it is %s in the log): no "
                      "update until it is %s", waits_on,
                      "silent (its agent answered none of its last switch's commands" if silent
                      else "unusable (its agent could not finish rolling back a failed switch",
                      core.phase.value if core is not None else "?", "heard from" if silent else "repaired")
        elif waits_on is None and self._update_waits_on is not None:
            log.info("scheduler: the core %s is heard from again (or no update waits)", self._update_waits_on)
        self._update_waits_on = waits_on

    def _send_accepted(self) -> None:
        """Sends each switch whose request the fold has read back and accepted."""
        for event_id in [e for e in self._to_send if e in self._read_back]:
            cell, role = self._to_send.pop(event_id)
            if not self._read_back.pop(event_id):
                log.warning("scheduler: switch of %s to %s not sent: the log refused it (%s)", cell, role,
                            self.fold.errors[-1] if self.fold.errors else "?")
                continue
            phase = next((c.phase for c in self.state.cells if c.name == cell), None)
            if phase is not SWITCH_PATH[Role(role)][0]:  # e.g. its agent registered again since
                log.warning("scheduler: switch of %s to %s not sent: the cell is %s now", cell, role,
                            phase.value if phase else "gone")
                continue
            self._send(cell, role, event_id)

    def _send_again(self) -> None:
        """Commands that may never have reached their cell go again. On the first tick: each
        cell in the first phase of a switch (a scheduler before this one may have stopped
        between storing the request and sending it). On every tick: each cell half-way
        through a switch, with no command of ours waiting on it, that nothing was heard
        from for ``switch_timeout_s``."""
        first, self._looked_back = not self._looked_back, True
        now = self.clock()
        for c in self.state.switching:
            request = self._request.get(c.name)
            if c.name in self._sending or c.name in self._give_up or request is None:
                continue
            if first and c.phase is SWITCH_PATH[c.heading_to][0]:
                why = "its request is in the log; the command may never have gone out"
            elif now - self._heard.get(c.name, now) > self.switch_timeout_s:
                why = f"nothing heard of it for {now - self._heard[c.name]:.0f}s"
            else:
                continue
            log.warning("scheduler: sending the switch of %s to %s again (%s; it is %s)", c.name,
                        c.heading_to.value, why, c.phase.value)
            self._send(c.name, c.heading_to.value, request)

    def _send(self, cell: str, role: str, causation: str) -> None:
        self._sending.add(cell)
        self._sends[causation] = self._sends.get(causation, 0) + 1
        self._heard[cell] = self.clock()  # the watchdog counts from the command too
        self._spawn(self._switch(cell, role, causation))

    async def _switch(self, cell: str, to_role: str, causation: str) -> None:
        reports = self._reports.get(cell, 0)
        try:
            answer = await self.send_switch(cell, to_role, causation)
        except Exception as exc:
            answer = {"ok": False, "cell": cell, "reason": repr(exc)}
            log.error("scheduler: switch of %s to %s got no answer: %r", cell, to_role, exc)
            if _nobody_listening(exc):
                await self._nobody_listened(cell, to_role, causation, exc)
            elif isinstance(exc, TimeoutError) and self._reports.get(cell, 0) == reports:
                self._count_unanswered(cell, to_role, causation)
            # otherwise the agent may still be at work: its own events tell the rest, or the
            # watchdog sends the command again (_send_again)
        finally:
            self._sending.discard(cell)
            self._heard[cell] = self.clock()
        self.switch_answers.append({"cell": cell, "to_role": to_role, **answer})

    def _count_unanswered(self, cell: str, to_role: str, causation: str) -> None:
        """A command of the cell's current switch timed out and nothing was read from the
        cell while it waited; past ``max_resends`` re-sends the next tick declares it failed."""
        if self._request.get(cell) != causation:
            return  # a command of a switch that is over
        sends = self._unanswered.get(cell, 0) + 1
        self._unanswered[cell] = sends
        if sends > self.max_resends:
            self._give_up[cell] = (causation, to_role, f"answered none of {sends} sends of it "
                                                       f"({self.switch_timeout_s:.0f}s each) nor wrote anything")
            log.error("scheduler: %s answered none of %d sends of its switch to %s and wrote nothing: declaring "
                      "the switch failed", cell, sends, to_role)
        else:
            log.warning("scheduler: %s answered none of %d send(s) of its switch to %s; sent again after %.0fs "
                        "of silence (%d re-send(s) before it is declared failed)", cell, sends, to_role,
                        self.switch_timeout_s, self.max_resends)

    async def _declare_silent(self) -> None:
        """Writes the ``SwitchFailed`` of each switch given up on (``_count_unanswered``),
        if the fold, read to the stream's end just now, still has its cell in it; a
        declaration whose publish fails is tried again next tick."""
        for cell, (request, to_role, what) in list(self._give_up.items()):
            c = next((x for x in self.state.cells if x.name == cell), None)
            if c is None or not c.switching or self._request.get(cell) != request or cell in self._sending:
                self._drop_give_up(cell)  # the switch ended or moved on meanwhile
                continue
            event = self._declaring.get(cell)
            if event is None:  # built once and tried as is until stored: a late copy is dropped by JetStream
                back, why = declared_role(c)
                reason = declared_reason(
                    f"the cell agent took the switch command to {to_role} and {what}; the log has it "
                    f"{c.phase.value}; {why}")
                event = SwitchFailed(run_id=self.run_id, cell=cell, role=back.value, phase=c.phase.value,
                                     reason=reason, declared_by_scheduler=True, causation_id=request,
                                     event_id=declaration_id(request, self._declared_for.get(request, 0)),
                                     time=datetime.fromtimestamp(self.clock(), UTC))
                self._declaring[cell] = event
            try:
                await self.bus.publish(event)
            except Exception as exc:
                log.error("scheduler: could not declare the switch of %s failed (again next tick): %r", cell, exc)
                continue
            self._drop_give_up(cell)
            reason = event.reason
            self._heard[cell] = self.clock()
            log.error("scheduler: switch of %s declared failed: %s", cell, reason)

    async def _nobody_listened(self, cell: str, to_role: str, causation: str, exc: Exception) -> None:
        """No agent is subscribed to the cell's commands. If none ever took this switch's
        command (this scheduler's first send of it, the log has the cell in the switch's
        first phase and no event of the cell's names the request), no switch began: it is
        recorded failed there (``_record_unanswered``). Otherwise an agent took it before
        and dropped off the bus (e.g. a hung agent whose connection the server closed): it
        is declared failed like any unanswered switch, in the phase the log has, and the
        cell is silent until it is heard from."""
        if self._request.get(cell) != causation:
            log.warning("scheduler: no agent of %s listened for a switch that is over; nothing recorded", cell)
            return
        c = next((x for x in self.state.cells if x.name == cell), None)
        if c is None or not c.switching:
            return
        first_phase = c.phase is SWITCH_PATH[Role(to_role)][0]
        if first_phase and self._sends.get(causation, 0) <= 1 and causation not in self._taken:
            await self._record_unanswered(cell, to_role, causation, exc)
            return
        sends = self._sends.get(causation, 0)
        self._give_up[cell] = (causation, to_role,
                               f"then no agent listened on its command subject ({type(exc).__name__} on send "
                               f"{sends} of it)")
        log.error("scheduler: %s took its switch to %s, and now no agent of it listens (%s; the log has it %s): "
                  "declaring the switch failed", cell, to_role, type(exc).__name__, c.phase.value)

    async def _record_unanswered(self, cell: str, to_role: str, causation: str, exc: Exception) -> None:
        """No agent took the command, so no switch began: record it failed in its first
        phase, back in the role the cell had (read back in stream order like any cell event)."""
        role = Role(to_role)
        back = Role.INFERENCE if role is Role.TRAINING else Role.TRAINING
        event = SwitchFailed(run_id=self.run_id, cell=cell, role=back.value, phase=SWITCH_PATH[role][0].value,
                             reason=f"no cell agent answered the command ({type(exc).__name__})",
                             causation_id=causation, time=datetime.fromtimestamp(self.clock(), UTC))
        try:
            await self.bus.publish(event)
        except Exception as publish_exc:
            log.error("scheduler: could not record the unanswered switch of %s: %r", cell, publish_exc)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def catch_up_cells(self) -> None:
        """Applies the cells stream from where the fold stands to its end, in stream order.
        Done before every decision, so the scheduler decides on every cell report already
        in the log, and its own events land after them (what a replay folds too)."""
        async for d in self.bus.read(Context.CELLS, start_seq=self.cells_seq + 1,
                                     filter_subject=f"gyre.{self.run_id}.cells.>"):
            self._apply_event(d.event)
            self.cells_seq = d.seq

    async def run(self, stop: asyncio.Event) -> None:
        followers: list[asyncio.Task] = []
        try:
            try:
                await self.catch_up_demand()  # the first tick decides on the whole history
            except Exception:
                log.exception("scheduler: could not read the demand streams; the followers read them")
            followers = [asyncio.create_task(self._follow(c, stop)) for c in DEMAND_STREAMS]
            while not stop.is_set():
                try:
                    await self.catch_up_cells()
                    await self.tick()
                except Exception:
                    log.exception("scheduler tick failed; trying again next tick")
                try:
                    await asyncio.wait_for(stop.wait(), self.tick_s)
                except asyncio.TimeoutError:
                    pass
        finally:
            for t in followers:
                t.cancel()
            if self._tasks:  # a switch still running goes on in its cell; its answer is not awaited
                _, pending = await asyncio.wait(set(self._tasks), timeout=STOP_WAIT_S)
                for t in pending:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
            try:
                self.final = await asyncio.wait_for(self.finish(), STOP_WAIT_S)
            except Exception:
                log.exception("scheduler: could not read the cells stream to its end at stop")

    async def finish(self) -> dict[str, Any]:
        """Applies the rest of the cells stream (no more decisions are made) and returns the
        fold's summary with the sequence it goes up to: what ``gyre replay --cells`` must
        rebuild from the log alone."""
        from .replay import summary

        await self.catch_up_cells()
        return {**summary(self.fold), "through_seq": self.cells_seq, "run_id": self.run_id}


def declared_role(cell: Cell) -> tuple[Role, str]:
    """The role a cell whose agent went silent half-way through a switch is declared back
    in, and what is known of it: the lifecycle's safe role for the phase the log has (a
    replay checks the same), with the doubts about the cell's real state spelled out."""
    back = next(iter(ROLLBACK[cell.phase]))
    phase = cell.phase
    if phase in (CellPhase.DRAINING, CellPhase.MIGRATING):
        why = ("back in inference: its engine still holds its memory, but the proxy may keep it drained until "
               "its agent serves it again")
    elif phase in (CellPhase.RELEASING, CellPhase.JOINING):
        seat = " and its training seat may have joined training" if phase is CellPhase.JOINING else ""
        why = (f"no safe role is known: its engine may have released its memory{seat}; back in inference, the "
               "only rollback the lifecycle allows from here, not counted as serving until it is heard from")
        if cell.is_core:
            why += "; no satellite goes to training until the core is heard from"
        else:
            why += ("; its seat may have joined (or join), so the core does not leave training until it is heard "
                    "from")
    elif phase is CellPhase.LEAVING:
        why = ("no safe role is known: its training seat may still hold a micro-step; kept in training "
               "(conservative: " + ("the core keeps the optimizer and stays the training group's root; no "
                                    "satellite goes to training until it is heard from"
                                    if cell.is_core else "the core does not leave training under it") + ")")
    else:  # RESUMING
        why = ("no safe role is known: its seat has left training but its engine may not have its memory back; "
               "kept in training, the only rollback the lifecycle allows from here (conservative: it is not "
               "counted as serving" + ("; no satellite goes to training until the core is heard from"
                                        if cell.is_core else "") + ")")
    return back, why


def declaration_id(request: str, earlier: int) -> str:
    """The event id of the scheduler's declaration that the switch started by ``request``
    failed, after ``earlier`` declarations of it in the log (an agent that woke up may go on
    with the switch and hang again): the same on every try, and for a scheduler that
    restarted, so JetStream's de-duplication drops a late copy."""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"gyre:switch-declared:{request}:{earlier}").hex


def _declared(ev: Any) -> bool:
    """A ``SwitchFailed`` the scheduler declared on a silent cell's behalf."""
    return isinstance(ev, SwitchFailed) and ev.declared_by_scheduler


def _nobody_listening(exc: Exception) -> bool:
    """NATS said no subscriber exists for the cell's command subject."""
    try:
        from nats.errors import NoRespondersError
    except ImportError:  # pragma: no cover - nats-py is a dependency
        return False
    return isinstance(exc, NoRespondersError)


STOP_WAIT_S = 3.0  # at stop, for answers of switches in flight and for the last read (serve() waits 10 s)
