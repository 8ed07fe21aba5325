"""Checkpoints: weights, optimizer, step, weight version and the consumed log positions,
written together (one file, atomically renamed), so a killed core resumes exactly: it
reloads this and reads the log on from the positions it names.

A checkpoint is durable before anything of its version reaches the log: the file is
fsynced, renamed into place, the folder fsynced, and only then ``LATEST`` is replaced (by
the same write, fsync, rename, fsync). A ``LATEST`` that names a missing or unreadable
file (a disk that lost it) is passed over, with a warning, for the newest readable
``step-*.pt``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger(__name__)


@dataclass
class TrainerState:
    step: int = 0  # the step being trained
    weight_version: int = 0  # weights after ``weight_version`` updates
    consumed: dict[str, int] = field(default_factory=dict)  # stream -> last sequence folded in
    history: list[dict] = field(default_factory=list)  # per applied step: loss statistics
    # the StepApplied of the step just applied, written with the checkpoint before it is
    # published: a core killed in between publishes it on restart (if the log lacks it)
    pending_applied: dict | None = None
    # weight blobs of versions below this are deleted (keep_weights), so a restart does not
    # look at them again
    weights_pruned_below: int = 0


def save_checkpoint(folder: Path, state: TrainerState, weights: dict[str, torch.Tensor],
                    optimizer: torch.optim.Optimizer, *, keep: int | None = None) -> Path:
    """Writes the checkpoint of ``state.step`` and makes it ``LATEST``. ``keep``: how many
    of the newest checkpoints to keep (None: all; ``gyre replay --step N`` needs the one
    written at step N's start). Each holds the weights and the optimizer's state: at a
    7B model in fp32 about 84 GB, so a long run on a big model sets it."""
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be at least 1 (the checkpoint just written), not {keep}")
    folder.mkdir(parents=True, exist_ok=True)
    path = checkpoint_for_step(folder, state.step)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        torch.save({"state": vars(state), "weights": {k: v.detach().cpu() for k, v in weights.items()},
                    "optimizer": optimizer.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(folder)  # the rename is on disk before LATEST names the file
    marker = folder / "LATEST.tmp"
    with open(marker, "w") as f:
        f.write(path.name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(marker, folder / "LATEST")
    _fsync_dir(folder)
    if keep is not None:
        _prune(folder, keep, path)
    return path


def _prune(folder: Path, keep: int, latest: Path) -> None:
    """Deletes all but the ``keep`` newest ``step-*.pt`` (by step), never ``latest``."""
    def step_of(p: Path) -> int:
        try:
            return int(p.stem.split("-", 1)[1])
        except (IndexError, ValueError):
            return -1
    found = sorted((p for p in folder.glob("step-*.pt") if step_of(p) >= 0), key=step_of, reverse=True)
    for old in found[keep:]:
        if old != latest:
            try:
                old.unlink()
            except OSError as exc:
                log.warning("could not delete old checkpoint %s: %r", old, exc)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def latest_checkpoint(folder: Path) -> Path | None:
    """The file ``LATEST`` names; if it is missing (or there is no ``LATEST``), the newest
    ``step-*.pt`` there is (None: no checkpoint)."""
    for path in _candidates(folder):
        if path.is_file():
            return path
    return None


def load_latest_checkpoint(folder: Path) -> tuple[Path, TrainerState, dict[str, torch.Tensor], dict] | None:
    """The checkpoint ``LATEST`` names, loaded; when that one is missing or unreadable,
    the newest readable ``step-*.pt`` (logged as a warning). None: no checkpoint at all."""
    marked = _marked(folder)
    for path in _candidates(folder):
        try:
            loaded = load_checkpoint(path)
        except Exception as exc:  # missing, truncated, not a checkpoint
            log.warning("checkpoint %s is unreadable (%s); trying an older one", path, exc)
            continue
        if path != marked:
            log.warning("checkpoint: LATEST names %s, which is missing or unreadable; resuming from %s",
                        marked, path)
        return (path, *loaded)
    if marked is not None:
        raise FileNotFoundError(f"{folder}/LATEST names {marked.name}, and no step-*.pt there is readable")
    return None


def _marked(folder: Path) -> Path | None:
    marker = folder / "LATEST"
    try:
        name = marker.read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return folder / name if name else None


def _candidates(folder: Path) -> list[Path]:
    """LATEST's file first, then every ``step-*.pt``, newest first."""
    marked = _marked(folder)
    steps = sorted(folder.glob("step-*.pt"), reverse=True) if folder.is_dir() else []
    return ([marked] if marked is not None else []) + [p for p in steps if p != marked]


def checkpoint_for_step(folder: Path, step: int) -> Path:
    """The state at the start of ``step`` (after every earlier step's update)."""
    return folder / f"step-{step:06d}.pt"


def load_checkpoint(path: Path) -> tuple[TrainerState, dict[str, torch.Tensor], dict]:
    data = torch.load(path, weights_only=False)
    return TrainerState(**data["state"]), data["weights"], data["optimizer"]
