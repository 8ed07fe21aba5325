"""The cell agent switching a real embedded engine cell behind the real proxy, with live
sessions; a failed join rolls back to inference; commands over NATS request/reply."""

from __future__ import annotations

import httpx
import pytest

from libs.common.events import Context, SwitchCompleted, SwitchFailed, SwitchPhaseEntered
from services.cell.adapters import EngineControl, NoSeat, ProxyControl, WeightsSeat
from services.cell.agent import CellAgent, request_switch
from services.cell.core import SwitchRefused, plan
from services.engine.client import EngineClient
from services.engine.main import build
from services.engine.settings import EngineSettings
from tests.proxy._fakes import Served
from tests.proxy.conftest import ADMIN

from ._fakes import FailingSeat



@pytest.fixture(scope="module")
def engines(model_dir):
    services = [build(EngineSettings(model="tiny-qwen", num_threads=1, admin_token=ADMIN)) for _ in range(2)]
    served = [Served(s.app) for s in services]
    yield served
    for s in served:
        s.stop()
    for s in services:
        s.close()


async def setup_cells(proxy, engines, model_dir, seat_for_e1=None) -> list[CellAgent]:
    for name in list(proxy.service.router.cells):
        proxy.service.router.remove_cell(name)
    proxy.service.client_factory = lambda url: EngineClient(url, admin_token=ADMIN, timeout=60)
    agents = [CellAgent(name=f"e{i}", run_id="ptest", bus=proxy.bus, proxy=ProxyControl(proxy.url, ADMIN),
                        engine=EngineControl(EngineClient(s.url, admin_token=ADMIN, timeout=60)),
                        seat=(seat_for_e1 if i == 1 and seat_for_e1 else WeightsSeat(model_dir)),
                        engine_url=s.url, is_core=(i == 0)) for i, s in enumerate(engines)]
    for a in agents:
        await a.register()
    return agents


async def talk(base: str, histories: list[list[dict]]) -> None:
    async with httpx.AsyncClient(timeout=60) as c:
        for h in histories:
            r = await c.post(base + "/v1/chat/completions", headers={"Authorization": "Bearer k-secret"},
                             json={"model": "m", "messages": h, "max_tokens": 4})
            assert r.status_code == 200, r.text
            h += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or "."},
                  {"role": "user", "content": "more"}]


async def cell_events(bus) -> list:
    return [d.event async for d in bus.read(Context.CELLS)]


def test_plans() -> None:
    assert plan("training", "inference") == ("leaving", "resuming")
    with pytest.raises(SwitchRefused):
        plan("inference", "inference")


async def test_switch_round_trip_with_live_sessions(proxy, engines, model_dir) -> None:
    agents = await setup_cells(proxy, engines, model_dir)
    base = await proxy.rollout("cell-1")
    histories = [[{"role": "user", "content": f"task {i}"}] for i in range(4)]
    await talk(base, histories)
    assert proxy.service.router.sessions_on("e1")
    rec = await agents[1].switch("training")
    assert rec.ok and agents[1].role == "training" and list(rec.timings) == ["draining", "migrating", "releasing",
                                                                             "joining"]
    assert not proxy.service.router.sessions_on("e1")
    await talk(base, histories)  # every session goes on, on e0
    rec = await agents[1].switch("inference")
    assert rec.ok and agents[1].role == "inference"
    await talk(base, histories)
    events = await cell_events(proxy.bus)
    phases = [e.phase for e in events if isinstance(e, SwitchPhaseEntered)]
    assert phases == ["draining", "migrating", "releasing", "joining", "leaving", "resuming"]
    done = [e for e in events if isinstance(e, SwitchCompleted)]
    assert [e.role for e in done] == ["training", "inference"]


async def test_a_failed_join_rolls_back_to_inference(proxy, engines, model_dir) -> None:
    seat = FailingSeat()
    agents = await setup_cells(proxy, engines, model_dir, seat_for_e1=seat)
    base = await proxy.rollout("cell-2")
    histories = [[{"role": "user", "content": f"task {i}"}] for i in range(2)]
    await talk(base, histories)
    left = seat.left  # (registering makes a seat leave: a no-op when it has not joined)
    rec = await agents[1].switch("training")
    assert not rec.ok and rec.failed_phase == "joining" and agents[1].role == "inference"
    assert seat.left == left + 1
    failed = [e for e in await cell_events(proxy.bus) if isinstance(e, SwitchFailed)]
    assert failed and failed[0].phase == "joining" and failed[0].role == "inference"
    assert proxy.service.router.cells["e1"].state.value == "active"  # serving again
    await talk(base, histories)


async def test_a_failed_resume_rolls_back_to_training_with_the_seat_joined(proxy, engines, model_dir) -> None:
    from ._fakes import ResumeFailsOnce

    agents = await setup_cells(proxy, engines, model_dir)
    cell = agents[1]
    assert (await cell.switch("training")).ok and cell.seat.model is not None
    cell.engine = ResumeFailsOnce(cell.engine)
    rec = await cell.switch("inference")
    assert not rec.ok and rec.failed_phase == "resuming" and cell.role == "training"
    assert cell.seat.model is not None  # left, then joined again: the cell trains as its role says
    assert cell.engine.releases == 1  # the engine's memory released again
    failed = [e for e in await cell_events(proxy.bus) if isinstance(e, SwitchFailed)]
    assert failed[-1].phase == "resuming" and failed[-1].role == "training"
    assert (await cell.switch("inference")).ok and cell.role == "inference"  # the next try resumes
    assert proxy.service.router.cells["e1"].state.value == "active"


async def test_a_rollback_that_cannot_resume_keeps_the_cell_out_of_routing_until_repaired(
        proxy, engines, model_dir) -> None:
    """Joining fails, then resuming the engine fails too: the cell must not be put back in
    the proxy's routing (calls would hit an engine without memory); it says why, refuses
    switches meanwhile, and keep_registered repairs it once the engine comes back."""
    import asyncio

    from ._fakes import ResumeFailsOnce

    agents = await setup_cells(proxy, engines, model_dir, seat_for_e1=FailingSeat())
    cell = agents[1]
    cell.engine = ResumeFailsOnce(cell.engine)
    rec = await cell.switch("training")
    assert not rec.ok and rec.failed_phase == "joining" and cell.role == "inference"
    assert "rollback to inference failed" in rec.reason and "out of memory" in rec.reason
    assert cell.broken is not None
    assert proxy.service.router.cells["e1"].state.value != "active"  # not routed to
    refused = await cell.switch("training")
    assert refused.failed_phase == "refused" and "not usable" in refused.reason
    failed = [e for e in await cell_events(proxy.bus) if isinstance(e, SwitchFailed)]
    assert [e.phase for e in failed[-2:]] == ["joining", "refused"]
    stop = asyncio.Event()
    task = asyncio.create_task(cell.keep_registered(stop, every_s=0.05))
    for _ in range(100):
        await asyncio.sleep(0.05)
        if cell.broken is None:
            break
    stop.set()
    await task
    assert cell.broken is None and proxy.service.router.cells["e1"].state.value == "active"
    await talk(await proxy.rollout("cell-repair"), [[{"role": "user", "content": "hi"}]])


async def test_a_phase_that_cannot_be_announced_fails_in_the_phase_the_log_knows(proxy, engines, model_dir,
                                                                                 monkeypatch) -> None:
    import services.cell.agent as agent_module

    monkeypatch.setattr(agent_module, "ANNOUNCE_RETRY_S", (0.01,), raising=False)
    agents = await setup_cells(proxy, engines, model_dir)
    cell = agents[1]
    publish = cell.bus.publish
    calls = {"n": 0}

    async def flaky(event):  # the bus fails on the joining announcement only
        if isinstance(event, SwitchPhaseEntered) and event.phase == "joining":
            calls["n"] += 1
            raise ConnectionError("nats went away")
        return await publish(event)

    cell.bus.publish = flaky
    try:
        rec = await cell.switch("training")
    finally:
        cell.bus.publish = publish
    assert calls["n"] == 2 and not rec.ok and rec.failed_phase == "releasing" and cell.role == "inference"
    failed = [e for e in await cell_events(proxy.bus) if isinstance(e, SwitchFailed)]
    assert failed[-1].phase == "releasing" and failed[-1].role == "inference"
    assert await cell.engine.released() == [] and proxy.service.router.cells["e1"].state.value == "active"


async def test_a_failed_resuming_announcement_puts_the_seat_back(proxy, engines, model_dir, monkeypatch) -> None:
    """Leaving ran (the seat left), then announcing resuming failed: the cell is reported
    in training, in the phase the log knows, and its seat is joined again."""
    import services.cell.agent as agent_module

    monkeypatch.setattr(agent_module, "ANNOUNCE_RETRY_S", (0.01,), raising=False)
    agents = await setup_cells(proxy, engines, model_dir)
    cell = agents[1]
    assert (await cell.switch("training")).ok
    publish = cell.bus.publish

    async def flaky(event):
        if isinstance(event, SwitchPhaseEntered) and event.phase == "resuming":
            raise ConnectionError("nats went away")
        return await publish(event)

    cell.bus.publish = flaky
    try:
        rec = await cell.switch("inference")
    finally:
        cell.bus.publish = publish
    assert not rec.ok and rec.failed_phase == "leaving" and cell.role == "training"
    assert cell.seat.model is not None and cell.broken is None  # joined again
    assert await cell.engine.released()  # and the engine's memory stays with training
    assert (await cell.switch("inference")).ok


async def test_an_outcome_the_bus_would_not_take_is_published_later(proxy, engines, model_dir, monkeypatch) -> None:
    import asyncio

    import services.cell.agent as agent_module

    monkeypatch.setattr(agent_module, "FINISH_RETRY_S", (0.01,))
    agents = await setup_cells(proxy, engines, model_dir)
    cell = agents[1]
    publish = cell.bus.publish

    async def no_outcomes(event):
        if isinstance(event, (SwitchCompleted, SwitchFailed)):
            raise ConnectionError("nats went away")
        return await publish(event)

    cell.bus.publish = no_outcomes
    try:
        assert (await cell.switch("training")).ok
    finally:
        cell.bus.publish = publish
    assert [type(e).__name__ for e in cell.unsent] == ["SwitchCompleted"]
    stop = asyncio.Event()
    task = asyncio.create_task(cell.keep_registered(stop, every_s=0.05))
    for _ in range(100):
        await asyncio.sleep(0.05)
        if not cell.unsent:
            break
    stop.set()
    await task
    done = [e for e in await cell_events(proxy.bus) if isinstance(e, SwitchCompleted)]
    assert not cell.unsent and done[-1].role == "training"
    assert (await cell.switch("inference")).ok


async def test_a_restarted_agent_resumes_an_engine_left_released(proxy, engines, model_dir) -> None:
    agents = await setup_cells(proxy, engines, model_dir)
    assert (await agents[1].switch("training")).ok
    assert await agents[1].engine.released()
    again = CellAgent(name="e1", run_id="ptest", bus=proxy.bus, proxy=ProxyControl(proxy.url, ADMIN),
                      engine=agents[1].engine, seat=WeightsSeat(model_dir), engine_url=engines[1].url)
    await again.register()  # as the agent process does when it starts again
    assert await again.engine.released() == []
    await talk(await proxy.rollout("cell-restart"), [[{"role": "user", "content": "hi"}]])


async def test_a_phase_announcement_whose_ack_was_lost_is_sent_again(proxy, engines, model_dir,
                                                                     monkeypatch) -> None:
    """The migrating announcement is stored but its ack is lost: the agent announces it
    again (the same event: JetStream keeps one copy) and the switch goes on, as the log says."""
    import services.cell.agent as agent_module

    monkeypatch.setattr(agent_module, "ANNOUNCE_RETRY_S", (0.01,), raising=False)
    agents = await setup_cells(proxy, engines, model_dir, seat_for_e1=NoSeat())  # no model to load
    cell = agents[1]
    publish = cell.bus.publish
    lost: list[str] = []

    async def lossy(event):
        seq = await publish(event)
        if isinstance(event, SwitchPhaseEntered) and event.phase == "migrating" and not lost:
            lost.append(event.event_id)
            raise TimeoutError("nats: timeout waiting for the publish ack")
        return seq

    cell.bus.publish = lossy
    try:
        rec = await cell.switch("training", causation_id="lost-ack")
    finally:
        cell.bus.publish = publish
    assert lost and rec.ok and cell.role == "training"
    mine = [e for e in await cell_events(proxy.bus) if getattr(e, "causation_id", None) == "lost-ack"]
    assert [getattr(e, "phase", type(e).__name__) for e in mine] == ["draining", "migrating", "releasing", "joining",
                                                                     "SwitchCompleted"]
    assert (await cell.switch("inference")).ok


async def test_a_command_sent_again_is_answered_with_its_outcome(proxy, engines, model_dir) -> None:
    """A scheduler that restarted or heard nothing for too long sends the command again,
    with the same causation id: nothing is done, refused or logged twice."""
    agents = await setup_cells(proxy, engines, model_dir, seat_for_e1=NoSeat())  # no model to load
    first = await agents[1].switch("training", causation_id="req-again")
    logged = len(await cell_events(proxy.bus))
    again = await agents[1].switch("training", causation_id="req-again")
    assert first.ok and again is first and agents[1].role == "training"
    assert len(await cell_events(proxy.bus)) == logged
    refused = await agents[1].switch("training", causation_id="req-other")  # another request is refused
    assert refused.failed_phase == "refused"
    assert (await agents[1].switch("inference")).ok


async def test_a_restarted_agent_resumes_an_engine_that_does_not_say_it_is_released(proxy, engines, model_dir) -> None:
    """SGLang lists no released memory in server_info: the cells stream says the cell trained."""
    from ._fakes import SaysNothingReleased

    agents = await setup_cells(proxy, engines, model_dir, seat_for_e1=NoSeat())  # no model to load
    assert (await agents[1].switch("training")).ok
    again = CellAgent(name="e1", run_id="ptest", bus=proxy.bus, proxy=ProxyControl(proxy.url, ADMIN),
                      engine=SaysNothingReleased(agents[1].engine), seat=WeightsSeat(model_dir),
                      engine_url=engines[1].url)
    await again.register()
    assert await agents[1].engine.released() == []
    await talk(await proxy.rollout("cell-restart-sglang"), [[{"role": "user", "content": "hi"}]])


async def test_a_restarted_core_agent_asks_its_trainer_to_leave(proxy, engines, model_dir) -> None:
    """With the core's trainer following c0's role, c0 trains, then its agent restarts and
    registers in inference: the trainer must stop claiming, or the cell is in two roles."""
    from services.cell.adapters import TrainerSeat
    from services.trainer.gate import GatedWorker

    from ._fakes import IdleWorker

    gate = GatedWorker(IdleWorker(), "e0")
    sub = await gate.serve(proxy.bus.nc, "ptest")
    try:
        agents = await setup_cells(proxy, engines, model_dir)
        agents[0].seat = TrainerSeat(proxy.bus, "ptest", "e0")
        assert (await agents[0].switch("training")).ok and gate.claiming
        again = CellAgent(name="e0", run_id="ptest", bus=proxy.bus, proxy=ProxyControl(proxy.url, ADMIN),
                          engine=agents[0].engine, seat=TrainerSeat(proxy.bus, "ptest", "e0"),
                          engine_url=engines[0].url, is_core=True)
        await again.register()
        assert not gate.claiming and again.role == "inference"
        assert await again.engine.released() == []
    finally:
        await sub.unsubscribe()
        await gate.leave()


async def test_switch_command_over_nats(proxy, engines, model_dir) -> None:
    agents = await setup_cells(proxy, engines, model_dir)
    sub = await agents[1].serve_commands(proxy.bus.nc)
    answer = await request_switch(proxy.bus.nc, "ptest", "e1", "training", timeout_s=60)
    assert answer["ok"] and answer["role"] == "training"
    bad = await request_switch(proxy.bus.nc, "ptest", "e1", "training", timeout_s=60)
    assert not bad["ok"] and "no switch" in bad["reason"]
    answer = await request_switch(proxy.bus.nc, "ptest", "e1", "inference", timeout_s=60)
    assert answer["ok"] and answer["role"] == "inference"
    await sub.unsubscribe()


async def test_a_restarted_proxy_gets_the_cell_back(proxy, engines, model_dir) -> None:
    import asyncio

    agents = await setup_cells(proxy, engines, model_dir)
    proxy.service.router.remove_cell("e1")  # as after a proxy restart
    stop = asyncio.Event()
    task = asyncio.create_task(agents[1].keep_registered(stop, every_s=0.05))
    for _ in range(100):
        await asyncio.sleep(0.05)
        if "e1" in proxy.service.router.cells:
            break
    stop.set()
    await task
    assert "e1" in proxy.service.router.cells


async def test_a_cell_back_from_training_serves_the_newest_weights(proxy, engines, model_dir) -> None:
    from safetensors.torch import load_file, save

    from libs.common.events import WeightsPublished
    from services.cell.adapters import LatestWeights

    agents = await setup_cells(proxy, engines, model_dir)
    agents[1].latest_weights = LatestWeights(proxy.bus, proxy.blobs, "ptest")
    assert (await agents[1].switch("training")).ok
    weights = load_file(str(model_dir / "model.safetensors"))  # the trainer published v7 meanwhile
    digest = await proxy.blobs.put(save(weights))
    await proxy.bus.publish(WeightsPublished(run_id="ptest", weight_version=7, checkpoint_digest=digest))
    assert (await agents[1].switch("inference")).ok
    assert await agents[1].engine.weight_version() == 7


def test_weights_seat_prepare_imports_the_architecture_without_loading_weights(model_dir):
    """A first switch to training must not pay transformers' lazy import of the model's
    module (~1.3 s for Qwen2): the seat resolves the class at agent start."""
    import subprocess
    import sys

    code = ("import asyncio, sys; from pathlib import Path; from services.cell.adapters import WeightsSeat; "
            f"s = WeightsSeat(Path({str(model_dir)!r})); asyncio.run(s.prepare()); "
            "print('transformers.models.qwen2.modeling_qwen2' in sys.modules, s.model is None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split()[-2:] == ["True", "True"]


async def test_a_cell_in_training_hosts_a_satellite_that_claims_micro_steps(proxy, engines, model_dir) -> None:
    """The default seat of a non-core cell: switched to training it pulls the core's newest
    weights, claims the step's micro-steps and sends gradients the core applies; switched
    back it hands the seat back and serves again, with every session going on."""
    import asyncio

    from libs.common.events import MicroStepClaimed, MicroStepDone, MicroStepQueued, StepApplied
    from services.cell.main import training_seat
    from services.trainer.backends.torch_hf import TorchBackend
    from services.trainer.core import CoreSettings, CoreTrainer
    from services.trainer.seat import SatelliteSeat
    from services.trainer.step import TrainConfig
    from services.trainer.transfer import BlobTransfer
    from services.trajectory.codec import encode_packed
    from tests.trainer.samples import two_branch_tree, workload_samples

    env = {"GYRE_MODEL": str(model_dir), "GYRE_TRAINER_LR": "1e-3"}
    seat = training_seat("satellite", name="e1", run_id="ptest", bus=proxy.bus, blobs=proxy.blobs, environ=env)
    assert isinstance(seat, SatelliteSeat) and seat.settings.train.lr == 1e-3
    core = CoreTrainer(CoreSettings("ptest", "e0", TrainConfig(lr=1e-3)), TorchBackend.from_pretrained(model_dir),
                       bus=proxy.bus, blobs=proxy.blobs, gradients=BlobTransfer(proxy.blobs))
    stop = asyncio.Event()
    core_task = asyncio.create_task(core.run(stop))  # publishes v0; no worker of its own here
    try:
        from services.trainer.worker import BusWeightSource

        source = BusWeightSource(proxy.bus, proxy.blobs, "ptest")
        for _ in range(600):
            if await source.current_version() >= 0:
                break
            await asyncio.sleep(0.1)
        agents = await setup_cells(proxy, engines, model_dir, seat_for_e1=seat)  # register: prepare, prefetch
        for _ in range(300):
            if seat.prefetched_version == 0:
                break
            await asyncio.sleep(0.1)
        base = await proxy.rollout("cell-sat")
        histories = [[{"role": "user", "content": f"task {i}"}] for i in range(4)]
        await talk(base, histories)
        rec = await agents[1].switch("training")
        assert rec.ok and seat.joined and seat.last_join["version"] == 0.0
        assert seat.last_join["prefetched"] == 1.0  # loaded from the bytes prefetched while it served
        vocab = core.backend.vocab_size
        samples = [(workload_samples(vocab)[0], 1.0), (two_branch_tree("rx"), -1.0)]
        digests = [await proxy.blobs.put(encode_packed(p)) for p, _ in samples]
        await proxy.bus.publish_many([
            MicroStepQueued(run_id="ptest", step=0, micro_step=f"s0-m{k}", group_id="g0",
                            sample_digests=[digests[k]], advantages=[samples[k][1]], n_tokens=1,
                            micro_steps_in_step=2) for k in range(2)])
        await talk(base, histories)  # sessions go on, on e0, while e1 trains

        async def applied():
            while core.state.weight_version < 1:
                await asyncio.sleep(0.05)
        await asyncio.wait_for(applied(), 120)
        rec = await agents[1].switch("inference")
        assert rec.ok and not seat.joined and seat.backend is None  # the model's memory is given back
        assert sorted(seat.stats()["micro_steps_done"]) == ["s0-m0", "s0-m1"]
        await talk(base, histories)
    finally:
        await seat.close()
        stop.set()
        await core_task
    training = [d.event async for d in proxy.bus.read(Context.TRAINING)]
    assert {e.cell for e in training if isinstance(e, (MicroStepClaimed, MicroStepDone))} == {"e1"}
    steps = [e for e in training if isinstance(e, StepApplied)]
    assert [(e.step, sorted(e.micro_steps_used)) for e in steps] == [(0, ["s0-m0", "s0-m1"])]
    assert all(e.gradient["transfer"]["kind"] == "blob" for e in training if isinstance(e, MicroStepDone))


def test_the_seat_follows_gyre_cell_seat(model_dir) -> None:
    from services.cell.main import training_seat

    env = {"GYRE_MODEL": str(model_dir)}
    assert isinstance(training_seat("weights", name="c0", run_id="r", bus=None, blobs=None, environ=env), WeightsSeat)
    assert training_seat("satellite", name="c1", run_id="r", bus=None, blobs=None, environ=env).prefetch
    assert not training_seat("satellite", name="c1", run_id="r", bus=None, blobs=None,
                             environ={**env, "GYRE_CELL_PREFETCH_WEIGHTS": "0"}).prefetch
    with pytest.raises(ValueError, match="GYRE_CELL_SEAT='gpu'"):
        training_seat("gpu", name="c0", run_id="r", bus=None, blobs=None, environ=env)
