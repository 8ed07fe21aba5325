"""``gyre replay --step N``: rebuild step N from the log and recompute its loss.

The step's micro-steps come from ``MicroStepQueued`` (trees stream), their samples from
the blob store, the weights from the checkpoint written at the start of step N; the
recomputed loss statistics are compared with the ones ``StepApplied`` recorded. A
mismatch points at what changed: samples, weights, code or configuration.

Samples are refused as the core refused them: too stale for ``max_staleness`` (by
default the run's own bound, ``trainer.staleness`` of the run config its ``RunStarted``
recorded, as ``gyre up`` passes it to the trainer), or bad.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from libs.common.bus.port import BlobStore, EventBus
from libs.common.events import Context, MicroStepQueued, RunStarted, StepApplied

from .backends.base import PolicyBackend
from .batch import tree_batch
from .checkpoint import checkpoint_for_step, load_checkpoint
from .step import MicroResult, StepReducer, TrainConfig, compute_micro_step
from .worker import load_samples

COMPARED = ("loss", "executions", "tokens", "micro_steps", "clip_fraction", "ratio_mean", "kl")
FROM_RUN: Any = object()  # max_staleness: the run config's, read from the log


async def replay_step(bus: EventBus, blobs: BlobStore, *, run_id: str, step: int, checkpoint_dir: Path,
                      backend: PolicyBackend, train: TrainConfig = TrainConfig(),
                      max_staleness: int | None = FROM_RUN, tolerance: float = 1e-5) -> dict:
    """Recomputes step ``step``; returns recorded vs replayed statistics and ``match``.
    ``max_staleness``: the trainer's bound (None: none); by default the run config's."""
    if max_staleness is FROM_RUN:
        max_staleness = await run_max_staleness(bus, run_id)
    state, weights, _ = load_checkpoint(checkpoint_for_step(checkpoint_dir, step))
    backend.load_hf_state_dict(weights)
    applied = await _recorded(bus, run_id, step)
    queued = await _queued(bus, run_id, step)
    used = set(applied.micro_steps_used) if applied else set(queued)
    reducer = StepReducer(step, state.weight_version)
    for name in sorted(used):
        ev = queued.get(name)
        if ev is None:
            raise LookupError(f"micro-step {name} of step {step} is not in the log")
        samples, rejected = await load_samples(blobs, ev, backend.vocab_size, state.weight_version,
                                                max_staleness)
        reducer.rejected.extend(rejected)
        if samples:
            reducer.add(compute_micro_step(backend, tree_batch(samples), train, micro_step=name,
                                           weight_version=state.weight_version))
        else:  # every sample refused: the core counts it as done with nothing added, so must this
            reducer.add(MicroResult(name, state.weight_version, (), 0.0, 0, 0, {}, None))
    replayed = reducer.loss_stats()
    recorded = dict(applied.loss) if applied else {}
    diffs = {k: abs(replayed[k] - recorded[k]) for k in COMPARED if k in recorded and k in replayed}
    return {
        "step": step,
        "weight_version": state.weight_version,
        "max_staleness": max_staleness,
        "micro_steps": sorted(used),
        "recorded": recorded,
        "replayed": replayed,
        "max_abs_diff": max(diffs.values(), default=None),
        "match": bool(recorded) and all(d <= tolerance * max(1.0, abs(recorded[k])) for k, d in diffs.items()),
    }


async def _recorded(bus: EventBus, run_id: str, step: int) -> StepApplied | None:
    found = None
    subject = f"gyre.{run_id}.{Context.TRAINING.value}.{StepApplied.TYPE}"
    async for d in bus.read(Context.TRAINING, filter_subject=subject):
        if isinstance(d.event, StepApplied) and d.event.step == step:
            found = d.event
    return found


async def _queued(bus: EventBus, run_id: str, step: int) -> dict[str, MicroStepQueued]:
    out: dict[str, MicroStepQueued] = {}
    subject = f"gyre.{run_id}.{Context.TREES.value}.{MicroStepQueued.TYPE}.>"
    async for d in bus.read(Context.TREES, filter_subject=subject):
        if isinstance(d.event, MicroStepQueued) and d.event.step == step:
            out[d.event.micro_step] = d.event
    return out


async def run_max_staleness(bus: EventBus, run_id: str) -> int | None:
    """The staleness bound the run's trainer had: the run config's ``trainer.staleness``
    (its last ``RunStarted``), as ``main.run_config_options`` maps it; None without one."""
    from .main import run_config_options

    config: dict[str, Any] = {}
    async for d in bus.read(Context.RUNS, filter_subject=f"gyre.{run_id}.runs.>"):
        if isinstance(d.event, RunStarted):
            config = d.event.config
    value = run_config_options(config).get("max_staleness")
    return None if value is None or value == "" else int(value)
