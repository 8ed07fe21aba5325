"""Benchmarks run by ``gyre bench <name> [--json]``: name -> (function, summary).

Each function takes ``n`` (size, None = default) and ``progress`` and returns one flat
dict, printed as a JSON object on the last line with ``--json``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _bus(**kw: Any) -> dict[str, Any]:
    from gyre.bench.bus import run_bus_bench

    return run_bus_bench(**kw)


BENCHMARKS: dict[str, tuple[Callable[..., dict[str, Any]], str]] = {
    "bus": (_bus, "raw nats-py vs Gyre's bus: publish and durable consume rates (ratios >= 0.8)"),
}
