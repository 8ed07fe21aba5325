"""What one simulated run produced: hours, the lower bound, and the schedule's digest."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core import Fact, SwitchStarted
from .sessions import SessionPool
from .workload import HOUR

if TYPE_CHECKING:
    from .engine import ClusterSim


@dataclass(frozen=True)
class Sample:
    """One tick as the scheduler saw it (for the picture)."""

    at: float
    level: float
    inference_cells: int
    training_cells: int
    queued_calls: int


@dataclass(frozen=True)
class SimResult:
    policy: str
    hours: float
    ideal_h: float  # total GPU work / total capacity: no schedule can beat it
    step_end_h: tuple[float, ...]
    switches: int
    migrated_calls: int
    timed_out_share: float
    over_4h_share: float
    inference_work_cell_h: float
    training_work_cell_h: float
    digest: str
    facts: tuple[Fact, ...] = ()
    samples: tuple[Sample, ...] = ()
    cells: int = 0

    def summary(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "hours": round(self.hours, 3),
            "ideal_h": round(self.ideal_h, 3),
            "over_ideal": round(self.hours / self.ideal_h, 4) if self.ideal_h else None,
            "switches": self.switches,
            "migrated_calls": self.migrated_calls,
            "timed_out_share": round(self.timed_out_share, 4),
            "over_4h_share": round(self.over_4h_share, 4),
            "inference_work_cell_h": round(self.inference_work_cell_h, 2),
            "training_work_cell_h": round(self.training_work_cell_h, 2),
            "digest": self.digest,
        }


def _canon(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6f}"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, dict) or hasattr(value, "items"):
        return "{" + ",".join(f"{k}:{_canon(v)}" for k, v in sorted(value.items())) + "}"
    return str(value)


def schedule_digest(facts: tuple[Fact, ...] | list[Fact]) -> str:
    """sha256 over every fact, fields in order, floats to the microsecond; the log ids a
    fact carries (fields outside its equality: which request it answers) are left out, as
    they say nothing of the schedule, and so are fields added later that are marked
    ``metadata={"digest": "if set"}`` while they have their default (digests of schedules
    without them stay what they were)."""
    h = hashlib.sha256()
    for fact in facts:
        parts = [type(fact).__name__] + [
            f"{f.name}={_canon(getattr(fact, f.name))}" for f in dataclasses.fields(fact)
            if f.compare and not (f.metadata.get("digest") == "if set" and getattr(fact, f.name) == f.default)
        ]
        h.update(("|".join(parts) + "\n").encode())
    return h.hexdigest()


def build_result(sim: ClusterSim) -> SimResult:
    cfg = sim.cfg
    inference_cell_s = sim.pool.executed_s / cfg.slots_per_cell
    if isinstance(sim.pool, SessionPool):  # memory binds too: the larger of the two is a bound
        sim.pool._account(sim.now)
        inference_cell_s = max(inference_cell_s, sim.pool.session_s / cfg.sessions_per_cell)
    training_cell_s = sim.steps.work_s
    walls = sim.finished_walls
    facts = tuple(sim.facts)
    return SimResult(
        policy=sim.policy.name,
        hours=sim.now / HOUR,
        ideal_h=(inference_cell_s + training_cell_s) / cfg.cells / HOUR,
        step_end_h=tuple(t / HOUR for t in sim.step_end_s),
        switches=sum(isinstance(f, SwitchStarted) for f in facts),
        migrated_calls=sim.pool.migrated,
        timed_out_share=sum(t for _, t in walls) / max(1, len(walls)),
        over_4h_share=sum(w > 4 * HOUR for w, _ in walls) / max(1, len(walls)),
        inference_work_cell_h=inference_cell_s / HOUR,
        training_work_cell_h=training_cell_s / HOUR,
        digest=schedule_digest(facts),
        facts=facts,
        samples=tuple(sim.samples),
        cells=cfg.cells,
    )
