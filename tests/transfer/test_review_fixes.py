"""Regressions from the transfer review: UCX requests that outlive their deadline or race to
connect (real ucxx, in the scenarios' private network namespace), KV releases that reach
regions that are not offers, offers with a bad block size, and HTTP refusals gone silent."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from fastapi import Depends, FastAPI
from safetensors.torch import save

from libs.common.transfer import kv as kv_mod
from libs.common.transfer.kv import fetch_kv, migrate_session, offer_kv
from libs.common.transfer.port import PeerDescriptor, TransferFailed
from services.engine.kv_port import KVPort, add_routes
from tests.engine._fakes import LoopbackAgent
from tests.transfer._fakes import ScriptedCell
from tests.transfer.conftest import scenario

SCENARIOS = [("ucx_stale", "ucx"), ("ucx_connect", "ucx")]


# -- 1. a read abandoned by its deadline never leaves its reply for the next one ---------------


def test_ucx_read_queued_behind_a_slow_one_times_out_on_its_own_deadline():
    r = scenario("ucx_stale", "ucx")
    assert r["warm_ok"]
    assert r["a"]["error"] is None and r["a_correct"]
    assert r["b"]["timeout"], r["b"]
    assert r["b"]["s"] < 3, r["b"]  # its own 1.5 s, not ucx's outer grace of 5 s more


def test_ucx_read_after_an_abandoned_one_gets_its_own_bytes():
    r = scenario("ucx_stale", "ucx")
    assert r["after_queued"]["error"] is None and r["after_queued_correct"], r["after_queued"]


def test_ucx_deadline_mid_exchange_drops_the_endpoint():
    r = scenario("ucx_stale", "ucx")
    assert r["mid_exchange"]["timeout"] and r["mid_exchange"]["s"] < 2, r["mid_exchange"]
    assert r["mid_exchange_dropped"]
    assert r["after_mid_exchange"]["error"] is None and r["after_mid_exchange_correct"]


def test_ucx_reply_to_another_request_is_never_taken_as_this_ones():
    r = scenario("ucx_stale", "ucx")
    assert r["after_stray"]["error"] is None and r["after_stray_correct"], r["after_stray"]


# -- 2. concurrent first reads share one endpoint; a drop touches only its own ---------------------


def test_ucx_concurrent_first_reads_open_one_endpoint():
    r = scenario("ucx_connect", "ucx")["fast"]
    assert all(v["error"] is None for v in r["reads"].values()), r["reads"]
    assert all(r["correct"].values())
    assert (r["created"], r["cached"], r["leaked"]) == (1, 1, 0)


def test_ucx_a_read_giving_up_does_not_break_another_reads_endpoint():
    r = scenario("ucx_connect", "ucx")["slow"]
    assert r["reads"]["a"]["error"] is None and r["correct"]["a"], r["reads"]
    assert r["reads"]["b"]["timeout"], r["reads"]
    assert r["leaked"] == 0 and r["cached"] == 1


def test_ucx_drop_of_a_stale_entry_keeps_the_cached_one():
    r = scenario("ucx_connect", "ucx")
    assert r["drop_error"] is None
    assert r["drop_stale_entry_keeps_cached"] and r["drop_stale_entry_aborts_it"]


# -- 3. a release reaches only this port's offers ---------------------------------------------------


def _port_with_weights():
    agent = LoopbackAgent()
    snapshot = torch.arange(8.0)
    agent.register("weights-v1-1", snapshot)
    port = KVPort(engine=None, agent=agent)
    return agent, port


def test_release_of_a_region_that_is_not_an_offer_drops_nothing():
    agent, port = _port_with_weights()
    try:
        assert port.release("weights-v1-1") is False
        assert "weights-v1-1" in agent.names()
    finally:
        agent.close()


def test_release_route_answers_false_with_a_reason_for_a_foreign_name():
    agent, port = _port_with_weights()
    app = FastAPI()
    add_routes(app, port, Depends(lambda: None))

    async def call():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as c:
            return await c.post("/gyre/kv/port/release", json={"lease": "weights-v1-1"})

    try:
        answer = asyncio.run(call())
        assert answer.status_code == 200
        body = answer.json()
        assert body["success"] is False and "no open KV offer 'weights-v1-1'" in body["message"]
        assert "weights-v1-1" in agent.names()
    finally:
        agent.close()


# -- 4. an offer's block size is checked before anything is read -----------------------------------


def _offer(block_bytes):
    src, dst = LoopbackAgent(), LoopbackAgent()
    kv = torch.full((2, 2, 2, 64, 16), 7.0)
    offer = offer_kv(src, kv, list(range(64)), weight_version="v1").to_json()
    offer["meta"]["block_bytes"] = block_bytes
    return src, dst, PeerDescriptor.from_json(offer)


@pytest.mark.parametrize("block_bytes", [-1, 0, 1.5, "4096", True])
def test_fetch_refuses_a_block_size_that_is_not_a_positive_integer(block_bytes):
    src, dst, offer = _offer(block_bytes)
    try:
        with pytest.raises(TransferFailed, match="block_bytes must be a positive integer"):
            fetch_kv(dst, offer)
        assert dst.names() == []
    finally:
        src.close(), dst.close()


def test_fetch_refuses_a_plan_short_of_the_region(monkeypatch):
    src, dst, offer = _offer(4096)
    real = kv_mod.kv_blocks
    monkeypatch.setattr(kv_mod, "kv_blocks", lambda *a, **k: real(*a, **k)[:-1])
    try:
        with pytest.raises(TransferFailed, match=r"cover \d+ of \d+ bytes"):
            fetch_kv(dst, offer)
        assert dst.names() == []
    finally:
        src.close(), dst.close()


def test_fetch_with_a_valid_block_size_still_moves_every_byte():
    src, dst, offer = _offer(1000)  # not a divisor of a plane: the last block of each is short
    try:
        ids, got = fetch_kv(dst, offer)
        assert ids == list(range(64)) and torch.equal(got, torch.full((2, 2, 2, 64, 16), 7.0))
    finally:
        src.close(), dst.close()


# -- 5. a target's HTTP refusal is reported ---------------------------------------------------------


def test_http_refusal_message_is_in_the_errors():
    blob = save({"kv": torch.zeros(1)}, metadata={"input_ids": "[1, 2]", "weight_version": "0"})
    a = ScriptedCell("A", offer=RuntimeError("no transfer backend works"), export=blob)
    b = ScriptedCell("B", import_={"success": False, "message": "KV prefix of 2 tokens not kept"})
    r = asyncio.run(migrate_session(a, b, [1, 2, 3], session_id="s"))
    assert r.kv == "reprefilled" and r.path is None
    assert r.errors[-1] == "http import refused: KV prefix of 2 tokens not kept"
