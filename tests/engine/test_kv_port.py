"""KVPort.offer labels the KV it offers with the weight version it was exported under."""

from __future__ import annotations

from types import SimpleNamespace

from services.engine import kv_port

PROMPT = list(range(8100, 8130))


class _UpdateRightAfterEachCommand:
    """The engine as KVPort sees it, with a weight update landing just after every command."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.prefix_cache = engine.prefix_cache
        self.weight_version = "old"

    async def acall(self, fn):
        result = await self._engine.acall(fn)
        self.weight_version = "new"
        return result


async def test_offer_labels_kv_with_the_version_read_with_the_export(http, shared_service, monkeypatch):
    out = await http.post("/generate", json={"input_ids": PROMPT,
                                             "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert out.status_code == 200
    offered = {}

    def fake_offer_kv(agent, kv, token_ids, *, weight_version, checksums):
        offered.update(tokens=len(token_ids), version=weight_version, kv_tokens=kv.shape[3])
        return SimpleNamespace(meta={"lease": "l1"}, to_json=lambda: {"meta": {"lease": "l1"}})

    monkeypatch.setattr(kv_port, "offer_kv", fake_offer_kv)
    engine = _UpdateRightAfterEachCommand(shared_service.engine)
    port = kv_port.KVPort(engine, agent=SimpleNamespace(backend="fake", endpoint="fake"))
    await port.offer(PROMPT)
    assert offered["tokens"] == offered["kv_tokens"] > 0
    assert offered["version"] == "old"


def test_a_cell_whose_kv_memory_is_released_takes_no_kv_by_the_port():
    """As the HTTP import: a cell lent to training (its KV cache released) refuses a
    session's KV before anything is transferred."""
    import pytest

    from services.engine.engine import MemoryReleased

    engine = SimpleNamespace(released={"kv_cache"}, weight_version="0")
    port = kv_port.KVPort(engine, agent=SimpleNamespace(backend="fake", endpoint="fake"))
    with pytest.raises(MemoryReleased, match="released"):
        port._check(SimpleNamespace(backend="fake", meta={"weight_version": "0", "token_ids": [1, 2]}))
