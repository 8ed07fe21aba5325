"""/metrics of the embedded engine, scraped over HTTP (ASGI) and read by Prometheus' own text parser."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from .conftest import asgi_client

GREEDY = {"temperature": 0, "ignore_eos": True}


async def _scrape(http) -> dict[str, float]:
    """Every sample as ``name{label=value,...}`` -> value."""
    response = await http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}"] = s.value
    return samples


def _delta(after: dict, before: dict, key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


async def test_metrics_count_requests_tokens_and_cache_hits(http, shared_service):
    before = await _scrape(http)
    first = list(range(5000, 5100))
    second = first + list(range(6000, 6020))
    hits = []
    for ids, n in ((first, 4), (second, 6)):
        r = await http.post("/generate", json={"input_ids": ids, "sampling_params": {**GREEDY, "max_new_tokens": n}})
        assert r.status_code == 200, r.text
        hits.append(r.json()["meta_info"]["cached_tokens"])
    assert hits[1] >= len(first)  # the second turn reused the first's KV
    after = await _scrape(http)

    assert _delta(after, before, "gyre_engine_requests_total{finish=length}") == 2
    assert _delta(after, before, "gyre_engine_prompt_tokens_total{}") == len(first) + len(second)
    assert _delta(after, before, "gyre_engine_generated_tokens_total{}") == 10
    assert _delta(after, before, "gyre_engine_prefix_cache_hit_tokens_total{}") == sum(hits)
    assert _delta(after, before, "gyre_engine_request_seconds_count{}") == 2
    assert _delta(after, before, "gyre_engine_request_seconds_sum{}") > 0
    assert after["gyre_engine_request_seconds_bucket{le=+Inf}"] == after["gyre_engine_request_seconds_count{}"]
    assert after["gyre_engine_running_requests{}"] == 0 and after["gyre_engine_queued_requests{}"] == 0
    assert after["gyre_engine_weight_version_info{version=0}"] == 1
    engine = shared_service.engine
    per_token = engine.runner.shape.kv_bytes_per_token
    assert after["gyre_engine_kv_cache_bytes{pool=prefix_cache}"] == engine.prefix_cache.cached_tokens * per_token > 0
    assert after["gyre_engine_kv_cache_bytes{pool=running}"] == 0
    assert after["gyre_engine_kv_cache_capacity_bytes{}"] == engine.prefix_cache.capacity_tokens * per_token


async def test_metrics_show_running_queued_aborted_and_the_weight_version(fresh_service):
    async with asgi_client(fresh_service, admin_token="secret") as cell:
        http = cell._http
        long = asyncio.create_task(cell.generate(list(range(100, 140)), {**GREEDY, "max_new_tokens": 3000}, rid="long"))
        for _ in range(500):  # until it has produced a token
            if fresh_service.engine.scheduler.running and fresh_service.engine.steps:
                break
            await asyncio.sleep(0.02)
        await cell.pause("in_place")
        queued = asyncio.create_task(cell.generate(list(range(200, 210)), {**GREEDY, "max_new_tokens": 2}))
        for _ in range(500):
            if fresh_service.engine.scheduler.waiting:
                break
            await asyncio.sleep(0.02)
        during = await _scrape(http)
        assert during["gyre_engine_running_requests{}"] == 1
        assert during["gyre_engine_queued_requests{}"] == 1
        assert during["gyre_engine_kv_cache_bytes{pool=running}"] > 0
        await cell.abort("long")
        await cell.resume_generation()
        assert (await long)["meta_info"]["finish_reason"]["type"] == "abort"
        await queued
        r = await http.post("/update_weight_version", json={"new_version": "v7"})
        assert r.status_code == 200, r.text
        after = await _scrape(http)
    assert after["gyre_engine_requests_total{finish=abort}"] >= 1
    assert after["gyre_engine_running_requests{}"] == 0 and after["gyre_engine_queued_requests{}"] == 0
    assert after["gyre_engine_weight_version_info{version=v7}"] == 1
    assert not any(k.startswith("gyre_engine_weight_version_info{version=0}") for k in after)
