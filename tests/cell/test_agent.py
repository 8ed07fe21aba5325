"""The cell agent switching a real embedded engine cell behind the real proxy, with live
sessions; a failed join rolls back to inference; commands over NATS request/reply."""

from __future__ import annotations

import httpx
import pytest

from libs.common.events import Context, SwitchCompleted, SwitchFailed, SwitchPhaseEntered
from services.cell.adapters import EngineControl, ProxyControl, WeightsSeat
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
    rec = await agents[1].switch("training")
    assert not rec.ok and rec.failed_phase == "joining" and agents[1].role == "inference"
    assert seat.left == 1
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
