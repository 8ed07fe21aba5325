"""``gyre serve trainer`` wiring on a real nats-server: the core cell (tiny Qwen model)
trains a queued step, publishes ``StepApplied`` and new weights, and checkpoints."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from libs.common.blobs import ObjectStoreBlobStore
from libs.common.events import Context, MicroStepQueued, StepApplied, WeightsPublished
from libs.common.runtime import Runtime
from libs.common.service import Health, ServiceContext
from libs.common.settings import GyreSettings
from services.trainer.backends.torch_hf import TorchBackend
from services.trainer.main import SPEC
from services.trajectory.codec import encode_packed

from .conftest import TINY
from .samples import two_branch_tree


async def test_core_cell_serves_a_step(js_bus, tmp_path):
    blobs = await ObjectStoreBlobStore.open(js_bus.js)
    settings = GyreSettings(run_id="m1", run_dir=tmp_path)
    stop = asyncio.Event()
    model = tmp_path / "model"  # a small Qwen2 folder: the real tiny-qwen has a 152k vocabulary
    TorchBackend.tiny(TINY).model.save_pretrained(model)
    ctx = ServiceContext(Runtime(settings, js_bus, blobs, None), Health("trainer"), stop, CollectorRegistry(),
                         {"role": "core", "lr": "1e-3", "model": str(model)}, FastAPI())
    task = asyncio.create_task(SPEC.main(ctx))
    digest = await blobs.put(encode_packed(two_branch_tree("r0")))
    await js_bus.publish(MicroStepQueued(run_id="m1", step=0, micro_step="g-m0", group_id="g",
                                         sample_digests=[digest], advantages=[1.0], n_tokens=10,
                                         micro_steps_in_step=1))
    applied = []
    for _ in range(600):
        events = [d.event async for d in js_bus.read(Context.TRAINING)]
        applied = [e for e in events if isinstance(e, StepApplied)]
        if applied or task.done():
            break
        await asyncio.sleep(0.1)
    stop.set()
    await task
    assert ctx.health.status == "ok"
    assert [(e.step, e.weight_version, e.loss["applied"]) for e in applied] == [(0, 1, 1.0)]
    published = [d.event async for d in js_bus.read(Context.TRAINING) if isinstance(d.event, WeightsPublished)]
    assert [e.weight_version for e in published] == [0, 1]
    assert (tmp_path / "trainer" / "checkpoints" / "step-000001.pt").is_file()


def test_the_run_configs_objective_reaches_the_trainer_and_a_step_replay_alike():
    from gyre.up import plan_stack
    from libs.common.runconfig import load_run_config
    from services.trainer.main import run_config_options, train_config

    cfg = load_run_config(None, ["cells.count=1", "loss.clip_low=0.1", "loss.tis_cap=3", "trainer.lr=0.002"])
    (launch,) = [x for x in plan_stack(cfg, "tok") if x.service == "trainer"]
    assert (launch.env["GYRE_TRAINER_EPS_LOW"], launch.env["GYRE_TRAINER_TIS_CAP"], launch.env["GYRE_TRAINER_LR"]) == \
        ("0.1", "3.0", "0.002")
    # what `gyre replay --step` rebuilds from RunStarted.config (the same dump)
    replayed = train_config(run_config_options(cfg.model_dump(mode="json")))
    assert (replayed.objective.eps_low, replayed.objective.tis_cap, replayed.lr) == (0.1, 3.0, 0.002)
    assert "GYRE_TRAINER_TIS_CAP" not in [x for x in plan_stack(load_run_config(None, ["cells.count=1", "loss.tis_cap=null"]),
                                                                "tok") if x.service == "trainer"][0].env


def test_core_follows_role_reaches_the_trainer_and_the_core_cell_and_satellites_get_the_objective():
    from gyre.up import follow_role_note, plan_stack
    from libs.common.runconfig import load_run_config

    cfg = load_run_config(None, ["cells.count=2", "cells.core_follows_role=true", "loss.clip_low=0.1"])
    plan = {x.name: x.env for x in plan_stack(cfg, "tok")}
    assert plan["trainer"]["GYRE_TRAINER_FOLLOW_ROLE"] == "1" and plan["cell-c0"]["GYRE_CELL_SEAT"] == "trainer"
    assert "GYRE_CELL_SEAT" not in plan["cell-c1"]  # a satellite, the non-core default
    assert plan["cell-c1"]["GYRE_TRAINER_EPS_LOW"] == plan["trainer"]["GYRE_TRAINER_EPS_LOW"] == "0.1"
    assert follow_role_note(cfg) is None
    one = load_run_config(None, ["cells.count=1", "cells.core_follows_role=true"])
    plan = {x.name: x.env for x in plan_stack(one, "tok")}
    assert plan["trainer"]["GYRE_TRAINER_FOLLOW_ROLE"] == "0" and "GYRE_CELL_SEAT" not in plan["cell-c0"]
    assert "one cell" in follow_role_note(one)
