"""The core cell's own worker, gated by the cell's role (option ``follow_role``).

In the seed the core cell serves inference while demand is high and trains when the
scheduler moves it to training; its optimizer and weights stay put either way. With
``follow_role`` the core trainer's worker claims micro-steps only while the cells stream
says its cell (``cell``) is in the ``training`` role (``CellRegistered``, then each
``SwitchCompleted`` / ``SwitchFailed``); the core itself keeps applying updates whenever a
step's micro-steps are all in (from satellites or from its own worker). Leaving training,
the worker finishes the micro-step in hand (a claim still waiting for weights goes back to
the queue).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from libs.common.events import CellRegistered, Context, SwitchCompleted, SwitchFailed, decode

log = logging.getLogger(__name__)


class CellRole:
    """The role of one cell, as the cells stream says."""

    def __init__(self, run_id: str, cell: str) -> None:
        self.run_id, self.cell = run_id, cell
        self.role: str | None = None
        self.training, self.not_training = asyncio.Event(), asyncio.Event()
        self.not_training.set()

    def apply(self, ev: Any) -> None:
        if isinstance(ev, (CellRegistered, SwitchCompleted, SwitchFailed)) and ev.cell == self.cell:
            self.role = str(ev.role)
            if self.role == "training":
                self.not_training.clear()
                self.training.set()
            else:
                self.training.clear()
                self.not_training.set()

    async def follow(self, bus: Any, stop: asyncio.Event) -> None:
        follow = bus.follow(Context.CELLS, filter_subject=f"gyre.{self.run_id}.cells.>", idle_s=0.2)
        try:
            async for raw in follow:
                if raw is not None:
                    self.apply(decode(raw.data))
                if stop.is_set():
                    return
        finally:
            await follow.aclose()


async def _first(*aws: Any) -> None:
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def run_gated(worker: Any, role: CellRole, bus: Any, stop: asyncio.Event) -> None:
    """Runs ``worker`` while ``role`` is training, until ``stop``."""
    follower = asyncio.create_task(role.follow(bus, stop))
    try:
        while not stop.is_set():
            await _first(role.training.wait(), stop.wait())
            if stop.is_set():
                return
            log.info("core worker: cell %s trains; claiming micro-steps", role.cell)
            paused = asyncio.Event()
            task = asyncio.create_task(worker.run(paused))
            await _first(role.not_training.wait(), stop.wait(), asyncio.shield(task))
            paused.set()
            ended = (await asyncio.gather(task, return_exceptions=True))[0]
            if isinstance(ended, Exception):  # claim again after a pause, not in a tight loop
                log.error("core worker ended with %r; restarts while the cell trains", ended)
                await _first(asyncio.sleep(1.0), stop.wait())
            if not stop.is_set():
                log.info("core worker: cell %s is %s; not claiming", role.cell, role.role)
    finally:
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
