"""Two embedded engines in one process (tiny-qwen), each with its own transfer agent, for
migration scenarios. HTTP goes through ASGI (in-process); the KV blocks go through the real
transfer library over TCP."""

from __future__ import annotations

import httpx

from services.engine.kv_port import PortCellClient, attach
from services.engine.main import build
from services.engine.settings import EngineSettings

ADMIN = "secret"


class EngineHandle:
    def __init__(self, **overrides) -> None:
        settings = EngineSettings(model="tiny-qwen", admin_token=ADMIN, num_threads=1, **overrides)
        self.service = build(settings)
        self.engine = self.service.engine

    def attach(self, agent):
        return attach(self.service, agent)

    def close(self) -> None:
        self.service.close()


def start_engine(**overrides) -> EngineHandle:
    return EngineHandle(**overrides)


def cell(name: str, handle: EngineHandle) -> PortCellClient:
    return PortCellClient(name, "http://engine", admin_token=ADMIN, transport=httpx.ASGITransport(app=handle.service.app))


def greedy(n: int) -> dict:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
