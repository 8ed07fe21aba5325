"""Shared fixtures: the tiny Qwen-architecture model (built once into the user cache) and engines."""

from __future__ import annotations

import httpx
import pytest
import torch

from services.engine.client import EngineClient
from services.engine.main import EngineService, build
from services.engine.model_store import default_cache_dir, ensure_tiny_qwen
from services.engine.settings import EngineSettings


@pytest.fixture(scope="session")
def tiny_model_dir():
    return ensure_tiny_qwen(default_cache_dir())


def make_service(**overrides) -> EngineService:
    settings = EngineSettings(model=overrides.pop("model", "tiny-qwen"), **overrides)
    return build(settings)


def asgi_client(service: EngineService, admin_token: str | None = None) -> EngineClient:
    return EngineClient("http://engine", admin_token=admin_token, transport=httpx.ASGITransport(app=service.app))


@pytest.fixture(scope="session")
def shared_service(tiny_model_dir):
    """One engine for tests that leave no lasting state (no weight or memory changes)."""
    service = make_service()
    yield service
    service.close()


@pytest.fixture(scope="module")
def admin_service(tiny_model_dir):
    """An engine with an admin token, shared by one module; reset before each test."""
    service = make_service(admin_token="secret")
    service.original = {k: v.detach().clone() for k, v in service.engine.runner.model.named_parameters()}
    yield service
    service.close()


@pytest.fixture
def fresh_service(admin_service):
    admin_service.engine.call(lambda: reset_engine(admin_service)).result(timeout=60)
    return admin_service


def reset_engine(service) -> None:
    """Engine thread: back to the freshly loaded state (weights, version, cache, pause)."""
    engine, weights = service.engine, service.weights
    engine.abort(None, "test reset")
    engine.resume()
    weights.resume(["weights", "kv_cache"])
    weights.staged = None
    params = weights.params
    with torch.no_grad():
        for key, value in service.original.items():
            params[key].data.copy_(value)
    engine.runner.weights_changed()
    engine.weight_version = service.settings.weight_version
    engine.prefix_cache.flush()


@pytest.fixture
async def http(shared_service):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=shared_service.app), base_url="http://engine") as c:
        yield c
