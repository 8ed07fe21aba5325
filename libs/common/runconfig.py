"""The run configuration: one YAML file is the source of truth for a run.

Validated at start with errors that name the key and what was expected; overridden from
the command line with dotted keys (``trainer.lr=1e-6``, values parsed as YAML); recorded
whole, resolved, as the run's first event (``RunStarted.config``) so a replay knows
exactly what ran. ``GYRE_*`` environment variables still say where NATS and the database
are (``libs/common/settings.py``); ``bus``/``storage`` here override them when set.

    >>> cfg = load_run_config(None, ["run.steps=3", "cells.count=2"])
    >>> cfg.run.steps, cfg.cells.count, cfg.model.name
    (3, 2, 'tiny-qwen')
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RunSection(_Section):
    id: str = Field(default="demo", pattern=r"^[A-Za-z0-9_\-:]{1,128}$")
    steps: int = Field(default=4, ge=1, le=100_000)
    dir: Path = Path("runs")  # reports and checkpoints go to <dir>/<id>/
    seed: int = 0


class ModelSection(_Section):
    name: str = "tiny-qwen"  # tiny-qwen | smollm2 | an HF folder
    policy_name: str = "policy"  # the model name the proxy serves under


class TasksSection(_Section):
    dir: Path | None = None  # default: the task set shipped in tasks/
    split: Literal["train", "heldout", "all"] = "train"
    per_step: int = Field(default=2, ge=1)
    include: list[str] | None = None  # task-id glob patterns (e.g. ["starter_*"]); None: every task


class HarnessSection(_Section):
    name: str = "gyre_agent"  # gyre_agent | claude_code | codex | mini_swe_agent | a plugin
    api: Literal["openai", "anthropic"] = "openai"
    max_turns: int = Field(default=8, ge=1)
    time_limit_scale: float = Field(default=1.0, gt=0)
    max_parallel: int = Field(default=4, ge=1)


class SamplingSection(_Section):
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    max_tokens: int = Field(default=256, ge=1)


class LossSection(_Section):
    clip_low: float = Field(default=0.2, ge=0, le=1)
    clip_high: float = Field(default=0.28, ge=0, le=10)
    tis_cap: float | None = Field(default=2.0, gt=0)  # truncated importance sampling; None = off
    kl_coef: float = Field(default=0.0, ge=0)
    sample_budget: int = Field(default=5, ge=1, le=64)  # branches per execution (role priority)


class TrainerSection(_Section):
    backend: Literal["torch", "megatron"] = "torch"
    lr: float = Field(default=1e-5, gt=0)
    micro_step_tokens: int = Field(default=8192, ge=64)
    staleness: int = Field(default=1, ge=0)  # samples older than this many weight versions are dropped
    keep_checkpoints: int | None = Field(default=None, ge=1)  # newest core checkpoints kept (None: all)
    # newest published weight versions whose blobs are kept: None is the trainer's default (3),
    # "all" (or 0, as GYRE_TRAINER_KEEP_WEIGHTS takes it) keeps every one; a count must be at
    # least 2 (the newest and the one before it)
    keep_weights: Literal["all"] | int | None = None

    @model_validator(mode="after")
    def _keep_weights_floor(self) -> "TrainerSection":
        if isinstance(self.keep_weights, int) and self.keep_weights != 0 and self.keep_weights < 2:
            raise ValueError(f"trainer.keep_weights must be at least 2, or 'all' (or 0), not {self.keep_weights}")
        return self


class CellsSection(_Section):
    count: int = Field(default=2, ge=0, le=16)
    policy: Literal["elastic", "colocate", "async"] = "elastic"
    hold_s: float = Field(default=5.0, ge=0)
    min_dwell_s: float = Field(default=10.0, ge=0)
    smoothing_s: float = Field(default=5.0, ge=0)
    tick_s: float = Field(default=1.0, gt=0)
    low_watermark: float = Field(default=1.0, gt=0)  # elastic: release a cell when the level fits under this x capacity
    high_watermark: float = Field(default=1.2, gt=0)  # elastic: reclaim training cells above this x capacity
    max_switches_in_flight: int = Field(default=2, ge=1)
    # elastic: cells that always serve inference (at least 1: with none, a call arriving while
    # every cell trains would find no cell). With 2 cells only the core (c0) ever trains.
    min_inference_cells: int = Field(default=1, ge=1)
    training_cells: int = Field(default=1, ge=1)  # async: the fixed split's training cells
    # re-sends of a switch command that a cell agent took and never answered (each after
    # 300 s of silence, then a 300 s wait)
    # before the scheduler declares the switch failed on the cell's behalf
    max_resends: int = Field(default=2, ge=0)
    # the core's trainer claims micro-steps only while the scheduler has cell c0 in training
    # (as in the seed: the core cell serves inference while demand is high); off: in every role
    core_follows_role: bool = False

    @model_validator(mode="after")
    def _watermarks(self) -> "CellsSection":
        if self.low_watermark >= self.high_watermark:
            raise ValueError("low_watermark must be below high_watermark")
        return self


class EvaluatorSection(_Section):
    workers: int = Field(default=2, ge=1, le=64)
    judge_url: str | None = None  # OpenAI-compatible base URL of a judge model; needs judge_model
    judge_model: str | None = None
    scorers: dict[str, float] = {}  # gyre.scorers plugin -> weight in the score, e.g. {has_readme: 0.25}

    @model_validator(mode="after")
    def _judge_pair(self) -> "EvaluatorSection":
        if bool(self.judge_url) != bool(self.judge_model):
            raise ValueError("judge_url and judge_model go together: set both or neither")
        return self


class StorageSection(_Section):
    database_url: str | None = None


class BusSection(_Section):
    nats_url: str | None = None


class MetricsSection(_Section):
    tensorboard: bool = True
    wandb_project: str | None = None  # set to log to Weights & Biases (offline works)
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"  # offline: files under runs/<run>/wandb


class WarmStartSection(_Section):
    """Supervised fine-tuning on a scripted solver's demonstrations of the *train* tasks,
    as a separate phase before RL (``gyre/warmstart.py``); never sees held-out tasks."""

    enabled: bool = False
    steps: int = Field(default=260, ge=1)
    lr: float = Field(default=3e-3, gt=0)
    seed: int = 0
    # share of drawn demonstrations that are the scripted solver's flawed variant (print
    # instead of return): the warm-started model then makes that mistake about this often
    flaw_rate: float = Field(default=0.0, ge=0, lt=1)


class EvalSection(_Section):
    """Greedy success on the held-out tasks, measured inside the run before the first RL
    step and after the last (same harness, proxy and evaluator; never trained on)."""

    heldout: bool = False


class RunConfig(_Section):
    run: RunSection = RunSection()
    model: ModelSection = ModelSection()
    tasks: TasksSection = TasksSection()
    harness: HarnessSection = HarnessSection()
    group_size: int = Field(default=2, ge=1, le=256)
    sampling: SamplingSection = SamplingSection()
    loss: LossSection = LossSection()
    trainer: TrainerSection = TrainerSection()
    cells: CellsSection = CellsSection()
    evaluator: EvaluatorSection = EvaluatorSection()
    storage: StorageSection = StorageSection()
    bus: BusSection = BusSection()
    metrics: MetricsSection = MetricsSection()
    warmstart: WarmStartSection = WarmStartSection()
    eval: EvalSection = EvalSection()

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()

    @property
    def run_dir(self) -> Path:
        return self.run.dir / self.run.id


class RunConfigError(ValueError):
    """A config that does not validate; the message names each bad key."""


def apply_override(data: dict[str, Any], assignment: str) -> None:
    key, sep, raw = assignment.partition("=")
    if not sep or not key.strip():
        raise RunConfigError(f"override {assignment!r}: expected key.path=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise RunConfigError(f"override {assignment!r}: value is not valid YAML ({exc})") from exc
    node = data
    parts = key.strip().split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise RunConfigError(f"override {assignment!r}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def load_run_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except FileNotFoundError:
            raise RunConfigError(f"run config {path} does not exist") from None
        except IsADirectoryError:
            raise RunConfigError(f"run config {path} is a folder, not a YAML file") from None
        except OSError as exc:
            raise RunConfigError(f"run config {path} cannot be read: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise RunConfigError(f"run config {path} is not UTF-8 text: {exc}") from None
        except yaml.YAMLError as exc:
            raise RunConfigError(f"run config {path} is not valid YAML: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise RunConfigError(f"run config {path}: the top level must be a mapping of sections")
        data = loaded or {}
    for assignment in overrides:
        apply_override(data, assignment)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "<top>"
            got = err.get("input")
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"  {where}: {err['msg']}{shown}")
        raise RunConfigError("invalid run config:\n" + "\n".join(lines)) from None
