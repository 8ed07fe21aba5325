"""Transfer scenarios, each run in its own process inside a private network namespace
(``_netns.run_scenario``); each prints one JSON line of findings for the tests to assert.

``python -m tests.transfer.scenarios NAME '{"backend": "mooncake"}'``
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import multiprocessing as mp
import os
import signal
import sys
import time

import numpy as np


def _error(fn) -> str | None:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


# -- port contract: two processes, one backend ----------------------------------------------


def _owner(backend: str, out: mp.Queue, inbox: mp.Queue) -> None:
    from libs.common.transfer.default import open_agent

    agent = open_agent(prefer=backend)
    data = np.random.default_rng(7).integers(0, 256, 16 << 20, dtype=np.uint8)
    agent.register("kv", data)
    agent.register("inbox", np.zeros(1 << 20, np.uint8))
    out.put(agent.descriptor(checksums=True).to_json())
    while (msg := inbox.get()) != "stop":
        if msg == "inbox-sha":
            out.put(hashlib.sha256(agent.view("inbox").tobytes()).hexdigest())
        elif msg == "corrupt":
            agent.view("kv")[12345] ^= 0xFF
            out.put("done")
    agent.close()


def contract(backend: str) -> dict:
    import torch

    from libs.common.transfer.default import open_agent
    from libs.common.transfer.port import (ChecksumMismatch, PeerDescriptor, TransferFailed, TransferTimeout,
                                           split_blocks, verify_blocks)

    ctx = mp.get_context("spawn")
    out, inbox = ctx.Queue(), ctx.Queue()
    owner = ctx.Process(target=_owner, args=(backend, out, inbox), daemon=True)
    owner.start()
    peer = PeerDescriptor.from_json(json.loads(json.dumps(out.get(timeout=60))))  # as over the wire
    agent = open_agent(prefer=backend)
    r: dict = {"backend": agent.backend, "peer_backend": peer.backend}
    stage = torch.zeros(16 << 20, dtype=torch.uint8)  # a tensor region
    agent.register("stage", stage)
    agent.register("ones", np.full(1 << 20, 1, np.uint8))
    rep = agent.read(peer, split_blocks("stage", "kv", 16 << 20, 256 << 10))
    r["read_blocks"], r["read_bytes"], r["read_gb_s"] = rep.blocks, rep.nbytes, rep.gb_s
    r["read_verify"] = _error(lambda: verify_blocks(agent.view("stage"), peer.region("kv").checksums))
    agent.write(peer, split_blocks("ones", "inbox", 1 << 20, 4096))
    inbox.put("inbox-sha")
    r["write_ok"] = out.get(timeout=30) == hashlib.sha256(np.full(1 << 20, 1, np.uint8).tobytes()).hexdigest()
    bad = split_blocks("stage", "kv", 1 << 20, 1 << 20, remote_offset=(16 << 20) - 100)
    r["overrun"] = _error(lambda: agent.read(peer, bad))
    r["unknown_region"] = _error(lambda: agent.read(peer, split_blocks("stage", "nope", 10, 10)))
    other = PeerDescriptor("ucx" if backend == "mooncake" else "mooncake", peer.endpoint, peer.regions)
    r["wrong_backend"] = _error(lambda: agent.read(other, split_blocks("stage", "kv", 10, 10)))
    inbox.put("corrupt")
    out.get(timeout=30)
    stage.zero_()
    agent.read(peer, split_blocks("stage", "kv", 16 << 20, 1 << 20))
    r["corruption"] = _error(lambda: verify_blocks(agent.view("stage"), peer.region("kv").checksums))
    mismatch = _raise_of(lambda: verify_blocks(agent.view("stage"), peer.region("kv").checksums))
    r["corruption_is_mismatch"] = isinstance(mismatch, ChecksumMismatch)
    os.kill(owner.pid, signal.SIGSTOP)  # a peer that stops answering
    t0 = time.perf_counter()
    exc = _raise_of(lambda: agent.read(peer, split_blocks("stage", "kv", 16 << 20, 256 << 10), timeout_s=2.0))
    r["stalled"] = f"{type(exc).__name__}: {exc}" if exc else None
    r["stalled_is_timeout"] = isinstance(exc, TransferTimeout)
    r["stalled_s"] = time.perf_counter() - t0
    os.kill(owner.pid, signal.SIGCONT)
    os.kill(owner.pid, signal.SIGKILL)
    owner.join(10)
    t0 = time.perf_counter()
    exc = _raise_of(lambda: agent.read(peer, split_blocks("stage", "kv", 1 << 20, 256 << 10), timeout_s=3.0))
    r["dead_peer"] = f"{type(exc).__name__}: {exc}" if exc else None
    r["dead_peer_is_failure"] = isinstance(exc, TransferFailed)
    r["dead_peer_s"] = time.perf_counter() - t0
    return r


def _raise_of(fn):
    try:
        fn()
    except Exception as exc:
        return exc
    return None


# -- weight pull: core publishes in one process, a satellite pulls in another -----------------


def _core(backend: str, out: mp.Queue, inbox: mp.Queue) -> None:
    import torch

    from libs.common.transfer.default import open_agent
    from libs.common.transfer.weights import PortTransfer, publish_weights, unpublish_weights

    agent = open_agent(prefer=backend)
    g = torch.Generator().manual_seed(3)
    named = {"embed.weight": torch.randn(1000, 128, generator=g),
             "layers.0.q.weight": torch.randn(128, 128, generator=g).to(torch.bfloat16),
             "layers.0.norm": torch.randn(128, generator=g),
             "step": torch.tensor(42, dtype=torch.int64),
             "odd": torch.randn(3, 5, 7, generator=g).transpose(0, 2)}  # non-contiguous source
    desc = publish_weights(named, version="v3", agent=agent, checksums=True)
    digests = {k: hashlib.sha256(v.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
               for k, v in named.items()}
    with torch.no_grad():
        named["embed.weight"].add_(1.0)  # training goes on: the snapshot must not change
    trainer_port = PortTransfer(agent, keep=1)
    grads = [asyncio.run(trainer_port.put({"g": torch.full((4,), float(i))})) for i in range(2)]
    out.put((desc.to_json(), digests, grads))
    assert inbox.get() == "unpublish"
    unpublish_weights(desc, agent=agent)
    out.put("done")
    assert inbox.get() == "stop"
    agent.close()


def weights(backend: str) -> dict:
    import torch

    from libs.common.transfer.default import open_agent
    from libs.common.transfer.weights import PortTransfer, WeightsDescriptor, pull_weights

    ctx = mp.get_context("spawn")
    out, inbox = ctx.Queue(), ctx.Queue()
    core = ctx.Process(target=_core, args=(backend, out, inbox), daemon=True)
    core.start()
    payload, digests, grads = out.get(timeout=60)
    desc = WeightsDescriptor.from_json(json.loads(json.dumps(payload)))
    agent = open_agent(prefer=backend)
    t0 = time.perf_counter()
    tensors = pull_weights(desc, agent=agent)
    r: dict = {"pull_s": time.perf_counter() - t0, "version": desc.version, "names": sorted(tensors)}
    r["identical"] = all(
        hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest() == digests[k]
        for k, t in tensors.items())
    r["dtypes"] = {k: str(t.dtype) for k, t in tensors.items()}
    r["shapes"] = {k: list(t.shape) for k, t in tensors.items()}
    r["left_registered"] = agent.names()
    trainer_port = PortTransfer(agent)
    r["trainer_port_kind"] = grads[1]["kind"]
    r["trainer_port_newest"] = asyncio.run(trainer_port.get(grads[1]))["g"].tolist()
    old = _raise_of(lambda: asyncio.run(trainer_port.get(grads[0])))  # beyond keep=1: unpublished
    r["trainer_port_oldest"] = f"{type(old).__name__}: {old}" if old else None
    inbox.put("unpublish")
    out.get(timeout=30)
    gone = _raise_of(lambda: pull_weights(desc, agent=agent, timeout_s=5))
    r["after_unpublish"] = f"{type(gone).__name__}: {gone}" if gone else None
    inbox.put("stop")
    core.join(20)
    return r


# -- KV migration between two embedded engines ---------------------------------------------------


def migration(backend: str, other_backend: str | None = None) -> dict:
    return asyncio.run(_migration(backend, other_backend))


async def _migration(backend: str, other_backend: str | None) -> dict:
    from libs.common.bus.memory import InMemoryBus
    from libs.common.events import Context
    from libs.common.transfer.default import open_agent
    from libs.common.transfer.kv import migrate_session
    from services.engine.kv_port import PortKvMover
    from tests.transfer._engines import cell, greedy, start_engine

    source, target = start_engine(), start_engine()
    src_port = source.attach(open_agent(prefer=backend))
    dst_port = target.attach(open_agent(prefer=other_backend or backend))
    a, b = cell("A", source), cell("B", target)
    r: dict = {"agents": [src_port.agent.backend, dst_port.agent.backend]}
    try:
        prompt = list(range(1000, 1600))
        first = await a.engine.generate(prompt, greedy(24))
        history = prompt + first["output_ids"]
        turn = history + list(range(2000, 2040))
        bus = InMemoryBus()
        result = await migrate_session(a, b, history, session_id="s-1", run_id="run1", bus=bus,
                                       reason="drain", verify=True)
        r["result"] = {k: v for k, v in result.__dict__.items() if k != "seconds"}
        on_target = await b.engine.generate(turn, greedy(16))
        on_source = await a.engine.generate(turn, greedy(16))
        r["cached_on_target"] = on_target["meta_info"]["cached_tokens"]
        r["cached_on_source"] = on_source["meta_info"]["cached_tokens"]
        r["history_tokens"] = len(history)
        r["logprobs_identical"] = _logprobs(on_target) == _logprobs(on_source)
        r["outputs_identical"] = on_target["output_ids"] == on_source["output_ids"]
        events = [d.event async for d in bus.read(Context.CALLS)]
        r["events"] = [e.model_dump(mode="json", include={"session_id", "from_cell", "to_cell", "kv",
                                                           "migrated_tokens", "reason"}) for e in events]
        r["source_offers_left"] = [n for n in src_port.agent.names() if n.startswith("kv-")]
        r["target_regions_left"] = dst_port.agent.names()
        await b.flush_cache()  # the proxy's evacuation hook, on the engines' plain clients
        mover = PortKvMover()
        r["mover_tokens"] = await mover.move(a.engine, b.engine, history)
        r["mover_path"] = mover.last.path
        again = await b.engine.generate(turn, greedy(16))
        r["mover_cached"] = again["meta_info"]["cached_tokens"]
        r["mover_logprobs_identical"] = _logprobs(again) == _logprobs(on_source)
    finally:
        for c in (a, b):
            await c.aclose()
        source.close()
        target.close()
    return r


def _logprobs(response: dict) -> list:
    return [lp for lp, _, _ in response["meta_info"]["output_token_logprobs"]]


def failures(backend: str) -> dict:
    return asyncio.run(_failures(backend))


async def _failures(backend: str) -> dict:
    """Corrupted offer (refused whole), port refused (HTTP fallback), stale weights (re-prefill)."""
    from libs.common.transfer.default import open_agent
    from libs.common.transfer.kv import migrate_session
    from libs.common.transfer.port import PeerDescriptor
    from tests.transfer._engines import cell, greedy, start_engine

    source, target = start_engine(), start_engine()
    src_port = source.attach(open_agent(prefer=backend))
    dst_port = target.attach(open_agent(prefer=backend))
    a, b = cell("A", source), cell("B", target)
    r: dict = {}
    try:
        prompt = list(range(3000, 3400))
        first = await a.engine.generate(prompt, greedy(8))
        history = prompt + first["output_ids"]
        offer = await a.kv_offer(history, checksums=True)
        lease = PeerDescriptor.from_json(offer).meta["lease"]
        src_port.agent.view(lease)[4096] ^= 0x01  # one flipped bit after the checksums were taken
        before = target.engine.prefix_cache.cached_tokens
        r["corrupt_fetch"] = await _error_async(b.kv_fetch(offer, verify=True))
        r["corrupt_imported_tokens"] = target.engine.prefix_cache.cached_tokens - before
        await a.kv_release(lease)
        r["offers_left"] = [n for n in src_port.agent.names() if n.startswith("kv-")]

        other = "mooncake" if backend == "ucx" else "ucx"
        own_agent, dst_port._agent = dst_port._agent, open_agent(prefer=other)  # target runs another library
        http = await migrate_session(a, b, history, session_id="s-http")
        r["http"] = {"kv": http.kv, "path": http.path, "migrated_tokens": http.migrated_tokens,
                     "errors": list(http.errors)}
        after_http = await b.engine.generate(history + [77, 78], greedy(4))
        r["http_cached"] = after_http["meta_info"]["cached_tokens"]

        dst_port._agent = own_agent
        target.engine.weight_version = "other"  # the target runs different weights: KV would be stale
        target.engine.call(target.engine.prefix_cache.flush).result(10)
        stale = await migrate_session(a, b, history, session_id="s-stale")
        r["stale"] = {"kv": stale.kv, "path": stale.path, "errors": list(stale.errors)}
        after = await b.engine.generate(history + [5, 6], greedy(4))
        r["stale_next_call_cached"] = after["meta_info"]["cached_tokens"]
        r["stale_next_call_tokens"] = len(after["output_ids"])
        r.update(await _weights_into_cell(source, target, src_port.agent, b))

        # an offer nobody releases: its timer drops it (the real library's region with it)
        # with no other offer, and a fetch that comes later is refused before a byte moves
        src_port.offer_ttl_s = 0.5
        expiring = await a.kv_offer(history)
        lease = PeerDescriptor.from_json(expiring).meta["lease"]
        r["expiring_registered"] = lease in src_port.agent.names()
        await asyncio.sleep(1.5)
        r["expired_left"] = [n for n in src_port.agent.names() if n == lease] + src_port.open_leases
        before = target.engine.prefix_cache.cached_tokens
        r["expired_fetch"] = await _error_async(b.kv_fetch(expiring))
        r["expired_imported_tokens"] = target.engine.prefix_cache.cached_tokens - before
    finally:
        for c in (a, b):
            await c.aclose()
        source.close()
        target.close()
    return r


async def _weights_into_cell(source, target, agent, b) -> dict:
    """The source publishes changed weights (version v2); the target cell pulls them over the port."""
    import torch

    from libs.common.transfer.weights import publish_weights

    named = {k: v.detach().clone() for k, v in source.engine.runner.model.named_parameters()}
    first = next(iter(named))
    named[first] += 0.5
    desc = publish_weights(named, version="v2", agent=agent, checksums=True)
    answer = await b._post("/gyre/weights/pull", {"descriptor": desc.to_json()})
    params = dict(target.engine.runner.model.named_parameters())
    r = {"pull_answer": answer, "pull_version": target.engine.weight_version,
         "pull_identical": all(torch.equal(params[k].detach(), v) for k, v in named.items())}
    wrong = publish_weights({first: torch.zeros(3)}, version="v9", agent=agent)
    r["pull_wrong_shape"] = await _error_async(b._post("/gyre/weights/pull", {"descriptor": wrong.to_json()}))
    r["version_after_wrong"] = target.engine.weight_version
    return r


async def _error_async(coro) -> str | None:
    try:
        await coro
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def choice(backend: str) -> dict:
    """What the embedded default picks, pinned and unpinned, and how it says so."""
    import logging

    import subprocess

    from libs.common.transfer import default

    # before any agent: the libraries read the machine's addresses when they start
    added = os.environ.get("GYRE_SCENARIO_NETNS") == "1" and subprocess.run(
        ["ip", "addr", "add", "10.9.9.9/32", "dev", "lo"], capture_output=True).returncode == 0
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: records.append(rec.getMessage())  # type: ignore[method-assign]
    logging.getLogger("libs.common.transfer.default").addHandler(handler)
    logging.getLogger("libs.common.transfer.default").setLevel(logging.INFO)
    r: dict = {"default": default.open_agent().backend}
    os.environ["GYRE_TRANSFER_BACKEND"] = backend
    r["pinned"] = default.open_agent().backend
    del os.environ["GYRE_TRANSFER_BACKEND"]
    r["unknown"] = _error(lambda: default.open_agent(prefer="carrier-pigeon"))
    probe = default.probe()
    r["probe"] = {"backend": probe.backend, "skipped": probe.skipped}
    r["log"] = records
    # GYRE_TRANSFER_HOST: the address peers are told; a second address on this private
    # namespace's loopback stands for the machine's own (only where the namespace is ours).
    # Both libraries advertise it; a transfer through it is checked on Mooncake (UCX's
    # connect to a second loopback address times out here, a NIC's is untested)
    from libs.common.transfer.port import split_blocks

    r["advertised"] = None
    if added:
        os.environ["GYRE_TRANSFER_HOST"] = "10.9.9.9"
        r["advertised"] = {}
        for name in default.BACKENDS:
            try:
                agent = default.open_agent(prefer=name)
            except default.TransferFailed:
                continue  # not installed here
            r["advertised"][name] = agent.endpoint.rsplit(":", 1)[0]
            if name == "mooncake":
                reader = default.open_agent(prefer=name)
                agent.register("kv", np.arange(1 << 16, dtype=np.uint8))
                reader.register("stage", np.zeros(1 << 16, np.uint8))
                reader.read(agent.descriptor(["kv"]), split_blocks("stage", "kv", 1 << 16, 4096), timeout_s=30)
                r["read_through_it"] = bool((reader.view("stage") == np.arange(1 << 16, dtype=np.uint8)).all())
                reader.close()
            agent.close()
    os.environ["GYRE_TRANSFER_HOST"] = "10.0.0.1:7000"
    r["bad_host"] = _error(lambda: default.open_agent(prefer=backend))
    del os.environ["GYRE_TRANSFER_HOST"]
    return r


def bench(**opts) -> dict:
    from libs.common.transfer.bench import run_bench

    return run_bench(**opts)


# -- UCX request hygiene: slow peers, abandoned requests, concurrent first reads ---------------

_SLOW_PEER_SEED = 11


def _slow_ucx_owner(delays: dict, out: mp.Queue, stop) -> None:
    """A UCX peer under load: its status reply to a request is held back ``delays[offset]``
    seconds, by the request's first block offset (a context variable: one per connection)."""
    import contextvars

    from libs.common.transfer import ucx
    from libs.common.transfer.default import open_agent

    delay = contextvars.ContextVar("delay", default=0.0)
    agent = open_agent(prefer="ucx")
    serve_views, send_status = agent._serve_views, ucx._send_status

    def views(blocks):
        delay.set(float(delays.get(str(blocks[0][1]), 0.0)))
        return serve_views(blocks)

    async def slow_status(ep, error):
        await asyncio.sleep(delay.get())
        delay.set(0.0)
        await send_status(ep, error)

    agent._serve_views, ucx._send_status = views, slow_status
    agent.register("kv", np.random.default_rng(_SLOW_PEER_SEED).integers(1, 256, 1 << 16, dtype=np.uint8))
    out.put(agent.descriptor().to_json())
    stop.wait()


def _slow_ucx_peer(delays: dict):
    from libs.common.transfer.port import PeerDescriptor

    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    owner = ctx.Process(target=_slow_ucx_owner, args=({str(k): v for k, v in delays.items()}, out, stop), daemon=True)
    owner.start()
    peer = PeerDescriptor.from_json(out.get(timeout=60))
    expected = np.random.default_rng(_SLOW_PEER_SEED).integers(1, 256, 1 << 16, dtype=np.uint8)
    return peer, expected, stop


def _timed_read(agent, peer, name: str, offset: int, length: int, timeout_s: float, into: dict) -> None:
    from libs.common.transfer.port import Block

    t0 = time.perf_counter()
    exc = _raise_of(lambda: agent.read(peer, [Block(name, 0, "kv", offset, length)], timeout_s=timeout_s))
    into[name] = {"error": f"{type(exc).__name__}: {exc}" if exc else None,
                  "timeout": type(exc).__name__ == "TransferTimeout", "s": time.perf_counter() - t0}


def ucx_stale(backend: str = "ucx") -> dict:
    """A read abandoned by its deadline must never leave its reply to be taken by the next
    read on the same endpoint (which would then 'succeed' with the wrong bytes)."""
    import threading

    from libs.common.transfer.default import open_agent

    # offset 8192: a read held 5.5 s (past ucx's outer 5 s grace); offset 0: held 2 s
    peer, expected, stop = _slow_ucx_peer({8192: 5.5, 0: 2.0})
    agent = open_agent(prefer="ucx")
    for name in ("a", "b", "c", "d", "e", "f"):
        agent.register(name, np.zeros(4096, np.uint8))
    r: dict = {}
    reads: dict = {}
    _timed_read(agent, peer, "c", 4096, 4096, 5, reads)  # connects and caches the endpoint
    r["warm_ok"] = reads["c"]["error"] is None
    # 1. B queues behind slow A; its deadline passes while it waits (before the fix: after it
    #    got the endpoint, so ucx's outer cancel cut it mid-exchange and its reply stayed queued)
    a = threading.Thread(target=_timed_read, args=(agent, peer, "a", 8192, 4096, 30, reads))
    a.start()
    time.sleep(0.2)
    _timed_read(agent, peer, "b", 0, 8, 1.5, reads)
    a.join()
    r["a"], r["b"] = reads["a"], reads["b"]
    r["a_correct"] = bool(np.array_equal(agent.view("a"), expected[8192:12288]))
    time.sleep(max(0.0, 8.0 - reads["a"]["s"] - 0.2))  # B's reply (had it been sent) has arrived
    agent.view("c")[:] = 0
    _timed_read(agent, peer, "c", 4096, 4096, 5, reads)
    r["after_queued"] = reads["c"]
    r["after_queued_correct"] = bool(np.array_equal(agent.view("c"), expected[4096:8192]))
    # 2. a deadline mid-exchange: the endpoint is dropped, the next read uses a new one
    before = agent._endpoints.get(peer.endpoint)
    _timed_read(agent, peer, "d", 0, 8, 0.5, reads)
    r["mid_exchange"] = reads["d"]
    r["mid_exchange_dropped"] = agent._endpoints.get(peer.endpoint) is not before
    time.sleep(2.0)
    _timed_read(agent, peer, "e", 4096, 4096, 5, reads)
    r["after_mid_exchange"] = reads["e"]
    r["after_mid_exchange_correct"] = bool(np.array_equal(agent.view("e"), expected[4096:8192]))
    # 3. a reply nobody waits for (a request under an id this agent never uses) is queued on
    #    the endpoint when the next read starts: it must not be taken as that read's answer
    ep, _ = agent._endpoints[peer.endpoint]

    async def stray() -> None:
        header = json.dumps({"op": "read", "id": 10**12, "blocks": [["kv", 0, 8]]}).encode()
        await ep.send(np.array([len(header)], dtype=np.uint64))
        await ep.send(np.frombuffer(header, dtype=np.uint8))

    agent._io.run(stray(), 5)
    time.sleep(2.5)  # its reply (held 2 s) is in
    _timed_read(agent, peer, "f", 4096, 4096, 5, reads)
    r["after_stray"] = reads["f"]
    r["after_stray_correct"] = bool(np.array_equal(agent.view("f"), expected[4096:8192]))
    stop.set()
    return r


def ucx_connect(backend: str = "ucx") -> dict:
    """Concurrent first reads to one peer share one endpoint; a failed read drops only its own."""
    import threading

    from libs.common.transfer.default import open_agent

    peer, expected, stop = _slow_ucx_peer({0: 2.0})
    r: dict = {}

    def race(offset: int, timeouts: tuple[float, float]) -> dict:
        agent = open_agent(prefer="ucx")  # a fresh agent: nothing connected yet
        created: list = []
        real = agent._io.ucx.create_endpoint

        async def counting(*args, **kwargs):
            ep = await real(*args, **kwargs)
            created.append(ep)
            return ep

        agent._io.ucx.create_endpoint = counting
        reads: dict = {}
        try:
            for name in "ab":
                agent.register(name, np.zeros(4096, np.uint8))
            threads = [threading.Thread(target=_timed_read, args=(agent, peer, name, offset, 4096, t, reads))
                       for name, t in zip("ab", timeouts)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            agent._io.ucx.create_endpoint = real
        cached = [e for e, _ in agent._endpoints.values()]
        return {"reads": reads, "created": len(created), "cached": len(cached),
                "leaked": sum(1 for ep in created if not ep.closed and all(ep is not e for e in cached)),
                "correct": {n: bool(np.array_equal(agent.view(n), expected[offset:offset + 4096])) for n in "ab"},
                "agent": agent}

    fast = race(4096, (10, 10))
    slow = race(0, (30, 1.0))  # the peer holds both 2 s: the 1 s read gives up
    agent = slow.pop("agent")
    fast.pop("agent").close()
    r["fast"], r["slow"] = fast, slow
    # _drop of an entry no longer cached leaves the cached one alone
    cached = agent._endpoints.get(peer.endpoint)

    class _Gone:
        aborted = False

        def abort(self):
            self.aborted = True

    gone = (_Gone(), None)
    r["drop_error"] = _error(lambda: agent._drop(peer.endpoint, gone))
    r["drop_stale_entry_keeps_cached"] = cached is not None and agent._endpoints.get(peer.endpoint) is cached
    r["drop_stale_entry_aborts_it"] = gone[0].aborted
    agent.close()
    stop.set()
    return r


if __name__ == "__main__":
    mp.set_start_method("spawn", force=True)
    name, args = sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    print(json.dumps(globals()[name](**args), default=str), flush=True)
    sys.stdout.flush()
    os._exit(0)  # library threads (Mooncake, UCX) need not be joined
