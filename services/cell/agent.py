"""The cell agent: one per cell; carries out the scheduler's switch commands.

Each phase is announced (``SwitchPhaseEntered``), timed, and the switch ends in exactly
one ``SwitchCompleted`` or ``SwitchFailed`` (with the phase, the reason, and the safe role
the cell was rolled back to). Commands arrive as NATS requests on
``gyre.<run>.cmd.cells.<cell>`` (``{"op": "switch", "to_role": "training"}``) and are
answered with the outcome, so every command is also an event in the log. A command sent
again with the same ``causation_id`` (a scheduler that restarted, or whose watchdog heard
nothing for too long) is answered with the outcome it had, and nothing is done or logged
twice.

A scheduler that heard nothing from a cell for several of its commands (the agent hung)
declares the switch failed on the cell's behalf: a ``SwitchFailed`` with the command's
causation id, written by the scheduler (``services.scheduler.live``). Before each phase it
starts, the agent looks at the newest ``SwitchFailed`` of its cell; if it names the switch
under way (its causation id; a declaration, or any record the scheduler wrote for it: the
agent writes its own only once the switch is over), the agent starts nothing more, rolls back as for a
failure in the last phase the log has (``core.rollback_role``, the same safe role the
scheduler declared) and reports its own ``SwitchFailed``, which the scheduler takes as the
cell's word. A phase already under way when the agent wakes up is finished; a switch whose
last phase was under way completes, and the scheduler takes that outcome too.

The evacuation (``migrating``) is bounded: the proxy gets a deadline shorter than the
agent's HTTP timeout (``ProxyControl.evacuate``) and answers with the sessions it moved and
those it left on the cell. Any left (or calls that outlasted the drain) fail the phase:
the agent rolls back to inference and the proxy routes to the cell again, so the sessions
not moved are served where their KV cache is, and the moved ones where they went.

A restarted agent registers in inference: it first asks its training seat to leave (the
core's trainer may still be claiming for a cell that trained) and gives its engine its
memory back if the cells stream says the cell trained or was on its way there (an SGLang
engine does not say whether its memory is released). A failed switch the scheduler
declared, or one that left the cell unusable, counts there as the phase it failed in,
not the role it names: the engine may have been released before the agent hung.

A core cell's trainer leave that times out (``TrainerSeat``) is rolled back by joining
again: the trainer goes on leaving once its micro-step in hand is done, and the cell
would train by every account with nothing claiming.

Every resume of an engine whose memory was (or may have been) released, on the way back
from training, in a rollback from ``releasing`` or ``joining``, or at a restart, is followed
by loading the newest published weights, whatever version the engine reports: SGLang's
release frees the weights, and without a CPU backup its resume gives back memory, not
values (``_catch_up_weights``).

A rollback step that fails leaves the cell *broken*: out of the proxy's routing, refusing
switches, until ``keep_registered`` runs the steps left. Its ``SwitchFailed`` (and each
refusal meanwhile) says ``unusable``, and the repair writes ``CellRepaired``, so the
scheduler's fold does not count the cell meanwhile, live and in a replay.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from libs.common.events import (CellRegistered, CellRepaired, Context, SwitchCompleted, SwitchFailed,
                                SwitchPhaseEntered, decode)
from libs.common.events.envelope import subject_token

from .adapters import EngineControl, ProxyControl, TrainingSeat
from .core import SwitchRecord, SwitchRefused, plan

log = logging.getLogger(__name__)


def command_subject(run_id: str, cell: str) -> str:
    return f"gyre.{run_id}.cmd.cells.{cell}"


FINISH_RETRY_S = (0.5, 1.0, 2.0, 4.0)  # waits between tries to publish a switch's outcome
ANNOUNCE_RETRY_S = (0.5, 1.0, 2.0)  # waits between tries to announce a phase (then it fails)
ANSWERS_KEPT = 32  # outcomes kept by causation id, to answer a command sent again
# the cell's last role or phase on the cells stream -> its engine's memory was released
# (surely / perhaps: a release under way, or a resume under way, when the agent stopped)
RELEASED_AFTER = frozenset({"training", "joining", "leaving"})
MAYBE_RELEASED_AFTER = frozenset({"releasing", "resuming"})
CATCH_UP_TIMEOUT_S = 120.0  # loading the newest weights on the way back (under the scheduler's 300 s request timeout)


class SwitchDeclaredFailed(RuntimeError):
    """The scheduler declared the switch under way failed (its agent did not answer)."""


class CellAgent:
    def __init__(self, *, name: str, run_id: str, bus: Any, proxy: ProxyControl, engine: EngineControl,
                 seat: TrainingSeat, engine_url: str, capacity: int = 8, is_core: bool = False,
                 role: str = "inference", latest_weights: Any = None) -> None:
        self.name, self.run_id, self.bus = name, run_id, bus
        self.proxy, self.engine, self.seat = proxy, engine, seat
        self.engine_url, self.capacity, self.is_core = engine_url, capacity, is_core
        self.role = role
        self.latest_weights = latest_weights  # adapters.LatestWeights, or None
        self.on_role: Any = None  # called with the role after each switch (health display)
        self._lock = asyncio.Lock()
        self.last: SwitchRecord | None = None
        self.last_evacuation: dict[str, Any] | None = None
        # why the cell cannot do what its role says (a rollback step failed), and the steps
        # left to get there, retried by keep_registered; None while all is well
        self.broken: str | None = None
        self._repair: tuple[Any, ...] = ()
        self.unsent: list[Any] = []  # switch outcomes the bus did not take yet
        self._answers: dict[str, SwitchRecord] = {}  # causation id -> the switch's outcome

    async def register(self) -> None:
        prepare = getattr(self.seat, "prepare", None)
        if prepare is not None:
            await prepare()
        if self.role == "inference":
            await self._leave_seat()
            await self._resume_if_released()
            await self.proxy.add(self.name, self.engine_url, self.capacity)
        await self.bus.publish(CellRegistered(run_id=self.run_id, cell=self.name, role=self.role,
                                              is_core=self.is_core, capacity=self.capacity))

    async def keep_registered(self, stop: asyncio.Event, every_s: float = 10.0) -> None:
        """A restarted proxy knows no cells: while this cell serves inference, make sure
        the proxy routes to it (never while it trains or switches)."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), every_s)
                return
            except asyncio.TimeoutError:
                pass
            if self._lock.locked():
                continue
            await self._publish_unsent()
            if self.broken is not None:
                await self._try_repair()
                continue
            if self.role != "inference":
                continue
            try:
                if all(c.get("name") != self.name for c in await self.proxy.cells()):
                    await self.proxy.add(self.name, self.engine_url, self.capacity)
                    log.info("cell %s: re-registered with the proxy", self.name)
            except Exception as exc:  # the proxy may be restarting; try again next round
                log.warning("cell %s: proxy check failed: %r", self.name, exc)

    async def switch(self, to_role: str, *, causation_id: str | None = None) -> SwitchRecord:
        async with self._lock:  # one switch at a time
            done = self._answers.get(causation_id) if causation_id is not None else None
            if done is not None:  # the same command again: its outcome is in the log already (or unsent)
                log.info("cell %s: switch %s was carried out already (%s)", self.name, causation_id,
                         "ok" if done.ok else f"failed in {done.failed_phase}")
                return done
            rec = await self._switch(to_role, causation_id)
            if causation_id is not None:
                self._answers[causation_id] = rec
                while len(self._answers) > ANSWERS_KEPT:
                    self._answers.pop(next(iter(self._answers)))
            return rec

    async def _switch(self, to_role: str, causation_id: str | None) -> SwitchRecord:
        rec = SwitchRecord(self.name, self.role, to_role)
        try:
            if self.broken is not None:
                rec.unusable = True
                raise SwitchRefused(f"cell is not usable as {self.role}: {self.broken}")
            phases = plan(self.role, to_role)
        except SwitchRefused as exc:
            rec.failed_phase, rec.reason = "refused", str(exc)
            await self._finish(rec, causation_id)
            self.last = rec
            return rec
        announced = phases[0]  # the scheduler's request entered the first phase already
        completed: list[str] = []
        for phase in phases:
            start = time.monotonic()
            try:
                if await self._declared_failed(causation_id):
                    raise SwitchDeclaredFailed(f"the scheduler declared this switch failed (its agent answered none "
                                               f"of its commands in time); stopped before {phase}")
                await self._announce(SwitchPhaseEntered(run_id=self.run_id, cell=self.name, phase=phase,
                                                        causation_id=causation_id))
                announced = phase
                log.info("cell %s: %s -> %s: %s", self.name, rec.from_role, to_role, phase)
                await self._run_phase(phase)
            except Exception as exc:
                rec.timings[phase] = time.monotonic() - start
                # the failure is reported in the last phase the log surely has (a phase
                # whose announcement failed never started; if it was stored after all,
                # the scheduler rolls back from there: core.state)
                rec.failed_phase, rec.reason = announced, repr(exc)
                log.error("cell %s: %s failed after %.2fs: %r", self.name, phase, rec.timings[phase], exc)
                problem = await self._roll_back(rec, completed)
                if problem is not None:
                    rec.reason += f"; rollback to {rec.role_now} failed, the cell is not usable: {problem}"
                    rec.unusable = True
                break
            rec.timings[phase] = time.monotonic() - start
            completed.append(phase)
            log.info("cell %s: %s done in %.2fs", self.name, phase, rec.timings[phase])
        self.role = rec.role_now
        if self.on_role is not None:
            self.on_role(self.role)
        await self._finish(rec, causation_id)
        self.last = rec
        return rec

    async def _declared_failed(self, causation_id: str | None) -> bool:
        """Whether the newest ``SwitchFailed`` of this cell names the switch under way (its
        causation id). The agent writes its own only once the switch is over, so one that
        names it now was written for it: the scheduler's declaration, or its record of a
        command no agent listened for (``declared_by_scheduler`` unset by a scheduler that
        thought no agent took it, or by an older one). Read failures count as no: the
        scheduler's fold takes whatever the agent writes next."""
        if causation_id is None:
            return False
        subject = f"gyre.{self.run_id}.{Context.CELLS.value}.{SwitchFailed.TYPE}.{subject_token(self.name)}"
        try:
            raw = await self.bus.last_on_subject(Context.CELLS, subject)
            if raw is None:
                return False
            ev = decode(raw.data)
            return isinstance(ev, SwitchFailed) and ev.causation_id == causation_id
        except Exception as exc:
            log.warning("cell %s: cannot read whether its switch was declared failed: %r", self.name, exc)
            return False

    async def _announce(self, event: SwitchPhaseEntered) -> None:
        """Publishes a phase's announcement, trying again with the same event: a try whose
        acknowledgement was lost may be stored, and JetStream drops the copy (same id)."""
        for delay in (*ANNOUNCE_RETRY_S, None):
            try:
                await self.bus.publish(event)
                return
            except Exception as exc:
                if delay is None:
                    raise
                log.warning("cell %s: could not announce %s (%r); again in %.1fs", self.name, event.phase, exc,
                            delay)
                await asyncio.sleep(delay)

    async def _run_phase(self, phase: str) -> None:
        if phase == "draining":
            return  # the proxy drains inside evacuate (one call: drain, wait, move)
        if phase == "migrating":
            result = await self.proxy.evacuate(self.name)
            self.last_evacuation = result
            if not result.get("drained", True):
                raise RuntimeError(f"{result.get('in_flight')} calls still in flight after the drain timeout")
            left = result.get("left") or []
            if left:  # the proxy stopped at its deadline: the sessions it did not move stay here
                raise RuntimeError(f"evacuation stopped ({result.get('stopped') or 'incomplete'}) after "
                                   f"{float(result.get('seconds', 0.0)):.1f}s: {len(result.get('moves') or [])} "
                                   f"session(s) moved, {len(left)} left on the cell, which goes back to inference")
        elif phase == "releasing":
            await self.engine.release()
        elif phase == "joining":
            await self.seat.join(await self._weight_version_safe())
        elif phase == "leaving":
            await self.seat.leave()
        elif phase == "resuming":
            await self.engine.resume()
            log.info("cell %s: engine memory resumed", self.name)
            await asyncio.wait_for(self._reload_weights(), CATCH_UP_TIMEOUT_S)
            await self._serve()

    async def _catch_up_weights(self, *, always: bool = False) -> None:
        """Load the newest published weights before serving: when newer than the engine's
        (published while the cell was away), or ``always`` after the engine's memory was
        released and resumed. SGLang's release (``tags=None``) frees the weights too, and
        without ``--enable-weights-cpu-backup`` its resume gives memory back, not their
        values, while it still reports the version it had: the version says nothing of
        what the engine holds then. The embedded engine parks its weights on disk and
        gets them back, so the push is redundant there, but the rule is the same for every
        engine. With nothing published (the core trainer publishes its starting weights
        when it starts), nothing can be pushed: said in the log."""
        newest = await self.latest_weights.newest() if self.latest_weights is not None else None
        if newest is None:
            if always:
                log.warning("cell %s: no published weights to load after its engine resumed; it serves what the "
                            "engine got back (an SGLang server without --enable-weights-cpu-backup lost them)",
                            self.name)
            return
        version, weights = newest
        if always or version > await self._weight_version_safe():
            from .adapters import push_weights

            log.info("cell %s: loading weights v%d (%s)", self.name, version,
                     "its engine's memory was released" if always else "published while it was away")
            await push_weights(self.engine.client, version, weights)

    async def _reload_weights(self) -> None:
        """After a resume of an engine whose memory was (or may have been) released."""
        await self._catch_up_weights(always=True)

    async def _weight_version_safe(self) -> int:
        try:
            return await self.engine.weight_version()
        except Exception:  # released engines may not answer model_info: the seat pulls the newest
            return 0

    async def _roll_back(self, rec: SwitchRecord, completed: list[str]) -> str | None:
        """Back to the record's safe role. From inference: leave the seat, resume, load the
        newest weights, serve. From training, once the seat has left (whatever failed
        after: resuming, or announcing it): release the engine's memory again and re-join
        the seat, so the cell trains as its role says. Stops at the first step that fails
        (serving from an engine that did not come back would fail agents' calls) and
        returns why; ``keep_registered`` retries the steps left."""
        if rec.from_role == "inference" and rec.role_now == "inference":
            # the engine may have released its memory once releasing began: its weights are
            # reloaded whatever version it reports (``_catch_up_weights``)
            released = "releasing" in completed or rec.failed_phase == "releasing"
            steps: tuple[Any, ...] = (self.seat.leave, self.engine.resume,
                                      self._reload_weights if released else self._catch_up_weights, self._serve)
        elif rec.from_role == "training" and "leaving" in completed:
            steps = (self.engine.release, self._rejoin)
        elif rec.from_role == "training" and rec.failed_phase == "leaving":
            # a leave that timed out may still complete (the core trainer answers once its
            # micro-step in hand is done): join again, or the cell trains by every account
            # while its seat claims nothing. A seat that never left takes the join as a no-op.
            steps = (self._rejoin,)
        else:
            return None
        return await self._run_steps(steps)

    async def _serve(self) -> None:
        """Routable again: ``add`` re-activates a known cell and registers it with a proxy
        that restarted meanwhile (``activate`` would fail there)."""
        await self.proxy.add(self.name, self.engine_url, self.capacity)

    async def _rejoin(self) -> None:
        await self.seat.join(await self._weight_version_safe())

    async def _run_steps(self, steps: tuple[Any, ...]) -> str | None:
        for k, step in enumerate(steps):
            try:
                await step()
            except Exception as exc:
                self.broken, self._repair = repr(exc), steps[k:]
                log.error("cell %s: rollback step failed, the cell is not usable until it is repaired: %r",
                          self.name, exc)
                return repr(exc)
        self.broken, self._repair = None, ()
        return None

    async def _publish_unsent(self) -> None:
        while self.unsent:
            try:
                await self.bus.publish(self.unsent[0])
            except Exception as exc:
                log.warning("cell %s: %s still not published: %r", self.name, self.unsent[0].TYPE, exc)
                return
            self.unsent.pop(0)

    async def _try_repair(self) -> None:
        """Retries the rollback steps left after one failed (keep_registered's rounds)."""
        async with self._lock:
            if self.broken is None:
                return
            if await self._run_steps(self._repair) is None:
                log.info("cell %s: repaired; serving as %s again", self.name, self.role)
                await self._publish_hard(CellRepaired(run_id=self.run_id, cell=self.name, role=self.role))

    async def _leave_seat(self) -> None:
        """A restarted agent registers in inference: its seat leaves training first. The
        core's trainer (``TrainerSeat``) lives on in its own process and may still be
        claiming for a cell that trained when its agent stopped; every seat's ``leave`` is
        a no-op when it has not joined."""
        try:
            await self.seat.leave()
        except Exception as exc:  # e.g. no core trainer runs: then none claims either
            log.error("cell %s: could not make its training seat leave: %r", self.name, exc)

    async def _resume_if_released(self) -> None:
        """A restarted agent registers in inference: an engine left released gets its memory
        back (and the newest weights) first. Whether it was released: the engine says so
        (the embedded engine does, SGLang does not), or the cells stream does (the cell
        trained, or its switch had got as far as releasing)."""
        try:
            released = await self.engine.released()
        except Exception as exc:  # an engine without server_info details: the log decides
            log.debug("cell %s: cannot read the engine's memory state: %r", self.name, exc)
            released = []
        surely = bool(released)
        if not surely:
            recorded = await self._recorded_state()
            if recorded not in RELEASED_AFTER and recorded not in MAYBE_RELEASED_AFTER:
                return
            surely = recorded in RELEASED_AFTER
            released = [f"the log has the cell {recorded}"]
        log.info("cell %s: engine memory was released (%s); resuming it", self.name, ", ".join(released))
        try:
            await self.engine.resume()
        except Exception as exc:
            if surely:
                raise
            # released, or resumed already, before the agent stopped: whichever, try serving
            log.warning("cell %s: resuming the engine failed (%r); it may not have been released", self.name, exc)
        await self._reload_weights()

    async def _recorded_state(self) -> str | None:
        """The cell's last role or phase on the cells stream (None: nothing recorded). A
        failed switch the scheduler declared (its agent hung) or whose rollback left the
        cell unusable names the role the cell should be in, not what its engine is in: it
        counts as the phase it failed in (from ``releasing`` on, the memory may be
        released); a later ``CellRepaired`` says the rollback was completed."""
        last = None
        try:
            async for d in self.bus.read(Context.CELLS, filter_subject=f"gyre.{self.run_id}.cells.>"):
                ev = d.event
                if getattr(ev, "cell", None) != self.name:
                    continue
                if isinstance(ev, SwitchFailed) and (ev.declared_by_scheduler or ev.unusable) \
                        and ev.phase in RELEASED_AFTER | MAYBE_RELEASED_AFTER:
                    last = ev.phase
                elif isinstance(ev, (CellRegistered, SwitchCompleted, SwitchFailed, CellRepaired)):
                    last = str(ev.role)
                elif isinstance(ev, SwitchPhaseEntered):
                    last = ev.phase
        except Exception as exc:
            log.warning("cell %s: cannot read its last role from the log: %r", self.name, exc)
        return last

    async def _finish(self, rec: SwitchRecord, causation_id: str | None) -> None:
        version = await self._weight_version_safe() if rec.role_now == "inference" else 0
        if rec.ok:
            ev: Any = SwitchCompleted(run_id=self.run_id, cell=self.name, role=rec.role_now,
                                      phase_timings=rec.timings, weight_version=version, causation_id=causation_id)
        else:
            ev = SwitchFailed(run_id=self.run_id, cell=self.name, role=rec.role_now, phase=rec.failed_phase or "?",
                              reason=rec.reason or "unknown", causation_id=causation_id, unusable=rec.unusable)
        await self._publish_hard(ev)

    async def _publish_hard(self, ev: Any) -> None:
        """A switch's outcome or a repair: the scheduler's fold waits on it. Behind any
        event still unsent, so the log has them in the order they happened."""
        if self.unsent:
            self.unsent.append(ev)
            return
        for delay in FINISH_RETRY_S:  # the scheduler waits on this event: try hard to write it
            try:
                await self.bus.publish(ev)
                return
            except Exception as exc:
                log.error("cell %s: could not publish %s (%r); again in %.1fs", self.name, ev.TYPE, exc, delay)
                await asyncio.sleep(delay)
        # keep_registered publishes it again until it goes (the same event id: a copy that
        # was stored after all is dropped by JetStream's de-duplication)
        self.unsent.append(ev)

    # -- command channel -----------------------------------------------------------------

    async def serve_commands(self, nc: Any) -> Any:
        async def on_request(msg: Any) -> None:
            try:
                cmd = json.loads(msg.data)
                if cmd.get("op") != "switch" or cmd.get("to_role") not in ("inference", "training"):
                    raise ValueError("expected {'op': 'switch', 'to_role': 'inference'|'training'}")
                rec = await self.switch(cmd["to_role"], causation_id=cmd.get("causation_id"))
                answer = {"ok": rec.ok, "role": rec.role_now, "timings": rec.timings, "reason": rec.reason,
                          "failed_phase": rec.failed_phase}
            except Exception as exc:
                answer = {"ok": False, "role": self.role, "reason": str(exc)}
            await msg.respond(json.dumps(answer).encode())

        return await nc.subscribe(command_subject(self.run_id, self.name), cb=on_request)


async def request_switch(nc: Any, run_id: str, cell: str, to_role: str, *, causation_id: str | None = None,
                         timeout_s: float = 300.0) -> dict[str, Any]:
    """What the scheduler sends; returns the cell's answer."""
    body = json.dumps({"op": "switch", "to_role": to_role, "causation_id": causation_id}).encode()
    msg = await nc.request(command_subject(run_id, cell), body, timeout=timeout_s)
    return json.loads(msg.data)
