"""Fixtures for the evaluator: a scratch root the sandbox uids can reach, and a harness
that publishes a rollout's start, stores its snapshot and hands back its ended event."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.common.blobs import MemoryBlobStore
from libs.common.bus.memory import InMemoryBus
from libs.common.events import RolloutFinished, RolloutStarted, RolloutTimedOut
from services.evaluator.adapters.catalog import InMemoryTaskCatalog
from services.evaluator.core.spec import TaskEvaluatorSpec
from services.evaluator.main import build_evaluator
from services.evaluator.service import Evaluator
from services.evaluator.settings import EvaluatorSettings, JudgeSettings

RUN = "evalrun"


@pytest.fixture(scope="session")
def work_root() -> Iterator[Path]:
    # Not pytest's tmp_path: that is mode 0700, which the sandbox uids could not cross.
    root = Path(tempfile.mkdtemp(prefix="gyre-eval-test-"))
    os.chmod(root, 0o711)
    yield root
    shutil.rmtree(root, ignore_errors=True)


class Harness:
    def __init__(self, evaluator: Evaluator, bus: InMemoryBus, store: MemoryBlobStore, catalog: InMemoryTaskCatalog):
        self.evaluator, self.bus, self.store, self.catalog = evaluator, bus, store, catalog

    async def rollout(
        self, task: str | TaskEvaluatorSpec, snapshot: bytes | None, *, timed_out: bool = False,
        digest: str | None = None, started: bool = True,
    ) -> RolloutFinished | RolloutTimedOut:
        if isinstance(task, TaskEvaluatorSpec):
            self.catalog.add(task)
            task = task.task_id
        rollout_id = f"r-{uuid.uuid4().hex[:8]}"
        if started:
            await self.bus.publish(RolloutStarted(
                run_id=RUN, rollout_id=rollout_id, task_id=task, group_id="g-1", harness="test",
                weight_version=0, api_key_digest="0" * 64,
            ))
        if snapshot is not None:
            digest = await self.store.put(snapshot)
        cls = RolloutTimedOut if timed_out else RolloutFinished
        ended = cls(run_id=RUN, rollout_id=rollout_id, snapshot_digest=digest, exit_status=0, wall_time_s=1.0)
        await self.bus.publish(ended)
        return ended

    async def score(self, task: str | TaskEvaluatorSpec, snapshot: bytes | None, **kw):
        return await self.evaluator.evaluate(await self.rollout(task, snapshot, **kw))


def worker_uid_base() -> int:
    """Sandbox uids of this pytest worker's evaluators: the tests that look for processes
    left under their harness's uids, or kill every process of a uid (``uid`` mode), must
    not meet another worker's evaluator (pytest-xdist runs them side by side) nor one
    that ``gyre up`` starts in another test (the default, 61000)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    return 62000 + 100 * index


@pytest.fixture
def make_harness(work_root: Path):
    """``await make_harness(judge_url=None, **settings)``: an evaluator on an in-memory bus."""

    async def make(judge_url: str | None = None, **overrides) -> Harness:
        bus, store, catalog = InMemoryBus(), MemoryBlobStore(), InMemoryTaskCatalog()
        # a redelivery after a transient failure comes quickly here (30 s in service)
        fields = {"work_root": work_root, "workers": 2, "retry_delay_s": 0.05, "uid_base": worker_uid_base(),
                  **overrides}
        if judge_url:
            fields["judge"] = JudgeSettings(base_url=judge_url, model="judge", timeout_s=2, attempts=3, backoff_s=0.05)
        evaluator = build_evaluator(EvaluatorSettings(**fields), bus=bus, store=store, catalog=catalog)
        await evaluator.start()
        return Harness(evaluator, bus, store, catalog)

    return make
