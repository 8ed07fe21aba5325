"""Per-step training metrics of a run, as TensorBoard event files under
``runs/<run>/tensorboard`` (``tensorboard --logdir runs``): reward mean and spread,
partial-score share, timed-out share, and the trainer's loss statistics for the step
(loss, clip fraction, importance-ratio mean, KL, tokens trained, rejected samples)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any


class RunMetrics:
    def __init__(self, folder: Path, *, enabled: bool = True) -> None:
        self.writer: Any = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            folder.mkdir(parents=True, exist_ok=True)
            self.writer = SummaryWriter(log_dir=str(folder))

    def step(self, step: int, rewards: list[float], partial: list[bool], timed_out: int, rollouts: int,
             trainer: dict[str, float] | None) -> dict[str, float]:
        figures: dict[str, float] = {
            "reward/mean": statistics.fmean(rewards) if rewards else 0.0,
            "reward/spread": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
            "rollouts/partial_score_share": sum(partial) / max(len(partial), 1),
            "rollouts/timed_out_share": timed_out / max(rollouts, 1),
        }
        for key, value in (trainer or {}).items():
            if isinstance(value, (int, float)):
                figures[f"train/{key}"] = float(value)
        if self.writer is not None:
            for name, value in figures.items():
                self.writer.add_scalar(name, value, step)
            self.writer.flush()
        return figures

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
