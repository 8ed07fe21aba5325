"""One request's sampling parameters (or a failure while sampling its row) end at most that
request, never the batch it shares steps with; min_new_tokens holds back stop and EOS ids."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.engine import engine as engine_module

PROMPT = [9707, 1879, 11, 419, 374, 264, 1273, 315, 279, 5392, 13]
LONG = {"max_new_tokens": 5000, "temperature": 0, "ignore_eos": True}


async def _gen(http, ids, params, **body) -> dict:
    response = await http.post("/generate", json={"input_ids": ids, "sampling_params": params, **body})
    assert response.status_code == 200, response.text
    return response.json()


async def _start_victim(http, engine, rid: str) -> asyncio.Task:
    victim = asyncio.create_task(_gen(http, PROMPT, LONG, rid=rid))
    for _ in range(1000):
        if engine.call(lambda: rid in engine._live and engine._live[rid].kv is not None).result(10):
            return victim
        await asyncio.sleep(0.01)
    raise AssertionError("victim never started")


async def _end_victim(http, engine, victim: asyncio.Task, rid: str) -> dict:
    assert engine.call(lambda: rid in engine._live).result(10), "the victim was ended with the other request"
    assert (await http.post("/abort_request", json={"rid": rid})).json()["num_aborted"] == 1
    out = await victim
    assert out["meta_info"]["finish_reason"] == {"type": "abort", "message": "aborted by abort_request"}
    return out


async def test_extreme_sampling_params_do_not_abort_other_requests(http, shared_service):
    engine = shared_service.engine
    victim = await _start_victim(http, engine, "victim-params")
    for params in ({"top_p": 1e-46, "temperature": 1.0}, {"temperature": 1e-40, "top_p": 0.9},
                   {"temperature": 1e-40, "min_p": 0.5}, {"temperature": 1e-12}):
        out = await _gen(http, [1, 2], {"max_new_tokens": 2, **params}, return_logprob=True)
        assert out["meta_info"]["finish_reason"]["type"] == "length", params
        assert all(lp is not None and lp <= 0 for lp, _, _ in out["meta_info"]["output_token_logprobs"])
    await _end_victim(http, engine, victim, "victim-params")


async def test_a_row_that_fails_to_sample_ends_only_its_request(http, shared_service, monkeypatch):
    real = engine_module.sample

    def failing(logits, specs, vocab_limit):
        if any(spec.params.sampling_seed == 424242 for spec in specs):
            raise RuntimeError("injected sampling failure")
        return real(logits, specs, vocab_limit)

    monkeypatch.setattr(engine_module, "sample", failing)
    engine = shared_service.engine
    victim = await _start_victim(http, engine, "victim-row")
    bad = await _gen(http, [1, 2], {"max_new_tokens": 3, "temperature": 1.0, "sampling_seed": 424242})
    reason = bad["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "sampling failed" in reason["message"] and "injected" in reason["message"]
    assert bad["output_ids"] == []
    out = await _end_victim(http, engine, victim, "victim-row")
    assert len(out["output_ids"]) > 0
    monkeypatch.undo()
    assert (await _gen(http, [1, 2], {"max_new_tokens": 2, "sampling_seed": 424242}))["output_ids"]


async def test_a_failed_row_does_not_make_the_rows_before_it_draw_twice(http, shared_service, monkeypatch):
    # the batch is redone row by row after a failure; rows sampled before the failing one
    # drew twice, so a seeded request's later tokens changed
    from services.engine import sampler

    params = {"max_new_tokens": 40, "temperature": 1.0, "top_p": 0.9, "sampling_seed": 77, "ignore_eos": True}
    alone = await _gen(http, PROMPT, params)
    real, shared = sampler._draw, []

    def failing(scaled, spec):
        if spec.params.sampling_seed == 424242:
            raise RuntimeError("injected draw failure")
        shared.append(spec.params.sampling_seed)
        return real(scaled, spec)

    monkeypatch.setattr(sampler, "_draw", failing)
    engine = shared_service.engine
    victim = asyncio.create_task(_gen(http, PROMPT, params, rid="victim-redo"))
    for _ in range(1000):  # decoding: the victim is the first sampling row of the next steps
        if engine.call(lambda: any(s.rid == "victim-redo" and s.output_ids for s in engine.scheduler.running)).result(10):
            break
        await asyncio.sleep(0.005)
    bad = await _gen(http, [1, 2], {"max_new_tokens": 3, "temperature": 1.0, "sampling_seed": 424242})
    assert "injected" in bad["meta_info"]["finish_reason"]["message"]
    assert (await victim)["output_ids"] == alone["output_ids"]
    assert len(shared) > len(alone["output_ids"]), "the failing row never shared a step with the victim"


async def test_a_temperature_below_the_epsilon_is_greedy(http):
    greedy = await _gen(http, PROMPT, {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
                        return_logprob=True)
    for params in ({"temperature": 1e-39}, {"temperature": 1e-39, "sampling_seed": 3}, {"temperature": 5e-7}):
        out = await _gen(http, PROMPT, {"max_new_tokens": 5, "ignore_eos": True, **params}, return_logprob=True)
        assert out["output_ids"] == greedy["output_ids"], params
        got, want = out["meta_info"]["output_token_logprobs"], greedy["meta_info"]["output_token_logprobs"]
        assert [lp for lp, _, _ in got] == pytest.approx([lp for lp, _, _ in want], abs=1e-4)


async def test_min_new_tokens_holds_back_stop_token_ids_and_eos(http, shared_service):
    plain = await _gen(http, PROMPT, {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
    stop = plain["output_ids"][1]
    first = plain["output_ids"].index(stop)
    cut = await _gen(http, PROMPT, {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True,
                                    "stop_token_ids": [stop]})
    assert cut["output_ids"] == plain["output_ids"][: first + 1]
    held = await _gen(http, PROMPT, {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True,
                                     "stop_token_ids": [stop], "min_new_tokens": 4})
    assert stop not in held["output_ids"][:4] and len(held["output_ids"]) >= 4
    assert held["output_ids"][: first] == plain["output_ids"][: first]
    # EOS: with the EOS id made the greedy pick, min_new_tokens still produces its minimum
    engine = shared_service.engine
    eos = set(engine.eos_ids)
    try:
        engine.eos_ids = frozenset(eos | {stop})
        no_min = await _gen(http, PROMPT, {"max_new_tokens": 6, "temperature": 0})
        assert no_min["output_ids"] == plain["output_ids"][: first + 1]
        with_min = await _gen(http, PROMPT, {"max_new_tokens": 6, "temperature": 0, "min_new_tokens": 5})
        assert len(with_min["output_ids"]) >= 5 and stop not in with_min["output_ids"][:5]
    finally:
        engine.eos_ids = frozenset(eos)


async def test_a_cancelled_non_streaming_request_is_aborted(http, shared_service):
    engine = shared_service.engine
    for body in ({"input_ids": PROMPT, "rid": "gone-1"},
                 {"input_ids": [PROMPT, PROMPT[:5]], "rid": ["gone-2", "gone-3"]}):
        rids = body["rid"] if isinstance(body["rid"], list) else [body["rid"]]
        client = asyncio.create_task(http.post("/generate", json={**body, "sampling_params": LONG}))
        for _ in range(1000):
            if engine.call(lambda: all(r in engine._live for r in rids)).result(10):
                break
            await asyncio.sleep(0.01)
        client.cancel()
        with pytest.raises(asyncio.CancelledError):
            await client
        for _ in range(500):  # the abort is queued to the engine thread
            if not engine.call(lambda: any(r in engine._live for r in rids)).result(10):
                break
            await asyncio.sleep(0.01)
        assert not engine.call(lambda: any(r in engine._live for r in rids)).result(10)
    again = await _gen(http, PROMPT, {"max_new_tokens": 1}, rid="gone-1")  # the rid is free again
    assert again["meta_info"]["id"] == "gone-1"


def test_a_non_streaming_client_that_closes_its_socket_is_aborted(shared_service):
    # a real server: Starlette does not cancel the handler when the connection closes, so the
    # handler itself must notice (the ASGI test transport cancels, which hid this)
    import socket
    import threading
    import time

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(shared_service.app, host="127.0.0.1", port=0, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    engine = shared_service.engine
    try:
        for _ in range(500):
            if server.started:
                break
            time.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        for rid, body in (("gone-raw-1", {"input_ids": PROMPT, "rid": "gone-raw-1"}),
                          ("gone-raw-3", {"input_ids": [PROMPT, PROMPT[:4]], "rid": ["gone-raw-2", "gone-raw-3"]})):
            payload = json.dumps({**body, "sampling_params": LONG}).encode()
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
            for _ in range(1000):
                if engine.call(lambda: any(s.rid == rid and s.output_ids for s in engine.scheduler.running)).result(10):
                    break
                time.sleep(0.01)
            else:
                raise AssertionError("the request never started")
            sock.close()
            for _ in range(500):
                if not engine.call(lambda: any(r.startswith("gone-raw") for r in engine._live)).result(10):
                    break
                time.sleep(0.01)
            assert not engine.call(lambda: any(r.startswith("gone-raw") for r in engine._live)).result(10), rid
    finally:
        server.should_exit = True
        thread.join(30)
