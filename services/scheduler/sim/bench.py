"""``gyre sim --preset seed-nl2repo --steps 48 --json`` as a benchmark function.

``run_bench(**opts) -> dict`` runs colocate (with and without carry-over), the best
static async split (a sweep) and elastic over five workload seeds on the same GPU budget,
the lower bound, and two what-ifs: switch costs 10x higher, and a shorter tail (the
duration spread halved around the same median). The lead wires it into the CLI.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from .calibrate import SEED_ASYNC_H, fit_train_cost
from .compare import Runner, compare_modes
from .config import FITTED, preset
from .modes import simulate
from .plot import draw_roles

SEED_FIGURES = {
    "steps": 48, "elastic_h": 75.42, "async_h": SEED_ASYNC_H, "speedup_vs_async": 1.78,
    "speedup_vs_colocate": 1.85, "switch_to_training_s": 8.52, "switch_to_inference_s": 3.46,
    "share_over_4h": 0.611, "share_timed_out": 0.382,
}
_SPEEDUPS = ("elastic_h", "async_h", "colocate_h", "speedup_vs_async", "speedup_vs_async_min",
             "speedup_vs_colocate", "elastic_over_ideal", "async_best_split")


def targets(report: dict[str, Any]) -> dict[str, bool]:
    return {
        "async_h_within_10pct_of_134.55": abs(report["async_h"] / SEED_ASYNC_H - 1.0) <= 0.10,
        "speedup_vs_async_ge_1.78": report["speedup_vs_async"] >= 1.78,
        "speedup_vs_colocate_ge_1.85": report["speedup_vs_colocate"] >= 1.85,
        "elastic_over_ideal_le_1.15": report["elastic_over_ideal"] <= 1.15,
        "elastic_faster_than_async_and_colocate": report["speedup_vs_async_min"] > 1.0
        and report["speedup_vs_colocate"] > 1.0,
    }


def run_bench(
    preset_name: str = "seed-nl2repo", steps: int | None = None, seeds: int | list[int] = 5, workers: int = 2,
    sensitivity: bool = True, refit: bool = False, png: str | None = None, **overrides: Any,
) -> dict[str, Any]:
    """Compare the modes; returns the JSON-able report (see the module docstring)."""
    started = time.monotonic()
    seed_list = list(range(seeds)) if isinstance(seeds, int) else list(seeds)
    if steps is not None:
        overrides["steps"] = steps
    config = preset(preset_name, **overrides)
    with Runner(workers) as runner:
        fitted: dict[str, Any] = dict(FITTED) if preset_name == "seed-nl2repo" else {}
        if refit:
            fit = fit_train_cost(config, seed_list, runner)
            config = replace(config, train_cost_ratio=fit.train_cost_ratio)
            fitted = fit.as_dict()
        fitted.setdefault("train_cost_ratio", config.train_cost_ratio)
        report: dict[str, Any] = {"bench": "sim", "preset": preset_name, "steps": config.steps, "cells": config.cells,
                                  "seeds": seed_list}
        base = compare_modes(config, seed_list, runner)
        report.update(base)
        report["fitted_params"] = fitted
        report["targets"] = targets(base)
        if sensitivity:
            split = base["async_best_split"]["training_cells"]
            what_ifs = {
                "switch_cost_x10": replace(config, switch_to_training_s=config.switch_to_training_s * 10,
                                           switch_to_inference_s=config.switch_to_inference_s * 10),
                "shorter_tail": config.with_options(sigma_scale=0.5),
            }
            report["sensitivity"] = {
                name: {k: v for k, v in compare_modes(cfg, seed_list, runner, split).items() if k in _SPEEDUPS}
                for name, cfg in what_ifs.items()
            }
    report["seed_figures"] = SEED_FIGURES
    if png:
        runs = [simulate(config, "elastic"),
                simulate(config, "async", training_cells=base["async_best_split"]["training_cells"]),
                simulate(config, "colocate")]
        report["png"] = draw_roles(runs, png)
    report["wall_s"] = round(time.monotonic() - started, 1)
    return report
