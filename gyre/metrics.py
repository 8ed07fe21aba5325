"""Per-step training metrics of a run: reward mean and spread, partial-score share,
timed-out share, and the trainer's loss statistics for the step (loss, clip fraction,
importance-ratio mean, KL, tokens trained, rejected samples).

They go to TensorBoard event files under ``runs/<run>/tensorboard`` (``tensorboard
--logdir runs``; ``metrics.tensorboard: false`` turns it off) and, when
``metrics.wandb_project`` is set, to Weights & Biases: by default offline
(``metrics.wandb_mode: offline``, no network needed; the run's files go under
``runs/<run>/wandb/offline-run-*``, sent later with ``wandb sync``), or ``online``.
The W&B run is named after the Gyre run and carries the resolved run config.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from libs.common.runconfig import RunConfig


class RunMetrics:
    def __init__(self, folder: Path, *, enabled: bool = True, wandb_project: str | None = None,
                 wandb_mode: str = "offline", wandb_dir: Path | None = None, run_name: str | None = None,
                 config: dict[str, Any] | None = None) -> None:
        self.writer: Any = None
        self.wandb: Any = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            folder.mkdir(parents=True, exist_ok=True)
            self.writer = SummaryWriter(log_dir=str(folder))
        if wandb_project and wandb_mode != "disabled":
            self.wandb = _start_wandb(wandb_project, wandb_mode, wandb_dir or folder.parent, run_name, config)

    @classmethod
    def for_run(cls, cfg: RunConfig) -> RunMetrics:
        m = cfg.metrics
        return cls(cfg.run_dir / "tensorboard", enabled=m.tensorboard, wandb_project=m.wandb_project,
                   wandb_mode=m.wandb_mode, wandb_dir=cfg.run_dir, run_name=cfg.run.id,
                   config=cfg.model_dump(mode="json"))

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
        if self.wandb is not None:
            self.wandb.log(figures, step=step)
        return figures

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            import wandb

            self.wandb.finish()
            self.wandb = None
            wandb.teardown()  # finish() returns before the W&B service has written the run file; this waits


def _start_wandb(project: str, mode: str, folder: Path, name: str | None, config: dict[str, Any] | None) -> Any:
    try:
        import wandb
    except ImportError as exc:
        raise RuntimeError("metrics.wandb_project is set but wandb is not installed "
                           "(pip install -r requirements/metrics.txt)") from exc
    folder.mkdir(parents=True, exist_ok=True)
    # console off: the run's live view owns the terminal; no stdout capture, no banner
    settings = wandb.Settings(console="off", silent=True)
    return wandb.init(project=project, mode=mode, dir=str(folder), name=name, config=config or {},
                      settings=settings, reinit="create_new")
