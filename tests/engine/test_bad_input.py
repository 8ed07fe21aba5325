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
])
async def test_bad_generate_bodies_are_a_400(http, body, says):
    response = await http.post("/generate", json=body)
    assert response.status_code == 400, response.text
    assert says in response.json()["error"]["message"]


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
])
async def test_bad_bodies_on_other_routes_are_a_400(http, path, body):
    response = await http.post(path, content=body)
    assert response.status_code == 400, (path, body, response.text)


async def test_the_engine_still_serves_after_bad_input(http):
    assert (await http.post("/get_weights_by_name", json={"name": NORM, "truncate_size": 3})).json().__len__() == 3
    response = await http.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    assert response.status_code == 200 and len(response.json()["output_ids"]) == 2
    assert (await http.get("/health_generate")).status_code == 200
