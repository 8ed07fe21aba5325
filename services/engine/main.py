"""Wiring: settings -> model -> engine -> HTTP app -> uvicorn. ``gyre serve engine`` calls :func:`serve`."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI

from .engine import Engine
from .http_app import create_app
from .model_runner import ModelRunner
from .model_store import resolve_model
from .settings import EngineSettings
from .weights import WeightManager

log = logging.getLogger(__name__)


@dataclass
class EngineService:
    settings: EngineSettings
    engine: Engine
    weights: WeightManager
    app: FastAPI

    def close(self) -> None:
        port = getattr(self.app.state, "kv_port", None)
        if port is not None:  # open KV offers are dropped (their leases unregistered)
            try:
                port.close()
            except Exception as exc:
                log.warning("engine: dropping open KV offers at close failed: %r", exc)
        self.engine.stop()


def build(settings: EngineSettings) -> EngineService:
    """Loads the model and starts the engine thread; the caller serves ``app`` and closes."""
    import torch
    from transformers import AutoTokenizer

    if settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    location = resolve_model(settings.model, settings.cache_dir)
    runner = ModelRunner.load(location)
    runner.output_kernel = settings.output_kernel
    kwargs: dict[str, Any] = {"gguf_file": location.gguf_file} if location.gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(str(location.folder), **kwargs)
    engine = Engine(runner, tokenizer, settings)
    weights = WeightManager(engine)
    app = create_app(settings, engine=engine, weights=weights)
    engine.start()
    return EngineService(settings, engine, weights, app)


def exposure_warnings(settings: EngineSettings) -> list[str]:
    """What an operator should know when the engine listens beyond loopback: ``/generate``
    takes no key (as SGLang without ``--api-key``), and without an admin token neither do
    the control endpoints (weight updates, memory release, flush)."""
    if settings.host in ("127.0.0.1", "localhost", "::1"):
        return []
    out = [f"engine listens on {settings.host}: /generate answers anyone who can reach it; "
           "keep the port on a private network"]
    if settings.admin_token is None:
        out.append("no admin token (GYRE_ENGINE_ADMIN_TOKEN): weight updates, memory release and flush are open too")
    return out


def serve(host: str | None = None, port: int | None = None, model: str | None = None, **overrides: Any) -> None:
    """Runs one embedded engine until interrupted (blocking)."""
    import uvicorn

    values = {k: v for k, v in {"host": host, "port": port, "model": model, **overrides}.items() if v is not None}
    settings = EngineSettings(**values)
    service = build(settings)
    log.info("engine serving %s on %s:%s", settings.model, settings.host, settings.port)
    for warning in exposure_warnings(settings):
        log.warning(warning)
    try:
        uvicorn.run(service.app, host=settings.host, port=settings.port, log_level="warning")
    finally:
        service.close()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Gyre's embedded SGLang-compatible engine")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--model", default="tiny-qwen")
    args = parser.parse_args()
    serve(args.host, args.port, args.model)
