"""Fixes from the review of the render threads, the ``post_compaction`` hint and the
``think_stripped`` class.

- A compacted history's summary that a call sent is in the call's match index, so a
  replica that rebuilds the rollout from the log (a second replica, a restarted proxy, or
  this one after dropping its state) labels a later edit of that history as the live one
  does (``main``, not a second ``post_compaction``).
- A call still in flight when ``ProxyService.close()`` shuts the render pool finishes and
  is recorded (its work then runs on the loop).
- ``think_stripped`` only when the dropped block (and the newlines after it) is the whole
  difference; a template that trims other leading whitespace is a template drift.
- ``GYRE_PROXY_RENDER_THREADS`` sets the render threads.

In-process: the proxy app over ASGI, an in-memory bus and blob store, scripted cells
(``FakeCell``), the real Qwen tokenizer.
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from libs.common.blobs import MemoryBlobStore
from libs.common.bus.memory import InMemoryBus
from libs.common.events import CallRecorded, Context, RolloutStarted
from libs.common.events.calls import DriftClass
from services.proxy.app import create_app
from services.proxy.core.hints import CONTINUATION_MARKER
from services.proxy.core.routing import Router
from services.proxy.core.tito import Boundary
from services.proxy.history import decode_match_index, encode_match_index, key_digest
from services.proxy.service import RENDER_THREADS, ProxyConfig, ProxyService

from .test_review_fixes import FakeCell
from .test_thinking_and_compaction_hints import OAI_TOOLS, second_call_drift
from .test_tito_templates import with_template

RUN = "fixes"
SYSTEM = {"role": "system", "content": "You are an agent."}
TASK = {"role": "user", "content": "Fix the bug."}
SUMMARY_ASK = {"role": "user", "content": "Your task is to create a detailed summary of the conversation so far"}
CONT = {"role": "user", "content": f"{CONTINUATION_MARKER} that ran out of context.\n\nSummary:\nx\n\nContinue."}


async def started(bus) -> None:
    await bus.publish(RolloutStarted(run_id=RUN, rollout_id="r1", task_id="t", group_id="g", harness="x",
                                     weight_version=0, api_key_digest=key_digest("k")))


def proxy(renderer, bus, blobs, cell) -> tuple[ProxyService, httpx.AsyncClient]:
    router = Router()
    router.add_cell("a", 4)
    svc = ProxyService(ProxyConfig(run_id=RUN), bus=bus, blobs=blobs, renderer=renderer, router=router,
                       clients={"a": cell})
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(svc, admin_token=None)),
                               base_url="http://t/r/r1", headers={"authorization": "Bearer k"}, timeout=60)
    return svc, client


async def send(c: httpx.AsyncClient, messages: list[dict]) -> str:
    r = await c.post("/v1/chat/completions", json={"model": "m", "messages": messages, "tools": OAI_TOOLS})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


async def recorded(bus) -> list[CallRecorded]:
    return [d.event async for d in bus.read(Context.CALLS, start_seq=1) if isinstance(d.event, CallRecorded)]


# -- the summaries a replica rebuilds from the log ---------------------------------------------------------


async def compact(c: httpx.AsyncClient) -> list[dict]:
    """A main turn, the summary request, the compaction; returns the compacted history."""
    a = await send(c, [SYSTEM, TASK])
    await send(c, [SYSTEM, TASK, {"role": "assistant", "content": a}, SUMMARY_ASK])
    compacted = [SYSTEM, CONT, {"role": "assistant", "content": a}, {"role": "user", "content": "Go on."}]
    await send(c, compacted)
    return compacted


@pytest.mark.parametrize("where", ["same proxy", "second replica"])
async def test_an_edit_of_a_compacted_history_is_main_on_any_replica(renderer, where) -> None:
    bus, blobs = InMemoryBus(), MemoryBlobStore()
    await started(bus)
    svc, c = proxy(renderer, bus, blobs, FakeCell(renderer.tokenizer, ["Looked.", "The summary.", "On.", "Redone."]))
    compacted = await compact(c)
    await svc.drain_background()
    if where == "second replica":  # or this proxy restarted: it knows the rollout from the log alone
        svc.close()
        svc, c = proxy(renderer, bus, blobs, FakeCell(renderer.tokenizer, ["Redone."]))
    await send(c, compacted[:3] + [{"role": "user", "content": "Go on, differently."}])  # TITO matches nothing
    await svc.drain_background()
    svc.close()
    kinds = [(e.hints.kind, e.drift.value) for e in await recorded(bus)]
    assert kinds == [("main", "fresh"), ("compaction_summary", "append"), ("post_compaction", "fork"),
                     ("main", "fork")]


async def test_a_history_dropped_after_an_indexing_failure_gets_its_summaries_back_from_the_log(
        renderer, monkeypatch) -> None:
    """The compaction call's reply cannot be indexed: it is recorded without boundaries and
    the proxy drops the rollout's state; the next call rebuilds it from the log, summary
    included."""
    bus, blobs = InMemoryBus(), MemoryBlobStore()
    await started(bus)
    svc, c = proxy(renderer, bus, blobs, FakeCell(renderer.tokenizer, ["Looked.", "The summary.", "On.", "Redone."]))
    a = await send(c, [SYSTEM, TASK])
    await send(c, [SYSTEM, TASK, {"role": "assistant", "content": a}, SUMMARY_ASK])
    await svc.drain_background()
    st = svc.book.states["r1"]

    def broken(*args, **kwargs):
        raise RuntimeError("cannot index this reply")

    monkeypatch.setattr(st.tito, "record", broken)
    compacted = [SYSTEM, CONT, {"role": "assistant", "content": a}, {"role": "user", "content": "Go on."}]
    await send(c, compacted)
    await svc.drain_background()
    assert svc.book.states.get("r1") is not st  # dropped: the next call rebuilds from the log
    await send(c, compacted[:3] + [{"role": "user", "content": "Go on, differently."}])
    await svc.drain_background()
    svc.close()
    assert [e.hints.kind for e in await recorded(bus)] == ["main", "compaction_summary", "post_compaction", "main"]
    assert svc.book.states["r1"].summaries  # learnt from the compaction call's match index


def test_the_match_index_keeps_the_summary_and_older_blobs_still_decode() -> None:
    b = Boundary("c1", 12, "reply", "\n", DriftClass.APPEND)
    h, cont, summ = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
    index = decode_match_index(encode_match_index("c1", [(h, b)], cont, summ))
    assert (index.boundaries, index.continued, index.summary) == ([(h, b)], cont, summ)
    assert "summary" not in json.loads(encode_match_index("c1", [(h, b)], None))  # none sent: no field
    old = json.dumps({"call_id": "c1", "boundaries": [[h.hex(), 12, "reply", "\n", "append"]], "continued": None})
    index = decode_match_index(old.encode())  # written before the field existed
    assert (index.boundaries, index.continued, index.summary) == ([(h, b)], None, None)


# -- calls in flight when the render pool shuts down ------------------------------------------------------


class GatedCell(FakeCell):
    """Streams its first pieces, then waits for ``gate`` before the rest."""

    def __init__(self, tok, gate: asyncio.Event) -> None:
        super().__init__(tok, ["Hello there, all of you."])
        self.gate, self.streaming = gate, asyncio.Event()

    async def generate_stream(self, input_ids, sampling_params=None, **kw):
        n = 0
        async for piece in super().generate_stream(input_ids, sampling_params, **kw):
            n += 1
            if n == 2:
                self.streaming.set()
                await self.gate.wait()
            yield piece


@pytest.mark.parametrize("stream", [False, True])
async def test_a_call_in_flight_when_the_proxy_closes_is_answered_and_recorded(renderer, stream) -> None:
    bus, blobs = InMemoryBus(), MemoryBlobStore()
    await started(bus)
    gate = asyncio.Event()
    cell = GatedCell(renderer.tokenizer, gate)
    svc, c = proxy(renderer, bus, blobs, cell)
    body = {"model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    call = asyncio.create_task(c.post("/v1/chat/completions", json=body))
    await asyncio.wait_for(cell.streaming.wait(), 30)
    svc.close()  # proxy_main's last step, the HTTP server and the bus still up
    gate.set()
    r = await call
    assert r.status_code == 200, r.text
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert all("error" not in ch for ch in chunks), r.text
        text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch.get("choices"))
    else:
        text = r.json()["choices"][0]["message"]["content"]
    assert text == "Hello there, all of you."
    await svc.drain_background()
    (ev,) = await recorded(bus)
    assert ev.delivered and ev.n_output_tokens == len(renderer.encode("Hello there, all of you.")) + 1


async def test_wait_calls_waits_for_the_calls_in_flight_and_their_records(renderer) -> None:
    """What proxy_main does at stop, before the bus closes."""
    bus, blobs = InMemoryBus(), MemoryBlobStore()
    await started(bus)
    gate = asyncio.Event()
    cell = GatedCell(renderer.tokenizer, gate)
    svc, c = proxy(renderer, bus, blobs, cell)
    assert await svc.wait_calls(0)  # none yet
    call = asyncio.create_task(c.post("/v1/chat/completions",
                                      json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
    await asyncio.wait_for(cell.streaming.wait(), 30)
    assert not await svc.wait_calls(0.05)  # in flight
    gate.set()
    assert await svc.wait_calls(10)
    assert len(await recorded(bus)) == 1  # recorded by then
    assert (await call).status_code == 200
    svc.close()


async def test_a_stopping_proxy_turns_new_calls_away_and_a_finished_call_is_out_of_flight(renderer) -> None:
    """At stop the HTTP server still takes calls: new ones get a 503 the SDKs retry (and are
    neither run nor recorded), so waiting for the calls in flight is enough; a plain call is
    out of flight as soon as it is answered."""
    bus, blobs = InMemoryBus(), MemoryBlobStore()
    await started(bus)
    gate = asyncio.Event()
    gate.set()
    svc, c = proxy(renderer, bus, blobs, GatedCell(renderer.tokenizer, gate))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
    assert svc._in_flight == 0 and await svc.wait_calls(0)
    svc.stopping = True
    r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 503 and r.headers["x-should-retry"] == "true"
    assert "stopping" in r.json()["error"]["message"]
    await svc.drain_background()
    assert len(await recorded(bus)) == 1  # the first call only
    svc.close()


async def test_after_close_off_loop_runs_on_the_loop(renderer) -> None:
    svc = ProxyService(ProxyConfig(run_id=RUN), bus=InMemoryBus(), blobs=MemoryBlobStore(), renderer=renderer,
                       router=Router(), clients={})
    loop_thread = threading.current_thread().name
    assert await svc.off_loop(lambda: threading.current_thread().name) != loop_thread
    svc.close()
    assert await svc.off_loop(lambda: threading.current_thread().name) == loop_thread
    with pytest.raises(ValueError, match="still raised"):
        await svc.off_loop(lambda: (_ for _ in ()).throw(ValueError("still raised")))


# -- think_stripped is only the dropped block --------------------------------------------------------------

TRIM = (  # Llama-3 style: every assistant reply re-rendered with ``| trim``
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content | trim }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_trims_the_reply_is_template_drift_with_or_without_thinking(renderer) -> None:
    r = with_template(renderer, TRIM).inner
    assert second_call_drift(r, "  Two files.") is DriftClass.TEMPLATE_DRIFT
    assert second_call_drift(r, "<think>\nplan\n</think>\n\n  Two files.") is DriftClass.TEMPLATE_DRIFT
    assert second_call_drift(r, "<think>\nplan\n</think>\t Two files.") is DriftClass.TEMPLATE_DRIFT
    # the block and the newlines after it are the whole difference
    assert second_call_drift(r, "<think>\nplan\n</think>\n\nTwo files.") is DriftClass.THINK_STRIPPED


# -- GYRE_PROXY_RENDER_THREADS -----------------------------------------------------------------------------


def test_render_threads_from_the_environment(monkeypatch) -> None:
    from services.proxy.main import proxy_config

    monkeypatch.delenv("GYRE_PROXY_RENDER_THREADS", raising=False)
    assert proxy_config("r").render_threads == RENDER_THREADS
    monkeypatch.setenv("GYRE_PROXY_RENDER_THREADS", "6")
    assert proxy_config("r").render_threads == 6
    for bad in ("0", "-2", "many", "1.5"):
        monkeypatch.setenv("GYRE_PROXY_RENDER_THREADS", bad)
        with pytest.raises(ValueError, match=f"GYRE_PROXY_RENDER_THREADS: expected a positive integer, got '{bad}'"):
            proxy_config("r")
    import services.proxy.main as main

    assert "GYRE_PROXY_RENDER_THREADS" in main.__doc__
