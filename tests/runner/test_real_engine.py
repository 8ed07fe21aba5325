"""The reference harness against the real embedded engine (tiny random Qwen-architecture
model) through the proxy: nonsense output must not crash it; it stops within its budgets
and the runner reports the rollout finished, every call recorded under its rollout."""

from __future__ import annotations

import json

import pytest

from libs.common.events import CallRecorded, Context
from services.runner.harness import gyre_agent
from services.runner.runner import RolloutRunner, RunnerConfig
from services.runner.tasks import load_tasks
from tests.proxy._fakes import Served


@pytest.fixture(scope="module")
def real_engine(model_dir):
    from services.engine.main import build
    from services.engine.settings import EngineSettings

    service = build(EngineSettings(model="tiny-qwen", num_threads=1))
    served = Served(service.app)
    yield served
    served.stop()
    service.close()


@pytest.mark.parametrize("api", ["anthropic"])
async def test_gyre_agent_on_the_tiny_random_model(stack, real_engine, tmp_path, api) -> None:
    for name in list(stack.service.router.cells):
        stack.service.router.remove_cell(name)
    stack.service.add_cell("real", real_engine.url, capacity=4)
    task = next(t for t in load_tasks() if t.task_id == "slugify")
    harness = gyre_agent(api, "--max-tokens", "24", "--max-turns", "3", "--max-calls", "6", "--max-retries", "1")
    runner = RolloutRunner(RunnerConfig(stack.run_id, stack.url, tmp_path / "work", harness=harness),
                           bus=stack.bus, blobs=stack.blobs)
    [out] = await runner.run_step(0, [task], group_size=1)
    assert out.status == "finished" and out.exit_status == 0, out.log_tail
    stats = json.loads(out.log_tail.strip().splitlines()[-1])
    print("gyre agent on the random model:", stats)  # shown with -s
    assert 1 <= stats["calls"] <= 6 and stats["stop"] in ("done", "empty_reply", "max_turns", "max_calls")
    calls = [d.event async for d in stack.bus.read(Context.CALLS) if isinstance(d.event, CallRecorded)]
    assert len(calls) == stats["calls"] and {c.rollout_id for c in calls} == {out.rollout_id}
