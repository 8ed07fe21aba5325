"""Prometheus figures for consumer lag (every service's JetStream consumers, through the
service host's /metrics) and the proxy's calls in flight per cell, read back with
prometheus_client's text parser."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from libs.common.bus.port import ConsumerConfig
from libs.common.bus_metrics import ConsumerLagMetrics
from libs.common.events import Context, RunStarted


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def lag(values, name: str, consumer: str) -> float:
    return values[(name, (("consumer", consumer), ("stream", "GYRE_RUNS")))]


async def _publish(bus, n: int) -> None:
    for i in range(n):
        await bus.publish(RunStarted(run_id=f"r{i}", config={}))


async def test_consumer_lag_follows_a_slow_consumer(js_bus) -> None:
    await _publish(js_bus, 5)
    release, seen = asyncio.Event(), []

    async def handler(delivery) -> None:
        seen.append(delivery.seq)
        await release.wait()

    stop = asyncio.Event()
    task = asyncio.create_task(js_bus.run_consumer(
        ConsumerConfig(name="slow", context=Context.RUNS, batch=1), handler, stop=stop))
    while not seen:
        await asyncio.sleep(0.02)
    registry = CollectorRegistry()
    metrics = ConsumerLagMetrics(registry)
    await metrics.refresh(js_bus)
    values = samples(generate_latest(registry).decode())
    assert lag(values, "gyre_consumer_pending", "slow") == 4  # five stored, one handed out
    assert lag(values, "gyre_consumer_ack_pending", "slow") == 1
    assert lag(values, "gyre_consumer_delivered_seq", "slow") == 1
    assert values[("gyre_stream_last_seq", (("stream", "GYRE_RUNS"),))] == 5

    release.set()
    while len(seen) < 5:
        await asyncio.sleep(0.02)
    stop.set()
    await task
    await metrics.refresh(js_bus)
    values = samples(generate_latest(registry).decode())
    assert lag(values, "gyre_consumer_pending", "slow") == 0
    assert lag(values, "gyre_consumer_ack_pending", "slow") == 0
    assert lag(values, "gyre_consumer_ack_floor_seq", "slow") == 5


async def test_every_service_serves_its_consumers_lag_on_metrics(nats_server, tmp_path) -> None:
    from libs.common.natsserver import free_port
    from libs.common.service import ServiceSpec, serve
    from libs.common.settings import GyreSettings

    gate, finish, handled = asyncio.Event(), asyncio.Event(), []

    async def main(ctx) -> None:
        async def handler(delivery) -> None:
            handled.append(delivery.seq)
            await gate.wait()

        consumer = asyncio.create_task(ctx.runtime.bus.run_consumer(
            ConsumerConfig(name="demo-consumer", context=Context.RUNS, batch=1), handler, stop=ctx.stop))
        ctx.health.ok()
        await finish.wait()
        ctx.stop.set()
        gate.set()
        await consumer

    port = free_port()
    settings = GyreSettings(nats_url=nats_server.url, run_dir=tmp_path, run_id="lagrun")
    served = asyncio.create_task(serve(ServiceSpec("demo", main), settings, port=port))
    from libs.common.bus.jetstream import JetStreamBus

    bus = await JetStreamBus.connect(nats_server.url)
    try:
        await _publish(bus, 3)
    finally:
        await bus.close()
    values: dict = {}
    async with httpx.AsyncClient() as http:
        for _ in range(100):  # the host polls every 2 s
            try:
                text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
            except httpx.HTTPError:
                text = ""
            values = samples(text) if text else {}
            if values.get(("gyre_consumer_pending", (("consumer", "demo-consumer"), ("stream", "GYRE_RUNS")))) == 2:
                break
            await asyncio.sleep(0.1)
    finish.set()
    await asyncio.wait_for(served, 30)
    assert lag(values, "gyre_consumer_pending", "demo-consumer") == 2
    assert lag(values, "gyre_consumer_ack_pending", "demo-consumer") == 1


def test_proxy_in_flight_per_cell_is_read_at_scrape_time() -> None:
    from services.proxy.core.routing import Router
    from services.proxy.queue_metrics import RouterCollector

    router = Router()
    router.add_cell("c0", capacity=4)
    router.add_cell("c1", capacity=2)
    registry = CollectorRegistry()
    registry.register(RouterCollector(router))
    router.pick("s1")
    router.pick("s2")
    for cell in ("c0", "c0", "c1"):
        router.begin(cell)
    router.drain("c1")
    values = samples(generate_latest(registry).decode())
    assert values[("gyre_proxy_in_flight", (("cell", "c0"),))] == 2
    assert values[("gyre_proxy_in_flight", (("cell", "c1"),))] == 1
    assert values[("gyre_proxy_queue_depth", ())] == 3
    assert values[("gyre_proxy_cell_capacity", (("cell", "c0"),))] == 4
    assert values[("gyre_proxy_cell_state", (("cell", "c1"), ("state", "draining")))] == 1
    assert sum(v for (name, _), v in values.items() if name == "gyre_proxy_sessions") == 2
    router.end("c0")
    values = samples(generate_latest(registry).decode())
    assert values[("gyre_proxy_in_flight", (("cell", "c0"),))] == 1


async def test_the_projector_serves_its_lag_per_stream(nats_server, tmp_path) -> None:
    from gyre.services import SERVICES
    from libs.common.bus.jetstream import JetStreamBus
    from libs.common.natsserver import free_port
    from libs.common.service import serve
    from libs.common.settings import GyreSettings

    bus = await JetStreamBus.connect(nats_server.url)
    try:
        await _publish(bus, 3)
    finally:
        await bus.close()
    port = free_port()
    settings = GyreSettings(nats_url=nats_server.url, run_dir=tmp_path, run_id="r0")
    served = asyncio.create_task(serve(SERVICES["projector"], settings, port=port))
    key = ("gyre_projection_lag", (("projection", "readmodels"), ("stream", "GYRE_RUNS")))
    values: dict = {}
    try:
        async with httpx.AsyncClient() as http:
            for _ in range(150):
                try:
                    values = samples((await http.get(f"http://127.0.0.1:{port}/metrics")).text)
                except httpx.HTTPError:
                    values = {}
                if values.get(key) == 0 and values.get(("gyre_projection_applied_total", (("projection", "readmodels"),))):
                    break
                await asyncio.sleep(0.1)
    finally:
        served.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await served
    assert values.get(key) == 0, values
    assert values[("gyre_projection_applied_total", (("projection", "readmodels"),))] >= 3
    assert ("gyre_projection_lag", (("projection", "readmodels"), ("stream", "GYRE_CALLS"))) in values
