"""Publication to a real embedded inference engine (the tiny Qwen model, in-process
over ASGI): after a training update, the engine serves the trainer's weights, tagged
with the new version, by tensor and by disk."""

from __future__ import annotations

import httpx
import pytest
import torch

from services.trainer.backends.torch_hf import TorchBackend
from services.trainer.publish import EnginePublisher


@pytest.fixture(scope="module")
def engine():
    from services.engine.main import build
    from services.engine.model_store import default_cache_dir, ensure_tiny_qwen
    from services.engine.settings import EngineSettings

    folder = ensure_tiny_qwen(default_cache_dir())
    service = build(EngineSettings(model="tiny-qwen", admin_token="secret"))
    yield service, folder
    service.close()


@pytest.mark.parametrize("mode", ["tensor", "disk"])
async def test_engine_serves_the_published_weights(engine, mode, tmp_path):
    from services.engine.client import EngineClient

    service, folder = engine
    trainer = TorchBackend.from_pretrained(folder)
    with torch.no_grad():
        trainer.model.model.norm.weight.add_(0.5 if mode == "tensor" else 0.25)  # stands for an update
    client = EngineClient("http://engine", admin_token="secret", transport=httpx.ASGITransport(app=service.app))
    publish = EnginePublisher({"cell-a": client}, mode=mode, folder=tmp_path, hf_config=folder / "config.json")
    version = 3 if mode == "tensor" else 4
    assert await publish(version, trainer.hf_state_dict()) == ["cell-a"]
    served = service.engine.call(lambda: service.weights.params["model.norm.weight"].detach().clone()).result(60)
    assert torch.equal(served, trainer.model.model.norm.weight.detach())
    assert str((await client.model_info()).get("weight_version")) == str(version)
    await client.aclose()



async def test_a_released_cell_is_skipped_without_a_warning(engine, caplog):
    """A cell lent to training has released its weights: publication skips it quietly (it
    loads the newest version when it resumes), and sends again once it has resumed."""
    import logging

    from services.engine.client import EngineClient

    service, folder = engine
    trainer = TorchBackend.from_pretrained(folder)
    client = EngineClient("http://engine", admin_token="secret", transport=httpx.ASGITransport(app=service.app))
    publish = EnginePublisher({"cell-a": client})
    await client.release_memory(None)
    try:
        with caplog.at_level(logging.INFO, logger="services.trainer.publish"):
            assert await publish(7, trainer.hf_state_dict()) == []
        assert [r.levelno for r in caplog.records] == [logging.INFO]
        assert "released" in caplog.records[0].getMessage()
    finally:
        await client.resume_memory(None)
    assert await publish(8, trainer.hf_state_dict()) == ["cell-a"]
    await client.aclose()

def test_distributed_publication_over_gloo(engine, tmp_path):
    """The core (a second process: one gloo rank each) broadcasts; the engine receives."""
    import os
    import socket
    import subprocess
    import sys
    import threading
    import time
    from pathlib import Path

    import uvicorn
    from safetensors.torch import save_file

    service, folder = engine
    trainer = TorchBackend.from_pretrained(folder)
    with torch.no_grad():
        trainer.model.model.norm.weight.add_(0.125)
    state = {k: v.contiguous() for k, v in trainer.hf_state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "w.safetensors"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(service.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        root = Path(__file__).resolve().parents[2]
        proc = subprocess.run([sys.executable, "-m", "tests.trainer.dist_publisher", f"http://127.0.0.1:{port}",
                               "secret", str(tmp_path / "w.safetensors"), "5"], cwd=root, capture_output=True,
                              text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
    finally:
        server.should_exit = True
        thread.join(10)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "published to ['cell-a']" in proc.stdout
    served = service.engine.call(lambda: service.weights.params["model.norm.weight"].detach().clone()).result(60)
    assert torch.equal(served, state["model.norm.weight"])
    assert str(service.engine.weight_version) == "5"


async def test_an_engine_that_refuses_updates_while_generating_is_paused_in_place(tmp_path):
    """``weight_update_mode=reject``: the first try is refused (a request is running); the
    publisher pauses generation in place, updates, continues. The running request finishes
    with its tokens tagged by the version that produced them."""
    import asyncio

    from services.engine.client import EngineClient
    from services.engine.main import build
    from services.engine.model_store import default_cache_dir, ensure_tiny_qwen
    from services.engine.settings import EngineSettings

    folder = ensure_tiny_qwen(default_cache_dir())
    service = build(EngineSettings(model="tiny-qwen", admin_token="secret", weight_update_mode="reject"))
    try:
        client = EngineClient("http://engine", admin_token="secret", transport=httpx.ASGITransport(app=service.app))
        trainer = TorchBackend.from_pretrained(folder)
        with torch.no_grad():
            trainer.model.model.norm.weight.add_(0.5)
        running = asyncio.create_task(client.generate(list(range(7100, 7140)), {
            "max_new_tokens": 600, "temperature": 0, "ignore_eos": True}))
        for _ in range(2000):
            if service.engine.scheduler.running and service.engine.steps > 0:
                break
            await asyncio.sleep(0.01)
        publish = EnginePublisher({"cell-a": client})
        assert await publish(5, trainer.hf_state_dict()) == ["cell-a"]
        out = await running
        versions = [run["version"] for run in out["meta_info"]["weight_versions"]]
        assert versions == ["0", "5"] and len(out["output_ids"]) == 600
        assert str((await client.model_info()).get("weight_version")) == "5"
        await client.aclose()
    finally:
        service.close()
