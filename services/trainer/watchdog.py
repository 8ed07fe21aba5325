"""The core's completeness watchdog, as bookkeeping (no I/O): which micro-steps of the step
in progress no cell will finish, so that the core computes them itself.

A micro-step is lost when the work queue dead-lettered it (it failed every try: the queue
will not deliver it again), or when no cell finished it within ``requeue_after_s`` of the
latest of: its step's weights being published (the step opening), the core reading its
``MicroStepQueued``, and its last ``MicroStepClaimed`` (a cell that hung while its claim's
heartbeat went on, a message lost otherwise); or when cells claimed it ``max_claims`` times
without a result (a cell publishes one claim per delivery it computes, so each claim but the
last is a cell that died with it: a micro-step that kills every cell that takes it, which the
queue, counting only failed tries of one delivery, would hand out for good). One whose
computation by the core failed is not lost again before ``REQUEUE_RETRY_S``. Micro-steps are
keyed by (step, micro-step).

    >>> t = [0.0]
    >>> w = CompletenessWatch(requeue_after_s=60, clock=lambda: t[0])
    >>> w.read(0, "m0"); w.read(0, "m1"); w.dead_lettered(0, "m1")
    >>> w.lost([(0, "m0"), (0, "m1")], used=())
    [(0, 'm1')]
    >>> t[0] = 61.0
    >>> w.lost([(0, "m0"), (0, "m1")], used=("m1",))
    [(0, 'm0')]
    >>> w = CompletenessWatch(requeue_after_s=None, max_claims=3)
    >>> for _ in range(3): w.claimed(0, "m2")
    >>> w.lost([(0, "m2")], used=())
    [(0, 'm2')]
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

REQUEUE_RETRY_S = 30.0  # a micro-step the core failed to compute is tried again after this
DEFAULT_MAX_CLAIMS = 4  # claims without a result before the core computes a micro-step

Key = tuple[int, str]


@dataclass
class CompletenessWatch:
    requeue_after_s: float | None  # None or 0: dead letters only
    clock: Callable[[], float] = time.monotonic
    max_claims: int | None = DEFAULT_MAX_CLAIMS  # None or 0: claims never make a micro-step lost
    _since: float = field(default=0.0, init=False)
    _seen: dict[Key, float] = field(default_factory=dict, init=False)  # read, or last claimed
    _dead: set[Key] = field(default_factory=set, init=False)
    _claims: dict[Key, int] = field(default_factory=dict, init=False)
    _retry: dict[Key, float] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self._since = self.clock()

    def step_opened(self, step: int) -> None:
        """The weights of ``step`` are published: its wait starts; earlier steps are forgotten."""
        self._since = self.clock()
        for marks in (self._seen, self._retry, self._claims):
            for key in [k for k in marks if k[0] < step]:
                del marks[key]
        self._dead = {k for k in self._dead if k[0] >= step}

    def read(self, step: int, micro_step: str) -> None:
        self._seen.setdefault((step, micro_step), self.clock())

    def claimed(self, step: int, micro_step: str) -> None:
        self._seen[(step, micro_step)] = self.clock()
        self._claims[(step, micro_step)] = self._claims.get((step, micro_step), 0) + 1

    def claims(self, key: Key) -> int:
        return self._claims.get(key, 0)

    def too_often_claimed(self, key: Key) -> bool:
        return bool(self.max_claims) and self._claims.get(key, 0) >= self.max_claims  # type: ignore[operator]

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
            if key in self._dead or self.too_often_claimed(key) or (after and quiet >= after):
                out.append(key)
        return out
