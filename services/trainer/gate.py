"""The core cell's own worker, run only while the cell trains (option ``follow_role``).

In the seed the core cell serves inference while demand is high and trains when the
scheduler moves it to training; its optimizer and weights stay put either way. With
``follow_role`` the core trainer's worker claims micro-steps only between the cell's
``join`` and ``leave``: the core cell's agent (seat ``trainer``,
``services.cell.main.TrainerSeat``) sends them as NATS requests on
``gyre.<run>.cmd.trainer.<cell>`` during its switches, and ``leave`` is answered once the
micro-step in hand is done (a claim still waiting for weights goes back to the queue), so
the cell's engine takes its memory back only then. At start the worker follows the cell's
last role on the cells stream (a restarted trainer of a training cell claims again),
counting a switch under way by its last phase: ``joining`` is training (the agent's join
request may have come before the restart), every other phase inference (``leaving`` and
``resuming``: the agent's leave was answered, the cell serves again; ``draining``,
``migrating``, ``releasing``: the cell has not joined yet). The
core itself keeps applying updates whenever a step's micro-steps are all in.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from libs.common.events import CellRegistered, Context, SwitchCompleted, SwitchFailed, SwitchPhaseEntered

log = logging.getLogger(__name__)


def command_subject(run_id: str, cell: str) -> str:
    return f"gyre.{run_id}.cmd.trainer.{cell}"


# a switch's phases by the role the trainer takes in them (services.scheduler.core.lifecycle):
# the seat joins in ``joining``; before it the cell still serves, and ``leaving`` starts
# with the seat's leave
TRAINING_PHASES = frozenset({"joining"})


async def last_role(bus: Any, run_id: str, cell: str) -> str | None:
    """The cell's role as the cells stream last recorded it (None: never registered): a
    switch's outcome, or, while one is under way, the role of its last phase."""
    role = None
    async for d in bus.read(Context.CELLS, filter_subject=f"gyre.{run_id}.cells.>"):
        ev = d.event
        if getattr(ev, "cell", None) != cell:
            continue
        if isinstance(ev, (CellRegistered, SwitchCompleted, SwitchFailed)):
            role = str(ev.role)
        elif isinstance(ev, SwitchPhaseEntered):
            role = "training" if ev.phase in TRAINING_PHASES else "inference"
    return role


class GatedWorker:
    """Runs ``worker`` between ``join`` and ``leave``."""

    def __init__(self, worker: Any, cell: str) -> None:
        self.worker, self.cell = worker, cell
        self._task: asyncio.Task | None = None
        self._pause = asyncio.Event()
        self._lock = asyncio.Lock()
        self.commands = 0  # join/leave requests received: each is newer than any log read before it

    @property
    def claiming(self) -> bool:
        return self._task is not None and not self._task.done()

    async def join(self, *, unless_commanded_since: int | None = None) -> None:
        """Starts claiming. With ``unless_commanded_since`` (a ``commands`` count), only if
        no join/leave request came since then: the cell's own word outranks a log read
        that may predate it."""
        async with self._lock:
            if unless_commanded_since is not None and self.commands != unless_commanded_since:
                log.info("core worker: cell %s sent a request while its role was read; follows that", self.cell)
                return
            if self.claiming:
                return
            if self._task is not None:  # ended by itself (crashed): say so, start again
                ended = (await asyncio.gather(self._task, return_exceptions=True))[0]
                log.error("core worker had ended with %r; starts again", ended)
            self._pause = asyncio.Event()
            self._task = asyncio.create_task(self.worker.run(self._pause))
            log.info("core worker: cell %s trains; claiming micro-steps", self.cell)

    async def leave(self) -> None:
        async with self._lock:
            if self._task is None:
                return
            self._pause.set()
            ended = (await asyncio.gather(self._task, return_exceptions=True))[0]
            if isinstance(ended, BaseException):
                log.error("core worker ended with %r", ended)
            self._task = None
            log.info("core worker: cell %s leaves training; not claiming", self.cell)

    async def serve(self, nc: Any, run_id: str) -> Any:
        async def on_request(msg: Any) -> None:
            self.commands += 1
            try:
                op = json.loads(msg.data).get("op")
                if op == "join":
                    await self.join()
                elif op == "leave":
                    await self.leave()
                else:
                    raise ValueError("expected {'op': 'join'} or {'op': 'leave'}")
                answer = {"ok": True, "claiming": self.claiming}
            except Exception as exc:
                answer = {"ok": False, "reason": str(exc), "claiming": self.claiming}
            await msg.respond(json.dumps(answer).encode())

        return await nc.subscribe(command_subject(run_id, self.cell), cb=on_request)


async def run_gated(worker: Any, bus: Any, run_id: str, cell: str, stop: asyncio.Event) -> None:
    """The core's own work under ``follow_role``: answers its cell's join/leave requests
    until ``stop``; starts claiming at once if the cell is in training already."""
    gated = GatedWorker(worker, cell)
    sub = await gated.serve(bus.nc, run_id)
    try:
        seen = gated.commands
        if await last_role(bus, run_id, cell) == "training":
            await gated.join(unless_commanded_since=seen)  # a leave sent meanwhile (a restarted agent) wins
        await stop.wait()
    finally:
        await sub.unsubscribe()
        await gated.leave()


async def request(nc: Any, run_id: str, cell: str, op: str, *, timeout_s: float) -> dict[str, Any]:
    """What the core cell's seat sends; raises when the trainer does not answer or refuses."""
    msg = await nc.request(command_subject(run_id, cell), json.dumps({"op": op}).encode(), timeout=timeout_s)
    answer = json.loads(msg.data)
    if not answer.get("ok"):
        raise RuntimeError(f"the core trainer refused {op}: {answer.get('reason')}")
    return answer
