"""The cell agent: one per cell; carries out the scheduler's switch commands.

Each phase is announced (``SwitchPhaseEntered``), timed, and the switch ends in exactly
one ``SwitchCompleted`` or ``SwitchFailed`` (with the phase, the reason, and the safe role
the cell was rolled back to). Commands arrive as NATS requests on
``gyre.<run>.cmd.cells.<cell>`` (``{"op": "switch", "to_role": "training"}``) and are
answered with the outcome, so every command is also an event in the log.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from libs.common.events import CellRegistered, SwitchCompleted, SwitchFailed, SwitchPhaseEntered

from .adapters import EngineControl, ProxyControl, TrainingSeat
from .core import SwitchRecord, SwitchRefused, plan

log = logging.getLogger(__name__)


def command_subject(run_id: str, cell: str) -> str:
    return f"gyre.{run_id}.cmd.cells.{cell}"


FINISH_RETRY_S = (0.5, 1.0, 2.0, 4.0)  # waits between tries to publish a switch's outcome
CATCH_UP_TIMEOUT_S = 120.0  # loading the newest weights on the way back (under the scheduler's 300 s request timeout)


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

    async def register(self) -> None:
        prepare = getattr(self.seat, "prepare", None)
        if prepare is not None:
            await prepare()
        if self.role == "inference":
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
            rec = SwitchRecord(self.name, self.role, to_role)
            try:
                if self.broken is not None:
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
                    await self.bus.publish(SwitchPhaseEntered(run_id=self.run_id, cell=self.name, phase=phase,
                                                              causation_id=causation_id))
                    announced = phase
                    log.info("cell %s: %s -> %s: %s", self.name, rec.from_role, to_role, phase)
                    await self._run_phase(phase)
                except Exception as exc:
                    rec.timings[phase] = time.monotonic() - start
                    # the failure is reported in the last phase the log knows of (a phase
                    # whose announcement failed never started)
                    rec.failed_phase, rec.reason = announced, repr(exc)
                    log.error("cell %s: %s failed after %.2fs: %r", self.name, phase, rec.timings[phase], exc)
                    problem = await self._roll_back(rec, completed)
                    if problem is not None:
                        rec.reason += f"; rollback to {rec.role_now} failed, the cell is not usable: {problem}"
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

    async def _run_phase(self, phase: str) -> None:
        if phase == "draining":
            return  # the proxy drains inside evacuate (one call: drain, wait, move)
        if phase == "migrating":
            result = await self.proxy.evacuate(self.name)
            self.last_evacuation = result
            if not result.get("drained", True):
                raise RuntimeError(f"{result.get('in_flight')} calls still in flight after the drain timeout")
        elif phase == "releasing":
            await self.engine.release()
        elif phase == "joining":
            await self.seat.join(await self._weight_version_safe())
        elif phase == "leaving":
            await self.seat.leave()
        elif phase == "resuming":
            await self.engine.resume()
            log.info("cell %s: engine memory resumed", self.name)
            await asyncio.wait_for(self._catch_up_weights(), CATCH_UP_TIMEOUT_S)
            await self._serve()

    async def _catch_up_weights(self) -> None:
        """Weights published while this cell trained: load the newest before serving."""
        if self.latest_weights is None:
            return
        newest = await self.latest_weights.newest()
        if newest is None:
            return
        version, weights = newest
        if version > await self._weight_version_safe():
            from .adapters import push_weights

            log.info("cell %s: loading weights v%d published while it trained", self.name, version)
            await push_weights(self.engine.client, version, weights)

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
            steps: tuple[Any, ...] = (self.seat.leave, self.engine.resume, self._catch_up_weights, self._serve)
        elif rec.from_role == "training" and "leaving" in completed:
            steps = (self.engine.release, self._rejoin)
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

    async def _resume_if_released(self) -> None:
        """A restarted agent registers in inference: an engine left released (the cell was
        training when its agent stopped) gets its memory back first."""
        try:
            released = await self.engine.released()
        except Exception as exc:  # an engine without server_info details: nothing to check
            log.debug("cell %s: cannot read the engine's memory state: %r", self.name, exc)
            return
        if released:
            log.info("cell %s: engine memory was released (%s); resuming it", self.name, ", ".join(released))
            await self.engine.resume()
            await self._catch_up_weights()

    async def _finish(self, rec: SwitchRecord, causation_id: str | None) -> None:
        version = await self._weight_version_safe() if rec.role_now == "inference" else 0
        if rec.ok:
            ev: Any = SwitchCompleted(run_id=self.run_id, cell=self.name, role=rec.role_now,
                                      phase_timings=rec.timings, weight_version=version, causation_id=causation_id)
        else:
            ev = SwitchFailed(run_id=self.run_id, cell=self.name, role=rec.role_now, phase=rec.failed_phase or "?",
                              reason=rec.reason or "unknown", causation_id=causation_id)
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
