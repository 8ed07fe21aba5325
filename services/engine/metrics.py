"""Prometheus metrics of one embedded engine, served at ``GET /metrics``.

Counters and the latency histogram are bumped by the engine thread as requests are admitted,
produce tokens and end. Gauges (running and queued requests, KV bytes, weight version) are
read from the engine thread when ``/metrics`` is scraped, so they are one consistent snapshot
taken between two steps. Each engine has its own registry (several engines may share a
process, as in tests and benchmarks).

Names (all prefixed ``gyre_engine_``): ``requests_total{finish}`` (finish type: stop, length,
abort), ``prompt_tokens_total``, ``generated_tokens_total``, ``prefix_cache_hit_tokens_total``
(prompt tokens served from the prefix cache), ``request_seconds`` (histogram, end-to-end),
``running_requests``, ``queued_requests``, ``kv_cache_bytes{pool}`` (pool: ``prefix_cache``
or ``running``), ``kv_cache_capacity_bytes`` (the prefix cache's cap), and
``weight_version_info{version}`` (always 1).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class EngineMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("gyre_engine_requests", "requests ended, by finish type", ["finish"], registry=r)
        self.prompt_tokens = Counter("gyre_engine_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter("gyre_engine_generated_tokens", "tokens generated", registry=r)
        self.cache_hit_tokens = Counter("gyre_engine_prefix_cache_hit_tokens",
                                        "prompt tokens whose KV came from the prefix cache", registry=r)
        self.latency = Histogram("gyre_engine_request_seconds", "end-to-end request latency (queueing included)",
                                 registry=r, buckets=LATENCY_BUCKETS)
        self.running = Gauge("gyre_engine_running_requests", "requests being computed", registry=r)
        self.queued = Gauge("gyre_engine_queued_requests", "requests waiting for admission", registry=r)
        self.kv_bytes = Gauge("gyre_engine_kv_cache_bytes", "KV memory held, by pool", ["pool"], registry=r)
        self.kv_capacity = Gauge("gyre_engine_kv_cache_capacity_bytes", "the prefix cache's cap", registry=r)
        self.weight_version = Info("gyre_engine_weight_version", "the weight version being served", registry=r)

    # -- engine thread -------------------------------------------------------------------
    def admitted(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        if cached_tokens:
            self.cache_hit_tokens.inc(cached_tokens)

    def ended(self, finish_type: str, seconds: float) -> None:
        self.requests.labels(finish=finish_type).inc()
        self.latency.observe(seconds)

    def set_state(self, *, running: int, queued: int, prefix_kv_bytes: int, running_kv_bytes: int,
                  capacity_bytes: int, weight_version: str) -> None:
        self.running.set(running)
        self.queued.set(queued)
        self.kv_bytes.labels(pool="prefix_cache").set(prefix_kv_bytes)
        self.kv_bytes.labels(pool="running").set(running_kv_bytes)
        self.kv_capacity.set(capacity_bytes)
        self.weight_version.info({"version": weight_version})

    # -- any thread ----------------------------------------------------------------------
    def exposition(self) -> bytes:
        return generate_latest(self.registry)
