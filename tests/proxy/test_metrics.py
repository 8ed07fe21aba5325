"""/metrics of the proxy, read by Prometheus' own text parser."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


async def test_proxy_metrics_parse_and_count_calls(proxy) -> None:
    base = await proxy.rollout("m-1")
    async with httpx.AsyncClient(timeout=30) as c:
        for _ in range(2):
            r = await c.post(base + "/v1/chat/completions", headers={"Authorization": "Bearer k-secret"},
                             json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200
        await c.post(base + "/v1/chat/completions", json={"model": "m", "messages": []})  # refused: 401
        text = (await c.get(proxy.url + "/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    calls = {tuple(sorted(s.labels.items())): s.value for s in families["gyre_proxy_calls"].samples
             if s.name.endswith("_total")}
    assert sum(calls.values()) == 2
    assert any(dict(k)["drift"] in ("fresh", "fork") for k in calls)
    errors = [s for s in families["gyre_proxy_errors"].samples if s.name.endswith("_total")]
    assert any(s.labels["kind"] == "authentication" and s.value == 1 for s in errors)
    latency = [s for s in families["gyre_proxy_call_seconds"].samples if s.name.endswith("_count")]
    assert latency and latency[0].value == 2
