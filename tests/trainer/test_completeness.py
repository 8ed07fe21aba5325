"""Every micro-step of a step is trained, once, whatever the work queue did with it (real
nats-server): a future step's claim handed back again and again is never dead-lettered; a
micro-step the queue did dead-letter (it kept failing) is computed by the core, also by a
core started after the fact; one that no cell finished in time is computed by the core;
and a micro-step computed twice is applied once."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from libs.common.blobs import MemoryBlobStore
from libs.common.events import Context, MicroStepQueued, StepApplied
from services.trainer.backends.torch_hf import TorchBackend
from services.trainer.batch import tree_batch
from services.trainer.core import CoreSettings, CoreTrainer
from services.trainer.step import compute_micro_step
from services.trainer.transfer import BlobTransfer

from .conftest import TINY
from .test_streaming import (CONFIG, RUN, _cells, _events, _queue, _reference, _reference_one_step, _same_weights,
                             _steps, _wait_version)


async def _work_dead_letters(bus) -> list:
    return [m async for m in bus.read_raw("GYRE_DEADLETTER", filter_subject=f"gyredlq.trainer-work-{RUN}")]


def _watchful(core: CoreTrainer, **kw) -> CoreTrainer:
    core.settings = replace(core.settings, watch_every_s=0.1, **kw)
    return core


async def test_a_future_steps_claim_handed_back_past_max_deliver_is_not_dead_lettered(js_bus, tmp_path,
                                                                                      monkeypatch):
    """Step 1's micro-steps are queued while step 0 has none yet: every cell hands them back
    (NotYet) again and again, far more often than MAX_DELIVER (3 here; 1000, about 100
    minutes, in production). They must still be there when step 1 opens. The watchdog is
    off: the queue alone must keep them."""
    import services.trainer.worker as worker_module

    monkeypatch.setattr(worker_module, "MAX_DELIVER", 3)
    blobs = MemoryBlobStore()
    core, workers = _cells(js_bus, blobs, tmp_path, n_satellites=1)
    _watchful(core, requeue_after_s=None)
    for w in workers:
        w.settings = replace(w.settings, future_hold_s=0.1, retry_delay_s=0.05)
    steps = _steps()
    await _queue(js_bus, blobs, 1, steps[1])
    stop = asyncio.Event()
    tasks = [asyncio.create_task(core.run(stop))] + [asyncio.create_task(w.run(stop)) for w in workers]
    await asyncio.sleep(3)  # some 20 hand-backs each
    await _queue(js_bus, blobs, 0, steps[0])
    await _wait_version(core, 2, timeout=40)
    stop.set()
    await asyncio.gather(*tasks)
    assert await _work_dead_letters(js_bus) == []
    assert _same_weights(core.backend, _reference(steps)) < 1e-6


class _FailingBlobs:
    """A cell's view of a blob store that is down (connection errors on every read)."""

    def __init__(self, blobs) -> None:
        self.blobs = blobs

    async def get(self, digest: str) -> bytes:
        raise ConnectionError("blob store unreachable")

    def __getattr__(self, name):
        return getattr(self.blobs, name)


async def test_a_dead_lettered_micro_step_is_computed_by_the_core_even_after_a_restart(js_bus, tmp_path,
                                                                                     monkeypatch):
    """A cell whose blob reads fail for good: each micro-step fails MAX_DELIVER tries and is
    dead-lettered (acked: the queue will not deliver it again). A core started after that
    (a restart) reads the dead letters and computes them itself; the step is applied."""
    import services.trainer.worker as worker_module
    from services.trainer.worker import BusWeightSource, MicroStepWorker, WorkerSettings

    monkeypatch.setattr(worker_module, "MAX_DELIVER", 2)
    blobs = MemoryBlobStore()
    first, _ = _cells(js_bus, blobs, tmp_path, n_satellites=0)
    await first.start()  # weights v0 published; this core then dies
    sat = MicroStepWorker(WorkerSettings(RUN, "sat", CONFIG, retry_delay_s=0.05), TorchBackend.tiny(TINY),
                          bus=js_bus, blobs=_FailingBlobs(blobs), gradients=BlobTransfer(blobs),
                          weights=BusWeightSource(js_bus, blobs, RUN))
    stop = asyncio.Event()
    sat_task = asyncio.create_task(sat.run(stop))
    steps = _steps()
    await _queue(js_bus, blobs, 0, steps[0])
    for _ in range(200):
        if len(await _work_dead_letters(js_bus)) == 2:
            break
        await asyncio.sleep(0.05)
    assert len(await _work_dead_letters(js_bus)) == 2
    again, _ = _cells(js_bus, blobs, tmp_path, n_satellites=0)  # from the checkpoint; its timer is off
    _watchful(again, requeue_after_s=None)
    core_task = asyncio.create_task(again.run(stop))
    await _wait_version(again, 1, timeout=30)
    stop.set()
    await asyncio.gather(core_task, sat_task)
    applied = await _events(js_bus, Context.TRAINING, StepApplied)
    assert [(e.step, sorted(e.micro_steps_used)) for e in applied] == [(0, ["s0-m0", "s0-m1"])]
    assert _same_weights(again.backend, _reference_one_step(steps[0])) < 1e-6


async def test_a_micro_step_no_cell_finished_in_time_is_computed_by_the_core(js_bus, tmp_path):
    """A claim acked without any MicroStepDone (lost however it was): after requeue_after_s
    the core computes the micro-step itself."""
    from services.trainer.worker import BusWeightSource, MicroStepWorker, WorkerSettings

    class Losing(MicroStepWorker):
        async def train(self, ev):
            self.done.append(ev.micro_step)  # acked, nothing published

    blobs = MemoryBlobStore()
    core, _ = _cells(js_bus, blobs, tmp_path, n_satellites=0)
    _watchful(core, requeue_after_s=1.0)
    losing = Losing(WorkerSettings(RUN, "lost", CONFIG), TorchBackend.tiny(TINY), bus=js_bus, blobs=blobs,
                    gradients=BlobTransfer(blobs), weights=BusWeightSource(js_bus, blobs, RUN))
    stop = asyncio.Event()
    tasks = [asyncio.create_task(core.run(stop)), asyncio.create_task(losing.run(stop))]
    steps = _steps()
    await _queue(js_bus, blobs, 0, steps[0])
    await _wait_version(core, 1, timeout=30)
    stop.set()
    await asyncio.gather(*tasks)
    assert sorted(losing.done) == ["s0-m0", "s0-m1"]
    assert _same_weights(core.backend, _reference_one_step(steps[0])) < 1e-6


async def _done_event(core, blobs, samples, k: int):
    """A cell's MicroStepDone of ``s0-m<k>``, computed at v0 under the core's objective."""
    from services.trainer.worker import MicroStepWorker, WorkerSettings

    backend = TorchBackend.tiny(TINY)
    backend.load_hf_state_dict(core.backend.hf_state_dict())
    sat = MicroStepWorker(WorkerSettings(RUN, "sat", CONFIG), backend, bus=core.bus, blobs=blobs,
                          gradients=BlobTransfer(blobs), weights=None)
    sat.version = 0
    queued = core.plans[0].queued[f"s0-m{k}"]
    res = compute_micro_step(backend, tree_batch([samples[k]]), CONFIG, micro_step=f"s0-m{k}")
    return await sat._done_event(queued, res, [])


async def test_a_micro_step_computed_twice_is_applied_once(js_bus, tmp_path):
    """The core computes a dead-lettered micro-step; a cell's result for it comes after all
    (it was only slow): passed over. The other way round, a micro-step whose result is in
    is not computed again when a dead letter names it."""
    core, blobs, steps = await _core_with_step_0_read(js_bus, tmp_path)
    computed = []
    recompute = core._recompute

    async def counting(ev, **kw):
        computed.append(ev.micro_step)
        await recompute(ev, **kw)

    core._recompute = counting
    late_m0, m1 = await _done_event(core, blobs, steps[0], 0), await _done_event(core, blobs, steps[0], 1)
    core.watch.dead_lettered(0, "s0-m0")
    await core._requeue_lost()
    assert computed == ["s0-m0"] and core.reducer.used == ["s0-m0"]
    await core.on_done(late_m0)  # the slow cell's result: a duplicate
    await core.on_done(m1)
    core.watch.dead_lettered(0, "s0-m1")  # named after its result is in: (the step is applied already)
    await core._requeue_lost()
    assert computed == ["s0-m0"] and core.state.weight_version == 1
    applied = (await _events(js_bus, Context.TRAINING, StepApplied))[0]
    assert applied.micro_steps_used == ["s0-m0", "s0-m1"] and applied.loss["micro_steps"] == 2.0
    assert _same_weights(core.backend, _reference_one_step(steps[0])) < 1e-6


async def _core_with_step_0_read(js_bus, tmp_path):
    """A core alone (timer off) that has read step 0's queued micro-steps; its blob store; the steps."""
    blobs = MemoryBlobStore()
    core, _ = _cells(js_bus, blobs, tmp_path, n_satellites=0)
    core.settings = replace(core.settings, requeue_after_s=None)
    await core.start()
    steps = _steps()
    await _queue(js_bus, blobs, 0, steps[0])
    for d in [d async for d in js_bus.read(Context.TREES) if isinstance(d.event, MicroStepQueued)]:
        await core.on_queued(d.event)
    return core, blobs, steps


async def test_a_dead_letter_for_a_micro_step_already_in_is_not_computed_again(js_bus, tmp_path):
    core, blobs, steps = await _core_with_step_0_read(js_bus, tmp_path)
    computed = []

    async def counting(ev, **kw):
        computed.append(ev.micro_step)

    core._recompute = counting
    await core.on_done(await _done_event(core, blobs, steps[0], 0))
    core.watch.dead_lettered(0, "s0-m0")
    await core._requeue_lost()
    assert computed == [] and core.reducer.used == ["s0-m0"] and core.state.weight_version == 0


async def test_a_watchdog_computation_that_fails_is_tried_again_and_does_not_stop_the_core(js_bus, tmp_path,
                                                                                         monkeypatch):
    import services.trainer.watchdog as watchdog

    monkeypatch.setattr(watchdog, "REQUEUE_RETRY_S", 0.2)
    blobs = MemoryBlobStore()
    core, _ = _cells(js_bus, blobs, tmp_path, n_satellites=0)
    core.settings = replace(core.settings, requeue_after_s=None)
    await core.start()
    await _queue(js_bus, blobs, 0, _steps()[0])
    for d in [d async for d in js_bus.read(Context.TREES) if isinstance(d.event, MicroStepQueued)]:
        await core.on_queued(d.event)
    real = core.blobs
    core.blobs = _FailingBlobs(real)
    core.watch.dead_lettered(0, "s0-m0")
    core.watch.dead_lettered(0, "s0-m1")
    await core._requeue_lost()  # logged, not raised
    assert core.reducer.used == []
    core.blobs = real
    await core._requeue_lost()
    assert core.reducer.used == []  # not before REQUEUE_RETRY_S
    await asyncio.sleep(0.25)
    await core._requeue_lost()
    assert core.state.weight_version == 1


def test_the_core_settings_default_to_dead_letters_only():
    """The timer is opt-in: a core computing waiting micro-steps would train while its cell
    serves (colocate, high demand); dead-lettered ones it always computes."""
    s = CoreSettings(RUN)
    assert not s.requeue_after_s and not s.resume_behind_log


def test_the_watch_waits_from_the_latest_of_opening_reading_and_claiming():
    from services.trainer.watchdog import CompletenessWatch

    t = [100.0]
    w = CompletenessWatch(requeue_after_s=10, clock=lambda: t[0])
    t[0] = 105.0
    w.read(1, "a")  # a future step's, read early
    w.step_opened(0)
    w.read(0, "b")
    t[0] = 114.0
    w.claimed(0, "b")  # a cell took it
    t[0] = 116.0
    assert w.lost([(0, "b")], used=()) == []
    t[0] = 124.0
    assert w.lost([(0, "b")], used=()) == [(0, "b")]
    assert w.lost([(0, "b")], used=("b",)) == []  # its result is in: never computed again
    w.failed((0, "b"))
    assert w.lost([(0, "b")], used=()) == []
    w.step_opened(1)  # step 1 opens at 124: "a" waits from then, not from its reading
    t[0] = 133.0
    assert w.lost([(1, "a")], used=()) == []
    t[0] = 134.0
    assert w.lost([(1, "a")], used=()) == [(1, "a")]
    off = CompletenessWatch(requeue_after_s=None, clock=lambda: t[0])
    t[0] = 10_000.0
    assert off.lost([(0, "c")], used=()) == []
    off.dead_lettered(0, "c")
    assert off.lost([(0, "c")], used=()) == [(0, "c")]


class _FlakyBlobs(_FailingBlobs):
    """A cell's view of a blob store whose first ``n`` reads fail, then all succeed."""

    def __init__(self, blobs, n: int) -> None:
        super().__init__(blobs)
        self.left = n

    async def get(self, digest: str) -> bytes:
        if self.left > 0:
            self.left -= 1
            raise ConnectionError("blob store unreachable")
        return await self.blobs.get(digest)


async def test_a_try_in_place_does_not_claim_again(js_bus, tmp_path):
    """A cell whose first blob reads fail retries the micro-step in place: one delivery, one
    MicroStepClaimed (so the core's claim count means deliveries that cells died with)."""
    from libs.common.events import MicroStepClaimed
    from services.trainer.worker import BusWeightSource, MicroStepWorker, WorkerSettings

    blobs = MemoryBlobStore()
    core, _ = _cells(js_bus, blobs, tmp_path, n_satellites=0)
    _watchful(core, requeue_after_s=None)
    sat = MicroStepWorker(WorkerSettings(RUN, "sat", CONFIG, retry_delay_s=0.05), TorchBackend.tiny(TINY),
                          bus=js_bus, blobs=_FlakyBlobs(blobs, 3), gradients=BlobTransfer(blobs),
                          weights=BusWeightSource(js_bus, blobs, RUN))
    stop = asyncio.Event()
    tasks = [asyncio.create_task(core.run(stop)), asyncio.create_task(sat.run(stop))]
    await _queue(js_bus, blobs, 0, _steps()[0])
    await _wait_version(core, 1, timeout=30)
    stop.set()
    await asyncio.gather(*tasks)
    claims = await _events(js_bus, Context.TRAINING, MicroStepClaimed)
    assert sorted(c.micro_step for c in claims) == ["s0-m0", "s0-m1"]
    assert sorted(sat.done) == ["s0-m0", "s0-m1"]


async def test_a_micro_step_claimed_max_claims_times_without_a_result_is_computed_by_the_core(js_bus, tmp_path):
    """Each claim is one delivery a cell computed: claims without a result are cells that died
    with the micro-step (one that kills every cell taking it, which the queue would hand out
    for good). At max_claims the core computes it; below, it waits."""
    from libs.common.events import MicroStepClaimed

    core, blobs, steps = await _core_with_step_0_read(js_bus, tmp_path)
    core.settings = replace(core.settings, max_claims=3)
    core.watch.max_claims = 3
    computed = []

    async def counting(ev, **kw):
        computed.append(ev.micro_step)

    core._recompute = counting
    queued = core.plans[0].queued["s0-m1"]
    for cell in ("sat0", "sat1"):
        await core.on_claimed(MicroStepClaimed(**queued.caused(step=0, micro_step="s0-m1", cell=cell,
                                                               weight_version=0)))
    await core._requeue_lost()
    assert computed == []
    await core.on_claimed(MicroStepClaimed(**queued.caused(step=0, micro_step="s0-m1", cell="sat2",
                                                           weight_version=0)))
    await core._requeue_lost()
    assert computed == ["s0-m1"]


def test_max_claims_is_an_option_with_a_clear_error():
    from services.trainer.main import env_options, max_claims

    assert max_claims({}) == 4 and CoreSettings(RUN).max_claims == 4
    assert max_claims(env_options({}, {"GYRE_TRAINER_MAX_CLAIMS": "0"})) is None
    assert max_claims(env_options({}, {"GYRE_TRAINER_MAX_CLAIMS": "7"})) == 7
    for bad in ("-1", "two", "1.5"):
        try:
            max_claims({"max_claims": bad})
        except ValueError as exc:
            assert "GYRE_TRAINER_MAX_CLAIMS" in str(exc)
        else:
            raise AssertionError(bad)


async def test_a_micro_step_that_kills_every_cell_taking_it_is_computed_by_the_core(js_bus, tmp_path, monkeypatch):
    """Cells die (the process goes, no ack, no hand-back) while computing s0-m1, one after
    another: the queue delivers it again after each ack wait, for good. The core counts the
    claims and computes it at max_claims; the step is applied with both micro-steps."""
    import services.trainer.worker as worker_module
    from services.trainer.worker import BusWeightSource, MicroStepWorker, WorkerSettings

    real = worker_module.compute_micro_step

    class Died(BaseException):
        """The cell's process died (not an Exception: nothing retries, acks or hands back)."""

    def deadly(backend, batch, train, *, micro_step, weight_version):
        if micro_step == "s0-m1":
            raise Died("the cell's process died")
        return real(backend, batch, train, micro_step=micro_step, weight_version=weight_version)

    monkeypatch.setattr(worker_module, "compute_micro_step", deadly)
    blobs = MemoryBlobStore()
    core, _ = _cells(js_bus, blobs, tmp_path, n_satellites=0)
    _watchful(core, requeue_after_s=None, max_claims=3)
    core.watch.max_claims = 3
    stop = asyncio.Event()
    core_task = asyncio.create_task(core.run(stop))
    await _queue(js_bus, blobs, 0, _steps()[0])
    deaths = 0
    for i in range(10):
        if core.state.weight_version >= 1 or deaths == 3:
            break  # no cell after the third death: the core alone must finish it (a fourth could
            # take the redelivered message and die before the core's result is in, on a loaded machine)
        sat = MicroStepWorker(WorkerSettings(RUN, f"sat{i}", CONFIG, ack_wait_s=1.0, retry_delay_s=0.05),
                              TorchBackend.tiny(TINY), bus=js_bus, blobs=blobs, gradients=BlobTransfer(blobs),
                              weights=BusWeightSource(js_bus, blobs, RUN))
        task = asyncio.create_task(sat.run(stop))
        done, _ = await asyncio.wait({task}, timeout=8)
        if task in done and isinstance(task.exception(), Died):
            deaths += 1
        else:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    await _wait_version(core, 1, timeout=30)
    stop.set()
    await core_task
    applied = (await _events(js_bus, Context.TRAINING, StepApplied))[0]
    assert deaths == 3 and sorted(applied.micro_steps_used) == ["s0-m0", "s0-m1"]
