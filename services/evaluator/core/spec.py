"""A task's evaluator spec: what to run on a rollout's workspace and how to score it.

Data only. The task catalog adapter loads it (``evaluator.yaml`` + a ``hidden/`` folder);
the sandbox and the scoring core read it. Example::

    TaskEvaluatorSpec(
        task_id="calc-1",
        hidden_files={"test_calc.py": b"from calc import add\\ndef test_add(): ..."},
        weights={"test_calc.py::test_add": 2.0},    # others weigh default_weight
        limits=Limits(wall_s=60, memory_mb=1024),
        rubric="Is the implementation idiomatic?",  # only used when a judge is configured
        combine=CombinePolicy(mode="weighted", tests_weight=0.8, judge_weight=0.2),
    )
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# The folder (inside the unpacked workspace) that receives the hidden tests. Pytest runs
# with its rootdir there, so per-test names are relative to it (``test_calc.py::test_add``).
HIDDEN_DIR = "_gyre_hidden"


class Limits(BaseModel):
    """Resource limits for one sandboxed test run."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    wall_s: float = Field(default=300.0, gt=0)
    per_test_s: float | None = Field(default=None, gt=0)  # pytest only: one hung test fails, the run goes on
    cpu_s: int = Field(default=300, gt=0)
    memory_mb: int = Field(default=1024, ge=64)  # address space per process
    output_bytes: int = Field(default=1_000_000, ge=1024)  # stdout+stderr kept; the rest dropped
    max_processes: int = Field(default=64, ge=4)  # per sandbox (its own uid where isolation allows)
    max_file_mb: int = Field(default=256, ge=1)  # largest single file the tests may write
    max_disk_mb: int = Field(default=4096, ge=1)  # the whole workspace, checked about once a second


class CombinePolicy(BaseModel):
    """How the tests' score and the judge's score make the rollout's score.

    ``tests``: tests only (the judge is not asked). ``judge``: the judge only.
    ``weighted``: (tests_weight * tests + judge_weight * judge) / (tests_weight + judge_weight).
    ``on_judge_error``: what a judge that never answers sensibly means: fall back to the
    tests' score (``tests``) or fail the scoring (``fail``). With mode ``judge`` it always fails.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    mode: Literal["tests", "judge", "weighted"] = "tests"
    tests_weight: float = Field(default=1.0, ge=0)
    judge_weight: float = Field(default=0.0, ge=0)
    on_judge_error: Literal["tests", "fail"] = "tests"

    @model_validator(mode="after")
    def _weights(self) -> CombinePolicy:
        if self.mode == "weighted" and self.tests_weight + self.judge_weight <= 0:
            raise ValueError("weighted policy needs tests_weight + judge_weight > 0")
        return self

    @property
    def uses_judge(self) -> bool:
        return self.mode == "judge" or (self.mode == "weighted" and self.judge_weight > 0)

    @property
    def uses_tests(self) -> bool:
        return self.mode == "tests" or (self.mode == "weighted" and self.tests_weight > 0)


class TaskEvaluatorSpec(BaseModel):
    """Everything needed to score one task's rollouts.

    ``command`` empty means pytest on the hidden tests (the usual case); a custom command
    (e.g. ``["npm", "test"]``) must write JUnit XML to ``junit_path`` (relative to the
    workspace). ``{python}`` in a command stands for the evaluator's interpreter.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    task_id: str = Field(min_length=1)
    hidden_files: dict[str, bytes] = Field(default_factory=dict)
    command: list[str] = Field(default_factory=list)
    junit_path: str | None = None
    weights: dict[str, float] = Field(default_factory=dict)
    default_weight: float = Field(default=1.0, ge=0)
    limits: Limits = Field(default_factory=Limits)
    prompt: str | None = None  # the task statement, shown to the judge
    rubric: str | None = None
    combine: CombinePolicy = Field(default_factory=CombinePolicy)

    @field_validator("hidden_files")
    @classmethod
    def _relative_paths(cls, files: dict[str, bytes]) -> dict[str, bytes]:
        for name in files:
            check_relative(name)
        return files

    @field_validator("weights")
    @classmethod
    def _non_negative(cls, weights: dict[str, float]) -> dict[str, float]:
        bad = [k for k, w in weights.items() if w < 0]
        if bad:
            raise ValueError(f"negative weight for {bad[0]!r}")
        return weights

    @model_validator(mode="after")
    def _consistent(self) -> TaskEvaluatorSpec:
        if self.command and not self.junit_path:
            raise ValueError("a custom command needs junit_path (where it writes JUnit XML)")
        if self.junit_path:
            check_relative(self.junit_path)
        if self.combine.uses_judge and not self.rubric:
            raise ValueError("a judge policy needs a rubric")
        if self.combine.uses_tests and not self.hidden_files and not self.command:
            raise ValueError("a tests policy needs hidden_files or a command")
        return self

    @property
    def uses_pytest(self) -> bool:
        return not self.command


def check_relative(name: str) -> str:
    """A path that stays inside the folder it is relative to (no absolute, no ``..``)."""
    p = PurePosixPath(name)
    if not name or p.is_absolute() or ".." in p.parts or "\\" in name or "\x00" in name:
        raise ValueError(f"path {name!r} must be relative and stay inside its folder")
    return name
