"""Malformed input on any route is a 400 naming the problem, never a 500 (the reviewer's
probe_inputs / probe_window cases); the engine keeps serving afterwards."""

from __future__ import annotations

import pytest

NORM = "model.norm.weight"
ONE = {"max_new_tokens": 1}


@pytest.mark.parametrize("body, says", [
    ({"input_ids": [1, 2], "rid": ["a"], "sampling_params": ONE}, "rid is a list"),
    ({"input_ids": [1, 2], "top_logprobs_num": [1], "return_logprob": True, "sampling_params": ONE},
     "top_logprobs_num is a list"),
    ({"input_ids": [1, 2], "return_logprob": [False], "sampling_params": ONE}, "return_logprob is a list"),
    ({"input_ids": [1, 2], "logprob_start_len": [-1], "sampling_params": ONE}, "logprob_start_len is a list"),
    ({"input_ids": [1, 2], "sampling_params": [ONE]}, "sampling_params is a list"),
    ({"input_ids": [[1, 2], [3]], "rid": ["a"], "sampling_params": ONE}, "must match the number of prompts"),
    ({"input_ids": [1, 2], "sampling_params": {**ONE, "sampling_seed": 2**70, "temperature": 1.0}}, "sampling_seed"),
    ({"input_ids": [1, 2], "sampling_params": {**ONE, "sampling_seed": -1, "temperature": 1.0}}, "sampling_seed"),
    ({"input_ids": [1, 2], "sampling_params": {**ONE, "temperature": "NaN"}}, "temperature"),
    ({"input_ids": [1, 2], "sampling_params": {**ONE, "temperature": "inf"}}, "temperature"),
    # finite, but logits / it overflow float32 to NaN: padding rows and banned ids were sampled
    ({"input_ids": [1, 2], "sampling_params": {**ONE, "temperature": 1e39}}, "temperature"),
    # no quiet coercion to numbers (pydantic's lax mode made these 1, 7 and 1)
    ({"input_ids": [True, 2], "sampling_params": ONE}, "input_ids.0"),
    ({"input_ids": ["7", 2], "sampling_params": ONE}, "input_ids.0"),
    ({"input_ids": [[1, 2], [3, False]], "sampling_params": ONE}, "input_ids.1.1"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": True}}, "max_new_tokens"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "3"}}, "max_new_tokens"),
    ({"input_ids": [1, 2], "sampling_params": {**ONE, "stop_token_ids": [True]}}, "stop_token_ids.0"),
    ({"input_ids": [1, 2], "sampling_params": {**ONE, "top_k": True}}, "top_k"),
    ({"input_ids": [1, 2], "sampling_params": {**ONE, "temperature": True}}, "temperature"),
    ({"input_ids": [1, 2], "sampling_params": {**ONE, "ignore_eos": "yes"}}, "ignore_eos"),
    ({"input_ids": [1, 2], "sampling_params": ONE, "return_logprob": "yes"}, "return_logprob"),
    ({"input_ids": [1, 2], "sampling_params": ONE, "return_logprob": True, "top_logprobs_num": True},
     "top_logprobs_num"),
    ({"input_ids": [1, 2], "sampling_params": ONE, "stream": "true"}, "stream"),
    ({"input_ids": [1, 2], "sampling_params": ONE, "rid": 5}, "rid"),
    # one id per prompt: a repeated one answered twice under one id (or was refused only
    # when the first prompt was still running)
    ({"input_ids": [[1, 2], [3]], "sampling_params": ONE, "rid": ["a", "a"]}, "rid must be unique"),
    ({"input_ids": [[1, 2], [3], [4]], "sampling_params": ONE, "rid": ["a", "b", "a"]}, "'a'"),
])
async def test_bad_generate_bodies_are_a_400(http, body, says):
    response = await http.post("/generate", json=body)
    assert response.status_code == 400, response.text
    assert says in response.json()["error"]["message"]


@pytest.mark.parametrize("body", [
    {"input_ids": [1.0, 2], "sampling_params": {"max_new_tokens": 2.0}},  # integral floats, as before
    {"input_ids": [1, 2], "sampling_params": {**ONE, "temperature": 1, "top_p": 1, "min_p": 0, "top_k": 0}},
    {"input_ids": [1, 2], "sampling_params": {**ONE, "ignore_eos": True, "stop_token_ids": [3]},
     "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": -1, "rid": "typed-ok"},
    {"input_ids": [[1, 2], [3]], "sampling_params": [ONE, ONE], "return_logprob": [True, False],
     "top_logprobs_num": [1, 0], "rid": ["typed-a", "typed-b"]},
])
async def test_well_typed_bodies_stay_valid(http, body):
    response = await http.post("/generate", json=body)
    assert response.status_code == 200, response.text


async def test_a_rid_still_running_is_refused_and_the_running_one_goes_on(http, shared_service):
    import asyncio

    long = {"max_new_tokens": 5000, "temperature": 0, "ignore_eos": True}
    blocker = asyncio.create_task(http.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": long,
                                                               "rid": "running-once"}))
    engine = shared_service.engine
    for _ in range(500):
        if engine.call(lambda: "running-once" in engine._live).result():
            break
        await asyncio.sleep(0.01)
    response = await http.post("/generate", json={"input_ids": [4, 5], "sampling_params": ONE,
                                                  "rid": "running-once"})
    assert response.status_code == 400 and "already in flight" in response.json()["error"]["message"]
    assert (await http.post("/abort_request", json={"rid": "running-once"})).json()["num_aborted"] == 1
    await blocker


async def test_a_batch_with_a_repeated_rid_starts_nothing(http, shared_service):
    long = {"max_new_tokens": 5000, "temperature": 0, "ignore_eos": True}
    response = await http.post("/generate", json={"input_ids": [[1, 2], [3, 4]], "sampling_params": long,
                                                  "rid": ["twice", "twice"]})
    assert response.status_code == 400, response.text
    engine = shared_service.engine
    assert engine.call(lambda: list(engine._live)).result() == []


async def test_the_largest_seed_is_accepted(http):
    params = {"max_new_tokens": 2, "temperature": 1.0, "sampling_seed": 2**64 - 1}
    assert (await http.post("/generate", json={"input_ids": [1, 2], "sampling_params": params})).status_code == 200


@pytest.mark.parametrize("path, body", [
    ("/gyre/kv/export", b"notjson"),
    ("/gyre/kv/export", b"[1, 2]"),
    ("/gyre/kv/export", b'{"input_ids": [true]}'),
    ("/gyre/kv/port/offer", b"notjson"),
    ("/gyre/kv/port/offer", b"[1]"),
    ("/gyre/kv/port/fetch", b"notjson"),
    ("/gyre/kv/port/release", b"[1]"),
    ("/gyre/kv/port/release", b"notjson"),
    ("/gyre/kv/port/release", b'{"lease": 5}'),
    ("/gyre/weights/pull", b"notjson"),
    ("/gyre/weights/pull", b"[1]"),
    ("/gyre/weights/pull", b'{"descriptor": 5}'),
    ("/gyre/weights/pull", b'{"descriptor": {"peer": {"backend": "tcp", "endpoint": "x"}, "region": "r", '
                           b'"tensors": [["model.norm.weight", "bogus", [64], 0, 256]]}}'),
    ("/gyre/weights/pull", b'{"descriptor": {"peer": {"backend": "tcp", "endpoint": "x"}, "region": "r", '
                           b'"tensors": [["model.norm.weight", "int64", [64], 0, 512]]}}'),
    ("/get_weights_by_name", f'{{"name": "{NORM}", "truncate_size": "x"}}'.encode()),
    ("/get_weights_by_name", f'{{"name": "{NORM}", "truncate_size": -1}}'.encode()),
    ("/abort_request", b'{"rid": ["a"]}'),
    ("/abort_request", b'{"rid": 5}'),
    ("/abort_request", b"{}"),
    ("/abort_request", b'{"rid": "x", "abort_all": "false"}'),  # a truthy string aborted every request
    ("/release_memory_occupation", b'{"tags": [[1]]}'),
    ("/resume_memory_occupation", b'{"tags": [{}]}'),
    ("/end_weight_update", b'{"abort": "true"}'),
])
async def test_bad_bodies_on_other_routes_are_a_400(http, path, body):
    response = await http.post(path, content=body)
    assert response.status_code == 400, (path, body, response.text)


async def test_the_engine_still_serves_after_bad_input(http):
    assert (await http.post("/get_weights_by_name", json={"name": NORM, "truncate_size": 3})).json().__len__() == 3
    response = await http.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    assert response.status_code == 200 and len(response.json()["output_ids"]) == 2
    assert (await http.get("/health_generate")).status_code == 200
