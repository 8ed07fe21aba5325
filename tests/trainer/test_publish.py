"""Publication to a real embedded inference engine (the tiny Qwen model, in-process
over ASGI): after a training update, the engine serves the trainer's weights, tagged
with the new version, by tensor and by disk."""

from __future__ import annotations

import asyncio

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
    """The core (a second process: one gloo rank each) broadcasts; the engine receives. A
    second configured cell that is down is left out of the group instead of blocking it."""
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
    with socket.socket() as s:  # a port nobody listens on: the down cell
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(service.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        root = Path(__file__).resolve().parents[2]
        proc = subprocess.run([sys.executable, "-m", "tests.trainer.dist_publisher", f"http://127.0.0.1:{port}",
                               "secret", str(tmp_path / "w.safetensors"), "5", f"http://127.0.0.1:{dead}"], cwd=root, capture_output=True,
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


class _DownCell:
    """A cell that answers /health but cannot join (answers 503 at once)."""

    def __init__(self):
        self.joins, self.left = 0, 0

    async def health(self):
        return True

    async def init_weights_update_group(self, *a, **k):
        from services.engine.client import CellError

        self.joins += 1
        raise CellError(503, "cell is down")

    async def destroy_weights_update_group(self, name):
        self.left += 1
        return {"success": True}


class _WaitingCell(_DownCell):
    """A cell that reaches the rendezvous store and waits there for the others (as a cell's
    join does while one rank is missing); it fails only when the store goes away. After its
    first join it is down (503 at once)."""

    async def init_weights_update_group(self, address, port, rank, world, name, backend="gloo"):
        import datetime

        import torch.distributed as dist

        if self.joins:
            return await super().init_weights_update_group()
        self.joins += 1

        def wait() -> None:
            store = dist.TCPStore(address, port, world, is_master=False, timeout=datetime.timedelta(seconds=60))
            store.wait(["never-set"])

        await asyncio.to_thread(wait)
        return {"success": True}


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


async def test_a_cell_that_cannot_join_is_set_aside_and_the_group_retried_without_it(caplog, monkeypatch):
    """A cell that answers /health but cannot join must not stop the core: nothing raises,
    the store's port is freed and every waiting rank released within moments (not at the
    60 s timeout), the failing cell is set aside and the group tried again without it in
    the same publication; set-aside cells are asked again after rejoin_after_s."""
    import logging
    import time

    import torch.distributed as dist

    stores = []
    real = dist.TCPStore

    def recording(*a, **k):
        store = real(*a, **k)
        if k.get("is_master"):
            stores.append(store.port)
        return store

    monkeypatch.setattr(dist, "TCPStore", recording)
    down, waiting = _DownCell(), _WaitingCell()
    publish = EnginePublisher({"cell-a": waiting, "cell-b": down}, mode="distributed", join_timeout_s=60.0,
                              rejoin_after_s=600.0)
    weights = {"w": torch.ones(4)}
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="services.trainer.publish"):
        assert await publish(3, weights) == []
    assert time.monotonic() - started < 15
    assert publish._group is None and publish._store is None
    assert len(stores) == 2 and not any(_listening(port) for port in stores)
    messages = [r.getMessage() for r in caplog.records]
    first = next(m for m in messages if "could not open" in m and "['cell-a', 'cell-b']" in m)
    assert "cell-b: CellError('503" in first.split("(first failure first: ")[1].split(";")[0]
    assert any("cell-b is left out" in m for m in messages) and any("cell-a is left out" in m for m in messages)
    assert "v3 published to no cell" in messages[-1]
    # every cell is told to leave after each failed opening, the failed one too: one holding
    # a group of ours from before (a restarted core, a join that timed out here but not
    # there) refuses every join until then
    assert down.joins == 1 and waiting.joins == 2 and down.left == 2 and waiting.left == 2
    assert await publish(4, weights) == []  # both set aside: nobody is asked to join
    assert down.joins == 1 and waiting.joins == 2 and len(stores) == 2
    publish._benched = dict.fromkeys(publish._benched, time.monotonic() - 1)  # as if rejoin_after_s passed
    assert await publish(5, weights) == []  # both asked again, then the one that did not fail first
    assert down.joins >= 2 and waiting.joins >= 3 and down.joins + waiting.joins == 6
    await publish.close()


class _Member(_DownCell):
    """A cell whose /health can be switched off and that applies every broadcast."""

    def __init__(self):
        super().__init__()
        self.up, self.applied = True, []

    async def health(self):
        if not self.up:
            raise OSError("connection refused")
        return True

    async def update_weights_from_distributed(self, names, dtypes, shapes, group, *, weight_version=None):
        self.applied.append(weight_version)
        return {"success": True}


async def test_the_group_holds_the_cells_that_answer_and_reforms_when_one_returns(monkeypatch):
    from services.engine import weights as engine_weights

    monkeypatch.setattr(engine_weights, "broadcast_rank0", lambda group, tensor: None)
    monkeypatch.setattr(engine_weights, "leave_weight_group", lambda group: None)
    a, b = _Member(), _Member()
    b.up = False
    publish = EnginePublisher({"cell-a": a, "cell-b": b}, mode="distributed")
    opened = []

    async def open_group(members):
        opened.append(members)
        publish._group, publish._store, publish._members = object(), "store", members
        return {}

    monkeypatch.setattr(publish, "_open_group", open_group)
    weights = {"w": torch.ones(2)}
    assert await publish(1, weights) == ["cell-a"]  # the down cell is left out, the other gets it
    assert await publish(2, weights) == ["cell-a"]
    assert opened == [("cell-a",)]  # the same members: the open group is reused
    b.up = True
    assert await publish(3, weights) == ["cell-a", "cell-b"]  # back: a new group with both
    assert opened == [("cell-a",), ("cell-a", "cell-b")] and a.left == 1 and b.left == 1
    assert a.applied == ["1", "2", "3"] and b.applied == ["3"]
    a.up = False
    assert await publish(4, weights) == ["cell-b"]
    assert opened[-1] == ("cell-b",)
    await publish.close()


async def test_a_failed_broadcast_drops_the_group_for_the_next_publication(monkeypatch):
    from services.engine import weights as engine_weights

    class Joined(_DownCell):
        async def update_weights_from_distributed(self, *a, **k):
            return {"success": True}

    def broken(group, tensor):
        raise RuntimeError("gloo: connection closed by peer")

    left = []
    monkeypatch.setattr(engine_weights, "broadcast_rank0", broken)
    monkeypatch.setattr(engine_weights, "leave_weight_group", left.append)
    cell = Joined()
    publish = EnginePublisher({"cell-a": cell}, mode="distributed", rejoin_after_s=0.0)
    opened = []

    async def open_group(members):
        opened.append(members)
        publish._group, publish._store, publish._members = "group", "store", members
        return {}

    monkeypatch.setattr(publish, "_open_group", open_group)
    assert await publish(1, {"w": torch.ones(2)}) == []
    assert publish._group is None and left == ["group"] and cell.left == 1
    assert await publish(2, {"w": torch.ones(2)}) == []
    assert len(opened) == 2  # a fresh group each time, never the broken one
