"""Fault injection for the cell agent's training seat.

``FailingSeat`` fakes a trainer replica that cannot join (e.g. the core is unreachable):
``join`` raises; ``leave`` succeeds. Everything else in these tests is real: the
embedded engines, the proxy, NATS.
"""

from __future__ import annotations


class FailingSeat:
    def __init__(self) -> None:
        self.left = 0

    async def join(self, weight_version: int) -> None:
        raise ConnectionError("core unreachable")

    async def leave(self) -> None:
        self.left += 1
