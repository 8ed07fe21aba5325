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

    def check_weight_label(self, what: str) -> None:
        self._engine.check_weight_label(what)

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


# -- offers' time to live: a lost release must not pin KV for good ----------------------------


async def _cached(http, prompt: list[int]) -> None:
    out = await http.post("/generate", json={"input_ids": prompt,
                                             "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert out.status_code == 200


async def _until(condition, timeout_s: float = 5.0) -> None:
    import asyncio
    import time

    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


async def test_an_offer_never_released_frees_its_kv_after_the_ttl_with_no_other_offer(http, shared_service):
    import gc
    import weakref

    from tests.engine._fakes import LoopbackAgent

    await _cached(http, PROMPT)
    agent = LoopbackAgent()
    port = kv_port.KVPort(shared_service.engine, agent, offer_ttl_s=0.2)
    offer = await port.offer(PROMPT)
    lease = offer["meta"]["lease"]
    assert offer["meta"]["token_ids"] and offer["meta"]["ttl_s"] == 0.2
    pinned = weakref.ref(agent.held(lease))
    assert port.open_leases == [lease] and lease in agent.names()
    await _until(lambda: lease not in agent.names())  # no release, no new offer: only the clock
    assert lease not in agent.names() and port.open_leases == []
    gc.collect()
    assert pinned() is None, "the expired offer's KV is still referenced"
    assert port.release(lease) is False  # a late release finds nothing (and does not fail)
    agent.close()


async def _two_ports(http, shared_service, *, ttl_s: float):
    """Source and target ports on loopback agents, and an offer of PROMPT's cached KV."""
    from tests.engine._fakes import LoopbackAgent

    await _cached(http, PROMPT)
    source, target = LoopbackAgent(), LoopbackAgent()
    src = kv_port.KVPort(shared_service.engine, source, offer_ttl_s=ttl_s)
    dst = kv_port.KVPort(shared_service.engine, target)
    return source, target, src, dst, await src.offer(PROMPT)


async def test_a_fetch_of_an_expired_offer_is_refused_naming_the_lease(http, shared_service):
    import pytest

    source, target, src, dst, offer = await _two_ports(http, shared_service, ttl_s=0.1)
    lease = offer["meta"]["lease"]
    await _until(lambda: lease not in source.names())
    with pytest.raises(kv_port.OfferExpired, match=rf"offer '{lease}' expired .*kept 0.1 s.*nothing imported"):
        await dst.fetch(offer)
    assert target.names() == []  # no staging region was even registered
    source.close(), target.close()


async def test_a_live_offer_is_fetched_and_a_release_cancels_its_expiry(http, shared_service):
    import asyncio

    source, target, src, dst, offer = await _two_ports(http, shared_service, ttl_s=0.3)
    lease = offer["meta"]["lease"]
    answer = await dst.fetch(offer)
    assert answer["success"] and answer["tokens"] == len(offer["meta"]["token_ids"]) > 0
    assert src.release(lease) is True and src.open_leases == [] and source.names() == []
    await asyncio.sleep(0.4)  # the cancelled timer does not run (it would log a failed drop)
    assert src.release(lease) is False
    source.close(), target.close()


async def test_an_offer_whose_timer_never_ran_is_swept_by_the_next_call(http, shared_service):
    """The timer lives on the loop that served the offer; if that loop is gone, the next
    offer or release drops what is past its deadline."""
    import time

    from tests.engine._fakes import LoopbackAgent

    await _cached(http, PROMPT)
    agent = LoopbackAgent()
    port = kv_port.KVPort(shared_service.engine, agent, offer_ttl_s=60)
    lease = (await port.offer(PROMPT))["meta"]["lease"]
    _, timer = port._offers[lease]
    timer.cancel()  # as if its loop had closed
    port._offers[lease] = (time.monotonic() - 1, None)
    port.release("some-other-lease")
    assert port.open_leases == [] and agent.names() == []
    agent.close()


def test_a_port_closes_its_open_offers_and_refuses_a_ttl_that_is_not_positive():
    import numpy as np
    import pytest

    from tests.engine._fakes import LoopbackAgent

    agent = LoopbackAgent()
    port = kv_port.KVPort(SimpleNamespace(), agent)
    agent.register("kv-x", np.zeros(8, dtype=np.uint8))
    port._offers["kv-x"] = (float("inf"), None)
    port.close()
    assert port.open_leases == [] and agent.names() == []
    with pytest.raises(ValueError, match="positive"):
        kv_port.KVPort(SimpleNamespace(), agent, offer_ttl_s=0)
    agent.close()


async def test_the_fetch_route_answers_an_expired_offer_with_a_400_naming_it(http):
    """What a target cell's caller sees: a clear 400 (not a transfer error), and the
    cell's transfer agent is not even opened."""
    import time

    offer = {"backend": "ucx", "endpoint": "10.0.0.9:4000", "regions": [],
             "meta": {"kind": "kv", "lease": "kv-7-1", "token_ids": [1, 2, 3], "ttl_s": 300.0,
                      "expires_at": time.time() - 5, "weight_version": "0"}}
    out = await http.post("/gyre/kv/port/fetch", json={"offer": offer})
    assert out.status_code == 400
    message = out.json()["message"]
    assert "KV offer 'kv-7-1' expired" in message and "kept 300 s" in message and "nothing imported" in message


async def test_an_import_the_cache_cannot_keep_is_not_reported_as_migrated(http, shared_service):
    """A prefix longer than the target's cache cap was inserted and evicted at once, while
    ``added_tokens`` (and so ``migrate_session``) said it had moved."""
    import pytest

    from libs.common.transfer.kv import migrate_session
    from services.engine.client import CellError
    from tests.engine._fakes import LoopbackAgent
    from tests.engine.conftest import asgi_client, make_service

    long_prompt = list(range(8400, 8500))
    await _cached(http, long_prompt)
    small = make_service(kv_cache_bytes=40 * shared_service.engine.runner.shape.kv_bytes_per_token)
    agents = [LoopbackAgent(), LoopbackAgent()]
    try:
        # the port: the target's answer and its client
        src = kv_port.KVPort(shared_service.engine, agents[0])
        dst = kv_port.attach(small, agents[1])
        offer = await src.offer(long_prompt)
        assert len(offer["meta"]["token_ids"]) > 40
        answer = await dst.fetch(offer)
        assert answer["success"] is False and answer["added_tokens"] == 0 and answer["cached_tokens"] == 0
        assert "not kept" in answer["message"] and small.engine.prefix_cache.cached_tokens == 0
        async with asgi_client(small) as target_client, asgi_client(shared_service) as source_client:
            target = kv_port.PortCellClient.wrap("target", target_client)
            with pytest.raises(CellError, match="not kept"):
                await target.kv_fetch(offer)
            # HTTP: the import's answer, and migrate_session's verdict
            blob = await source_client.kv_export(long_prompt)
            answer = await target_client.kv_import(blob)
            assert answer["success"] is False and answer["added_tokens"] == 0
            result = await migrate_session(kv_port.PortCellClient.wrap("source", source_client), target,
                                           long_prompt, session_id="s-too-long", use_port=False)
            assert result.kv == "reprefilled" and result.migrated_tokens == 0
            # a prefix that fits is kept and reported as before
            short = long_prompt[:20]
            answer = await target_client.kv_import(await source_client.kv_export(short))
            assert answer == {"success": True, "added_tokens": 20, "tokens": 20, "cached_tokens": 20}
        src.release(offer["meta"]["lease"])
    finally:
        for agent in agents:
            agent.close()
        small.close()


# -- the weight_version label is all an import compares: an unlabelled update makes it lie ---


EMBED = "model.embed_tokens.weight"


def _perturbed_embed(service):
    import torch

    weight = service.engine.runner.model.get_parameter(EMBED).detach()
    return weight + 0.5 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(1))


async def test_an_unlabelled_weight_update_makes_the_target_refuse_kv_until_a_label_is_set(http, shared_service,
                                                                                              fresh_service):
    """A tensor update without weight_version changed the target's weights and kept label
    "0": KV from a cell really at "0" was taken in, stale."""
    import pytest

    from services.engine.client import CellError
    from services.engine.weights import serialize_named_tensors
    from tests.engine._fakes import LoopbackAgent
    from tests.engine.conftest import asgi_client

    await _cached(http, PROMPT)
    agents = [LoopbackAgent(), LoopbackAgent()]
    src = kv_port.KVPort(shared_service.engine, agents[0])
    dst = kv_port.KVPort(fresh_service.engine, agents[1])
    offer = await src.offer(PROMPT)
    try:
        async with asgi_client(fresh_service, admin_token="secret") as target, \
                asgi_client(shared_service) as source:
            blob = await source.kv_export(PROMPT)
            await target.update_weights_from_tensor(serialize_named_tensors([(EMBED, _perturbed_embed(fresh_service))]))
            assert (await target.model_info())["weight_version"] == shared_service.engine.weight_version
            with pytest.raises(CellError) as err:  # HTTP import
                await target.kv_import(blob)
            assert err.value.status == 400 and "without weight_version" in err.value.message
            with pytest.raises(kv_port.InvalidRequest, match="without weight_version"):  # the port
                await dst.fetch(offer)
            assert fresh_service.engine.prefix_cache.cached_tokens == 0
            # the cell's own exports would carry the lying label too
            with pytest.raises(CellError) as err:
                await target.kv_export(PROMPT)
            assert err.value.status == 400 and "without weight_version" in err.value.message
            with pytest.raises(kv_port.InvalidRequest, match="without weight_version"):
                await dst.offer(PROMPT)
            # a label set afresh vouches for the weights as they are: imports are taken again
            await target._post("/update_weight_version", {"new_version": shared_service.engine.weight_version})
            assert fresh_service.engine.weight_label_stale is False
            assert (await target.kv_import(blob))["success"]
            # a labelled update keeps the label true; an unlabelled one after it makes it stale again
            await target.update_weights_from_tensor(serialize_named_tensors([(EMBED, _perturbed_embed(fresh_service))]),
                                                    weight_version="9")
            assert fresh_service.engine.weight_label_stale is False
            await target.update_weights_from_tensor(serialize_named_tensors([(EMBED, _perturbed_embed(fresh_service))]))
            assert fresh_service.engine.weight_label_stale is True
    finally:
        src.release(offer["meta"]["lease"])
        for agent in agents:
            agent.close()


async def test_an_unlabelled_update_during_a_port_transfer_drops_the_fetched_kv(http, shared_service, fresh_service,
                                                                              monkeypatch):
    """The version check after the transfer compared labels only: an update without
    weight_version landing mid-transfer kept the label, and the KV went in."""
    import pytest

    from tests.engine._fakes import LoopbackAgent

    await _cached(http, PROMPT)
    agents = [LoopbackAgent(), LoopbackAgent()]
    src = kv_port.KVPort(shared_service.engine, agents[0])
    dst = kv_port.KVPort(fresh_service.engine, agents[1])
    offer = await src.offer(PROMPT)
    real_fetch = kv_port.fetch_kv
    weights = fresh_service.weights

    def fetch_then_update(*args, **kwargs):
        got = real_fetch(*args, **kwargs)
        checked = weights.check_all([(EMBED, _perturbed_embed(fresh_service))])
        weights.submit(checked, None).result(timeout=60)  # as a distributed update without weight_version
        return got

    monkeypatch.setattr(kv_port, "fetch_kv", fetch_then_update)
    try:
        with pytest.raises(kv_port.InvalidRequest, match="changed during the transfer"):
            await dst.fetch(offer)
        assert fresh_service.engine.prefix_cache.cached_tokens == 0
    finally:
        src.release(offer["meta"]["lease"])
        for agent in agents:
            agent.close()


async def test_offer_and_release_without_a_working_transfer_backend_answer_a_400_naming_it(
        http, shared_service, monkeypatch):
    """No transfer backend opens on this cell: the offer route answers a 400 that says so
    (as fetch and weights pull do), not a bare 500 'Internal Server Error'."""
    from libs.common.transfer import weights as transfer_weights

    prompt = list(range(8500, 8540))
    await _cached(http, prompt)
    monkeypatch.setenv("GYRE_TRANSFER_BACKEND", "nccl")  # a backend that cannot open here
    monkeypatch.setattr(transfer_weights, "_default", None)
    monkeypatch.setattr(shared_service.app.state.kv_port, "_agent", None)
    offer = await http.post("/gyre/kv/port/offer", json={"input_ids": prompt})
    assert offer.status_code == 400, offer.text
    assert "transfer backend" in offer.json()["message"] and "nothing offered" in offer.json()["message"]
    release = await http.post("/gyre/kv/port/release", json={"lease": "kv-1-1"})
    assert release.status_code == 400 and "transfer backend" in release.json()["message"]
