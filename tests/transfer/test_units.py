"""The port's pure parts: descriptors, block plans, checksums, and the migration decision
(port -> HTTP -> re-prefill) against scripted cells."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from libs.common.bus.memory import InMemoryBus
from libs.common.events import Context
from libs.common.transfer.kv import kv_blocks, migrate_session
from libs.common.transfer.port import (
    Block,
    ChecksumMismatch,
    PeerDescriptor,
    RegionInfo,
    TransferFailed,
    as_bytes,
    check_blocks,
    checksums,
    coalesce,
    split_blocks,
    verify_blocks,
)
from libs.common.transfer.weights import TensorSpec, WeightsDescriptor
from tests.transfer._fakes import ScriptedCell


def test_descriptor_survives_json():
    peer = PeerDescriptor("mooncake", "127.0.0.1:5", (RegionInfo("kv", 10, 1234, 4, (1, 2, 3)),), {"lease": "x"})
    assert PeerDescriptor.from_json(json.loads(json.dumps(peer.to_json()))) == peer
    weights = WeightsDescriptor(peer, "kv", (TensorSpec("w", "float32", (2, 3), 0, 24),), "v1")
    assert WeightsDescriptor.from_json(json.loads(json.dumps(weights.to_json()))) == weights


def test_checksums_name_the_bad_block():
    data = np.arange(3000, dtype=np.uint8)
    sums = checksums(data, 1024)
    verify_blocks(data, sums, 1024)
    data[2050] ^= 1
    with pytest.raises(ChecksumMismatch, match="block 2"):
        verify_blocks(data, sums, 1024)


def test_blocks_are_checked_before_anything_moves():
    peer = PeerDescriptor("ucx", "h:1", (RegionInfo("kv", 100),))
    assert check_blocks(split_blocks("s", "kv", 100, 30), {"s": 100}, peer) == 100
    for bad, why in [(Block("s", 0, "kv", 90, 20), "overruns remote"), (Block("s", 90, "kv", 0, 20), "overruns local"),
                     (Block("x", 0, "kv", 0, 1), "no local region"), (Block("s", 0, "nope", 0, 1), "no region"),
                     (Block("s", 0, "kv", 0, 0), "bad block")]:
        with pytest.raises(TransferFailed, match=why):
            check_blocks([bad], {"s": 100}, peer)


def test_adjacent_blocks_coalesce_up_to_a_cap():
    blocks = split_blocks("s", "r", 100, 10)
    assert coalesce(blocks, 40) == [Block("s", 0, "r", 0, 40), Block("s", 40, "r", 40, 40), Block("s", 80, "r", 80, 20)]
    gap = [Block("s", 0, "r", 0, 10), Block("s", 10, "r", 20, 10)]
    assert coalesce(gap, 100) == gap


def test_kv_blocks_cover_each_layer_plane_once():
    shape = (2, 2, 2, 100, 32)  # layers, K|V, kv heads, tokens, head dim
    blocks = kv_blocks(shape, 4, "stage", "kv", block_bytes=10_000)
    plane = 2 * 100 * 32 * 4
    covered = sorted((b.local_offset, b.length) for b in blocks)
    assert sum(n for _, n in covered) == 4 * plane
    assert all(b.local_offset // plane == (b.local_offset + b.length - 1) // plane for b in blocks)  # none straddles
    assert all(b.local_offset == b.remote_offset and b.length <= 10_000 for b in blocks)


def test_tensors_register_as_bytes_and_refuse_strided_views():
    t = torch.arange(12, dtype=torch.float32)
    view, address, nbytes = as_bytes(t)
    assert (address, nbytes) == (t.data_ptr(), 48) and view.view(np.float32)[5] == 5.0
    with pytest.raises(ValueError, match="contiguous"):
        as_bytes(t.view(3, 4).t())


def _offer(tokens):
    return PeerDescriptor("mooncake", "h:1", (), {"lease": "kv-1", "token_ids": tokens}).to_json()


async def test_port_first_and_event_published():
    a = ScriptedCell("A", offer=_offer([1, 2, 3]))
    b = ScriptedCell("B", fetch={"success": True, "bytes": 96})
    bus = InMemoryBus()
    result = await migrate_session(a, b, [1, 2, 3, 4], session_id="s", run_id="r1", bus=bus, reason="drain")
    assert (result.kv, result.path, result.migrated_tokens) == ("migrated", "mooncake", 3)
    assert a.calls == ["offer", "release"] and b.calls == ["fetch"]
    [delivery] = [d async for d in bus.read(Context.CALLS)]
    event = delivery.event
    assert (type(event).__name__, event.kv, event.from_cell, event.to_cell, event.migrated_tokens) == (
        "SessionRerouted", "migrated", "A", "B", 3)


async def test_failed_port_falls_back_to_http_then_to_reprefill():
    from safetensors.torch import save

    blob = save({"kv": torch.zeros(1)}, metadata={"input_ids": "[1, 2]", "weight_version": "0"})
    a = ScriptedCell("A", offer=_offer([1, 2]), export=blob)
    b = ScriptedCell("B", fetch=RuntimeError("peer vanished"), import_={"success": True})
    result = await migrate_session(a, b, [1, 2, 3], session_id="s")
    assert (result.kv, result.path, result.migrated_tokens) == ("migrated", "http", 2)
    assert "release" in a.calls and "peer vanished" in result.errors[0]

    b = ScriptedCell("B", fetch=RuntimeError("peer vanished"), import_=RuntimeError("stale weights"))
    result = await migrate_session(a, b, [1, 2, 3], session_id="s")  # never raises
    assert (result.kv, result.path, result.migrated_tokens) == ("reprefilled", None, 0)
    assert len(result.errors) == 2


async def test_nothing_cached_means_reprefill_without_http():
    a = ScriptedCell("A", offer=_offer([]))
    result = await migrate_session(a, ScriptedCell("B"), [1, 2], session_id="s")
    assert result.kv == "reprefilled" and "export" not in a.calls


def test_port_transfer_close_unregisters_every_snapshot(monkeypatch):
    """A satellite's gradient snapshots (pinned under RDMA) stay registered until close;
    close drops them all, once."""
    import asyncio

    from libs.common.transfer import weights as w

    registered, made = set(), iter(range(100))

    def publish(tensors, *, version=None, agent=None, checksums=False):
        name = f"snap-{next(made)}"
        registered.add(name)
        return WeightsDescriptor.from_json({**_desc_json(), "region": name})

    monkeypatch.setattr(w, "publish_weights", publish)
    monkeypatch.setattr(w, "unpublish_weights", lambda d, agent=None: registered.remove(d.region))
    port = w.PortTransfer(object(), keep=4)

    async def go():
        for i in range(6):
            await port.put({"g": torch.full((4,), float(i))})
        assert registered == {"snap-2", "snap-3", "snap-4", "snap-5"}  # the newest keep
        await port.close()
        assert registered == set()
        await port.close()  # idempotent

    asyncio.run(go())



def _desc_json():
    peer = PeerDescriptor("mooncake", "127.0.0.1:5", (RegionInfo("kv", 16, 1234, 4, None),), {})
    return WeightsDescriptor(peer, "kv", (TensorSpec("g", "float32", (4,), 0, 16),), None).to_json()
