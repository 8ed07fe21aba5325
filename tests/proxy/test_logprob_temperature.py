"""The proxy records, per call, the temperature the engine's logprobs were taken under:
the one it sent (the default 1.0 when the agent named none; 1.0 for a greedy call, and a
top_k 1 call is sent 1.0: SGLang's logprobs for it are otherwise tempered or not by what
it is batched with). top_k is always sent, -1 (no limit) for none or Anthropic's 0, which
SGLang refuses. On the real embedded engine, the trainer scoring the recorded tokens under
that temperature gets the recorded logprobs back (ratio 1)."""

from __future__ import annotations

from array import array
from typing import Any

import anthropic
import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from libs.common.blobs import decode_logprobs
from services.engine.main import build
from services.engine.params import logprob_temperature, parse_sampling_params
from services.engine.settings import EngineSettings
from services.proxy.api.common import ChatRequest

from ._fakes import ScriptedEngine, Served
from .conftest import RUN
from .tito_check import recorded_calls


@pytest.fixture(scope="module")
def real_engine(model_dir):
    service = build(EngineSettings(model="tiny-qwen", num_threads=1))
    served = Served(service.app)
    yield served
    served.stop()
    service.close()


def test_the_temperature_is_always_sent():
    def sent(**kw):
        return ChatRequest(api="openai_chat", model="m", messages=[], **kw).sampling_params(8, [])["temperature"]

    assert (sent(), sent(temperature=0.7), sent(temperature=0.0)) == (1.0, 0.7, 0.0)


def test_a_top_k_1_call_is_sent_temperature_1_and_top_k_is_always_sent():
    def sent(**kw):
        sp = ChatRequest(api="anthropic_messages", model="m", messages=[], **kw).sampling_params(8, [])
        return sp["temperature"], sp["top_k"], logprob_temperature(sp["temperature"])

    # a greedy pick: untempered logprobs in any SGLang batch, and recorded so
    assert sent(temperature=0.6, top_k=1) == (1.0, 1, 1.0)
    assert sent(top_k=1) == sent(temperature=0.0, top_k=1) == (1.0, 1, 1.0)
    assert sent(temperature=0.6, top_k=5) == (0.6, 5, 0.6)
    # no limit: -1, which SGLang and the embedded engine take (SGLang refuses 0)
    assert sent(temperature=0.6) == sent(temperature=0.6, top_k=0) == (0.6, -1, 0.6)
    assert parse_sampling_params(ChatRequest(api="anthropic_messages", model="m", messages=[], top_k=0)
                                 .sampling_params(8, [])).top_k == -1


def test_a_top_p_0_and_a_negative_seed_are_sent_as_the_cells_take_them():
    """The APIs allow top_p 0 and any int64 seed; SGLang and the engine want top_p > 0 and a
    seed >= 0 (the call was refused by the cell: a 400 the caller could not have seen coming)."""
    def sent(**kw):
        sp = ChatRequest(api="openai_chat", model="m", messages=[], **kw).sampling_params(8, [])
        parse_sampling_params(sp)  # the engine's own check
        return sp.get("top_p"), sp.get("sampling_seed")

    assert sent(top_p=0.0, seed=-1) == (1e-9, 2**63 - 1)
    assert sent(top_p=0.5, seed=-(2**63)) == (0.5, 0)
    assert sent(top_p=1.0, seed=2**63 - 1) == (1.0, 2**63 - 1)
    assert sent() == (None, None)


def sglang_checked(engine: ScriptedEngine, sent: list[dict]) -> FastAPI:
    """``engine``'s app behind SGLang's own check of ``top_k`` (-1, or at least 1; a 400
    otherwise, as SGLang answers), keeping each request's ``sampling_params``."""
    plain = engine.app()
    serve = next(r for r in plain.routes if getattr(r, "path", "") == "/generate").endpoint
    app = FastAPI()

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        sp = (await request.json()).get("sampling_params") or {}
        sent.append(sp)
        top_k = sp.get("top_k", -1)
        if top_k < -1 or top_k == 0:
            return JSONResponse({"error": {"message": f"top_k must be -1 (disable), or at least 1, got {top_k}."}},
                                status_code=400)
        return await serve(request)

    for route in plain.routes:  # /health, /abort_request
        if getattr(route, "path", "") != "/generate":
            app.router.routes.append(route)
    return app


async def test_anthropic_top_k_0_and_1_reach_an_sglang_cell_as_it_takes_them(sdk, proxy) -> None:
    sent: list[dict] = []
    served = Served(sglang_checked(proxy.engines["cell-a"], sent))
    try:
        for name in list(proxy.service.router.cells):
            proxy.service.router.remove_cell(name)
        proxy.service.add_cell("sglang", served.url, capacity=4)
        base = await proxy.rollout("topk-1")
        client = sdk(anthropic.AsyncAnthropic(base_url=base, api_key="k-secret", max_retries=0))
        for label, extra in {"k0": {"temperature": 0.6, "top_k": 0}, "k1": {"temperature": 0.6, "top_k": 1}}.items():
            msg = await client.messages.create(model="m", max_tokens=8, system=f"Case {label}.",
                                               messages=[{"role": "user", "content": "hi"}], extra_body=extra)
            assert msg.content
        await proxy.service.drain_background()
        recorded = list((await recorded_calls(proxy.bus, proxy.blobs, RUN)).values())
    finally:
        served.stop()
    assert [(sp["temperature"], sp["top_k"]) for sp in sent] == [(0.6, -1), (1.0, 1)]
    assert [r.event.logprob_temperature for r in recorded] == [0.6, 1.0]


def _packed(input_ids, output_ids, logprobs, temperature):
    from services.trajectory.packing import BranchEnd, PackedTree, Segment

    n_in, n = len(input_ids), len(input_ids) + len(output_ids)
    mask = bytes([0] * n_in + [1] * len(output_ids))
    return PackedTree(
        rollout_id="r", piece=0, n_pieces=1, role="main", token_ids=array("i", input_ids + output_ids),
        position_ids=array("i", range(n)), parent_index=array("i", range(-1, n - 1)), loss_mask=mask,
        loss_weights=array("f", [1.0 / len(output_ids) if m else 0.0 for m in mask]),
        behaviour_logprobs=array("f", [0.0] * n_in + list(logprobs)),
        weight_versions=array("i", [-1] * n_in + [0] * len(output_ids)), segments=(Segment(0, n, -1, 0),),
        branches=(BranchEnd("c", "main", n - 1),), n_execution_trained_tokens=len(output_ids),
        logprob_temperatures=array("f", [1.0] * n_in + [temperature] * len(output_ids)))


async def test_the_proxy_records_the_temperature_it_sent(sdk, proxy, real_engine, model_dir) -> None:
    for name in list(proxy.service.router.cells):
        proxy.service.router.remove_cell(name)
    proxy.service.add_cell("real", real_engine.url, capacity=4)
    base = await proxy.rollout("temp-1")
    client = sdk(anthropic.AsyncAnthropic(base_url=base, api_key="k-secret", max_retries=0))
    asks = {"t0.7": {"temperature": 0.7}, "default": {}, "greedy": {"temperature": 0.0},
            "top_k1": {"temperature": 0.6, "top_k": 1}, "top_k0": {"temperature": 0.6, "top_k": 0}}
    for label, extra in asks.items():  # one conversation each (no reuse between them)
        await client.messages.create(model="claude-opus-4-8", max_tokens=8, system=f"Case {label}.",
                                     messages=[{"role": "user", "content": f"Say something ({label})."}],
                                     extra_body=extra)
    await proxy.service.drain_background()  # the append follows the answer's end
    recorded = list((await recorded_calls(proxy.bus, proxy.blobs, RUN)).values())
    assert [r.event.logprob_temperature for r in recorded] == [0.7, 1.0, 1.0, 1.0, 0.6]

    # the trainer's path on the engine's own weights: the recorded logprobs come back
    from services.trainer.attention import AttentionConfig
    from services.trainer.backends.torch_hf import TorchBackend
    from services.trainer.batch import tree_batch

    backend = TorchBackend.from_pretrained(model_dir)
    for r in recorded:
        logprobs = decode_logprobs(await proxy.blobs.get(r.event.logprobs_digest))
        assert len(logprobs) == len(r.output_ids) > 0
        p = _packed(r.input_ids, r.output_ids, logprobs, r.event.logprob_temperature)
        batch = tree_batch([(p, 1.0)])
        with torch.no_grad():
            lp = backend.target_logprobs(batch, AttentionConfig())
        ratio = torch.exp(lp - batch.behaviour_logprobs)
        assert torch.allclose(ratio, torch.ones_like(ratio), atol=2e-3), (r.event.logprob_temperature, ratio)
