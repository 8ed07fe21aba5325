"""The rollout workload: long-tailed agent executions that alternate model calls and tools.

Fixed from the seed (NL2RepoBench on Qwen3.8 2.4T): 61.1 % of queries run over 4 h and
38.2 % hit the time limit. A rollout's natural (uncontended) duration ``D`` is lognormal;
the two shares pin its two parameters once the time limit is declared::

    P(D > 4 h) = 0.611            P(D > limit) = 0.382

The seed does not state the limit; ``time_limit_h`` is a declared assumption (6 h in the
preset, flag ``--time-limit-h``). A rollout is a sequence of turns, each one model call
(its latency is GPU time: the call holds one of a cell's slots) and one tool phase (no
GPU). ``call_share`` is the share of a rollout's uncontended time spent in model calls.
Under load, calls queue and wall time stretches; the limit counts the agent's own time.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from statistics import NormalDist

HOUR = 3600.0


@dataclass(frozen=True)
class WorkloadModel:
    time_limit_h: float = 6.0
    share_over_4h: float = 0.611
    share_timed_out: float = 0.382
    call_share: float = 0.5
    turn_minutes: float = 6.0  # mean length of one call + tool turn, uncontended
    front_load: float = 0.5  # 0..1: model calls concentrate early in a rollout (declared)
    sigma_scale: float = 1.0  # <1 narrows the spread around the same median (a shorter tail)

    def __post_init__(self) -> None:
        if self.time_limit_h <= 4.0:
            raise ValueError("time_limit_h must exceed 4 h: the seed has 61.1 % of queries over 4 h")
        if not 0 < self.share_timed_out < self.share_over_4h < 1:
            raise ValueError("need 0 < share_timed_out < share_over_4h < 1")
        if not 0 < self.call_share < 1 or not 0 <= self.front_load <= 1 or self.sigma_scale <= 0:
            raise ValueError("need 0 < call_share < 1, 0 <= front_load <= 1 and sigma_scale > 0")

    def lognormal(self) -> tuple[float, float]:
        """(mu, sigma) of ln(D / 1 h), solved from the two seed shares (then ``sigma_scale``)."""
        z4 = NormalDist().inv_cdf(1.0 - self.share_over_4h)
        zl = NormalDist().inv_cdf(1.0 - self.share_timed_out)
        sigma = (math.log(self.time_limit_h) - math.log(4.0)) / (zl - z4)
        mu = math.log(4.0) - z4 * sigma
        return mu, sigma * self.sigma_scale

    def share_over(self, hours: float) -> float:
        """Share of rollouts whose natural duration exceeds ``hours``."""
        mu, sigma = self.lognormal()
        return 1.0 - NormalDist(mu, sigma).cdf(math.log(hours))

    def mean_duration_h(self) -> float:
        """Mean own-time duration of a rollout, cut at the limit (closed form)."""
        mu, sigma = self.lognormal()
        cut = math.log(self.time_limit_h)
        nd = NormalDist()
        below = math.exp(mu + sigma**2 / 2) * nd.cdf((cut - mu - sigma**2) / sigma)
        return below + self.time_limit_h * (1.0 - nd.cdf((cut - mu) / sigma))


@dataclass(frozen=True)
class RolloutPlan:
    """One rollout's turns: ``calls[i]`` seconds of model call then ``tools[i]`` of tools."""

    natural_s: float
    calls: tuple[float, ...]
    tools: tuple[float, ...]
    truncated: bool = False  # cut at the time limit: it ends timed out

    @property
    def call_s(self) -> float:
        return sum(self.calls)


def draw_rollout(model: WorkloadModel, rng: random.Random) -> RolloutPlan:
    """Draw one rollout; a rollout longer than the limit is cut at the limit (it times out).

    The limit counts the agent's own time (its tools and its calls being served); time a
    call waits in the proxy's queue does not count, so every mode runs the same work and
    a starved inference side cannot look fast by timing rollouts out early.
    """
    mu, sigma = model.lognormal()
    natural = math.exp(rng.gauss(mu, sigma)) * HOUR
    horizon = min(natural, model.time_limit_h * HOUR)
    turn = model.turn_minutes * 60.0
    n_full = max(1, round(natural / turn))
    calls: list[float] = []
    tools: list[float] = []
    elapsed = 0.0
    for i in range(n_full):
        # progress through the natural run; front-loading moves call time to early turns
        x = (i + 0.5) / n_full
        share = model.call_share * (1.0 + model.front_load * (1.0 - 2.0 * x))
        share = min(0.95, max(0.05, share))
        length = natural / n_full * rng.uniform(0.5, 1.5)
        if i == n_full - 1 and natural <= horizon:
            length = max(1.0, horizon - elapsed)  # the last turn ends the run on time
        length = min(length, horizon - elapsed)
        calls.append(max(1.0, length * share))
        tools.append(length * (1.0 - share))
        elapsed += length
        if elapsed >= horizon - 1e-6:
            break
    if natural > horizon and elapsed < horizon:
        tools[-1] += horizon - elapsed  # a cut rollout runs until its limit
    return RolloutPlan(natural_s=natural, calls=tuple(calls), tools=tuple(tools), truncated=natural > horizon)
