"""The chat template and the tokenizer run off the event loop.

Rendering and tokenising a long agent history takes from tens of milliseconds to over a
second (about 1.2 s for 200k tokens with the Qwen tokenizer on this machine); on the event
loop that would stall every other session's stream. The proxy hands that work to render
threads (``ProxyService.off_loop``), under each rollout's lock, so a rollout's calls are
planned and recorded in order as before.

In-process: the proxy app over ASGI, an in-memory bus and blob store, scripted cells
(``FakeCell`` from ``test_review_fixes``), the real Qwen tokenizer. No timing thresholds:
the tests check what ran while a render was in progress.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from libs.common.blobs import MemoryBlobStore
from libs.common.bus.memory import InMemoryBus
from libs.common.events import RolloutStarted
from services.proxy.adapters.template import HFRenderer
from services.proxy.app import create_app
from services.proxy.core.messages import Msg
from services.proxy.core.routing import Router
from services.proxy.history import key_digest
from services.proxy.service import ProxyConfig, ProxyService

from .test_review_fixes import FakeCell, recorded

RUN = "offloop"
MARK = "gate-this-render"


class Watched:
    """The real renderer; a render of a conversation that holds ``MARK`` waits for
    ``release`` (a threading event: set from the test's loop), and renders/encodes of large
    texts note when they ran (monotonic start, end)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.stop_texts, self.stop_token_ids = inner.stop_texts, inner.stop_token_ids
        self.max_context = inner.max_context
        self.entered, self.release = threading.Event(), threading.Event()
        self.spans: list[tuple[float, float]] = []
        self.threads: set[str] = set()

    def render(self, msgs, tools, *, add_generation_prompt: bool) -> str:
        self.threads.add(threading.current_thread().name)
        if any(MARK in m.content for m in msgs):
            self.entered.set()
            if not self.release.wait(10):
                raise RuntimeError("the gated render was never released: the event loop was blocked")
        t0 = time.monotonic()
        out = self.inner.render(msgs, tools, add_generation_prompt=add_generation_prompt)
        if len(out) > 100_000:
            self.spans.append((t0, time.monotonic()))
        return out

    def encode(self, text: str) -> list[int]:
        t0 = time.monotonic()
        ids = self.inner.encode(text)
        if len(text) > 100_000:
            self.spans.append((t0, time.monotonic()))
        return ids

    def decode(self, ids) -> str:
        return self.inner.decode(ids)


async def make(renderer, rollouts: list[str]):
    bus, blobs = InMemoryBus(), MemoryBlobStore()
    router = Router()
    router.add_cell("a", 8)
    watched = Watched(renderer)
    svc = ProxyService(ProxyConfig(run_id=RUN, max_context=1_000_000), bus=bus, blobs=blobs, renderer=watched,
                       router=router, clients={"a": FakeCell(renderer.tokenizer)})
    for r in rollouts:
        await bus.publish(RolloutStarted(run_id=RUN, rollout_id=r, task_id="t", group_id="g", harness="x",
                                         weight_version=0, api_key_digest=key_digest("k")))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(svc, admin_token=None)),
                               base_url="http://t", headers={"authorization": "Bearer k"}, timeout=60)
    return svc, bus, client, watched


def chat(content: str) -> dict:
    return {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": content}]}


async def test_a_small_call_completes_while_another_sessions_render_is_in_progress(renderer) -> None:
    svc, bus, c, watched = await make(renderer, ["big", "small"])
    big = asyncio.create_task(c.post("/r/big/v1/chat/completions", json=chat(f"{MARK} " + "long history " * 50)))
    assert await asyncio.to_thread(watched.entered.wait, 10)  # the big call's render has started ...
    try:
        small = await asyncio.wait_for(c.post("/r/small/v1/chat/completions", json=chat("hi")), 20)
        assert small.status_code == 200, small.text
        assert not big.done()  # ... and is still in progress: the loop served the other session meanwhile
    finally:
        watched.release.set()
    r = await big
    assert r.status_code == 200, r.text
    await svc.drain_background()
    calls = await recorded(bus)
    assert [e.rollout_id for e in calls] == ["small", "big"]
    assert all(name.startswith("gyre-proxy-render") for name in watched.threads)  # never on the loop's thread
    svc.close()


async def test_the_loop_keeps_ticking_while_a_long_history_is_rendered_and_tokenised(renderer) -> None:
    """The real tokenizer on a ~60k-token history (a few hundred milliseconds): a ticker on
    the event loop runs while the render and the encode are in progress."""
    svc, bus, c, watched = await make(renderer, ["long"])
    ticks: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            ticks.append(time.monotonic())
            await asyncio.sleep(0.002)

    history = []
    for i in range(120):
        words = " ".join(f"item{j} alpha beta" for j in range(100))
        history.append({"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: {words}"})
    history.append({"role": "user", "content": "and now?"})
    tick = asyncio.create_task(ticker())
    try:
        r = await c.post("/r/long/v1/chat/completions", json={"model": "m", "max_tokens": 8, "messages": history})
    finally:
        done.set()
        await tick
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 50_000
    assert watched.spans, "no large render or encode was seen"
    start, end = min(s for s, _ in watched.spans), max(e for _, e in watched.spans)
    during = [t for t in ticks if start < t < end]
    # on the loop, the render and the encode would have let no tick through at all
    assert len(during) >= 2, (len(during), end - start)
    await svc.drain_background()
    svc.close()


async def test_a_cancelled_caller_keeps_the_rollouts_lock_until_the_worker_is_done(renderer) -> None:
    """A caller that goes away mid-render must not free the rollout for its next call while
    a thread still works on the rollout's history."""
    svc = ProxyService(ProxyConfig(run_id=RUN), bus=InMemoryBus(), blobs=MemoryBlobStore(), renderer=renderer,
                       router=Router(), clients={})
    lock, started, go = asyncio.Lock(), threading.Event(), threading.Event()
    finished: list[str] = []

    def work() -> str:
        started.set()
        go.wait(10)
        finished.append("work")
        return "done"

    async def caller() -> None:
        async with lock:
            await svc.off_loop(work)

    task = asyncio.create_task(caller())
    assert await asyncio.to_thread(started.wait, 10)
    task.cancel()
    await asyncio.sleep(0.05)
    assert lock.locked() and not task.done()  # still waiting for the worker
    go.set()
    try:
        await task
    except asyncio.CancelledError:
        pass
    assert task.cancelled() and finished == ["work"] and not lock.locked()
    # errors still come back to a caller that waits
    assert await svc.off_loop(lambda: 7) == 7
    svc.close()


def test_the_renderer_encodes_and_renders_from_many_threads_as_from_one(renderer) -> None:
    """The real tokenizer and template used by several render threads at once give what
    one thread gives (no shared setting is changed by an encode)."""
    texts = [f"<|im_start|>user\nrequest {i}: " + "naïve café 東京 " * (200 + 37 * i) + "<|im_end|>\n"
             for i in range(16)]
    convos = [[Msg("system", "s"), Msg("user", t)] for t in texts]
    want = [renderer.encode(t) for t in texts]
    want_renders = [renderer.render(m, [], add_generation_prompt=True) for m in convos]
    backend = renderer.tokenizer.backend_tokenizer
    settings = (backend.truncation, backend.padding)
    with ThreadPoolExecutor(8) as pool:
        for _ in range(3):
            assert list(pool.map(renderer.encode, texts)) == want
            got = list(pool.map(lambda m: renderer.render(m, [], add_generation_prompt=True), convos))
            assert got == want_renders
            assert list(pool.map(renderer.decode, want)) == texts
    assert (backend.truncation, backend.padding) == settings == (None, None)


def test_a_tokenizer_saved_with_truncation_is_read_only_for_encode(renderer, tmp_path) -> None:
    """A truncation setting in tokenizer.json would make the first encode change it (in
    whichever thread comes first): the renderer clears it when it loads."""
    renderer.tokenizer.save_pretrained(str(tmp_path))
    path = tmp_path / "tokenizer.json"
    body = json.loads(path.read_text())
    body["truncation"] = {"direction": "Right", "max_length": 16, "strategy": "LongestFirst", "stride": 0}
    path.write_text(json.dumps(body))
    r = HFRenderer(tmp_path)
    assert r.tokenizer.backend_tokenizer.truncation is None  # cleared once, before any thread encodes
    assert r.encode("word " * 100) == renderer.encode("word " * 100)
