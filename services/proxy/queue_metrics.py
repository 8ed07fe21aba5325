"""Prometheus figures of the proxy's routing, read from the router at scrape time: calls
in flight per inference cell (the proxy's queue towards each cell), each cell's capacity
and state, and the sessions pinned to it; and the streams waiting for a cell (none
active, or theirs failed: ``ProxyConfig.cell_wait_s``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .core.routing import Router

if TYPE_CHECKING:
    from .service import CellWaits


class RouterCollector(Collector):
    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterator[GaugeMetricFamily]:
        cells = list(self.router.cells.values())
        in_flight = GaugeMetricFamily("gyre_proxy_in_flight", "calls in flight at each inference cell", labels=["cell"])
        capacity = GaugeMetricFamily("gyre_proxy_cell_capacity", "concurrent calls a cell takes", labels=["cell"])
        state = GaugeMetricFamily("gyre_proxy_cell_state", "1 for the cell's current state", labels=["cell", "state"])
        sessions = GaugeMetricFamily("gyre_proxy_sessions", "sessions pinned to each cell", labels=["cell"])
        for c in cells:
            in_flight.add_metric([c.name], c.in_flight)
            capacity.add_metric([c.name], c.capacity)
            state.add_metric([c.name, c.state.value], 1)
            sessions.add_metric([c.name], self.router.pinned(c.name))
        total = GaugeMetricFamily("gyre_proxy_queue_depth", "calls in flight over all cells")
        total.add_metric([], sum(c.in_flight for c in cells))
        yield from (in_flight, capacity, state, sessions, total)


class CellWaitCollector(Collector):
    """``gyre_proxy_cell_waiting`` (calls waiting for a cell now),
    ``gyre_proxy_cell_waits_total`` (calls that began to wait) and
    ``gyre_proxy_cell_waits_given_up_total`` (waits that ended with no cell: the call got
    the overloaded error). A caller that leaves while it waits ends the wait uncounted."""

    def __init__(self, waits: "CellWaits") -> None:
        self.waits = waits

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        waiting = GaugeMetricFamily("gyre_proxy_cell_waiting", "streamed calls waiting for an inference cell now")
        waiting.add_metric([], self.waits.waiting)
        waits = CounterMetricFamily("gyre_proxy_cell_waits", "streamed calls that began to wait for a cell")
        waits.add_metric([], self.waits.waits)
        given_up = CounterMetricFamily("gyre_proxy_cell_waits_given_up",
                                       "waits for a cell that ended with none (the call ended overloaded)")
        given_up.add_metric([], self.waits.given_up)
        yield from (waiting, waits, given_up)
