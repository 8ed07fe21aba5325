"""The trainer under faults, over a real nats-server: a core whose event handling fails
stops at once and a restart finishes the step's work; a cell never sits on a future
step's claim while the current step's waits; a replay refuses what the core refused; a
gradient in another parameter layout is never added; checkpoints are durable before
LATEST names them, and a lost one is passed over."""

from __future__ import annotations

import asyncio
import logging
from array import array
from dataclasses import replace

import pytest
import torch

from libs.common.blobs import MemoryBlobStore
from libs.common.events import Context, MicroStepDone, MicroStepQueued, RunStarted, StepApplied, WeightsPublished
from services.trainer.backends.torch_hf import TorchBackend
from services.trainer.batch import tree_batch
from services.trainer.core import CoreSettings, CoreTrainer
from services.trainer.step import compute_micro_step
from services.trainer.transfer import BlobTransfer

from .conftest import TINY
from .samples import two_branch_tree
from .test_streaming import (CONFIG, RUN, _cells, _events, _queue, _reference, _reference_one_step, _same_weights,
                             _steps, _wait_version)


async def _run_until_it_fails(core, stop, timeout=10):
    """core.run(stop) must end by itself with the handler's error (not wait for stop)."""
    task = asyncio.create_task(core.run(stop))
    done, _ = await asyncio.wait([task], timeout=timeout)
    if not done:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        pytest.fail("the core kept running after an event's handling failed")
    return task.exception()


async def _step_0_until_the_core_fails(js_bus, blobs, core, worker_cell):
    """Queues step 0 for ``core`` and its own worker, runs both until the core fails, stops
    the worker; returns the error that ended the core."""
    stop = asyncio.Event()
    worker = asyncio.create_task(worker_cell.run(stop))
    await _queue(js_bus, blobs, 0, _steps()[0])
    error = await _run_until_it_fails(core, stop)
    stop.set()
    await worker
    return error


async def test_a_failed_publication_stops_the_core_and_a_restart_publishes_the_weights(js_bus, tmp_path):
    blobs = MemoryBlobStore()
    calls = []

    async def publisher(version, weights):
        calls.append(version)
        if calls == [0, 1]:
            raise ConnectionError("inference cell unreachable")
        return ["cell-a"]

    core, workers = _cells(js_bus, blobs, tmp_path, n_satellites=0)
    core.publish_to_cells = publisher
    error = await _step_0_until_the_core_fails(js_bus, blobs, core, workers[0])
    assert isinstance(error, ConnectionError) and calls == [0, 1]
    assert [e.weight_version for e in await _events(js_bus, Context.TRAINING, WeightsPublished)] == [0]
    again, _ = _cells(js_bus, blobs, tmp_path, n_satellites=0)
    again.publish_to_cells = publisher
    await again.start()  # the supervisor's restart: from the checkpoint of step 1
    assert calls == [0, 1, 1] and again.state.weight_version == 1
    published = await _events(js_bus, Context.TRAINING, WeightsPublished)
    assert [(e.weight_version, e.target_cells) for e in published] == [(0, ["cell-a"]), (1, ["cell-a"])]
    assert [e.step for e in await _events(js_bus, Context.TRAINING, StepApplied)] == [0]
    assert _same_weights(again.backend, _reference_one_step(_steps()[0])) < 1e-6


async def test_a_failed_checkpoint_write_stops_the_core_and_a_restart_trains_the_step_again(js_bus, tmp_path,
                                                                                           monkeypatch):
    """Disk full while the step's checkpoint is written: nothing of the new version is in
    the log; the restarted core trains the step again from the step's first checkpoint."""
    import services.trainer.core as core_module

    save = core_module.save_checkpoint

    def disk_full(folder, state, weights, optimizer, **kw):
        if state.step == 1:
            raise OSError(28, "No space left on device")
        return save(folder, state, weights, optimizer, **kw)

    monkeypatch.setattr(core_module, "save_checkpoint", disk_full)
    blobs = MemoryBlobStore()
    core, workers = _cells(js_bus, blobs, tmp_path, n_satellites=0)
    error = await _step_0_until_the_core_fails(js_bus, blobs, core, workers[0])
    assert isinstance(error, OSError)
    assert await _events(js_bus, Context.TRAINING, StepApplied) == []
    monkeypatch.setattr(core_module, "save_checkpoint", save)
    again, _ = _cells(js_bus, blobs, tmp_path, n_satellites=0)  # its own worker's gradients died with it
    stop = asyncio.Event()
    task = asyncio.create_task(again.run(stop))
    await _wait_version(again, 1, timeout=20)
    stop.set()
    await task
    assert [(e.step, e.weight_version) for e in await _events(js_bus, Context.TRAINING, StepApplied)] == [(0, 1)]
    assert _same_weights(again.backend, _reference_one_step(_steps()[0])) < 1e-6


async def test_nothing_is_computed_on_a_version_whose_checkpoint_is_being_written(js_bus, tmp_path, monkeypatch):
    """The core's own worker trains on the newest version checkpointed and published, not on
    the one being written: a core killed during that write leaves no micro-step of the next
    step in the log (a restart from the older checkpoint would pass those over as stragglers,
    their queue messages acked: the step would never complete). The core that failed ends at
    once, and its restart trains both steps."""
    import time

    import services.trainer.core as core_module

    save = core_module.save_checkpoint

    def slow_then_fails(folder, state, weights, optimizer, **kw):
        if state.step == 1:  # v1's checkpoint: a slow disk, then the write fails
            time.sleep(2.0)
            raise OSError(5, "Input/output error")
        return save(folder, state, weights, optimizer, **kw)

    monkeypatch.setattr(core_module, "save_checkpoint", slow_then_fails)
    blobs = MemoryBlobStore()
    core, workers = _cells(js_bus, blobs, tmp_path, n_satellites=0)
    stop = asyncio.Event()
    worker = asyncio.create_task(workers[0].run(stop))
    for step, samples in enumerate(_steps()):
        await _queue(js_bus, blobs, step, samples)
    error = await _run_until_it_fails(core, stop, timeout=30)
    stop.set()
    await worker
    assert isinstance(error, OSError)
    assert [e.micro_step for e in await _events(js_bus, Context.TRAINING, MicroStepDone)
            if e.weight_version >= 1] == []
    monkeypatch.setattr(core_module, "save_checkpoint", save)
    again, workers = _cells(js_bus, blobs, tmp_path, n_satellites=0)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(again.run(stop)), asyncio.create_task(workers[0].run(stop))]
    await _wait_version(again, 2, timeout=30)
    stop.set()
    await asyncio.gather(*tasks)
    assert [(e.step, e.weight_version) for e in await _events(js_bus, Context.TRAINING, StepApplied)] == [(0, 1), (1, 2)]
    assert _same_weights(again.backend, _reference(_steps())) < 1e-5


async def test_an_unreadable_sample_blob_is_rejected_with_its_reason_and_the_rest_train():
    from services.trainer.worker import load_samples
    from services.trajectory.codec import MAGIC, encode_packed

    blobs = MemoryBlobStore()
    good = await blobs.put(encode_packed(two_branch_tree("r1")))
    bad = [await blobs.put(MAGIC + b"\x01"), await blobs.put(MAGIC + b"\x02\x00\x00\x00[]")]
    ev = MicroStepQueued(run_id=RUN, step=0, micro_step="m0", group_id="g", sample_digests=[good, *bad],
                         advantages=[1.0, 1.0, 1.0], n_tokens=1, micro_steps_in_step=1)
    samples, rejected = await load_samples(blobs, ev, TINY.vocab_size, 0, None)
    assert len(samples) == 1 and [r["digest"] for r in rejected] == bad
    assert all("not a readable packed tree" in r["reason"] or "header" in r["reason"] for r in rejected)


async def test_a_future_step_s_claim_goes_back_so_a_dead_cell_s_claim_is_taken(js_bus, tmp_path):
    """Cell A claims a micro-step of step 0 and dies; cell B finishes the other and then
    fetches step 1's, whose weights cannot exist before step 0 is done. B must put those
    back and take A's redelivered claim, or the run stops for ever."""
    from services.trainer.worker import BusWeightSource, MicroStepWorker, WorkerSettings

    blobs = MemoryBlobStore()
    grads = BlobTransfer(blobs)
    claimed = asyncio.Event()

    class Dying(MicroStepWorker):
        async def train(self, ev):
            claimed.set()
            await asyncio.Event().wait()  # killed here, its claim never acked

    def cell(kind, name):
        settings = WorkerSettings(RUN, name, CONFIG, ack_wait_s=1.0, future_hold_s=0.2, retry_delay_s=0.2)
        return kind(settings, TorchBackend.tiny(TINY), bus=js_bus, blobs=blobs, gradients=grads,
                    weights=BusWeightSource(js_bus, blobs, RUN))

    core = CoreTrainer(CoreSettings(RUN, train=CONFIG), TorchBackend.tiny(TINY), bus=js_bus, blobs=blobs,
                       gradients=grads)
    steps = _steps()
    for step, samples in enumerate(steps):
        await _queue(js_bus, blobs, step, samples)
    stop = asyncio.Event()
    core_task = asyncio.create_task(core.run(stop))
    dying = asyncio.create_task(cell(Dying, "a").run(stop))
    await asyncio.wait_for(claimed.wait(), 10)
    dying.cancel()
    await asyncio.gather(dying, return_exceptions=True)
    b = cell(MicroStepWorker, "b")
    b_task = asyncio.create_task(b.run(stop))
    await _wait_version(core, 2, timeout=20)
    stop.set()
    await asyncio.gather(core_task, b_task)
    assert sorted(set(b.done)) == ["s0-m0", "s0-m1", "s1-m0", "s1-m1"]
    assert _same_weights(core.backend, _reference(steps)) < 1e-6


async def test_replay_refuses_stale_samples_as_the_core_did(js_bus, tmp_path):
    """A run with trainer.staleness 0: step 1's sample generated by v0 is refused by the
    core, and by the replay (the run config's bound, by default), so they agree."""
    from services.trainer.replay import replay_step

    blobs = MemoryBlobStore()
    await js_bus.publish(RunStarted(run_id=RUN, config={"trainer": {"staleness": 0}}))
    core, workers = _cells(js_bus, blobs, tmp_path, n_satellites=0)
    core.settings = replace(core.settings, max_staleness=0)
    workers[0].settings = replace(workers[0].settings, max_staleness=0)
    fresh = two_branch_tree("r1")
    fresh = replace(fresh, weight_versions=array("i", [1 if m else -1 for m in fresh.loss_mask]))
    stop = asyncio.Event()
    tasks = [asyncio.create_task(core.run(stop)), asyncio.create_task(workers[0].run(stop))]
    await _queue(js_bus, blobs, 0, [(two_branch_tree("a"), 1.0), (two_branch_tree("b"), -1.0)])
    await _queue(js_bus, blobs, 1, [(fresh, 1.0), (two_branch_tree("old"), -1.0)])  # "old": v0, at v1
    await _wait_version(core, 2)
    stop.set()
    await asyncio.gather(*tasks)
    applied = (await _events(js_bus, Context.TRAINING, StepApplied))[1]
    assert applied.loss["rejected_samples"] == 1.0 and applied.loss["executions"] == 1.0
    kw = dict(run_id=RUN, step=1, checkpoint_dir=tmp_path / "ckpt", train=CONFIG)
    report = await replay_step(js_bus, blobs, backend=TorchBackend.tiny(TINY), **kw)
    assert report["match"] and report["max_staleness"] == 0, report
    unbounded = await replay_step(js_bus, blobs, backend=TorchBackend.tiny(TINY), max_staleness=None, **kw)
    assert not unbounded["match"]  # the stale sample counted: what a replay without the bound reports


async def test_a_gradient_in_another_parameter_layout_is_recomputed_not_added(js_bus, tmp_path):
    """A satellite whose backend flattens its parameters in another order (another
    backend or model) sends a gradient of the very same size; the core must not add it."""
    from services.trainer.worker import MicroStepWorker, WorkerSettings, objective_key

    class Reordered(TorchBackend):
        def named_parameters(self):
            return reversed(list(super().named_parameters()))

    blobs = MemoryBlobStore()
    core, _ = _cells(js_bus, blobs, tmp_path, n_satellites=0)
    await core.start()
    steps = _steps()
    await _queue(js_bus, blobs, 0, steps[0])
    queued = [d.event async for d in js_bus.read(Context.TREES) if isinstance(d.event, MicroStepQueued)]
    for ev in queued:
        await core.on_queued(ev)
    other = Reordered.tiny(TINY)
    other.load_hf_state_dict(core.backend.hf_state_dict())
    assert objective_key(CONFIG, other) != objective_key(CONFIG, core.backend)
    grads = BlobTransfer(blobs)
    for k, backend in ((0, other), (1, core.backend)):
        sat = MicroStepWorker(WorkerSettings(RUN, f"sat{k}", CONFIG), backend, bus=js_bus, blobs=blobs,
                              gradients=grads, weights=None)
        sat.version = 0
        res = compute_micro_step(backend, tree_batch([steps[0][k]]), CONFIG, micro_step=f"s0-m{k}")
        assert res.gradient.numel() == sum(p.numel() for _, p in core.backend.named_parameters())
        done = await sat._done_event(queued[k], res, [])
        await core.on_done(done)
    assert core.state.weight_version == 1
    applied = (await _events(js_bus, Context.TRAINING, StepApplied))[0]
    assert applied.micro_steps_dropped == ["s0-m0"] and sorted(applied.micro_steps_used) == ["s0-m0", "s0-m1"]
    assert _same_weights(core.backend, _reference_one_step(steps[0])) < 1e-6


def test_the_key_names_the_backend_and_the_parameter_layout(torch_backend):
    from services.trainer.worker import objective_key

    key = objective_key(CONFIG, torch_backend)
    assert "backend=torch" in key and "layout=" in key
    bigger = TorchBackend.tiny(replace(TINY, hidden_size=TINY.hidden_size * 2))
    assert objective_key(CONFIG, bigger) != key


def test_a_checkpoint_is_on_disk_before_latest_names_it(tmp_path, monkeypatch, torch_backend):
    import services.trainer.checkpoint as ckpt

    order = []
    fsync, rename = ckpt.os.fsync, ckpt.os.replace

    def recording_fsync(fd):
        import os

        order.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        fsync(fd)

    def recording_replace(src, dst):
        order.append(("rename", f"{src.name}->{dst.name}"))
        rename(src, dst)

    monkeypatch.setattr(ckpt.os, "fsync", recording_fsync)
    monkeypatch.setattr(ckpt.os, "replace", recording_replace)
    folder = tmp_path / "ckpt"
    opt = torch.optim.AdamW([p for _, p in torch_backend.named_parameters()])
    ckpt.save_checkpoint(folder, ckpt.TrainerState(step=3), torch_backend.hf_state_dict(), opt)
    assert order == [("fsync", "step-000003.tmp"), ("rename", "step-000003.tmp->step-000003.pt"),
                     ("fsync", "ckpt"), ("fsync", "LATEST.tmp"), ("rename", "LATEST.tmp->LATEST"),
                     ("fsync", "ckpt")]


def test_a_latest_checkpoint_that_is_lost_falls_back_to_the_newest_readable(tmp_path, torch_backend, caplog):
    from services.trainer.checkpoint import (TrainerState, checkpoint_for_step, latest_checkpoint,
                                             load_latest_checkpoint, save_checkpoint)

    folder = tmp_path / "ckpt"
    opt = torch.optim.AdamW([p for _, p in torch_backend.named_parameters()])
    for step in (0, 1, 2):
        save_checkpoint(folder, TrainerState(step=step, weight_version=step), torch_backend.hf_state_dict(), opt)
    assert load_latest_checkpoint(folder)[1].step == 2
    checkpoint_for_step(folder, 2).write_bytes(b"truncated")  # unreadable
    with caplog.at_level(logging.WARNING, logger="services.trainer.checkpoint"):
        path, state, weights, _ = load_latest_checkpoint(folder)
    assert path == checkpoint_for_step(folder, 1) and state.step == 1 and weights
    assert "LATEST names" in caplog.text and "step-000002.pt" in caplog.text
    checkpoint_for_step(folder, 2).unlink()  # missing
    assert latest_checkpoint(folder) == checkpoint_for_step(folder, 1)
    assert load_latest_checkpoint(folder)[1].step == 1
    (folder / "LATEST").unlink()  # killed before LATEST was first written: the newest there is
    assert load_latest_checkpoint(folder)[1].step == 1
    assert load_latest_checkpoint(tmp_path / "none") is None


def test_only_the_newest_checkpoints_are_kept_when_asked(tmp_path, torch_backend):
    """keep_checkpoints: a long run on a big model cannot keep a full checkpoint (weights and
    optimizer) per step; the newest N stay, LATEST among them."""
    from services.trainer.checkpoint import TrainerState, load_latest_checkpoint, save_checkpoint

    opt = torch.optim.AdamW([p for _, p in torch_backend.named_parameters()])
    folder = tmp_path / "ckpt"
    for step in range(5):
        save_checkpoint(folder, TrainerState(step=step), torch_backend.hf_state_dict(), opt, keep=2)
    assert sorted(p.name for p in folder.glob("step-*.pt")) == ["step-000003.pt", "step-000004.pt"]
    assert load_latest_checkpoint(folder)[1].step == 4
    with pytest.raises(ValueError, match="at least 1"):
        save_checkpoint(folder, TrainerState(step=5), torch_backend.hf_state_dict(), opt, keep=0)


async def test_an_unreadable_training_event_is_dead_lettered_and_the_step_goes_on(js_bus, tmp_path):
    """A MicroStepDone this core cannot read (a newer cell's, say) is kept on the
    dead-letter stream and passed over; before, it stopped the core, and every restart
    from the checkpoint stopped on it again."""
    blobs = MemoryBlobStore()
    await js_bus.publish_raw(f"gyre.{RUN}.training.MicroStepDone.s0-x",
                             f'{{"type":"MicroStepDone","schema_version":1,"run_id":"{RUN}","bogus":1}}'.encode(),
                             {"Nats-Msg-Id": "unreadable-1"})
    core, workers = _cells(js_bus, blobs, tmp_path, n_satellites=0)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(core.run(stop))] + [asyncio.create_task(w.run(stop)) for w in workers]
    await _queue(js_bus, blobs, 0, _steps()[0])
    await _wait_version(core, 1)
    stop.set()
    await asyncio.gather(*tasks)
    dead = [m async for m in js_bus.read_raw("GYRE_DEADLETTER", filter_subject=f"gyredlq.trainer-core-{RUN}")]
    assert len(dead) == 1 and "undecodable" in dead[0].headers["Gyre-Dead-Reason"]
