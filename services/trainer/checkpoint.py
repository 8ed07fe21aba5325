"""Checkpoints: weights, optimizer, step, weight version and the consumed log positions,
written together (one file, atomically renamed), so a killed core resumes exactly: it
reloads this and reads the log on from the positions it names."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class TrainerState:
    step: int = 0  # the step being trained
    weight_version: int = 0  # weights after ``weight_version`` updates
    consumed: dict[str, int] = field(default_factory=dict)  # stream -> last sequence folded in
    history: list[dict] = field(default_factory=list)  # per applied step: loss statistics
    # the StepApplied of the step just applied, written with the checkpoint before it is
    # published: a core killed in between publishes it on restart (if the log lacks it)
    pending_applied: dict | None = None


def save_checkpoint(folder: Path, state: TrainerState, weights: dict[str, torch.Tensor],
                    optimizer: torch.optim.Optimizer) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = checkpoint_for_step(folder, state.step)
    tmp = path.with_suffix(".tmp")
    torch.save({"state": vars(state), "weights": {k: v.detach().cpu() for k, v in weights.items()},
                "optimizer": optimizer.state_dict()}, tmp)
    os.replace(tmp, path)
    (folder / "LATEST.tmp").write_text(path.name)
    os.replace(folder / "LATEST.tmp", folder / "LATEST")
    return path


def latest_checkpoint(folder: Path) -> Path | None:
    marker = folder / "LATEST"
    return folder / marker.read_text().strip() if marker.is_file() else None


def checkpoint_for_step(folder: Path, step: int) -> Path:
    """The state at the start of ``step`` (after every earlier step's update)."""
    return folder / f"step-{step:06d}.pt"


def load_checkpoint(path: Path) -> tuple[TrainerState, dict[str, torch.Tensor], dict]:
    data = torch.load(path, weights_only=False)
    return TrainerState(**data["state"]), data["weights"], data["optimizer"]
