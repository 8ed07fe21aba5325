"""Wiring: the task folder catalog, the weaker sandbox modes, and the pool on real JetStream."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from libs.common.blobs import MemoryBlobStore
from libs.common.events import Context, RolloutFinished, RolloutScored, RolloutScoringFailed, RolloutStarted
from services.evaluator.adapters.catalog import DirectoryTaskCatalog, TaskSpecError
from services.evaluator.main import build_evaluator
from services.evaluator.settings import EvaluatorSettings

from ._workspaces import CALC_OK, CALC_PARTIAL, CALC_TESTS, calc_spec, tar_of


def write_task(root: Path, task_id: str, yaml_text: str, hidden: dict[str, str]) -> None:
    folder = root / task_id
    (folder / "hidden").mkdir(parents=True)
    (folder / "evaluator.yaml").write_text(yaml_text)
    for name, text in hidden.items():
        (folder / "hidden" / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / "hidden" / name).write_text(text)


def test_directory_catalog(tmp_path: Path):
    write_task(tmp_path, "calc", "weights:\n  test_calc.py::test_div: 2\nlimits:\n  wall_s: 20\n",
               {"test_calc.py": CALC_TESTS, "data/input.txt": "1 2"})
    write_task(tmp_path, "broken", "limits: [1, 2]\n", {"test_x.py": ""})
    catalog = DirectoryTaskCatalog(tmp_path)
    spec = catalog.get("calc")
    assert spec is not None and spec.limits.wall_s == 20 and spec.weights == {"test_calc.py::test_div": 2}
    assert set(spec.hidden_files) == {"test_calc.py", "data/input.txt"}
    assert catalog.get("missing") is None and catalog.get("../calc") is None
    with pytest.raises(TaskSpecError, match="broken"):
        catalog.get("broken")


@pytest.mark.parametrize("mode", ["uid", "none"])
async def test_weaker_sandboxes_still_score_and_say_so(make_harness, mode):
    if mode == "uid" and os.geteuid() != 0:
        pytest.skip("uid mode needs root")
    h = await make_harness(isolation=mode)
    ev = await h.score(calc_spec(), tar_of({"calc.py": CALC_PARTIAL}))
    assert isinstance(ev, RolloutScored) and ev.score == 0.25
    assert ev.isolation == h.evaluator.sandbox.description
    assert ("own-uid" in ev.isolation) == (mode == "uid") and not ev.isolation.startswith("namespaces")


async def test_pool_on_jetstream_shares_the_queue(js_bus, work_root: Path):
    from services.evaluator.adapters.catalog import InMemoryTaskCatalog

    store = MemoryBlobStore()
    catalog = InMemoryTaskCatalog([calc_spec()])
    rollouts = []
    for i, code in enumerate([CALC_OK, CALC_PARTIAL, CALC_OK, None]):
        rid = f"js-{i}"
        await js_bus.publish(RolloutStarted(run_id="jsrun", rollout_id=rid, task_id="calc", group_id="g",
                                            harness="t", weight_version=0, api_key_digest="0" * 64))
        digest = await store.put(tar_of({"calc.py": code})) if code else None
        await js_bus.publish(RolloutFinished(run_id="jsrun", rollout_id=rid, snapshot_digest=digest, wall_time_s=1))
        rollouts.append(rid)
    settings = EvaluatorSettings(work_root=work_root, workers=2, consumer_name="evaluator-js")
    evaluator = build_evaluator(settings, bus=js_bus, store=store, catalog=catalog)
    stop = asyncio.Event()
    runner = asyncio.create_task(evaluator.run(stop))
    try:
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            got = [d.event async for d in js_bus.read(Context.SCORES)]
            if len(got) >= len(rollouts):
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)
        got = [d.event async for d in js_bus.read(Context.SCORES)]
    finally:
        stop.set()
        await asyncio.wait_for(runner, 15)
    by_id = {ev.rollout_id: ev for ev in got}
    assert len(got) == len(rollouts) and sorted(by_id) == rollouts
    assert [by_id[r].score for r in rollouts[:3]] == [1.0, 0.25, 1.0]
    assert isinstance(by_id["js-3"], RolloutScoringFailed) and "no workspace snapshot" in by_id["js-3"].reason


async def test_service_entry_runs_under_the_service_host(js_bus, work_root: Path, monkeypatch):
    from fastapi import FastAPI
    from prometheus_client import CollectorRegistry

    from libs.common.runtime import Runtime
    from libs.common.service import Health, ServiceContext
    from libs.common.settings import GyreSettings
    from services.evaluator.adapters.catalog import InMemoryTaskCatalog
    from services.evaluator.main import evaluator_main

    monkeypatch.setenv("GYRE_EVALUATOR_WORK_ROOT", str(work_root))
    store = MemoryBlobStore()
    runtime = Runtime(settings=GyreSettings(run_id="svc"), bus=js_bus, blobs=store, engine=None)
    ctx = ServiceContext(runtime, Health("evaluator"), asyncio.Event(), CollectorRegistry(),
                         {"workers": 1, "consumer_name": "evaluator-svc"}, FastAPI())
    await js_bus.publish(RolloutStarted(run_id="svc", rollout_id="s-1", task_id="calc", group_id="g", harness="t",
                                        weight_version=0, api_key_digest="0" * 64))
    await js_bus.publish(RolloutFinished(run_id="svc", rollout_id="s-1", wall_time_s=1,
                                         snapshot_digest=await store.put(tar_of({"calc.py": CALC_OK}))))
    await js_bus.publish(RolloutFinished(run_id="other", rollout_id="o-1", wall_time_s=1))  # another run's
    task = asyncio.create_task(evaluator_main(ctx, catalog=InMemoryTaskCatalog([calc_spec()])))
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and ctx.health.detail.get("scored") != 1:
            await asyncio.sleep(0.1)
    finally:
        ctx.stop.set()
        await asyncio.wait_for(task, 15)
    assert ctx.health.status == "ok" and ctx.health.detail["scored"] == 1 and ctx.health.detail["failed"] == 0
    assert ctx.health.detail["isolation"]
    got = [d.event async for d in js_bus.read(Context.SCORES)]
    assert [(type(e), e.rollout_id, e.score) for e in got] == [(RolloutScored, "s-1", 1.0)]
