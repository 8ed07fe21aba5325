"""``gyre bench bus``: Gyre's bus against raw nats-py on the same server, in one run.

Publish: N small events with raw ``publish_async`` (at most 4,000 pending, the very
payload bytes and headers Gyre sends), then N through ``JetStreamBus.publish_many``
(which also serialises the events). Consume: the raw events with a raw pull consumer
(``fetch(1000)``, explicit ack per message), then Gyre's events through Gyre's durable
consumer (decode, handler, ack). Ratios are Gyre / raw, measured back to back.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from nats.js import api

from libs.common.bus.jetstream import JetStreamBus, headers_for
from libs.common.bus.port import ConsumerConfig, Delivery
from libs.common.events import Context, Event, RolloutStarted
from libs.common.natsserver import EmbeddedNats

N_DEFAULT = 100_000
CHUNK = 10_000  # publish_many batch size Gyre's services use for bulk appends


def _events(run_id: str, n: int) -> list[Event]:
    # ~small events: the envelope plus a few fields, as a rollout registration
    return [
        RolloutStarted(run_id=run_id, rollout_id=f"r{i}", task_id="t", group_id="g", harness="gyre",
                       weight_version=0, api_key_digest="0" * 64)
        for i in range(n)
    ]


async def _raw_publish(bus: JetStreamBus, payloads: list[tuple[str, bytes, dict[str, str]]]) -> float:
    js = bus.nc.jetstream(publish_async_max_pending=4000)
    t = time.perf_counter()
    for subject, data, headers in payloads:
        await js.publish_async(subject, data, headers=headers)
    await js.publish_async_completed()
    return time.perf_counter() - t


async def _gyre_publish(bus: JetStreamBus, events: list[Event]) -> float:
    t = time.perf_counter()
    for i in range(0, len(events), CHUNK):
        await bus.publish_many(events[i : i + CHUNK])
    return time.perf_counter() - t


async def _raw_consume(bus: JetStreamBus, subject: str, n: int) -> float:
    cfg = api.ConsumerConfig(durable_name="bench-raw", ack_policy=api.AckPolicy.EXPLICIT, filter_subject=subject,
                             max_ack_pending=20_000)
    await bus.js.add_consumer(Context.ROLLOUTS.stream, cfg)
    sub = await bus.js.pull_subscribe_bind(durable="bench-raw", stream=Context.ROLLOUTS.stream)
    got = 0
    t = time.perf_counter()
    while got < n:
        for msg in await sub.fetch(1000, timeout=5):
            await msg.ack()
            got += 1
    elapsed = time.perf_counter() - t
    await sub.unsubscribe()
    return elapsed


async def _gyre_consume(bus: JetStreamBus, subject: str, n: int) -> float:
    stop = asyncio.Event()
    got = 0

    async def handler(_: Delivery) -> None:
        nonlocal got
        got += 1
        if got >= n:
            stop.set()

    cfg = ConsumerConfig(name="bench-gyre", context=Context.ROLLOUTS, filter_subject=subject)
    t = time.perf_counter()
    await bus.run_consumer(cfg, handler, stop=stop)
    return time.perf_counter() - t


async def _run(n: int, url: str, progress: bool) -> dict[str, Any]:
    def say(msg: str) -> None:
        if progress:
            print(msg, file=sys.stderr, flush=True)

    bus = await JetStreamBus.connect(url, name="gyre-bench")
    try:
        raw_events, gyre_events = _events("benchraw", n), _events("benchgyre", n)
        payloads = [(e.subject, e.to_json(), headers_for(e)) for e in raw_events]
        say(f"publishing {n} events raw ...")
        raw_pub = await _raw_publish(bus, payloads)
        say(f"publishing {n} events through Gyre ...")
        gyre_pub = await _gyre_publish(bus, gyre_events)
        say("consuming raw ...")
        raw_con = await _raw_consume(bus, "gyre.benchraw.rollouts.>", n)
        say("consuming through Gyre ...")
        gyre_con = await _gyre_consume(bus, "gyre.benchgyre.rollouts.>", n)
    finally:
        await bus.close()
    rp, gp, rc, gc = n / raw_pub, n / gyre_pub, n / raw_con, n / gyre_con
    return {
        "bench": "bus", "events": n, "payload_bytes": len(payloads[0][1]),
        "raw_publish_per_s": round(rp), "gyre_publish_per_s": round(gp), "publish_ratio": round(gp / rp, 3),
        "raw_consume_per_s": round(rc), "gyre_consume_per_s": round(gc), "consume_ratio": round(gc / rc, 3),
    }


def run_bus_bench(n: int | None = None, progress: bool = True) -> dict[str, Any]:
    n = n or N_DEFAULT
    with tempfile.TemporaryDirectory(prefix="gyre-bench-") as tmp, EmbeddedNats(Path(tmp) / "nats") as nats:
        return asyncio.run(_run(n, nats.url, progress))
