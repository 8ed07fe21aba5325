"""Proxy fixtures: the real Qwen tokenizer and template, a real nats-server, the proxy
served over real HTTP in the test's event loop, and scripted SGLang-compatible cells."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
import uvicorn

from libs.common.blobs import ObjectStoreBlobStore
from libs.common.bus.jetstream import JetStreamBus
from libs.common.events import RolloutStarted
from libs.common.natsserver import EmbeddedNats, free_port
from services.engine.client import EngineClient
from services.proxy.adapters.template import HFRenderer
from services.proxy.app import create_app
from services.proxy.core.routing import Router
from services.proxy.history import key_digest
from services.proxy.service import ProxyConfig, ProxyService

from ._fakes import ScriptedEngine, Served

RUN = "ptest"
ADMIN = "admin-secret"


@pytest.fixture(scope="session")
def model_dir():
    from services.engine.model_store import default_cache_dir, ensure_tiny_qwen

    return ensure_tiny_qwen(default_cache_dir())


@pytest.fixture(scope="session")
def renderer(model_dir) -> HFRenderer:
    return HFRenderer(model_dir)


@dataclass
class ProxyHarness:
    url: str
    service: ProxyService
    bus: JetStreamBus
    blobs: ObjectStoreBlobStore
    engines: dict[str, ScriptedEngine]
    served: list[Served] = field(default_factory=list)

    async def rollout(self, rollout_id: str, key: str = "k-secret") -> str:
        await self.bus.publish(RolloutStarted(run_id=RUN, rollout_id=rollout_id, task_id="t", group_id="g",
                                              harness="test", weight_version=0, api_key_digest=key_digest(key)))
        return f"{self.url}/r/{rollout_id}"


async def start_proxy(bus, blobs, renderer, engines: dict[str, ScriptedEngine], **config) -> tuple[str, ProxyService,
                                                                                                   uvicorn.Server]:
    service = ProxyService(ProxyConfig(run_id=RUN, **config), bus=bus, blobs=blobs, renderer=renderer, router=Router(),
                           clients={}, client_factory=lambda url: EngineClient(url, timeout=30))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(service, admin_token=ADMIN), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    asyncio.get_running_loop().create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    return f"http://127.0.0.1:{port}", service, server


@pytest.fixture
async def proxy(tmp_path, renderer) -> AsyncIterator[ProxyHarness]:
    with EmbeddedNats(tmp_path / "nats") as nats:
        bus = await JetStreamBus.connect(nats.url)
        blobs = await ObjectStoreBlobStore.open(bus.js)
        engines = {"cell-a": ScriptedEngine(renderer.tokenizer, name="cell-a"),
                   "cell-b": ScriptedEngine(renderer.tokenizer, name="cell-b")}
        served = {name: Served(e.app()) for name, e in engines.items()}
        url, service, server = await start_proxy(bus, blobs, renderer, engines)
        for name, s in served.items():
            service.add_cell(name, s.url, capacity=4)
        harness = ProxyHarness(url, service, bus, blobs, engines, list(served.values()))
        try:
            yield harness
        finally:
            await service.drain_background()
            server.should_exit = True
            await asyncio.sleep(0.05)
            for s in served.values():
                s.stop()
            await bus.close()


@pytest.fixture
async def sdk():
    """Wraps the anthropic/openai SDKs' async clients a test makes and closes them in the
    test's own event loop. An SDK client left open is closed by its __del__ whenever it is
    collected, in a later test's loop, where its transport's loop is gone: that logs
    'Task exception was never retrieved' into the later test."""
    made: list = []

    def keep(client):
        made.append(client)
        return client

    yield keep
    for client in made:
        await client.close()
