"""``gyre bench switch``: role switches of an embedded cell against a cold restart.

Two embedded engine cells (``gyre serve engine`` processes) behind the proxy; four agent
sessions in the middle of their conversations, spread over both cells. Cell ``e1``
switches inference -> training (drain, migrate its sessions' KV caches to ``e0``,
release its engine's memory, join training as a satellite trainer: build the policy and
load the newest weights the core published, here v0, which the seat prefetched from the
blob store while the cell served; ``cold_pull_weights_s`` is that read without the
prefetch) and back (leave:
stop claiming and free the model; resume memory, take sessions again). Every session must complete a turn after
each switch. ``cold_restart_s``: spawning the same engine command until
``/health_generate`` answers. ``switch_vs_restart`` = the larger switch / the restart.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from libs.common.blobs import ObjectStoreBlobStore
from libs.common.bus.jetstream import JetStreamBus
from libs.common.events import RolloutStarted
from libs.common.natsserver import EmbeddedNats, free_port

ADMIN = "bench-admin"
RUN = "switchbench"


def _spawn_engine(port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "GYRE_ENGINE_ADMIN_TOKEN": ADMIN, "GYRE_ENGINE_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "gyre", "serve", "engine", "--port", str(port)], env=env,
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


async def _wait_ready(url: str, timeout_s: float = 180.0) -> float:
    start = time.monotonic()
    async with httpx.AsyncClient(timeout=10) as c:
        while time.monotonic() - start < timeout_s:
            try:
                if (await c.get(url + "/health_generate")).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    raise TimeoutError(f"engine at {url} not ready within {timeout_s}s")


async def _turn(c: httpx.AsyncClient, base: str, history: list[dict]) -> None:
    r = await c.post(base + "/v1/chat/completions", headers={"Authorization": "Bearer bench-key"},
                     json={"model": "policy", "messages": history, "max_tokens": 8, "temperature": 0})
    if r.status_code != 200:
        raise RuntimeError(f"a session failed its turn: {r.status_code} {r.text[:200]}")
    history += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or "."},
                {"role": "user", "content": "continue"}]


async def _run(tmp: Path, nats_url: str, progress: bool) -> dict[str, Any]:
    from services.cell.adapters import EngineControl, ProxyControl, WeightsSeat
    from libs.common.events import WeightsPublished
    from services.cell.agent import CellAgent
    from services.trainer.main import satellite_seat
    from services.engine.client import EngineClient
    from services.engine.model_store import default_cache_dir, ensure_tiny_qwen
    from services.proxy.bench import _serve
    from services.proxy.adapters.template import HFRenderer
    from services.proxy.app import create_app
    from services.proxy.core.routing import Router
    from services.proxy.history import key_digest
    from services.proxy.service import ProxyConfig, ProxyService

    def say(msg: str) -> None:
        if progress:
            print(msg, file=sys.stderr, flush=True)

    folder = ensure_tiny_qwen(default_cache_dir())
    ports = [free_port(), free_port()]
    procs = [_spawn_engine(p, tmp / f"engine{i}.log") for i, p in enumerate(ports)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    bus = await JetStreamBus.connect(nats_url)
    try:
        say("starting two engine cells ...")
        await asyncio.gather(*(_wait_ready(u) for u in urls))
        blobs = await ObjectStoreBlobStore.open(bus.js)
        service = ProxyService(ProxyConfig(run_id=RUN), bus=bus, blobs=blobs, renderer=HFRenderer(folder),
                               router=Router(), clients={},
                               client_factory=lambda url: EngineClient(url, admin_token=ADMIN, timeout=120))
        proxy_url, proxy_server = await _serve(create_app(service, admin_token=ADMIN))
        # e1 switches as a non-core cell does: its seat is a satellite trainer that builds the
        # policy and pulls the newest weights the core published (v0 here, from the blob store)
        satellite = satellite_seat(RUN, "e1", {"model": str(folder)}, bus=bus, blobs=blobs)
        digest = await blobs.put((folder / "model.safetensors").read_bytes())
        await bus.publish(WeightsPublished(run_id=RUN, weight_version=0, checkpoint_digest=digest))
        agents = [CellAgent(name=f"e{i}", run_id=RUN, bus=bus, proxy=ProxyControl(proxy_url, ADMIN),
                            engine=EngineControl(EngineClient(u, admin_token=ADMIN, timeout=120)),
                            seat=WeightsSeat(folder) if i == 0 else satellite, engine_url=u, capacity=8,
                            is_core=(i == 0))
                  for i, u in enumerate(urls)]
        for a in agents:
            await a.register()
        await bus.publish(RolloutStarted(run_id=RUN, rollout_id="sw", task_id="t", group_id="g", harness="bench",
                                         weight_version=0, api_key_digest=key_digest("bench-key")))
        base = f"{proxy_url}/r/sw"
        histories = [[{"role": "system", "content": f"agent {i}"}, {"role": "user", "content": f"task {i}"}]
                     for i in range(4)]
        async with httpx.AsyncClient(timeout=120) as c:
            for _ in range(2):
                for h in histories:
                    await _turn(c, base, h)
            for _ in range(300):  # a cell serves for a while after a publication: its seat has prefetched it
                if satellite.prefetched_version == 0:
                    break
                await asyncio.sleep(0.1)
            on_e1 = len(service.router.sessions_on("e1"))
            say(f"switching e1 to training ({on_e1} sessions on it) ...")
            to_train = await agents[1].switch("training")
            moves_snapshot, join = agents[1].last_evacuation, dict(satellite.last_join)
            if not to_train.ok:
                raise RuntimeError(f"switch to training failed in {to_train.failed_phase}: {to_train.reason}")
            await asyncio.gather(*(_turn(c, base, h) for h in histories))
            say("switching e1 back to inference ...")
            to_infer = await agents[1].switch("inference")
            if not to_infer.ok:
                raise RuntimeError(f"switch to inference failed in {to_infer.failed_phase}: {to_infer.reason}")
            await asyncio.gather(*(_turn(c, base, h) for h in histories))
        start = time.monotonic()  # joining without the prefetched copy: a read from the local NATS server
        from safetensors.torch import load

        load(await blobs.get(digest))
        cold_pull_s = time.monotonic() - start
        say("cold restart of the same engine command ...")
        restart_port = free_port()
        start = time.monotonic()
        cold = _spawn_engine(restart_port, tmp / "restart.log")
        try:
            await _wait_ready(f"http://127.0.0.1:{restart_port}")
            cold_s = time.monotonic() - start
        finally:
            cold.terminate()
            cold.wait(timeout=30)
        await satellite.close()
        proxy_server.should_exit = True
        moves = (moves_snapshot or {}).get("moves", [])
        larger = max(to_train.total_s, to_infer.total_s)
        return {
            "bench": "switch", "sessions": len(histories), "sessions_on_switched_cell": on_e1,
            "infer_to_train_s": round(to_train.total_s, 3), "train_to_infer_s": round(to_infer.total_s, 3),
            "cold_restart_s": round(cold_s, 3), "switch_vs_restart": round(larger / cold_s, 3),
            "phases_to_train": {k: round(v, 3) for k, v in to_train.timings.items()},
            "phases_to_infer": {k: round(v, 3) for k, v in to_infer.timings.items()},
            "seat": "satellite", "joining_build_s": round(join["build_s"], 3),
            "joining_load_weights_s": round(join["pull_s"], 3), "joined_at_version": int(join["version"]),
            "weights_prefetched": bool(join.get("prefetched")), "cold_pull_weights_s": round(cold_pull_s, 3),
            "all_sessions_completed": True, "sessions_moved": len(moves),
            "sessions_kv_migrated": sum(1 for m in moves if m["kv"] == "migrated"),
        }
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        await bus.close()


def run_bench(progress: bool = True) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="gyre-bench-switch-") as tmp, EmbeddedNats(Path(tmp) / "nats") as nats:
        return asyncio.run(_run(Path(tmp), nats.url, progress))
