"""``gyre bench transfer`` / ``gyre bench migrate``: ``run_bench(what=..., **opts) -> dict``.

- ``transfer``: ``total_mib`` (256) in blocks of ``block_kib`` (256, KV-block sized) read
  by one process from another, per adapter (``mooncake_gb_s``, ``ucx_gb_s``; best of
  ``repeats`` after one warm-up batch that also opens the connection), every byte
  checked against the owner's checksums; and ``memcpy_gb_s``, a local copy of the same
  size (the ceiling). An adapter that cannot run gives ``null`` and its error.
- ``migrate``: two embedded engines (the default tiny Qwen-architecture model, 32k
  positions) in this process; for an 8k- and a 32k-token session: ``reprefill_s`` (the
  target recomputes the prefix for the session's next call: 64 new tokens, first output
  token) vs ``migrate_s`` (port transfer + import + that first token), ``speedup`` (32k),
  ``speedup_8k``, and ``logprobs_identical`` (the next call on the target against the
  same call on the source).

The libraries' listeners bind every interface, so by default the bench re-runs itself
inside a private network namespace (``unshare -n``) when the machine allows it and says
so (``"netns"``).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import time
from typing import Any, Callable, Protocol

import numpy as np

from .kv import KVCell, migrate_session

_INSIDE = "GYRE_TRANSFER_BENCH_NETNS"


def run_bench(what: str = "transfer", *, isolate: bool = True, **opts: Any) -> dict[str, Any]:
    if isolate and os.environ.get(_INSIDE) != "1" and _netns_ok():
        return _in_netns(what, opts)
    result = {"transfer": _transfer, "migrate": _migrate}[what](**opts)
    result["netns"] = os.environ.get(_INSIDE) == "1"
    return result


def _netns_ok() -> bool:
    if not shutil.which("unshare"):
        return False
    try:
        return subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _in_netns(what: str, opts: dict) -> dict:
    code = ("import json,sys,os; from libs.common.transfer.bench import run_bench; "
            "print(json.dumps(run_bench(sys.argv[1], **json.loads(sys.argv[2]))), flush=True); os._exit(0)")
    script = 'ip link set lo up && exec "$0" -c "$1" "$2" "$3"'
    env = {**os.environ, _INSIDE: "1", "UCX_WARN_UNUSED_ENV_VARS": "n", "GLOG_minloglevel": "2"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    proc = subprocess.run(["unshare", "-n", "sh", "-c", script, sys.executable, code, what, json.dumps(opts)],
                          capture_output=True, text=True, env=env, cwd=root)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"bench {what} failed (rc {proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(lines[-1])


# -- transfer ---------------------------------------------------------------------------------


def _owner(backend: str, nbytes: int, out, stop) -> None:
    from .default import open_agent

    try:
        agent = open_agent(prefer=backend)
        data = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
        agent.register("blocks", data)
        out.put(agent.descriptor(checksums=True).to_json())
    except Exception as exc:
        out.put({"error": f"{type(exc).__name__}: {exc}"})
        return
    stop.wait()
    agent.close()


def _transfer(total_mib: int = 256, block_kib: int = 256, repeats: int = 3,
              backends: tuple[str, ...] = ("mooncake", "ucx")) -> dict[str, Any]:
    nbytes = total_mib << 20
    result: dict[str, Any] = {"total_mib": total_mib, "block_kib": block_kib, "blocks": nbytes // (block_kib << 10),
                              "repeats": repeats, "memcpy_gb_s": _memcpy_gb_s(nbytes, repeats)}
    for backend in backends:
        try:
            gb_s, verified = _adapter_gb_s(backend, nbytes, block_kib << 10, repeats)
            result[f"{backend}_gb_s"], result[f"{backend}_verified"] = round(gb_s, 3), verified
        except Exception as exc:
            result[f"{backend}_gb_s"], result[f"{backend}_error"] = None, f"{type(exc).__name__}: {exc}"
    return result


def _memcpy_gb_s(nbytes: int, repeats: int) -> float:
    src = np.random.default_rng(2).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeats))
    return round(nbytes / best / 1e9, 3)


def _adapter_gb_s(backend: str, nbytes: int, block: int, repeats: int) -> tuple[float, bool]:
    from .default import open_agent
    from .port import PeerDescriptor, split_blocks, verify_blocks

    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    owner = ctx.Process(target=_owner, args=(backend, nbytes, out, stop), daemon=True)
    owner.start()
    try:
        answer = out.get(timeout=120)
        if "error" in answer:
            raise RuntimeError(answer["error"])
        peer = PeerDescriptor.from_json(answer)
        agent = open_agent(prefer=backend)
        stage = np.zeros(nbytes, dtype=np.uint8)
        agent.register("stage", stage)
        blocks = split_blocks("stage", "blocks", nbytes, block)
        agent.read(peer, blocks[:8])  # warm-up: connection and handshake
        best = min(agent.read(peer, blocks).seconds for _ in range(repeats))
        verify_blocks(stage, peer.region("blocks").checksums)
        agent.close()
        return nbytes / best / 1e9, True
    finally:
        stop.set()
        owner.join(20)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# -- migrate ---------------------------------------------------------------------------------


class BenchCell(KVCell, Protocol):
    """A migration endpoint that can also serve the session's next call."""

    async def generate(self, input_ids: list[int], sampling_params: dict) -> dict: ...

    async def flush_cache(self) -> None: ...


def _resolve(cells: str | Callable[..., Any]) -> Callable[..., Any]:
    """``"package.module:function"`` (so the bench can run in a subprocess) or the callable."""
    if callable(cells):
        return cells
    module, _, name = cells.partition(":")
    return getattr(importlib.import_module(module), name)


def _migrate(cells: str | Callable[..., Any] | None = None, sizes: tuple[int, ...] = (8192, 32768),
             new_tokens: int = 64, backend: str | None = None, model: str = "tiny-qwen") -> dict[str, Any]:
    if cells is None:  # libs never import services: the caller names the engine's factory
        raise ValueError("bench migrate needs cells='services.engine.kv_bench:bench_cells' (or a factory)")
    return asyncio.run(_migrate_async(_resolve(cells), sizes, new_tokens, backend, model))


async def _migrate_async(open_cells, sizes, new_tokens: int, backend: str | None, model: str) -> dict[str, Any]:
    async with open_cells(model=model, backend=backend) as (a, b, info):
        result: dict[str, Any] = {"model": model, "new_tokens": new_tokens, **info}
        identical = True
        for n in sizes:
            row, same = await _one_size(a, b, n, new_tokens, info.get("vocab", 30000))
            identical = identical and same
            key = "" if n == max(sizes) else f"_{n // 1024}k"
            result.update({f"{k}{key}": v for k, v in row.items()})
        result["logprobs_identical"] = identical
    return result


async def _one_size(a: BenchCell, b: BenchCell, n: int, new_tokens: int, vocab: int) -> tuple[dict, bool]:
    rng = np.random.default_rng(n)
    one = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}
    prompt = rng.integers(0, vocab, n - new_tokens - 2).tolist()  # the turn ends 1 short of n: room for its output
    out = await a.generate(prompt, one)  # the session so far, now cached on the source
    history = prompt + out["output_ids"]
    turn = history + rng.integers(0, vocab, new_tokens).tolist()
    t0 = time.perf_counter()
    await b.generate(turn, one)  # re-prefill: the target computes the whole prefix
    reprefill = time.perf_counter() - t0
    await b.flush_cache()
    t0 = time.perf_counter()
    moved = await migrate_session(a, b, history, session_id=f"bench-{n}")
    on_target = await b.generate(turn, one)
    migrate = time.perf_counter() - t0
    on_source = await a.generate(turn, one)
    same = moved.kv == "migrated" and (on_target["meta_info"]["output_token_logprobs"]
                                       == on_source["meta_info"]["output_token_logprobs"])
    await a.flush_cache()
    await b.flush_cache()
    row = {"tokens": len(turn), "reprefill_s": round(reprefill, 4), "migrate_s": round(migrate, 4),
           "speedup": round(reprefill / migrate, 2), "migrated_tokens": moved.migrated_tokens,
           "path": moved.path, "cached_tokens": on_target["meta_info"]["cached_tokens"]}
    return row, same


if __name__ == "__main__":
    print(json.dumps(run_bench(sys.argv[1] if len(sys.argv) > 1 else "transfer", isolate=False)))
