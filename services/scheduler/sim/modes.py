"""The three modes as policy strategies over one simulator (no per-mode copies)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..core import AsyncPolicy, ColocatePolicy, ElasticPolicy, Policy
from .config import SimConfig
from .engine import ClusterSim
from .report import SimResult

MODES = ("elastic", "async", "colocate")
# SimConfig fields that are the elastic policy's own
ELASTIC_KNOBS = ("low_watermark", "high_watermark", "hold_s", "min_dwell_s", "smoothing_s", "max_switches_in_flight")


def make_policy(mode: str, config: SimConfig, *, training_cells: int | None = None, **elastic_opts: Any) -> Policy:
    # with sessions binding, every unfinished rollout holds capacity (weight 1)
    weight = 1.0 if config.sessions_per_cell else config.workload.call_share
    if mode == "elastic":
        knobs = {name: getattr(config, name) for name in ELASTIC_KNOBS}
        return ElasticPolicy(between_calls_weight=weight, **{**knobs, **elastic_opts})
    if mode == "async":
        if training_cells is None:
            raise ValueError("async needs training_cells (the fixed split)")
        if not 1 <= training_cells < config.cells:
            raise ValueError(f"async training_cells must be in 1..{config.cells - 1}")
        return AsyncPolicy(training_cells=training_cells, between_calls_weight=weight)
    if mode == "colocate":
        return ColocatePolicy(between_calls_weight=weight)
    raise ValueError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")


def simulate(config: SimConfig, mode: str, *, training_cells: int | None = None,
             carry_over: bool | None = None, **elastic_opts: Any) -> SimResult:
    """Run one simulation. ``carry_over`` overrides the config (colocate's two variants)."""
    if carry_over is not None:
        config = replace(config, carry_over=carry_over)
    policy = make_policy(mode, config, training_cells=training_cells, **elastic_opts)
    return ClusterSim(config, policy).run()
