"""``gyre bench proxy``: what the recording proxy adds to each agent turn.

Against an engine that answers instantly (``instant_engine``: SGLang's ``/generate``
shape, a fixed 3-token reply, no model), one run drives 50-turn append-only chat
conversations through the proxy at contexts of about 1k, 32k and 256k tokens. Each
context is set up by one warm-up call (its first render is not part of the steady
state); then every turn's proxy time is compared with the baseline: the very
``/generate`` body the proxy sent, replayed to the same engine with the same HTTP client.
overhead = proxy time - baseline time; the agent's own request encoding happens before the
clock starts (it is the agent's cost whatever server it talks to). ``encoded_tokens_per_turn_*`` counts what the
proxy's tokenizer encoded per turn (not timed). ``exact_tokens``: every recorded input
equals what the engine received and every reused span is the engine's own output.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from libs.common.blobs import ObjectStoreBlobStore, decode_tokens
from libs.common.bus.jetstream import JetStreamBus
from libs.common.events import CallRecorded, Context, RolloutStarted
from libs.common.natsserver import EmbeddedNats, free_port

from .app import create_app
from .core.routing import Router
from .history import key_digest
from .service import ProxyConfig, ProxyService

RUN = "bench"
CONTEXTS = {"1k": 1_000, "32k": 32_000, "256k": 256_000}


def instant_engine(reply_ids: list[int], received: dict[str, dict]) -> FastAPI:
    """An SGLang-shaped engine that answers at once (so only the proxy is measured)."""
    app = FastAPI()

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        body = json.loads(await request.body())
        received[str(body.get("rid"))] = body
        n = len(body["input_ids"])
        final = {"text": "", "output_ids": reply_ids, "meta_info": {
            "id": body.get("rid"), "finish_reason": {"type": "stop", "matched": reply_ids[-1]}, "prompt_tokens": n,
            "completion_tokens": len(reply_ids), "cached_tokens": 0, "weight_version": 0,
            "output_token_logprobs": [[-0.1, t, None] for t in reply_ids]}}

        async def chunks():
            yield f"data: {json.dumps(final)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app


def _filler(renderer: Any, n_tokens: int) -> str:
    """Text of about ``n_tokens`` tokens (measured on a sample, then scaled)."""
    words = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma "
             "tau upsilon phi chi psi omega 0123 4567 89 def class return import yield async await").split()
    sample = " ".join(words[i % len(words)] for i in range(2000))
    per_word = len(renderer.tokenizer.encode(sample)) / 2000
    n_words = max(1, int(n_tokens / per_word))
    return " ".join(words[(i * 7 + i // len(words)) % len(words)] for i in range(n_words))


async def _serve(app: FastAPI) -> tuple[str, uvicorn.Server]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    asyncio.get_running_loop().create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    return f"http://127.0.0.1:{port}", server


async def _conversation(client: httpx.AsyncClient, base: str, filler: str, turns: int,
                        renderer: Any) -> tuple[list[tuple[float, str]], int]:
    """Warm-up call, then ``turns`` timed append-only turns; returns [(seconds, call id)]
    and the tokens the proxy encoded during the timed turns."""
    encoded_at_start = 0
    messages = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": filler}]
    out: list[tuple[float, str]] = []
    headers = {"Authorization": "Bearer bench-key"}
    headers = {**headers, "content-type": "application/json"}
    for turn in range(turns + 1):
        # the agent's own request encoding is not proxy work: encode before the clock starts
        body = json.dumps({"model": "policy", "messages": messages, "max_tokens": 16}).encode()
        t = time.perf_counter()
        r = await client.post(base + "/v1/chat/completions", headers=headers, content=body)
        elapsed = time.perf_counter() - t
        r.raise_for_status()
        reply = r.json()
        if turn == 0:
            encoded_at_start = renderer.encoded_tokens
        else:
            out.append((elapsed, reply["id"].removeprefix("chatcmpl-")))
        messages += [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                     {"role": "user", "content": f"Step {turn}: run the tests again and fix what fails."}]
    return out, renderer.encoded_tokens - encoded_at_start


async def _baseline(engine_client: Any, bodies: list[dict]) -> list[float]:
    times = []
    for body in bodies:
        t = time.perf_counter()
        async for _ in engine_client.generate_stream(body["input_ids"], body["sampling_params"],
                                                     return_logprob=True, rid=f"base-{uuid.uuid4().hex}"):
            pass
        times.append(time.perf_counter() - t)
    return times


async def _exact(bus: JetStreamBus, blobs: ObjectStoreBlobStore, received: dict[str, dict],
                 reply_ids: list[int]) -> bool:
    full: dict[str, list[int]] = {}
    async for d in bus.read(Context.CALLS, filter_subject=f"gyre.{RUN}.calls.CallRecorded.>"):
        ev: CallRecorded = d.event  # type: ignore[assignment]
        new = decode_tokens(await blobs.get(ev.new_input_digest))
        out = decode_tokens(await blobs.get(ev.output_digest))
        prefix = full[ev.parent_call_id][: ev.prefix_len] if ev.parent_call_id else []
        sent = received.get(f"{ev.call_id}-0", {}).get("input_ids")
        if sent != prefix + new or out != reply_ids:
            return False
        full[ev.call_id] = prefix + new + out
    return bool(full)


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def _run(turns: int, progress: bool, nats_url: str) -> dict[str, Any]:
    from services.engine.client import EngineClient
    from services.engine.model_store import default_cache_dir, ensure_tiny_qwen

    from .adapters.template import HFRenderer

    renderer = HFRenderer(ensure_tiny_qwen(default_cache_dir()))
    reply_ids = renderer.tokenizer.encode("ok", add_special_tokens=False) + [renderer.stop_token_ids[-1]]
    received: dict[str, dict] = {}
    engine_url, engine_server = await _serve(instant_engine(reply_ids, received))
    bus = await JetStreamBus.connect(nats_url)
    blobs = await ObjectStoreBlobStore.open(bus.js)
    service = ProxyService(ProxyConfig(run_id=RUN, max_context=400_000), bus=bus, blobs=blobs, renderer=renderer,
                           router=Router(), clients={}, client_factory=lambda url: EngineClient(url, timeout=120))
    service.add_cell("instant", engine_url, capacity=64)
    proxy_url, proxy_server = await _serve(create_app(service, admin_token=None))
    result: dict[str, Any] = {"bench": "proxy", "turns": turns}
    try:
        async with httpx.AsyncClient(timeout=120) as client:
            for label, size in CONTEXTS.items():
                if progress:
                    print(f"context {label}: {turns} turns ...", file=sys.stderr, flush=True)
                rollout = f"bench-{label}"
                await bus.publish(RolloutStarted(run_id=RUN, rollout_id=rollout, task_id="t", group_id="g",
                                                 harness="bench", weight_version=0,
                                                 api_key_digest=key_digest("bench-key")))
                filler = _filler(renderer, size)
                timed, encoded = await _conversation(client, f"{proxy_url}/r/{rollout}", filler, turns, renderer)
                proxy_s = [t for t, _ in timed]
                bodies = [received[f"{cid}-0"] for _, cid in timed]
                base_s = await _baseline(service.clients["instant"], bodies)
                overhead = [(p - b) * 1000 for p, b in zip(proxy_s, base_s)]
                result[f"overhead_ms_p50_{label}"] = round(statistics.median(overhead), 3)
                result[f"overhead_ms_p99_{label}"] = round(_pct(overhead, 0.99), 3)
                result[f"encoded_tokens_per_turn_{label}"] = round(encoded / turns, 2)
                result[f"context_tokens_{label}"] = len(bodies[-1]["input_ids"])
        result["exact_tokens"] = await _exact(bus, blobs, received, reply_ids)
        result["drift"] = dict(service.stats.drift)
    finally:
        proxy_server.should_exit = engine_server.should_exit = True
        await asyncio.sleep(0.1)
        await bus.close()
    keep = ["overhead_ms_p50_1k", "overhead_ms_p50_32k", "overhead_ms_p50_256k", "overhead_ms_p99_256k",
            "encoded_tokens_per_turn_1k", "encoded_tokens_per_turn_32k", "encoded_tokens_per_turn_256k",
            "exact_tokens"]
    return {**{k: result[k] for k in ("bench", "turns")}, **{k: result[k] for k in keep}, **{
        k: v for k, v in result.items() if k not in keep and k not in ("bench", "turns")}}


def run_bench(turns: int = 50, progress: bool = True) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="gyre-bench-proxy-") as tmp, EmbeddedNats(Path(tmp) / "nats") as nats:
        return asyncio.run(_run(turns, progress, nats.url))
