"""The evaluator's settings: validated once at start, then passed down.

From ``GYRE_EVALUATOR_*`` variables (nested with ``__``, e.g.
``GYRE_EVALUATOR_JUDGE__BASE_URL``) or built in code.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Literal

import math

from pydantic import BaseModel, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class JudgeSettings(BaseModel):
    base_url: str = Field(min_length=1, description="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    model: str = Field(min_length=1)
    api_key: SecretStr | None = None
    timeout_s: float = Field(default=60.0, gt=0)
    attempts: int = Field(default=3, ge=1, le=10)
    backoff_s: float = Field(default=1.0, ge=0)
    max_tokens: int = Field(default=512, ge=1)


def default_work_root() -> Path:
    """``<tmp>/gyre-evaluator-<euid>``: one per user, so evaluators of two users on one host
    (a shared ``/tmp``) do not meet in the same work_root, which is refused unless it is ours."""
    return Path(tempfile.gettempdir()) / f"gyre-evaluator-{os.geteuid()}"


class EvaluatorSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="GYRE_EVALUATOR_", env_nested_delimiter="__", extra="ignore", frozen=True
    )

    tasks_dir: Path = Field(default=Path("tasks"), description="one folder per task: evaluator.yaml + hidden/")
    work_root: Path = Field(default_factory=lambda: default_work_root(), description=(
        "scratch workspaces; must be this uid's own (see services/evaluator/README.md)"))
    workers: int = Field(default=2, ge=1, le=64, description="rollouts scored at once")
    isolation: Literal["auto", "namespaces", "uid", "none"] = "auto"
    uid_base: int = Field(default=61000, ge=1000, description="sandbox n runs as uid_base + n")
    python: str = Field(default=sys.executable, description="interpreter (with pytest) that runs hidden tests")
    run_id: str | None = Field(default=None, description="score this run only; None = every run")
    consumer_name: str = Field(default="evaluator", pattern=r"^[A-Za-z0-9_\-]{1,64}$", description=(
        "base of the durable consumer's name; the run id is added to it (see Evaluator.consumer_config)"))
    # A failure that is not the rollout's (judge unreachable, blob store or bus down) is
    # retried: redelivered after retry_delay_s, up to max_deliver deliveries in all, so an
    # outage of (max_deliver - 1) * retry_delay_s (4.5 min by default) costs no scores. On
    # the last delivery the judge's absence goes to the task's on_judge_error policy and a
    # store that still fails becomes a RolloutScoringFailed.
    retry_delay_s: float = Field(default=30.0, gt=0, description="wait before a transient failure is retried")
    max_deliver: int = Field(default=10, ge=1, le=1000, description="deliveries of a rollout before giving up")
    ack_wait_s: float = Field(default=300.0, gt=0, description="how long after an evaluator's last heartbeat "
                              "(every min(30 s, ack_wait_s / 3) while it scores) its rollout goes to another")
    max_snapshot_bytes: int = Field(default=512 * 2**20, ge=1024)
    max_unpacked_bytes: int = Field(default=2 * 2**30, ge=1024)
    max_members: int = Field(default=100_000, ge=1)
    max_result_bytes: int = Field(default=8 * 2**20, ge=1024, description=(
        "cap on the results read back (pytest's results pipe, a custom command's JUnit XML)"))
    keep_workdirs: bool = False
    judge: JudgeSettings | None = None
    scorers: dict[str, float] = Field(
        default_factory=dict,
        description="gyre.scorers plugins -> weight, e.g. GYRE_EVALUATOR_SCORERS='{\"has_readme\": 0.25}'")

    @field_validator("scorers")
    @classmethod
    def _weights(cls, v: dict[str, float]) -> dict[str, float]:
        bad = {k: w for k, w in v.items() if not math.isfinite(w) or w < 0}
        if bad:
            raise ValueError(f"scorer weights must be finite and >= 0, got {bad}")
        return v
