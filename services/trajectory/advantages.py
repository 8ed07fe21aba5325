"""Group advantages: the G rollouts of one task are compared with each other.

``A_i = (r_i - mean(r)) / (std(r) + eps)`` with ``scale="std"`` (GRPO), or just
``r_i - mean(r)`` with ``scale="none"`` (no length/difficulty rescaling). A group whose
scores are all equal gets zero advantages: it teaches nothing, but it is still queued so
the step's accounting stays whole.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class AdvantageConfig:
    scale: Literal["std", "none"] = "std"
    eps: float = 1e-6


def group_advantages(scores: Mapping[str, float], config: AdvantageConfig = AdvantageConfig()) -> dict[str, float]:
    """Advantage per rollout id, from the group's scores (in the mapping's order)."""
    if not scores:
        return {}
    values = list(scores.values())
    mean = sum(values) / len(values)
    centred = {r: s - mean for r, s in scores.items()}
    if config.scale == "none":
        return centred
    std = math.sqrt(sum(d * d for d in centred.values()) / len(values))
    return {r: d / (std + config.eps) for r, d in centred.items()}
