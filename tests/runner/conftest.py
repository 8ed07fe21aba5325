"""Runner fixtures: a real nats-server (tests/conftest.py), the real proxy served in the
test's event loop in front of one scripted cell (tests/proxy/_fakes.py), and a runner
whose harness processes talk to that proxy."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from libs.common.blobs import ObjectStoreBlobStore
from libs.common.bus.jetstream import JetStreamBus
from services.proxy.service import ProxyService
from tests.proxy._fakes import ScriptedEngine, Served
from tests.proxy.conftest import RUN, model_dir, renderer, start_proxy  # noqa: F401  (fixtures)


@dataclass
class Stack:
    url: str
    service: ProxyService
    bus: JetStreamBus
    blobs: ObjectStoreBlobStore
    engine: ScriptedEngine
    run_id: str = RUN


@pytest.fixture
async def bus_blobs(nats_server) -> AsyncIterator[tuple[JetStreamBus, ObjectStoreBlobStore]]:
    bus = await JetStreamBus.connect(nats_server.url)
    blobs = await ObjectStoreBlobStore.open(bus.js)
    yield bus, blobs
    await bus.close()


@pytest.fixture
async def stack(bus_blobs, renderer) -> AsyncIterator[Stack]:  # noqa: F811
    bus, blobs = bus_blobs
    engine = ScriptedEngine(renderer.tokenizer, name="cell-a")
    served = Served(engine.app())
    url, service, server = await start_proxy(bus, blobs, renderer, {"cell-a": engine})
    service.add_cell("cell-a", served.url, capacity=4)
    try:
        yield Stack(url, service, bus, blobs, engine)
    finally:
        await service.drain_background()
        server.should_exit = True
        await asyncio.sleep(0.05)
        served.stop()
