"""Prometheus figures of the JetStream consumers a service runs: how far behind each is.

Every durable consumer a process starts through ``JetStreamBus.run_consumer`` is polled
(``consumer_info``, every ``interval_s``) and exported with ``stream`` and ``consumer``
labels; the service host (``libs/common/service.py``) runs this for every service, so each
``/metrics`` shows the consumers of that service only:

- ``gyre_consumer_pending``: matching events not yet delivered (the consumer's lag);
- ``gyre_consumer_ack_pending``: delivered, not yet acknowledged (being worked on);
- ``gyre_consumer_redelivered``: delivered more than once and still unacknowledged;
- ``gyre_consumer_delivered_seq`` / ``gyre_consumer_ack_floor_seq``: stream positions;
- ``gyre_stream_last_seq``: the stream's head, for the consumers' streams.

The trainer's micro-step queue is the ``trainer-work-<run>`` consumer of ``GYRE_TREES``: its
depth is ``pending + ack_pending``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

log = logging.getLogger(__name__)


class ConsumerLagMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["stream", "consumer"]
        self.pending = Gauge("gyre_consumer_pending", "events matching the consumer not yet delivered (lag)",
                             labels, registry=registry)
        self.ack_pending = Gauge("gyre_consumer_ack_pending", "events delivered, not yet acknowledged",
                                 labels, registry=registry)
        self.redelivered = Gauge("gyre_consumer_redelivered", "events redelivered, not yet acknowledged",
                                 labels, registry=registry)
        self.delivered_seq = Gauge("gyre_consumer_delivered_seq", "stream sequence last delivered",
                                   labels, registry=registry)
        self.ack_floor_seq = Gauge("gyre_consumer_ack_floor_seq", "stream sequence below which all are acked",
                                   labels, registry=registry)
        self.stream_last = Gauge("gyre_stream_last_seq", "the stream's last sequence", ["stream"], registry=registry)

    async def refresh(self, bus: Any) -> None:
        """One poll of every consumer ``bus`` runs (a bus without JetStream has none)."""
        js = getattr(bus, "js", None)
        consumers = sorted(getattr(bus, "consumers", ()))
        if js is None or not consumers:
            return
        for stream in {s for s, _ in consumers}:
            info = await js.stream_info(stream)
            self.stream_last.labels(stream).set(info.state.last_seq or 0)
        for stream, name in consumers:
            info = await js.consumer_info(stream, name)
            self.pending.labels(stream, name).set(info.num_pending or 0)
            self.ack_pending.labels(stream, name).set(info.num_ack_pending or 0)
            self.redelivered.labels(stream, name).set(info.num_redelivered or 0)
            self.delivered_seq.labels(stream, name).set((info.delivered.stream_seq or 0) if info.delivered else 0)
            self.ack_floor_seq.labels(stream, name).set((info.ack_floor.stream_seq or 0) if info.ack_floor else 0)

    async def run(self, bus: Any, stop: asyncio.Event, *, interval_s: float = 2.0) -> None:
        while not stop.is_set():
            try:
                await self.refresh(bus)
            except Exception as exc:  # a slow or restarting server must not stop the service
                log.debug("consumer metrics: %r", exc)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
