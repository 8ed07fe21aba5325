"""The core's checkpoint and the log (real nats-server): the checkpoint is written off the
event loop (a slow write does not freeze NATS pings and claim heartbeats), and a core
whose newest readable checkpoint is behind the log's last StepApplied refuses to resume
there unless the operator says so."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from libs.common.blobs import MemoryBlobStore
from libs.common.events import Context, StepApplied, WeightsPublished
from services.trainer.checkpoint import checkpoint_for_step

from .test_streaming import _cells, _events, _queue, _steps, _wait_version


async def _train_step_0(js_bus, blobs, tmp_path):
    core, workers = _cells(js_bus, blobs, tmp_path, n_satellites=0)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(core.run(stop)), asyncio.create_task(workers[0].run(stop))]
    await _queue(js_bus, blobs, 0, _steps()[0])
    await _wait_version(core, 1, timeout=30)
    stop.set()
    await asyncio.gather(*tasks)
    return core


async def test_a_slow_checkpoint_write_does_not_freeze_the_event_loop(js_bus, tmp_path, monkeypatch):
    import services.trainer.core as core_module

    save = core_module.save_checkpoint
    slow = []

    def slow_disk(folder, state, weights, optimizer, **kw):
        if state.step == 1:
            slow.append(state.step)
            time.sleep(1.0)  # a big model's write and fsync
        return save(folder, state, weights, optimizer, **kw)

    monkeypatch.setattr(core_module, "save_checkpoint", slow_disk)
    gaps, ticking = [], True

    async def ticker():
        last = time.monotonic()
        while ticking:
            await asyncio.sleep(0.02)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    core = await _train_step_0(js_bus, MemoryBlobStore(), tmp_path)
    ticking = False
    await tick
    assert slow == [1] and core.state.step == 1
    assert max(gaps) < 0.6, f"the event loop stood still for {max(gaps):.2f}s while the checkpoint was written"


async def test_a_core_behind_the_logs_last_step_refuses_to_resume(js_bus, tmp_path, caplog):
    """LATEST and step 1's checkpoint lost after step 0 was applied: the newest readable is
    step 0's. Resuming there would train step 0 again and publish v1 a second time (with
    other bytes); the core refuses, naming the override, and resumes with it."""
    from services.trainer.core import RESUME_BEHIND_LOG_ENV, BehindTheLog

    blobs = MemoryBlobStore()
    await _train_step_0(js_bus, blobs, tmp_path)
    folder = tmp_path / "ckpt"
    (folder / "LATEST").unlink()
    checkpoint_for_step(folder, 1).unlink()
    again, _ = _cells(js_bus, blobs, tmp_path, n_satellites=0)
    with pytest.raises(BehindTheLog, match=RESUME_BEHIND_LOG_ENV) as refused:
        await again.start()
    assert "applied step 0" in str(refused.value) and "at step 0" in str(refused.value)
    assert [e.weight_version for e in await _events(js_bus, Context.TRAINING, WeightsPublished)] == [0, 1]
    wiped = tmp_path / "wiped"  # the folder lost altogether: the same
    other, _ = _cells(js_bus, blobs, wiped, n_satellites=0)
    with pytest.raises(BehindTheLog, match="no checkpoint"):
        await other.start()
    assert not (wiped / "ckpt").exists()  # nothing written for a step 0 the log is past
    forced, _ = _cells(js_bus, blobs, tmp_path, n_satellites=0)
    forced.settings = replace(forced.settings, resume_behind_log=True)
    await forced.start()
    assert forced.state.step == 0
    assert [e.step for e in await _events(js_bus, Context.TRAINING, StepApplied)] == [0]


async def test_a_core_whose_checkpoint_is_the_newest_resumes(js_bus, tmp_path):
    blobs = MemoryBlobStore()
    await _train_step_0(js_bus, blobs, tmp_path)
    again, _ = _cells(js_bus, blobs, tmp_path, n_satellites=0)
    await again.start()
    assert again.state.step == 1 and again.state.weight_version == 1


def test_the_override_is_an_option_of_the_service():
    from services.trainer.main import ENV, requeue_after_s

    assert ENV["resume_behind_log"] == "GYRE_TRAINER_RESUME_BEHIND_LOG"
    assert ENV["requeue_after_s"] == "GYRE_TRAINER_REQUEUE_AFTER_S"
    assert requeue_after_s({}) is None and requeue_after_s({"requeue_after_s": "0"}) is None
    assert requeue_after_s({"requeue_after_s": "1800"}) == 1800.0
    with pytest.raises(ValueError, match="GYRE_TRAINER_REQUEUE_AFTER_S"):
        requeue_after_s({"requeue_after_s": "-1"})

