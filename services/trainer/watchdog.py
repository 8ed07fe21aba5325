"""The core's completeness watchdog, as bookkeeping (no I/O): which micro-steps of the step
in progress no cell will finish, so that the core computes them itself.

A micro-step is lost when the work queue dead-lettered it (it failed every try: the queue
will not deliver it again), or when no cell finished it within ``requeue_after_s`` of the
latest of: its step's weights being published (the step opening), the core reading its
``MicroStepQueued``, and its last ``MicroStepClaimed`` (a cell that hung while its claim's
heartbeat went on, a message lost otherwise). One whose computation by the core failed is
not lost again before ``REQUEUE_RETRY_S``. Micro-steps are keyed by (step, micro-step).

    >>> t = [0.0]
    >>> w = CompletenessWatch(requeue_after_s=60, clock=lambda: t[0])
    >>> w.read(0, "m0"); w.read(0, "m1"); w.dead_lettered(0, "m1")
    >>> w.lost([(0, "m0"), (0, "m1")], used=())
    [(0, 'm1')]
    >>> t[0] = 61.0
    >>> w.lost([(0, "m0"), (0, "m1")], used=("m1",))
    [(0, 'm0')]
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

REQUEUE_RETRY_S = 30.0  # a micro-step the core failed to compute is tried again after this

Key = tuple[int, str]


@dataclass
class CompletenessWatch:
    requeue_after_s: float | None  # None or 0: dead letters only
    clock: Callable[[], float] = time.monotonic
    _since: float = field(default=0.0, init=False)
    _seen: dict[Key, float] = field(default_factory=dict, init=False)  # read, or last claimed
    _dead: set[Key] = field(default_factory=set, init=False)
    _retry: dict[Key, float] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self._since = self.clock()

    def step_opened(self, step: int) -> None:
        """The weights of ``step`` are published: its wait starts; earlier steps are forgotten."""
        self._since = self.clock()
        for marks in (self._seen, self._retry):
            for key in [k for k in marks if k[0] < step]:
                del marks[key]
        self._dead = {k for k in self._dead if k[0] >= step}

    def read(self, step: int, micro_step: str) -> None:
        self._seen.setdefault((step, micro_step), self.clock())

    def claimed(self, step: int, micro_step: str) -> None:
        self._seen[(step, micro_step)] = self.clock()

    def dead_lettered(self, step: int, micro_step: str) -> None:
        self._dead.add((step, micro_step))

    def is_dead(self, key: Key) -> bool:
        return key in self._dead

    def failed(self, key: Key) -> None:
        """The core's own computation of ``key`` failed: not lost again for a while."""
        self._retry[key] = self.clock() + REQUEUE_RETRY_S

    def lost(self, queued: Iterable[Key], used: Collection[str]) -> list[Key]:
        """Those of ``queued`` (the current step's) that no cell will finish; ``used``: the
        micro-steps whose result is in (never lost, whatever else is known of them)."""
        now, after = self.clock(), self.requeue_after_s
        out = []
        for key in queued:
            if key[1] in used or now < self._retry.get(key, 0.0):
                continue
            quiet = now - max(self._since, self._seen.get(key, 0.0))
            if key in self._dead or (after and quiet >= after):
                out.append(key)
        return out
