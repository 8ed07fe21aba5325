"""A cell whose engine's memory was released serves the newest published weights again,
whatever version the engine reports: SGLang's release frees the weights and, without a CPU
backup, its resume gives back memory, not values, while the engine still reports its old
version. In-memory bus; the engine (``ForgetfulEngine``), the proxy and the seat are faked
(``_fakes.py``), the agent is real."""

from __future__ import annotations

from libs.common.bus.memory import InMemoryBus
from services.cell.agent import CellAgent

from ._fakes import FailingSeat, ForgetfulEngine, NoSeatWork, PublishedWeights, RoutingProxy

RUN = "weights"


def _agent(bus, engine, seat=None) -> CellAgent:
    return CellAgent(name="c1", run_id=RUN, bus=bus, proxy=RoutingProxy(), engine=engine, seat=seat or NoSeatWork(),
                     engine_url="x", latest_weights=PublishedWeights(3))


async def test_back_from_training_with_no_newer_version_the_weights_are_loaded_again() -> None:
    engine = ForgetfulEngine(version=3)  # v3 is also the newest published
    agent = _agent(InMemoryBus(), engine)
    await agent.register()
    assert (await agent.switch("training")).ok and not engine.weights_valid
    assert (await agent.switch("inference")).ok
    assert engine.weights_valid and engine.pushes == [3] and "c1" in agent.proxy.routed


async def test_a_rollback_after_releasing_loads_the_weights_again() -> None:
    engine = ForgetfulEngine(version=3)
    agent = _agent(InMemoryBus(), engine, seat=FailingSeat())
    await agent.register()
    rec = await agent.switch("training")
    assert not rec.ok and rec.failed_phase == "joining" and agent.role == "inference" and agent.broken is None
    assert engine.weights_valid and engine.pushes == [3] and "c1" in agent.proxy.routed


async def test_a_rollback_before_releasing_pushes_nothing() -> None:
    engine = ForgetfulEngine(version=3)
    agent = _agent(InMemoryBus(), engine)

    async def stuck(cell: str) -> dict:
        return {"drained": False, "in_flight": 2}

    await agent.register()
    agent.proxy.evacuate = stuck
    rec = await agent.switch("training")
    assert not rec.ok and rec.failed_phase == "migrating" and engine.pushes == []


async def test_a_restarted_agent_loads_the_weights_into_an_engine_left_released() -> None:
    bus, engine = InMemoryBus(), ForgetfulEngine(version=3)
    agent = _agent(bus, engine)
    await agent.register()
    assert (await agent.switch("training")).ok
    again = _agent(bus, engine)  # the agent process started again; the engine says nothing of its memory
    await again.register()
    assert engine.weights_valid and engine.pushes == [3] and again.role == "inference"


def test_the_sglang_launcher_keeps_a_cpu_copy_of_the_weights_only_when_asked() -> None:
    from services.engine.sglang_server import SGLangConfig, build_command

    assert "--enable-weights-cpu-backup" not in build_command(SGLangConfig(model_path="m"))
    cmd = build_command(SGLangConfig(model_path="m", enable_weights_cpu_backup=True))
    assert "--enable-memory-saver" in cmd and "--enable-weights-cpu-backup" in cmd


async def test_a_push_that_fails_part_way_is_reported_failed_and_leaves_no_window_open() -> None:
    """A real embedded engine refuses the pushed weights (a name it does not have): the
    switch back to inference fails at ``resuming``, the engine's update window is closed,
    and the engine does not report the pushed version as its own."""
    from services.cell.adapters import EngineControl
    from services.engine.model_store import default_cache_dir, ensure_tiny_qwen
    from tests.engine.conftest import asgi_client, make_service

    ensure_tiny_qwen(default_cache_dir())
    service = make_service(admin_token="secret")
    try:
        async with asgi_client(service, admin_token="secret") as client:
            agent = _agent(InMemoryBus(), EngineControl(client))  # publishes v3 = {"w": ...}: unknown here
            await agent.register()
            assert (await agent.switch("training")).ok
            rec = await agent.switch("inference")
            assert not rec.ok and rec.failed_phase == "resuming" and "unknown weight name" in (rec.reason or "")
            assert service.weights.staged is None  # the failed push did not leave the window open
            await client.resume_memory()
            assert (await client.model_info())["weight_version"] != "3"
    finally:
        service.close()
