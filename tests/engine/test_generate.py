"""/generate on the real tiny model over HTTP (ASGI): correctness against transformers,
prefix cache, continuous batching, sampling, stops, streaming, aborts and bad input."""

from __future__ import annotations

import asyncio
import json

import torch

PROMPT = [9707, 1879, 11, 419, 374, 264, 1273, 315, 279, 5392, 13]  # "Hello world, this is a test of the ..."


def _greedy(n: int, **extra) -> dict:
    return {"max_new_tokens": n, "temperature": 0, **extra}


async def _gen(http, ids, params, **body) -> dict:
    response = await http.post("/generate", json={"input_ids": ids, "sampling_params": params, **body})
    assert response.status_code == 200, response.text
    return response.json()


async def test_greedy_tokens_and_logprobs_agree_with_transformers(http, shared_service):
    model = shared_service.engine.runner.model
    for prompt in (PROMPT, list(range(2000, 2037))):
        ours = await _gen(http, prompt, _greedy(12, ignore_eos=True), return_logprob=True)
        with torch.inference_mode():
            ref = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        ref_ids = ref.sequences[0, len(prompt):].tolist()
        ref_lps = [torch.log_softmax(step[0], -1)[tok].item() for step, tok in zip(ref.logits, ref_ids)]
        assert ours["output_ids"] == ref_ids
        got = ours["meta_info"]["output_token_logprobs"]
        assert [entry[1] for entry in got] == ref_ids
        assert all(entry[2] is None for entry in got)
        assert max(abs(entry[0] - lp) for entry, lp in zip(got, ref_lps)) < 1e-4


async def test_response_shape_follows_sglang(http):
    out = await _gen(http, PROMPT, _greedy(3, ignore_eos=True), rid="shape-1", some_unknown_top_level_key=1)
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["id"] == "shape-1"
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == 3
    assert meta["weight_version"] == "0" and meta["e2e_latency"] > 0
    assert "output_token_logprobs" not in meta
    assert isinstance(out["text"], str)


async def test_next_turn_reuses_the_cached_prefix_and_matches_uncached_output(http):
    first_turn = list(range(3000, 3120))
    first = await _gen(http, first_turn, _greedy(5, ignore_eos=True))
    second_turn = first_turn + first["output_ids"] + list(range(4000, 4010))
    cached = await _gen(http, second_turn, _greedy(6, ignore_eos=True), return_logprob=True)
    # the first turn left KV for its prompt and all output tokens but the last (never fed)
    assert cached["meta_info"]["cached_tokens"] == len(first_turn) + 4
    assert (await http.post("/flush_cache", json={})).status_code == 200
    uncached = await _gen(http, second_turn, _greedy(6, ignore_eos=True), return_logprob=True)
    assert uncached["meta_info"]["cached_tokens"] == 0
    assert cached["output_ids"] == uncached["output_ids"]
    pairs = zip(cached["meta_info"]["output_token_logprobs"], uncached["meta_info"]["output_token_logprobs"])
    assert max(abs(a[0] - b[0]) for a, b in pairs) < 1e-4


async def test_concurrent_requests_share_steps_and_match_one_at_a_time(http):
    prompts = [list(range(5000 + 97 * i, 5000 + 97 * i + 8 + 13 * i)) for i in range(6)]
    alone = [(await _gen(http, p, _greedy(10, ignore_eos=True)))["output_ids"] for p in prompts]
    await http.post("/flush_cache", json={})
    before = (await http.get("/server_info")).json()["internal_states"][0]["steps"]
    together = await asyncio.gather(*[_gen(http, p, _greedy(10, ignore_eos=True)) for p in prompts])
    after = (await http.get("/server_info")).json()["internal_states"][0]["steps"]
    assert [out["output_ids"] for out in together] == alone
    assert after - before < 6 * 10  # decode steps were shared by the batch


async def test_batched_input_ids_return_a_list(http):
    prompts = [PROMPT, PROMPT[:5]]
    outs = await _gen(http, prompts, _greedy(4, ignore_eos=True))
    assert isinstance(outs, list) and len(outs) == 2
    single = await _gen(http, PROMPT[:5], _greedy(4, ignore_eos=True))
    assert outs[1]["output_ids"] == single["output_ids"]


async def test_seeded_sampling_is_reproducible_and_seed_dependent(http):
    params = {"max_new_tokens": 8, "temperature": 0.8, "top_p": 0.95, "top_k": 40, "ignore_eos": True}
    a = await _gen(http, PROMPT, {**params, "sampling_seed": 7}, return_logprob=True)
    b = await _gen(http, PROMPT, {**params, "sampling_seed": 7}, return_logprob=True)
    c = await _gen(http, PROMPT, {**params, "sampling_seed": 8})
    assert a["output_ids"] == b["output_ids"] != c["output_ids"]
    assert all(lp <= 0 for lp, _, _ in a["meta_info"]["output_token_logprobs"])


async def test_seeded_sampling_survives_a_prefix_cache_hit_and_batch_company(http):
    # a cache hit or a batch changes logits in their last bits, which moved the top-p / min-p
    # candidate count; the request's generator then fell out of step for every later token
    first_turn = list(range(20000, 20000 + 150))
    for cut in ({"top_p": 0.9}, {"min_p": 0.02}):
        params = {"max_new_tokens": 24, "temperature": 1.0, "sampling_seed": 5, "ignore_eos": True, **cut}
        await http.post("/flush_cache", json={})
        first = await _gen(http, first_turn, params)
        second_turn = first_turn + first["output_ids"] + list(range(30000, 30007))
        hit = await _gen(http, second_turn, params)
        assert hit["meta_info"]["cached_tokens"] > len(first_turn)
        await http.post("/flush_cache", json={})
        cold = await _gen(http, second_turn, params)
        assert cold["meta_info"]["cached_tokens"] == 0
        company = await asyncio.gather(_gen(http, second_turn, params),
                                       *[_gen(http, list(range(40000 + i, 40060 + 7 * i)), params) for i in range(3)])
        assert hit["output_ids"] == cold["output_ids"] == company[0]["output_ids"], cut


async def test_stop_token_ids_and_stop_strings(http, shared_service):
    full = (await _gen(http, PROMPT, _greedy(8, ignore_eos=True)))["output_ids"]
    stop_id = full[3]
    cut = await _gen(http, PROMPT, _greedy(8, ignore_eos=True, stop_token_ids=[stop_id]))
    first = full.index(stop_id)
    assert cut["output_ids"] == full[: first + 1]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}

    decode = shared_service.engine.tokenizer.decode
    text = decode(full)
    stop = decode(full[4:5]).strip()
    assert stop and stop in text
    by_text = await _gen(http, PROMPT, _greedy(8, ignore_eos=True, stop=[stop]))
    assert by_text["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in by_text["text"] and text.startswith(by_text["text"])


async def test_bad_input_is_a_400(http, shared_service):
    vocab = shared_service.engine.vocab_limit
    for body in (
        {"input_ids": [], "sampling_params": {}},
        {"input_ids": [1, vocab], "sampling_params": {}},
        {"input_ids": [1, -3], "sampling_params": {}},
        {"input_ids": [1, 2], "sampling_params": {"no_such_field": 1}},
        {"input_ids": [1, 2], "sampling_params": {"top_p": 0}},
        {"sampling_params": {}},
        {"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": 500},
        {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 0},
    ):
        response = await http.post("/generate", json=body)
        assert response.status_code == 400, body
        assert response.json()["error"]["message"]
    assert (await http.post("/generate", content=b"not json")).status_code == 400


async def test_a_refused_batch_leaves_nothing_running(http, shared_service):
    long = _greedy(5000, ignore_eos=True)
    # one string rid for a batch: refused before anything starts
    response = await http.post("/generate", json={"input_ids": [PROMPT, PROMPT], "sampling_params": long,
                                                  "rid": "one-for-all"})
    assert response.status_code == 400 and "rid must be a list" in response.json()["error"]["message"]
    # the second prompt's rid is taken: the first, already submitted, is aborted with the refusal
    blocker = asyncio.create_task(http.post("/generate", json={"input_ids": PROMPT, "sampling_params": long,
                                                               "rid": "taken"}))
    engine = shared_service.engine
    for _ in range(500):
        if engine.call(lambda: "taken" in engine._live):
            break
        await asyncio.sleep(0.01)
    response = await http.post("/generate", json={"input_ids": [PROMPT, PROMPT], "sampling_params": [long, long],
                                                  "rid": ["fresh", "taken"]})
    assert response.status_code == 400 and "already in flight" in response.json()["error"]["message"]
    assert (await http.post("/abort_request", json={"rid": "fresh"})).json()["num_aborted"] == 0  # already gone
    assert (await http.post("/abort_request", json={"rid": "taken"})).json()["num_aborted"] == 1
    await blocker


async def test_text_prompts_and_zero_new_tokens(http):
    out = (await http.post("/generate", json={"text": "Hello world,", "sampling_params": _greedy(2)})).json()
    assert out["meta_info"]["prompt_tokens"] == 3
    none = await _gen(http, PROMPT, {"max_new_tokens": 0})
    assert none["output_ids"] == [] and none["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


async def test_streaming_accumulates_and_ends_with_done(http):
    body = {"input_ids": PROMPT, "sampling_params": _greedy(5, ignore_eos=True), "stream": True, "return_logprob": True}
    chunks, done = [], False
    async with http.stream("POST", "/generate", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
    assert done and len(chunks) == 5
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4, 5]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(chunks[-1]["meta_info"]["output_token_logprobs"]) == 5
    plain = await _gen(http, PROMPT, _greedy(5, ignore_eos=True))
    assert chunks[-1]["output_ids"] == plain["output_ids"]


async def test_abort_request_returns_partial_output(http):
    body = {"input_ids": PROMPT, "sampling_params": _greedy(5000, ignore_eos=True), "rid": "long-1"}
    pending = asyncio.create_task(http.post("/generate", json=body))
    await asyncio.sleep(0.3)
    assert (await http.post("/abort_request", json={"rid": "long-1"})).json()["num_aborted"] == 1
    out = (await pending).json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(out["output_ids"]) < 5000


async def test_health_and_info_endpoints(http, shared_service):
    assert (await http.get("/health")).status_code == 200
    assert (await http.get("/health_generate")).status_code == 200
    info = (await http.get("/model_info")).json()
    assert info["is_generation"] is True and info["weight_version"] == "0" and info["model_type"] == "qwen2"
    assert (await http.get("/get_model_info")).json() == info
    server = (await http.get("/get_server_info")).json()
    assert server["max_running_requests"] == shared_service.settings.max_running_requests
    assert server["context_length"] == 32768 and "admin_token" not in server
    assert {"running", "waiting", "cached_tokens"} <= set(server["internal_states"][0])


async def test_top_logprobs_list_the_most_likely_tokens(http):
    out = await _gen(http, PROMPT, _greedy(3, ignore_eos=True), return_logprob=True, top_logprobs_num=3)
    meta = out["meta_info"]
    assert len(meta["output_top_logprobs"]) == 3
    for chosen, top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert len(top) == 3 and top[0][1] == chosen[1]  # greedy: the pick is the most likely
        assert abs(top[0][0] - chosen[0]) < 1e-5
        assert top[0][0] >= top[1][0] >= top[2][0]


async def test_stop_strings_match_special_tokens_multi_token_characters_and_after_min_new_tokens(
        http, shared_service, monkeypatch):
    # the model's picks are scripted (a random-init model never writes these texts)
    from services.engine import engine as engine_module

    tokenizer = shared_service.engine.tokenizer
    scripts: dict[int, list[int]] = {}

    def scripted(logits, specs, vocab_limit):
        tokens = [scripts[s.params.sampling_seed][s.step] for s in specs]
        return tokens, [None] * len(specs), [[] for _ in specs]

    monkeypatch.setattr(engine_module, "sample", scripted)
    rare = "\U0002000b\U0002000b"  # CJK extension B: several byte tokens a character
    cases = [  # text, stop, extra params, kept text, tokens produced
        ("done<|im_end|>more text", "<|im_end|>", {}, "done", "done<|im_end|>"),
        ("done<|im_end|>more text", "<|im_end|>", {"skip_special_tokens": False}, "done", "done<|im_end|>"),
        ("abc " + rare + " tail", rare, {}, "abc ", "abc " + rare),
        ("x STOP y z w v u", "STOP", {"min_new_tokens": 3}, "x ", "x STOP y"),
    ]
    for seed, (text, stop, extra, kept, produced) in enumerate(cases, start=1000):
        scripts[seed] = tokenizer.encode(text, add_special_tokens=False)
        assert len(scripts[seed]) > len(tokenizer.encode(produced, add_special_tokens=False))
        if stop == rare:
            assert len(tokenizer.encode(rare, add_special_tokens=False)) > len(rare) + 2  # the old window
        out = await _gen(http, PROMPT, {"max_new_tokens": 40, "temperature": 1.0, "sampling_seed": seed,
                                        "ignore_eos": True, "stop": [stop], **extra})
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}, (text, extra)
        assert out["output_ids"] == tokenizer.encode(produced, add_special_tokens=False), (text, extra)
        assert out["text"] == kept, (text, extra)


async def test_running_kv_stays_within_the_admitted_worst_case(http, shared_service, monkeypatch):
    runner = shared_service.engine.runner
    made = []
    real = runner.new_kv

    def spy(capacity, limit=None):
        made.append(real(capacity, limit))
        return made[-1]

    monkeypatch.setattr(runner, "new_kv", spy)
    prompt = list(range(6000, 6100))
    out = await _gen(http, prompt, _greedy(540, ignore_eos=True))
    assert len(out["output_ids"]) == 540
    assert len(made) == 1 and made[0].data.shape[3] <= 100 + 540  # doubling from 612 made 1224


async def test_streamed_text_is_decoded_incrementally_and_matches_the_whole_decode(http, shared_service, monkeypatch):
    from services.engine import engine as engine_module

    tokenizer = shared_service.engine.tokenizer
    script = tokenizer.encode("h\u00e9llo \U0002000b\U0002000b" + " w\u00f6rld, \u4f60\u597d" * 40, add_special_tokens=False)

    def scripted(logits, specs, vocab_limit):
        return [script[s.step] for s in specs], [None] * len(specs), [[] for _ in specs]

    decoded: list[int] = []
    real_decode = tokenizer.decode

    def counting(ids, *args, **kwargs):
        decoded.append(len(ids))
        return real_decode(ids, *args, **kwargs)

    monkeypatch.setattr(engine_module, "sample", scripted)
    monkeypatch.setattr(tokenizer, "decode", counting)
    body = {"input_ids": PROMPT, "sampling_params": _greedy(len(script), ignore_eos=True), "stream": True}
    chunks = []
    async with http.stream("POST", "/generate", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    monkeypatch.undo()
    assert chunks[-1]["output_ids"] == script and len(chunks) == len(script)
    final = chunks[-1]["text"]
    assert final == tokenizer.decode(script)
    for chunk in chunks:
        whole = tokenizer.decode(chunk["output_ids"])
        assert final.startswith(chunk["text"])
        assert chunk["text"] == whole if not whole.endswith("\ufffd") else whole.startswith(chunk["text"])
    # every streamed token decoded a few tokens (stop strings none); only the final snapshot all
    assert sorted(decoded)[-2] <= 8 and max(decoded) == len(script)
