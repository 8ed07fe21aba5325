"""Running the three modes on the same workload and GPU budget, over several seeds.

``async`` is the best static split: a downhill walk over the number of training cells
(from a hint) on the mean hours over all seeds, so one split serves every seed, as an
operator would choose it. Runs fan out over worker processes; results do not depend on
the number of workers.
"""

from __future__ import annotations

import statistics
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from .config import SimConfig
from .modes import simulate


@dataclass(frozen=True)
class Job:
    config: SimConfig
    mode: str
    training_cells: int | None = None
    carry_over: bool | None = None


def run_job(job: Job) -> dict[str, Any]:
    result = simulate(job.config, job.mode, training_cells=job.training_cells, carry_over=job.carry_over)
    return result.summary()


class Runner:
    """Maps jobs over ``workers`` processes (1: in this process)."""

    def __init__(self, workers: int = 1) -> None:
        self.workers = max(1, workers)
        self._pool = ProcessPoolExecutor(self.workers) if self.workers > 1 else None

    def map(self, jobs: list[Job]) -> list[dict[str, Any]]:
        if self._pool is None:
            return [run_job(j) for j in jobs]
        return list(self._pool.map(run_job, jobs))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _seeded(config: SimConfig, seeds: list[int]) -> list[SimConfig]:
    return [replace(config, seed=s) for s in seeds]


def mean_hours(rows: list[dict[str, Any]]) -> float:
    return statistics.fmean(r["hours"] for r in rows)


def best_async_split(
    config: SimConfig, seeds: list[int], runner: Runner, hint: int
) -> tuple[int, list[dict[str, Any]], dict[int, float]]:
    """(best split, its per-seed rows, mean hours of every split tried)."""
    tried: dict[int, list[dict[str, Any]]] = {}

    def score(split: int) -> float:
        if split not in tried:
            jobs = [Job(c, "async", training_cells=split) for c in _seeded(config, seeds)]
            tried[split] = runner.map(jobs)
        return mean_hours(tried[split])

    lo, hi = 1, config.cells - 1
    best = min(max(hint, lo), hi)
    while True:
        around = [s for s in (best - 1, best + 1) if lo <= s <= hi]
        nxt = min(around + [best], key=lambda s: (score(s), s))
        if nxt == best:
            break
        best = nxt
    return best, tried[best], {s: round(mean_hours(rows), 3) for s, rows in sorted(tried.items())}


def compare_modes(config: SimConfig, seeds: list[int], runner: Runner, split_hint: int | None = None) -> dict[str, Any]:
    """Every mode on every seed; speedups are means over seeds, plus the worst seed."""
    configs = _seeded(config, seeds)
    jobs = [Job(c, "elastic") for c in configs]
    jobs += [Job(c, "colocate", carry_over=True) for c in configs]
    jobs += [Job(c, "colocate", carry_over=False) for c in configs]
    rows = runner.map(jobs)
    n = len(configs)
    elastic, colocate, colocate_nc = rows[:n], rows[n : 2 * n], rows[2 * n :]
    if split_hint is None:
        share = statistics.fmean(
            r["training_work_cell_h"] / (r["training_work_cell_h"] + r["inference_work_cell_h"]) for r in elastic
        )
        split_hint = round(share * config.cells)
    split, async_rows, tried = best_async_split(config, seeds, runner, split_hint)

    def per_seed(base: list[dict[str, Any]]) -> list[float]:
        return [b["hours"] / e["hours"] for b, e in zip(base, elastic, strict=True)]

    return {
        "colocate_h": round(mean_hours(colocate), 3),
        "colocate_no_carry_h": round(mean_hours(colocate_nc), 3),
        "async_h": round(mean_hours(async_rows), 3),
        "async_best_split": {"training_cells": split, "inference_cells": config.cells - split},
        "async_sweep_h": {str(k): v for k, v in tried.items()},
        "elastic_h": round(mean_hours(elastic), 3),
        "ideal_h": round(statistics.fmean(r["ideal_h"] for r in elastic), 3),
        "speedup_vs_async": round(statistics.fmean(per_seed(async_rows)), 4),
        "speedup_vs_async_min": round(min(per_seed(async_rows)), 4),
        "speedup_vs_colocate": round(statistics.fmean(per_seed(colocate)), 4),
        "speedup_vs_colocate_no_carry": round(statistics.fmean(per_seed(colocate_nc)), 4),
        "elastic_over_ideal": round(statistics.fmean(r["hours"] / r["ideal_h"] for r in elastic), 4),
        "elastic_switches_mean": round(statistics.fmean(r["switches"] for r in elastic), 1),
        "elastic_digests": [r["digest"] for r in elastic],
    }
