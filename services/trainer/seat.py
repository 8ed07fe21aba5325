"""A satellite as the cell agent hosts it: ``join`` when the scheduler switches the cell
to training, ``leave`` when it switches back (the shape of ``services.cell.adapters``'
``TrainingSeat``).

``join`` builds the policy model once per seat (kept between switches, so a second
switch costs only the weight pull) and starts a :class:`MicroStepWorker` on the work
queue; ``leave`` stops it after the micro-step in hand (an unacked claim would simply be
delivered to another cell).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from libs.common.bus.port import BlobStore, EventBus

from .backends.base import PolicyBackend
from .transfer import TensorTransfer
from .worker import BusWeightSource, MicroStepWorker, WorkerSettings


@dataclass
class SatelliteSeat:
    settings: WorkerSettings
    build_backend: Callable[[], PolicyBackend]
    bus: EventBus
    blobs: BlobStore
    gradients: TensorTransfer
    backend: PolicyBackend | None = None
    worker: MicroStepWorker | None = None
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task | None = None

    async def join(self, weight_version: int) -> None:
        if self._task is not None:
            return
        if self.backend is None:
            self.backend = await asyncio.to_thread(self.build_backend)
        weights = BusWeightSource(self.bus, self.blobs, self.settings.run_id)
        self.worker = MicroStepWorker(self.settings, self.backend, bus=self.bus, blobs=self.blobs,
                                      gradients=self.gradients, weights=weights)
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self.worker.run(self._stop))

    async def leave(self) -> None:
        if self._task is None:
            return
        self._stop.set()
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None

    @property
    def joined(self) -> bool:
        return self._task is not None and not self._task.done()

    def stats(self) -> dict[str, Any]:
        return {"joined": self.joined, "micro_steps_done": list(self.worker.done) if self.worker else []}
