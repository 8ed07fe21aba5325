"""Fault injection for the cell agent's training seat and engine control.

``FailingSeat`` fakes a trainer replica that cannot join (e.g. the core is unreachable):
``join`` raises; ``leave`` succeeds. ``ResumeFailsOnce`` wraps the real engine control
and fails the first ``resume`` (an engine that cannot get its memory back).
``SaysNothingReleased`` wraps it too and, like SGLang's ``server_info``, never lists the
memory released. ``IdleWorker`` is the core trainer's micro-step worker (a GPU trainer on
a CPU machine): it runs until paused. ``HangingRelease`` wraps the real engine control
and hangs in ``release`` until woken (a cell agent stuck in a phase). ``SlowKvMover`` is
the proxy's KV transfer port taking its time over each session (a slow network).
``ForgetfulEngine`` is an SGLang server on a GPU (``--enable-memory-saver`` without
``--enable-weights-cpu-backup``): releasing its memory loses its weights' values, resuming
gives the memory back, not the values, and it still reports the version it had; a tensor
update makes it whole. ``PublishedWeights`` is the newest ``WeightsPublished`` and its
blob. ``RoutingProxy`` is the proxy's admin routes as a set of routed cells (evacuate
takes the cell out, add puts it in); ``NoSeatWork`` a training seat with nothing to load.
Everything else in these tests is real: the embedded engines, the proxy, NATS, the trainer's
join/leave gate.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager


class FailingSeat:
    def __init__(self) -> None:
        self.left = 0

    async def join(self, weight_version: int) -> None:
        raise ConnectionError("core unreachable")

    async def leave(self) -> None:
        self.left += 1


class ResumeFailsOnce:
    def __init__(self, real) -> None:
        self.real, self.failed, self.releases = real, False, 0

    def __getattr__(self, name):
        return getattr(self.real, name)

    async def release(self) -> None:
        self.releases += 1
        await self.real.release()

    async def resume(self) -> None:
        if not self.failed:
            self.failed = True
            raise RuntimeError("out of memory")
        await self.real.resume()


class SaysNothingReleased:
    def __init__(self, real) -> None:
        self.real = real

    def __getattr__(self, name):
        return getattr(self.real, name)

    async def released(self) -> list[str]:
        return []


class IdleWorker:
    async def run(self, pause) -> None:
        await pause.wait()


class HangingRelease:
    def __init__(self, real) -> None:
        self.real, self.entered, self.wake = real, asyncio.Event(), asyncio.Event()

    def __getattr__(self, name):
        return getattr(self.real, name)

    async def release(self) -> None:
        self.entered.set()
        await self.wake.wait()
        await self.real.release()


class SlowKvMover:
    def __init__(self, delay_s: float) -> None:
        self.delay_s, self.started = delay_s, 0

    async def move(self, source, target, input_ids: list[int]) -> int:
        self.started += 1
        await asyncio.sleep(self.delay_s)
        return 0


class ForgetfulEngine:
    def __init__(self, version: int = 0) -> None:
        self.version, self.weights_valid, self.memory_released, self.pushes = version, True, False, []
        self.client = self  # push_weights talks to the engine's client

    async def release(self) -> None:
        self.memory_released, self.weights_valid = True, False

    async def resume(self) -> None:
        self.memory_released = False  # the memory, not the values

    async def released(self) -> list[str]:
        return []  # SGLang's server_info does not say

    async def weight_version(self) -> int:
        return self.version

    @asynccontextmanager
    async def weight_update_window(self, weight_version=None):
        yield

    async def update_weights_from_tensor(self, serialized: str, *, weight_version=None) -> dict:
        self.version, self.weights_valid = int(weight_version), not self.memory_released
        self.pushes.append(self.version)
        return {"success": True}


class PublishedWeights:
    def __init__(self, version: int) -> None:
        self.version = version

    async def newest(self):
        import torch

        return self.version, {"w": torch.zeros(2)}


class RoutingProxy:
    def __init__(self) -> None:
        self.routed: set[str] = set()

    async def evacuate(self, cell: str) -> dict:
        self.routed.discard(cell)
        return {"drained": True, "moves": [], "left": []}

    async def add(self, cell: str, url: str, capacity: int) -> None:
        self.routed.add(cell)

    async def cells(self) -> list[dict]:
        return [{"name": c} for c in self.routed]


class NoSeatWork:
    async def join(self, version: int) -> None:
        return None

    async def leave(self) -> None:
        return None
