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
