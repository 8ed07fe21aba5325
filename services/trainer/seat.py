"""A satellite as the cell agent hosts it: ``join`` when the scheduler switches the cell
to training, ``leave`` when it switches back (the shape of ``services.cell.adapters``'
``TrainingSeat``).

``join`` builds the policy model, loads the newest published weights into it (the
switch's ``joining`` phase pays for that, not the first claim; the seat prefetches the
newest version's bytes while the cell serves, so that is a load from host memory) and starts a
:class:`MicroStepWorker` on the work queue, so the cell claims micro-steps of the step in
progress (it joins mid-batch). ``leave`` stops the worker after the micro-step in hand (a
claim still waiting for weights goes back to the queue for another cell) and, unless
``keep_model`` is set, drops the model: a cell going back to inference needs the memory.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from libs.common.bus.port import BlobStore, EventBus

from .backends.base import PolicyBackend
from .transfer import TensorTransfer
from .worker import BusWeightSource, MicroStepWorker, WorkerSettings

log = logging.getLogger(__name__)


@dataclass
class SatelliteSeat:
    settings: WorkerSettings
    build_backend: Callable[[], PolicyBackend]
    bus: EventBus
    blobs: BlobStore
    gradients: TensorTransfer
    keep_model: bool = False  # keep the built model between switches (costs memory while serving)
    warm_up: Callable[[], None] | None = None  # run once at agent start (imports), never during a switch
    backend: PolicyBackend | None = None
    worker: MicroStepWorker | None = None
    joins: int = 0
    micro_steps_done: list[str] = field(default_factory=list)  # over every join
    last_join: dict[str, float] = field(default_factory=dict)  # build_s, pull_s, version, prefetched
    # While the cell serves, keep the newest published weights' bytes in host memory (one
    # copy, replaced when a newer version is published), so joining reads no network.
    prefetch: bool = True
    prefetch_every_s: float = 2.0
    _cached: tuple[int, bytes] | None = None
    _prefetcher: asyncio.Task | None = None
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task | None = None
    _busy: bool = False  # joining, trained or leaving: no prefetching meanwhile
    _closed: bool = False
    # join, leave, close and a prefetch's store take turns (a prefetch in flight finishes
    # before a join reads the cache: one read of the blob, one copy in memory)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def prepare(self) -> None:
        """At agent start: import the model code once (as a long-lived trainer has), so a
        first switch does not pay for it; start prefetching published weights (bytes only:
        no model is built)."""
        if self.warm_up is not None:
            await asyncio.to_thread(self.warm_up)
        if self.prefetch and self._prefetcher is None:
            self._prefetcher = asyncio.create_task(self._prefetch_loop())

    async def close(self) -> None:
        """At the cell's shutdown: no more joins, the prefetching stopped, the worker left."""
        self._closed = True
        if self._prefetcher is not None:
            self._prefetcher.cancel()
            await asyncio.gather(self._prefetcher, return_exceptions=True)
            self._prefetcher = None
        await self.leave()
        self._cached = None

    async def _prefetch_loop(self) -> None:
        source = BusWeightSource(self.bus, self.blobs, self.settings.run_id)
        while True:
            try:
                await self._prefetch_once(source)
            except Exception as exc:  # the log or the store may be restarting: try again later
                log.warning("satellite %s: prefetching weights failed: %r", self.settings.cell, exc)
            await asyncio.sleep(self.prefetch_every_s)

    async def _prefetch_once(self, source: BusWeightSource) -> None:
        if self._busy:
            return
        ev = await source.last_event()
        if ev is None or ev.checkpoint_digest is None:
            return
        if self._cached is not None and self._cached[0] >= ev.weight_version:
            return
        async with self._lock:
            if self._busy or (self._cached is not None and self._cached[0] >= ev.weight_version):
                return
            self._cached = None  # the older copy goes before the newer one arrives
            self._cached = (ev.weight_version, await self.blobs.get(ev.checkpoint_digest))
        log.info("satellite %s: prefetched weights v%d", self.settings.cell, ev.weight_version)

    @property
    def prefetched_version(self) -> int | None:
        return None if self._cached is None else self._cached[0]

    async def _newest_weights(self, source: BusWeightSource) -> tuple[int, dict[str, Any], bool] | None:
        """The newest published version and its weights, from the prefetched bytes when they
        are that version (True), else from the blob store. The bytes are dropped once
        loaded (the model holds the weights now; the next version is prefetched after
        leaving)."""
        from safetensors.torch import load

        ev = await source.last_event()
        if ev is None or ev.checkpoint_digest is None:
            return None
        cached, self._cached = self._cached, None
        if cached is not None and cached[0] == ev.weight_version:
            return ev.weight_version, await asyncio.to_thread(load, cached[1]), True
        del cached
        data = await self.blobs.get(ev.checkpoint_digest)
        return ev.weight_version, await asyncio.to_thread(load, data), False

    async def join(self, weight_version: int) -> None:
        async with self._lock:
            if self._closed:
                raise RuntimeError(f"satellite {self.settings.cell} is closed")
            if self._task is not None and not self._task.done():
                return
            self._task, self._busy = None, True  # a worker that ended (crashed) is replaced
            start = time.monotonic()
            try:
                if self.backend is None:
                    self.backend = await asyncio.to_thread(self.build_backend)
                built = time.monotonic()
                weights = BusWeightSource(self.bus, self.blobs, self.settings.run_id)
                worker = MicroStepWorker(self.settings, self.backend, bus=self.bus, blobs=self.blobs,
                                         gradients=self.gradients, weights=weights)
                newest = await self._newest_weights(weights)
                version, prefetched = -1, False
                if newest is not None:  # the core has published: hold its newest weights before claiming
                    version, state, prefetched = newest
                    await asyncio.to_thread(self.backend.load_hf_state_dict, state)
                    del state
                    worker.version = version  # (a newer one published meanwhile is pulled at the next claim)
            except BaseException:
                self._free()  # a failed join holds no memory: the cell goes back to serving
                self._busy = False
                raise
            self.last_join = {"build_s": built - start, "pull_s": time.monotonic() - built,
                              "version": float(version), "prefetched": float(prefetched)}
            self.worker, self.joins = worker, self.joins + 1
            self._stop = asyncio.Event()
            self._task = asyncio.create_task(worker.run(self._stop))
        log.info("satellite %s joined training at v%d (model %.2fs, weights %.2fs%s)", self.settings.cell, version,
                 self.last_join["build_s"], self.last_join["pull_s"], ", prefetched" if prefetched else "")

    async def leave(self) -> None:
        async with self._lock:
            if self._task is not None:
                self._stop.set()
                results = await asyncio.gather(self._task, return_exceptions=True)
                self._task = None
                if self.worker is not None:
                    self.micro_steps_done.extend(self.worker.done)
                if isinstance(results[0], BaseException):
                    log.error("satellite %s: worker ended with %r", self.settings.cell, results[0])
                log.info("satellite %s left training (%d micro-steps over %d joins)", self.settings.cell,
                         len(self.micro_steps_done), self.joins)
            close = getattr(self.gradients, "close", None)  # the port's gradient snapshots (pinned memory)
            if close is not None:
                try:
                    await close()
                except Exception as exc:
                    log.warning("satellite %s: releasing its gradient snapshots failed: %r", self.settings.cell, exc)
            if not self.keep_model:
                self._free()
                await asyncio.to_thread(gc.collect)
            self._busy = False

    def _free(self) -> None:
        self.backend, self.worker = None, None

    @property
    def joined(self) -> bool:
        return self._task is not None and not self._task.done()

    def stats(self) -> dict[str, Any]:
        done = self.micro_steps_done + (list(self.worker.done) if self.worker is not None and self._task else [])
        return {"joined": self.joined, "joins": self.joins, "micro_steps_done": done}
