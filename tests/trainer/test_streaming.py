"""Core + satellite over a real nats-server: work queue, version tags, one update per
step, weights published, bad samples rejected with reasons, and a killed core resumes."""

from __future__ import annotations

import asyncio

import pytest
import torch

from libs.common.blobs import MemoryBlobStore
from libs.common.events import Context, MicroStepDone, MicroStepQueued, StepApplied, WeightsPublished
from services.trainer.backends.torch_hf import TorchBackend
from services.trainer.batch import tree_batch
from services.trainer.core import CoreSettings, CoreTrainer, CoreWeightSource
from services.trainer.step import StepReducer, TrainConfig, compute_micro_step, make_optimizer
from services.trainer.transfer import BlobTransfer
from services.trajectory.codec import encode_packed

from .conftest import TINY
from .samples import two_branch_tree, workload_samples

RUN = "t1"
CONFIG = TrainConfig(lr=1e-3)


async def _queue(bus, blobs, step, samples, n_micro=2):
    """One step: the samples split over ``n_micro`` micro-steps."""
    digests = [await blobs.put(encode_packed(p)) for p, _ in samples]
    events = []
    for k in range(n_micro):
        idx = list(range(k, len(samples), n_micro))
        events.append(MicroStepQueued(run_id=RUN, step=step, micro_step=f"s{step}-m{k}", group_id=f"g{step}",
                                      sample_digests=[digests[i] for i in idx],
                                      advantages=[samples[i][1] for i in idx], n_tokens=1,
                                      micro_steps_in_step=n_micro))
    await bus.publish_many(events)


def _reference(steps):
    """The same steps trained directly, one update each."""
    backend = TorchBackend.tiny(TINY)
    opt = make_optimizer(backend, CONFIG)
    for step, samples in enumerate(steps):
        red = StepReducer(step, step)
        for k in range(2):
            batch = tree_batch([samples[i] for i in range(k, len(samples), 2)])
            red.add(compute_micro_step(backend, batch, CONFIG, micro_step=f"s{step}-m{k}", weight_version=step))
        assert red.apply(backend, opt, CONFIG)
    return backend


def _steps():
    w = workload_samples(TINY.vocab_size)
    return [[(w[0], 1.0), (two_branch_tree("rx"), -1.0)], [(w[1], -0.5), (two_branch_tree("ry"), 0.5)]]


async def _events(bus, context, kind):
    out = []
    async for d in bus.read(context):
        if isinstance(d.event, kind):
            out.append(d.event)
    return out


def _same_weights(a, b):
    sa, sb = a.hf_state_dict(), b.hf_state_dict()
    return max(float((sa[k] - sb[k]).abs().max()) for k in sa)


async def _wait_version(core, version, timeout=60):
    async def wait():
        while core.state.weight_version < version:
            await asyncio.sleep(0.05)
    await asyncio.wait_for(wait(), timeout)


def _cells(bus, blobs, tmp_path, n_satellites=1, transfer="blob"):
    """The core with its own worker (gradients in memory) and satellites (blob or port)."""
    from services.trainer.transfer import InProcessTransfer, RoutedTransfer
    from services.trainer.worker import BusWeightSource, MicroStepWorker, WorkerSettings

    blob, local = BlobTransfer(blobs), InProcessTransfer()
    routes = {"memory": local, "blob": blob}
    if transfer == "port":
        from libs.common.transfer.weights import PortTransfer

        routes["port"] = PortTransfer()
    remote = routes[transfer]
    core = CoreTrainer(CoreSettings(RUN, train=CONFIG, checkpoint_dir=tmp_path / "ckpt"), TorchBackend.tiny(TINY),
                       bus=bus, blobs=blobs, gradients=RoutedTransfer(blob, **routes))
    workers = [MicroStepWorker(WorkerSettings(RUN, "core", CONFIG), TorchBackend.tiny(TINY), bus=bus, blobs=blobs,
                               gradients=local, weights=CoreWeightSource(core))]
    for i in range(n_satellites):
        workers.append(MicroStepWorker(WorkerSettings(RUN, f"sat{i}", CONFIG), TorchBackend.tiny(TINY), bus=bus,
                                       blobs=blobs, gradients=remote, weights=BusWeightSource(bus, blobs, RUN)))
    return core, workers


@pytest.mark.parametrize("transfer", ["blob", "port"])
async def test_core_and_satellite_train_two_steps(js_bus, tmp_path, transfer):
    blobs = MemoryBlobStore()
    core, workers = _cells(js_bus, blobs, tmp_path, transfer=transfer)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(core.run(stop))] + [asyncio.create_task(w.run(stop)) for w in workers]
    steps = _steps()
    for step, samples in enumerate(steps):
        await _queue(js_bus, blobs, step, samples)
    await _wait_version(core, 2)
    stop.set()
    await asyncio.gather(*tasks)
    assert _same_weights(core.backend, _reference(steps)) < 1e-6
    applied = await _events(js_bus, Context.TRAINING, StepApplied)
    assert [(e.step, e.weight_version, sorted(e.micro_steps_used)) for e in applied] == [
        (0, 1, ["s0-m0", "s0-m1"]), (1, 2, ["s1-m0", "s1-m1"])]
    published = await _events(js_bus, Context.TRAINING, WeightsPublished)
    assert [e.weight_version for e in published] == [0, 1, 2]
    dones = await _events(js_bus, Context.TRAINING, MicroStepDone)
    assert {e.cell for e in dones} <= {"core", "sat0"} and sum(len(w.done) for w in workers) == 4
    assert {e.gradient["transfer"]["kind"] for e in dones if e.cell == "sat0"} <= {transfer}
    # a satellite's gradient blob is deleted once its step is in a checkpoint (the last
    # step's too: it is checkpointed before the weights go out)
    sent = [e.gradient["transfer"]["digest"] for e in dones if e.gradient["transfer"]["kind"] == "blob"]
    assert [d for d in sent if await blobs.has(d)] == []
    from services.trainer.replay import replay_step

    for step in (0, 1):  # `gyre replay --step N`: the log + the checkpoint give the recorded loss
        report = await replay_step(js_bus, blobs, run_id=RUN, step=step, checkpoint_dir=tmp_path / "ckpt",
                                   backend=TorchBackend.tiny(TINY), train=CONFIG)
        assert report["match"], report
        assert report["micro_steps"] == [f"s{step}-m0", f"s{step}-m1"]


@pytest.mark.parametrize("order", ["queued_first", "done_first"])
async def test_stale_gradient_is_dropped_and_recomputed(js_bus, tmp_path, order):
    """A gradient from another weight version is dropped; the core computes that
    micro-step itself (also when the stale result arrives before the queue event)."""
    from services.trainer.worker import objective_key

    blobs = MemoryBlobStore()
    core, _ = _cells(js_bus, blobs, tmp_path, n_satellites=0)
    await core.start()
    steps = _steps()
    await _queue(js_bus, blobs, 0, steps[0])
    queued = [d.event async for d in js_bus.read(Context.TREES)]
    grads = BlobTransfer(blobs)
    dones = []
    for k, version in ((0, 7), (1, 0)):  # m0 computed on an old version; m1 fine
        backend = TorchBackend.tiny(TINY) if version == 7 else core.backend
        res = compute_micro_step(backend, tree_batch([steps[0][k]]), CONFIG, micro_step=f"s0-m{k}")
        desc = {"transfer": await grads.put({"gradient": res.gradient}), "executions": list(res.executions),
                "stats": res.stats, "finite": True, "rejected": [], "objective": objective_key(CONFIG, backend)}
        dones.append(MicroStepDone(run_id=RUN, step=0, micro_step=f"s0-m{k}", cell="sat", weight_version=version,
                                   n_tokens=1, loss=res.loss_sum, gradient=desc))
    first, second = (queued, dones) if order == "queued_first" else (dones, queued)
    for ev in first + second:
        await (core.on_queued(ev) if isinstance(ev, MicroStepQueued) else core.on_done(ev))
    assert core.state.weight_version == 1
    applied = (await _events(js_bus, Context.TRAINING, StepApplied))[0]
    assert applied.micro_steps_dropped == ["s0-m0"] and sorted(applied.micro_steps_used) == ["s0-m0", "s0-m1"]
    assert _same_weights(core.backend, _reference_one_step(steps[0])) < 1e-6


async def test_a_gradient_under_another_objective_is_recomputed_by_the_core(js_bus, tmp_path):
    """A satellite configured apart from the core (another clip range) must not bend the
    step: the core recomputes that micro-step under its own objective."""
    from dataclasses import replace

    from services.trainer.objective import ObjectiveConfig
    from services.trainer.worker import objective_key

    blobs = MemoryBlobStore()
    core, _ = _cells(js_bus, blobs, tmp_path, n_satellites=0)
    await core.start()
    steps = _steps()
    await _queue(js_bus, blobs, 0, steps[0])
    for d in [d async for d in js_bus.read(Context.TREES)]:
        await core.on_queued(d.event)
    grads = BlobTransfer(blobs)
    other = replace(CONFIG, objective=ObjectiveConfig(eps_low=0.5, eps_high=0.5))
    for k, config in ((0, other), (1, CONFIG)):
        res = compute_micro_step(core.backend, tree_batch([steps[0][k]]), config, micro_step=f"s0-m{k}")
        desc = {"transfer": await grads.put({"gradient": res.gradient}), "executions": list(res.executions),
                "stats": res.stats, "finite": True, "rejected": [],
                "objective": objective_key(config, core.backend)}
        await core.on_done(MicroStepDone(run_id=RUN, step=0, micro_step=f"s0-m{k}", cell="sat", weight_version=0,
                                         n_tokens=1, loss=res.loss_sum, gradient=desc))
    assert core.state.weight_version == 1
    applied = (await _events(js_bus, Context.TRAINING, StepApplied))[0]
    assert applied.micro_steps_dropped == ["s0-m0"] and sorted(applied.micro_steps_used) == ["s0-m0", "s0-m1"]
    assert _same_weights(core.backend, _reference_one_step(steps[0])) < 1e-6


def _reference_one_step(samples):
    backend = TorchBackend.tiny(TINY)
    opt = make_optimizer(backend, CONFIG)
    red = StepReducer(0, 0)
    for k in range(2):
        red.add(compute_micro_step(backend, tree_batch([samples[k]]), CONFIG, micro_step=f"m{k}"))
    red.apply(backend, opt, CONFIG)
    return backend


async def test_killed_core_resumes_exactly(js_bus, tmp_path):
    from services.trainer.worker import BusWeightSource, MicroStepWorker, WorkerSettings

    blobs = MemoryBlobStore()
    grads = BlobTransfer(blobs)

    gate = asyncio.Event()

    class Satellite(MicroStepWorker):
        async def train(self, ev):
            if ev.micro_step == "s1-m1":  # holds the step open until the core is killed
                await gate.wait()
            await super().train(ev)

    def satellite(name):
        return Satellite(WorkerSettings(RUN, name, CONFIG), TorchBackend.tiny(TINY), bus=js_bus, blobs=blobs,
                         gradients=grads, weights=BusWeightSource(js_bus, blobs, RUN))

    def core():
        return CoreTrainer(CoreSettings(RUN, train=CONFIG, checkpoint_dir=tmp_path / "ckpt"),
                           TorchBackend.tiny(TINY), bus=js_bus, blobs=blobs, gradients=grads)

    steps = _steps()
    for step, samples in enumerate(steps):
        await _queue(js_bus, blobs, step, samples)
    stop = asyncio.Event()
    first = core()
    core_task = asyncio.create_task(first.run(stop))
    sat_task = asyncio.create_task(satellite("sat0").run(stop))
    while not [e for e in await _events(js_bus, Context.TRAINING, MicroStepDone) if e.step == 1]:
        await asyncio.sleep(0.05)
    core_task.cancel()  # killed mid step 1, after its step-0 checkpoint
    await asyncio.gather(core_task, return_exceptions=True)
    assert first.state.weight_version == 1 and "s1-m0" in first.reducer.used
    gate.set()
    second = core()
    core_task = asyncio.create_task(second.run(stop))
    await _wait_version(second, 2)
    stop.set()
    await asyncio.gather(core_task, sat_task)
    assert _same_weights(second.backend, _reference(steps)) < 1e-6
    applied = await _events(js_bus, Context.TRAINING, StepApplied)
    assert [e.step for e in applied] == [0, 1]


async def test_bad_sample_is_rejected_with_its_reason(js_bus, tmp_path):
    from dataclasses import replace

    blobs = MemoryBlobStore()
    core, workers = _cells(js_bus, blobs, tmp_path, n_satellites=0)
    good = (two_branch_tree("ra"), 1.0)
    bad_tree = two_branch_tree("rb")
    blp = bad_tree.behaviour_logprobs[:]
    blp[3] = 3.0  # not a log-probability
    bad = (replace(bad_tree, behaviour_logprobs=blp), 1.0)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(core.run(stop)), asyncio.create_task(workers[0].run(stop))]
    await _queue(js_bus, blobs, 0, [good, bad])
    await _wait_version(core, 1)
    stop.set()
    await asyncio.gather(*tasks)
    done = {e.micro_step: e for e in await _events(js_bus, Context.TRAINING, MicroStepDone)}
    assert done["s0-m1"].gradient["rejected"][0]["reason"] == "behaviour_logprobs[3] = 3.0 is not a log-probability"
    applied = (await _events(js_bus, Context.TRAINING, StepApplied))[0]
    assert applied.loss["rejected_samples"] == 1.0 and applied.loss["executions"] == 1.0


async def test_non_finite_micro_step_marks_the_step_and_keeps_the_weights(js_bus, tmp_path):
    from services.trainer.worker import objective_key

    blobs = MemoryBlobStore()
    core, _ = _cells(js_bus, blobs, tmp_path, n_satellites=0)
    await core.start()
    before = {k: v.clone() for k, v in core.backend.hf_state_dict().items()}
    await _queue(js_bus, blobs, 0, [(two_branch_tree("ra"), 1.0)], n_micro=1)
    async for d in js_bus.read(Context.TREES):
        await core.on_queued(d.event)
    await core.on_done(MicroStepDone(run_id=RUN, step=0, micro_step="s0-m0", cell="sat", weight_version=0,
                                     n_tokens=10, loss=0.0, gradient={"finite": False, "executions": ["ra"],
                                                                      "objective": objective_key(CONFIG, core.backend)}))
    applied = (await _events(js_bus, Context.TRAINING, StepApplied))[0]
    assert applied.loss["applied"] == 0.0 and applied.micro_steps_dropped == ["s0-m0"]
    assert core.state.weight_version == 1 and core.state.step == 1  # step 1 trains on v1 = the same weights
    after = core.backend.hf_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


async def test_staleness_bound_rejects_old_samples():
    from services.trainer.worker import load_samples

    blobs = MemoryBlobStore()
    digest = await blobs.put(encode_packed(two_branch_tree("ra")))  # generated by v0
    ev = MicroStepQueued(run_id=RUN, step=3, micro_step="m", group_id="g", sample_digests=[digest],
                         advantages=[1.0], n_tokens=10)
    kept, rejected = await load_samples(blobs, ev, TINY.vocab_size, version=3, max_staleness=3)
    assert len(kept) == 1 and not rejected
    kept, rejected = await load_samples(blobs, ev, TINY.vocab_size, version=3, max_staleness=2)
    assert not kept and rejected == [{"digest": digest,
                                      "reason": "generated by v0, more than 2 versions before v3"}]


async def test_satellite_seat_joins_trains_and_leaves(js_bus, tmp_path):
    """The cell agent's view: join on a switch to training, leave on the way back, even
    while waiting for weights that are not there yet (the claim goes back to the queue)."""
    from services.trainer.seat import SatelliteSeat
    from services.trainer.worker import WorkerSettings

    blobs = MemoryBlobStore()
    grads = BlobTransfer(blobs)
    core = CoreTrainer(CoreSettings(RUN, train=CONFIG), TorchBackend.tiny(TINY), bus=js_bus, blobs=blobs,
                       gradients=grads)
    seat = SatelliteSeat(WorkerSettings(RUN, "cell-7", CONFIG), lambda: TorchBackend.tiny(TINY), js_bus, blobs,
                         grads)
    stop = asyncio.Event()
    core_task = asyncio.create_task(core.run(stop))
    await seat.join(0)
    await _queue(js_bus, blobs, 0, _steps()[0])
    await _wait_version(core, 1)
    assert sorted(seat.worker.done) == ["s0-m0", "s0-m1"]
    await _queue(js_bus, blobs, 5, _steps()[1], n_micro=1)  # v5 never comes
    await asyncio.sleep(0.3)
    await asyncio.wait_for(seat.leave(), 10)
    assert not seat.joined
    stop.set()
    await core_task


async def test_a_failed_satellite_join_holds_no_model():
    """The cell rolls back to inference when a join fails: the seat must not keep the
    model it built (fault injected: the log cannot be read)."""
    from services.trainer.seat import SatelliteSeat
    from services.trainer.worker import WorkerSettings

    class Unreachable:
        async def last_on_subject(self, context, subject):
            raise ConnectionError("nats unreachable")

    built = []

    def build():
        built.append(TorchBackend.tiny(TINY))
        return built[-1]

    blobs = MemoryBlobStore()
    seat = SatelliteSeat(WorkerSettings(RUN, "cell-9", CONFIG), build, Unreachable(), blobs, BlobTransfer(blobs))
    with pytest.raises(ConnectionError):
        await seat.join(0)
    assert len(built) == 1 and seat.backend is None and not seat.joined
    await seat.leave()  # nothing to stop; still fine


async def test_a_group_with_nothing_to_train_counts_toward_its_step(js_bus, tmp_path):
    """groups_per_step = 2: step 0 has one group of two micro-steps and one whose rollouts
    left no sample (GroupQueued with none); step 1 has only empty groups. Neither step
    waits for ever: step 0 is the first group's update, step 1 closes with no update."""
    from dataclasses import replace

    from libs.common.events import GroupQueued

    blobs = MemoryBlobStore()
    core, workers = _cells(js_bus, blobs, tmp_path, n_satellites=0)
    core.settings = replace(core.settings, groups_per_step=2)
    samples = _steps()[0]
    digests = [await blobs.put(encode_packed(p)) for p, _ in samples]
    stop = asyncio.Event()
    tasks = [asyncio.create_task(core.run(stop))] + [asyncio.create_task(w.run(stop)) for w in workers]
    await js_bus.publish_many([
        MicroStepQueued(run_id=RUN, step=0, micro_step=f"g0-m{k}", group_id="g0", sample_digests=[digests[k]],
                        advantages=[samples[k][1]], n_tokens=1, group_micro_steps=2) for k in range(2)])
    await js_bus.publish(GroupQueued(run_id=RUN, step=0, group_id="empty0", micro_steps=0))
    # step 1 is settled, empty, while step 0 may still be training: it closes right after it
    await js_bus.publish_many([GroupQueued(run_id=RUN, step=1, group_id=g, micro_steps=0) for g in ("e1", "e2")])
    await _wait_version(core, 2)
    stop.set()
    await asyncio.gather(*tasks)
    applied = await _events(js_bus, Context.TRAINING, StepApplied)
    assert [(e.step, e.weight_version, sorted(e.micro_steps_used), e.loss["applied"]) for e in applied] == [
        (0, 1, ["g0-m0", "g0-m1"], 1.0), (1, 2, [], 0.0)]


async def test_a_step_waits_for_a_group_read_only_in_part(js_bus, tmp_path):
    from dataclasses import replace

    blobs = MemoryBlobStore()
    core, _ = _cells(js_bus, blobs, tmp_path, n_satellites=0)
    core.settings = replace(core.settings, groups_per_step=1)
    first = MicroStepQueued(run_id=RUN, step=0, micro_step="g0-m0", group_id="g0", sample_digests=["ab" * 32],
                            advantages=[1.0], n_tokens=1, group_micro_steps=2)
    await core.on_queued(first)
    core.reducer.used.append("g0-m0")  # and already trained
    assert not core._complete()  # the group has two micro-steps; one is read
    other = MicroStepQueued(run_id=RUN, step=0, micro_step="g9-m0", group_id="g9", sample_digests=["ab" * 32],
                            advantages=[1.0], n_tokens=1, group_micro_steps=3)  # a re-run's extra group
    await core.on_queued(other)
    core.reducer.used.append("g9-m0")
    second = first.model_copy(update={"micro_step": "g0-m1"})
    await core.on_queued(second)
    core.reducer.used.append("g0-m1")
    assert not core._complete()  # g0 is complete, but g9 is read 1/3: it is waited for
    for k in (1, 2):
        await core.on_queued(other.model_copy(update={"micro_step": f"g9-m{k}"}))
        core.reducer.used.append(f"g9-m{k}")
    assert core._complete()


async def test_a_group_queued_after_its_step_was_applied_is_named_not_passed_over_silently(js_bus, tmp_path, caplog):
    import logging
    from dataclasses import replace

    blobs = MemoryBlobStore()
    core, workers = _cells(js_bus, blobs, tmp_path, n_satellites=0)
    core.settings = replace(core.settings, groups_per_step=1)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(core.run(stop)), asyncio.create_task(workers[0].run(stop))]
    await _queue(js_bus, blobs, 0, _steps()[0])  # group g0: the step's one group
    await _wait_version(core, 1, timeout=30)
    late = MicroStepQueued(run_id=RUN, step=0, micro_step="late-m0", group_id="late", sample_digests=["ab" * 32],
                           advantages=[1.0], n_tokens=1, group_micro_steps=1)
    with caplog.at_level(logging.WARNING, logger="services.trainer.core"):
        await core.on_queued(late)
        await core.on_queued(MicroStepQueued(run_id=RUN, step=0, micro_step="s0-m0", group_id="g0",
                                             sample_digests=["ab" * 32], advantages=[1.0], n_tokens=1))
    stop.set()
    await asyncio.gather(*tasks)
    warned = [r.getMessage() for r in caplog.records if "queued after step 0 was applied" in r.getMessage()]
    assert len(warned) == 1 and "late-m0 (group late)" in warned[0]  # s0-m0 was trained: read again quietly


async def test_a_core_killed_between_its_checkpoint_and_the_step_s_events_publishes_them_on_restart(js_bus, tmp_path):
    """The checkpoint is written before StepApplied and the new weights reach the log, so
    the log never runs ahead of it; a core killed in between publishes them on restart,
    once."""
    blobs = MemoryBlobStore()
    core, workers = _cells(js_bus, blobs, tmp_path, n_satellites=0)
    publish = js_bus.publish

    async def killed_at_step_applied(event, **kw):
        if isinstance(event, StepApplied):
            raise asyncio.CancelledError  # the process dies here
        return await publish(event, **kw)

    js_bus.publish = killed_at_step_applied
    stop = asyncio.Event()
    tasks = [asyncio.create_task(core.run(stop)), asyncio.create_task(workers[0].run(stop))]
    await _queue(js_bus, blobs, 0, _steps()[0])
    for _ in range(400):
        await asyncio.sleep(0.05)
        if core.state.weight_version == 1:
            break
    await asyncio.sleep(0.2)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    js_bus.publish = publish
    assert await _events(js_bus, Context.TRAINING, StepApplied) == []
    assert [e.weight_version for e in await _events(js_bus, Context.TRAINING, WeightsPublished)] == [0]
    again, _ = _cells(js_bus, blobs, tmp_path, n_satellites=0)
    await again.start()  # from the checkpoint of step 1, with step 0's record pending
    await again.start()  # a second restart: the log has it now, nothing is published twice
    applied = await _events(js_bus, Context.TRAINING, StepApplied)
    assert [(e.step, e.weight_version) for e in applied] == [(0, 1)]
    assert [e.weight_version for e in await _events(js_bus, Context.TRAINING, WeightsPublished)] == [0, 1]
    assert again.state.step == 1 and again.state.pending_applied is None


async def test_a_result_the_core_does_not_use_frees_its_in_memory_gradient(js_bus, tmp_path):
    from services.trainer.transfer import InProcessTransfer, RoutedTransfer

    blobs = MemoryBlobStore()
    local = InProcessTransfer()
    core = CoreTrainer(CoreSettings(RUN, train=CONFIG), TorchBackend.tiny(TINY), bus=js_bus, blobs=blobs,
                       gradients=RoutedTransfer(BlobTransfer(blobs), memory=local))
    descriptor = await local.put({"g": torch.zeros(4)})
    straggler = MicroStepDone(run_id=RUN, step=5, micro_step="s5-m0", cell="core", weight_version=5, n_tokens=1,
                              loss=0.0, gradient={"transfer": descriptor})
    await core.on_done(straggler)  # not the core's step: ignored, and its gradient freed
    assert local._items == {}


async def test_in_memory_gradient_keys_never_name_another_processs_gradient():
    """A restarted core reads its dead predecessor's MicroStepDone events again. Their
    in-memory descriptors must not find a gradient the new process's worker stored since
    (with a bare counter both would say mem-0, and the core added the wrong micro-step's
    gradient: seen with a restart while the weights were being published)."""
    import torch

    from services.trainer.transfer import InProcessTransfer

    before, after = InProcessTransfer(), InProcessTransfer()  # the dead process's and the new one's
    old = await before.put({"g": torch.zeros(2)})
    new = await after.put({"g": torch.ones(2)})
    assert old["key"] != new["key"]
    with pytest.raises(LookupError, match="gone"):
        await after.get(old)  # the core recomputes that micro-step instead
    assert torch.equal((await after.get(new))["g"], torch.ones(2))


async def test_a_leaving_satellite_releases_its_port_gradient_snapshots():
    """The port keeps a satellite's newest gradients registered; leaving frees them."""
    from services.trainer.seat import SatelliteSeat
    from services.trainer.worker import WorkerSettings

    class Port:
        closed = 0

        async def close(self):
            Port.closed += 1

    seat = SatelliteSeat(WorkerSettings(RUN, "cell-8", CONFIG), lambda: None, object(), object(), Port())
    await seat.leave()
    await seat.close()
    assert Port.closed == 2
