"""Control endpoints on a fresh engine with an admin token: auth, flush, pause modes, weight
updates (disk, tensor, begin/end) with bad input and updates during generation, memory
release/resume, and KV export/import between two engines."""

from __future__ import annotations

import asyncio
import gc

import psutil
import pytest
import torch
from safetensors.torch import save_file

from services.engine.client import CellError
from services.engine.weights import WeightUpdateError, serialize_named_tensors

from .conftest import asgi_client

PROMPT = list(range(7000, 7040))
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
EMBED = "model.embed_tokens.weight"
Q0 = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture
async def cell(fresh_service):
    async with asgi_client(fresh_service, admin_token="secret") as client:
        yield client


def _perturb(t: torch.Tensor) -> torch.Tensor:
    # Noise, not a scale: RMSNorm and the tied head make a pure scale change no argmax.
    g = torch.Generator().manual_seed(0)
    return t + 0.5 * torch.randn(t.shape, generator=g)


def _params(service) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in service.engine.runner.model.named_parameters()}


async def _wait_running(service, count=1, timeout=10.0):
    for _ in range(int(timeout / 0.02)):
        if len(service.engine.scheduler.running) >= count and service.engine.steps > 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("request never started")


async def test_control_endpoints_need_the_admin_token(fresh_service):
    async with asgi_client(fresh_service) as anonymous:
        with pytest.raises(CellError) as err:
            await anonymous.flush_cache()
        assert err.value.status == 401
        with pytest.raises(CellError):
            await anonymous.pause("in_place")
        assert (await anonymous.generate(PROMPT, GREEDY))["meta_info"]["completion_tokens"] == 6


async def test_flush_cache_is_refused_while_busy(cell, fresh_service):
    pending = asyncio.create_task(cell.generate(PROMPT, {**GREEDY, "max_new_tokens": 3000}, rid="busy"))
    await _wait_running(fresh_service)
    with pytest.raises(CellError) as err:
        await cell.flush_cache()
    assert err.value.status == 400
    await cell.abort("busy")
    assert (await pending)["meta_info"]["finish_reason"]["type"] == "abort"
    await cell.flush_cache()


@pytest.mark.parametrize("mode", ["in_place", "retract"])
async def test_pause_and_continue_keep_the_answer(cell, fresh_service, mode):
    params = {**GREEDY, "max_new_tokens": 24}
    reference = await cell.generate(PROMPT, params)
    await cell.flush_cache()
    pending = asyncio.create_task(cell.generate(PROMPT, params))
    await _wait_running(fresh_service)
    await cell.pause(mode)
    steps = fresh_service.engine.steps
    await asyncio.sleep(0.2)
    assert fresh_service.engine.steps == steps and not pending.done()
    await cell.resume_generation()
    out = await pending
    assert out["meta_info"]["num_retractions"] == (1 if mode == "retract" else 0)
    assert out["output_ids"] == reference["output_ids"]
    lps = [round(e[0], 4) for e in out["meta_info"]["output_token_logprobs"]]
    assert lps == [round(e[0], 4) for e in reference["meta_info"]["output_token_logprobs"]]


async def test_pause_abort_ends_requests_in_flight(cell, fresh_service):
    pending = asyncio.create_task(cell.generate(PROMPT, {**GREEDY, "max_new_tokens": 3000}))
    await _wait_running(fresh_service)
    assert (await cell.pause("abort"))["num_paused_requests"] == 1
    assert (await pending)["meta_info"]["finish_reason"]["type"] == "abort"
    queued = asyncio.create_task(cell.generate(PROMPT, GREEDY))
    await asyncio.sleep(0.2)
    assert not queued.done()  # paused: new work waits
    await cell.resume_generation()
    assert (await queued)["meta_info"]["completion_tokens"] == 6


async def test_update_weights_from_disk_and_back(cell, fresh_service, tmp_path):
    original = _params(fresh_service)
    before = await cell.generate(PROMPT, GREEDY)
    changed = {k: _perturb(v) if k == EMBED else v for k, v in original.items()}
    save_file(changed, str(tmp_path / "model.safetensors"))
    result = await cell.update_weights_from_disk(str(tmp_path), weight_version="1")
    assert result["success"] is True and result["num_paused_requests"] == 0
    after = await cell.generate(PROMPT, GREEDY)
    assert after["meta_info"]["weight_version"] == "1"
    assert after["output_ids"] != before["output_ids"]
    save_file(original, str(tmp_path / "model.safetensors"))
    await cell.update_weights_from_disk(str(tmp_path), weight_version="2")
    assert (await cell.generate(PROMPT, GREEDY))["output_ids"] == before["output_ids"]
    assert (await cell.model_info())["weight_version"] == "2"


async def test_bad_disk_updates_are_400_and_keep_old_weights(cell, fresh_service, tmp_path):
    original = _params(fresh_service)
    broken = dict(original)
    broken[Q0] = torch.zeros(3, 3)
    save_file(broken, str(tmp_path / "model.safetensors"))
    missing = {k: v for k, v in original.items() if k != Q0}
    (tmp_path / "partial").mkdir()
    save_file(missing, str(tmp_path / "partial" / "model.safetensors"))
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors at all")
    for path in (str(tmp_path), str(tmp_path / "partial"), str(tmp_path / "nowhere"),
                 str(tmp_path / "junk.safetensors")):
        with pytest.raises(CellError) as err:
            await cell.update_weights_from_disk(path, weight_version="9")
        assert err.value.status == 400
    assert all(torch.equal(v, original[k]) for k, v in _params(fresh_service).items())
    assert (await cell.model_info())["weight_version"] == "0"


async def test_tensor_updates_check_everything_before_writing(cell, fresh_service):
    original = _params(fresh_service)
    good = original[Q0] + 1.0
    bad_batches = [
        [(Q0, good), ("model.layers.0.no_such.weight", good)],
        [(Q0, good), (EMBED, torch.zeros(2, 2))],
        [(Q0, good), (EMBED, original[EMBED].to(torch.int64))],
        # right name, shape and dtype, but nothing copy_ can read: refused before Q0 is written
        [(Q0, good), (EMBED, torch.empty(original[EMBED].shape, device="meta"))],
        [(Q0, good), (EMBED, original[EMBED].to_sparse())],
    ]
    for batch in bad_batches:
        with pytest.raises(CellError) as err:
            await cell.update_weights_from_tensor(serialize_named_tensors(batch), weight_version="bad")
        assert err.value.status == 400
        assert torch.equal(fresh_service.engine.runner.model.get_parameter(Q0), original[Q0])
    named = [(Q0, good), ("lm_head.weight", original[EMBED].to(torch.bfloat16))]  # tied alias, cast
    assert (await cell.update_weights_from_tensor(serialize_named_tensors(named), weight_version="3"))["success"]
    assert torch.equal(fresh_service.engine.runner.model.get_parameter(Q0), good)
    assert (await cell.model_info())["weight_version"] == "3"


async def test_begin_end_window_applies_all_at_once(cell, fresh_service):
    original = _params(fresh_service)
    before = await cell.generate(PROMPT, GREEDY)
    async with cell.weight_update_window(weight_version="5"):
        await cell.update_weights_from_tensor(serialize_named_tensors([(EMBED, _perturb(original[EMBED]))]))
        inside = await cell.generate(PROMPT, GREEDY)
        assert inside["output_ids"] == before["output_ids"] and inside["meta_info"]["weight_version"] == "0"
    after = await cell.generate(PROMPT, GREEDY)
    assert after["meta_info"]["weight_version"] == "5" and after["output_ids"] != before["output_ids"]


async def test_end_while_weights_are_released_is_a_400_that_keeps_the_staged_update(cell, fresh_service):
    original = _params(fresh_service)
    new = _perturb(original[EMBED])
    before = await cell.generate(PROMPT, GREEDY)
    await cell._post("/begin_weight_update", {})
    await cell.update_weights_from_tensor(serialize_named_tensors([(EMBED, new)]), weight_version="5")
    await cell.release_memory()
    with pytest.raises(CellError) as err:
        await cell._post("/end_weight_update", {})
    assert err.value.status == 400 and "released" in err.value.message
    await cell.resume_memory()
    assert torch.equal(_params(fresh_service)[EMBED], original[EMBED])  # nothing applied by the refusal
    assert (await cell.generate(PROMPT, GREEDY))["output_ids"] == before["output_ids"]
    await cell._post("/end_weight_update", {})  # the window survived: ending it now applies it
    assert torch.equal(_params(fresh_service)[EMBED], new)
    assert (await cell.model_info())["weight_version"] == "5"


async def test_a_write_reaching_released_weights_is_a_400(cell, fresh_service):
    weights = fresh_service.weights
    original = _params(fresh_service)
    await cell.release_memory(["weights"])
    future = weights.apply_now({EMBED: _perturb(original[EMBED])}, "9")
    with pytest.raises(WeightUpdateError, match="released"):
        future.result(timeout=30)
    await cell.resume_memory(["weights"])
    assert torch.equal(_params(fresh_service)[EMBED], original[EMBED])
    assert fresh_service.engine.weight_version == "0"


async def test_update_during_generation_waits_for_the_running_request(cell, fresh_service):
    original = _params(fresh_service)
    pending = asyncio.create_task(cell.generate(PROMPT, {**GREEDY, "max_new_tokens": 40}))
    await _wait_running(fresh_service)
    await cell.update_weights_from_tensor(serialize_named_tensors([(EMBED, _perturb(original[EMBED]))]), weight_version="7")
    out = await pending
    # every token came from the old weights: the write waited for the request in flight
    assert out["meta_info"]["weight_versions"] == [{"version": "0", "start": 0, "end": 40}]
    assert (await cell.generate(PROMPT, GREEDY))["meta_info"]["weight_version"] == "7"
    assert out["meta_info"]["completion_tokens"] == 40


async def test_update_while_paused_in_place_marks_the_version_per_token(cell, fresh_service):
    original = _params(fresh_service)
    pending = asyncio.create_task(cell.generate(PROMPT, {**GREEDY, "max_new_tokens": 200}))
    await _wait_running(fresh_service)
    await cell.pause("in_place")
    done_before = len(fresh_service.engine.scheduler.running[0].output_ids)
    result = await cell.update_weights_from_tensor(serialize_named_tensors([(EMBED, _perturb(original[EMBED]))]),
                                                   weight_version="8")
    assert result["success"]
    await cell.resume_generation()
    spans = (await pending)["meta_info"]["weight_versions"]
    assert spans == [{"version": "0", "start": 0, "end": done_before}, {"version": "8", "start": done_before, "end": 200}]


async def test_release_and_resume_memory(cell, fresh_service):
    before = await cell.generate(PROMPT, GREEDY)
    gc.collect()
    rss = psutil.Process().memory_info().rss
    await cell.release_memory()
    gc.collect()
    freed = rss - psutil.Process().memory_info().rss
    assert fresh_service.engine.runner.model.get_parameter(EMBED).numel() == 0
    assert freed > 0.5 * 151936 * 128 * 4, f"freed {freed} bytes"  # at least half the embedding
    with pytest.raises(CellError) as err:
        await cell.generate(PROMPT, GREEDY)
    assert err.value.status == 503
    await cell.resume_memory()
    after = await cell.generate(PROMPT, GREEDY)
    assert after["output_ids"] == before["output_ids"] and after["meta_info"]["cached_tokens"] == 0


async def test_release_needs_an_idle_engine(cell, fresh_service):
    pending = asyncio.create_task(cell.generate(PROMPT, {**GREEDY, "max_new_tokens": 3000}, rid="r"))
    await _wait_running(fresh_service)
    with pytest.raises(CellError) as err:
        await cell.release_memory(["weights"])
    assert err.value.status == 400
    await cell.abort("r")
    await pending


async def test_kv_export_import_moves_a_session_between_cells(cell, shared_service):
    turn = list(range(8000, 8300))
    async with asgi_client(shared_service) as source:
        first = await source.generate(turn, GREEDY)
        blob = await source.kv_export(turn + first["output_ids"])
    assert (await cell.kv_import(blob))["added_tokens"] == len(turn) + len(first["output_ids"]) - 1
    follow = turn + first["output_ids"] + [11, 12, 13]
    moved = await cell.generate(follow, GREEDY)
    assert moved["meta_info"]["cached_tokens"] == len(turn) + len(first["output_ids"]) - 1
    await cell.flush_cache()
    assert (await cell.generate(follow, GREEDY))["output_ids"] == moved["output_ids"]
    with pytest.raises(CellError) as err:
        await cell.kv_import(b"garbage")
    assert err.value.status == 400


async def test_releasing_only_the_kv_cache_refuses_generation_and_kv_imports_until_resumed(cell, fresh_service,
                                                                                            shared_service):
    turn = list(range(8400, 8500))
    async with asgi_client(shared_service) as source:
        first = await source.generate(turn, GREEDY)
        blob = await source.kv_export(turn + first["output_ids"])
    await cell.release_memory(["kv_cache"])
    assert fresh_service.engine.released == {"kv_cache"}
    assert fresh_service.engine.runner.model.get_parameter(EMBED).numel() > 0  # the weights stay
    for attempt in (cell.kv_import(blob), cell.generate(PROMPT, GREEDY)):
        with pytest.raises(CellError) as err:
            await attempt
        assert err.value.status == 503
    assert fresh_service.engine.prefix_cache.tree.total_tokens == 0
    await cell.resume_memory(["kv_cache"])
    assert (await cell.kv_import(blob))["added_tokens"] == len(turn) + len(first["output_ids"]) - 1


async def test_prefix_cache_evicts_least_recent_sessions_under_its_cap(cell, fresh_service):
    tree = fresh_service.engine.prefix_cache.tree
    saved, tree.capacity_tokens = tree.capacity_tokens, 150
    try:
        a, b = list(range(9000, 9100)), list(range(9500, 9600))
        params = {**GREEDY, "max_new_tokens": 2}
        await cell.generate(a, params)
        await cell.generate(b, params)  # 202 tokens > 150: the older session goes
        assert tree.total_tokens <= 150
        assert (await cell.generate(b, params))["meta_info"]["cached_tokens"] == 99
        assert (await cell.generate(a, params))["meta_info"]["cached_tokens"] == 0
    finally:
        tree.capacity_tokens = saved


async def test_weight_version_and_weights_by_name(cell, fresh_service):
    await cell._post("/update_weight_version", {"new_version": "42"})
    assert (await cell.model_info())["weight_version"] == "42"
    values = await cell._post("/get_weights_by_name", {"name": Q0, "truncate_size": 4})
    expected = fresh_service.original[Q0].flatten()[:4].tolist()
    assert values == pytest.approx(expected)


async def test_mixed_load_with_aborts_and_pauses_leaves_a_clean_engine(cell, fresh_service):
    import random

    rng = random.Random(5)

    async def one(i: int) -> dict:
        ids = [rng.randrange(100, 150000) for _ in range(rng.randrange(1, 120))]
        params = {"max_new_tokens": rng.randrange(1, 30), "ignore_eos": True}
        if i % 2:
            params.update(temperature=0.9, top_p=0.9, sampling_seed=i)
        else:
            params.update(temperature=0)
        return await cell.generate(ids, params, rid=f"mix-{i}")

    tasks = [asyncio.create_task(one(i)) for i in range(16)]
    await asyncio.sleep(0.1)
    await cell.abort("mix-3")
    await cell.pause("retract")
    await cell.resume_generation()
    await cell.abort("mix-7")
    outs = await asyncio.gather(*tasks)
    for out in outs:
        reason = out["meta_info"]["finish_reason"]["type"]
        assert reason in ("length", "abort")
        if reason == "length":
            assert len(out["output_ids"]) == out["meta_info"]["finish_reason"]["length"]
    stats = (await cell.server_info())["internal_states"][0]
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert not fresh_service.engine._live


async def test_a_window_whose_body_fails_is_closed_and_applies_nothing(cell, fresh_service):
    """The client's window ends (with Gyre's abort) when its body raises: nothing staged is
    applied, the version stays, and a later update without a window applies at once."""
    original = _params(fresh_service)
    with pytest.raises(RuntimeError, match="trainer died"):
        async with cell.weight_update_window(weight_version="5"):
            await cell.update_weights_from_tensor(serialize_named_tensors([(EMBED, _perturb(original[EMBED]))]),
                                                  weight_version="5")
            raise RuntimeError("trainer died mid-push")
    assert fresh_service.weights.staged is None  # not left open
    assert torch.equal(_params(fresh_service)[EMBED], original[EMBED])
    assert (await cell.model_info())["weight_version"] == "0"
    new = _perturb(original[Q0])
    answer = await cell.update_weights_from_tensor(serialize_named_tensors([(Q0, new)]), weight_version="6")
    assert answer["success"] and torch.equal(_params(fresh_service)[Q0], new)  # success means applied
    assert (await cell.model_info())["weight_version"] == "6"


async def test_an_update_refused_inside_a_window_drops_it_and_a_later_end_is_refused(cell, fresh_service):
    """Engine side, whatever the client does: a staged update that fails drops the window,
    so the next update without a window applies, and an end with no window open is a 400
    (not a success that applied nothing)."""
    original = _params(fresh_service)
    await cell._post("/begin_weight_update", {})
    await cell.update_weights_from_tensor(serialize_named_tensors([(EMBED, _perturb(original[EMBED]))]))
    with pytest.raises(CellError) as err:  # a bad tensor, staged nowhere
        await cell.update_weights_from_tensor(serialize_named_tensors([(Q0, torch.zeros(3, 3))]))
    assert err.value.status == 400 and fresh_service.weights.staged is None
    with pytest.raises(CellError) as err:
        await cell._post("/end_weight_update", {"weight_version": "5"})
    assert err.value.status == 400 and "no weight update window" in err.value.message
    assert "dropped" in err.value.message
    assert torch.equal(_params(fresh_service)[EMBED], original[EMBED])  # the staged part was not applied
    assert (await cell.model_info())["weight_version"] == "0"
    new = _perturb(original[Q0])
    await cell.update_weights_from_tensor(serialize_named_tensors([(Q0, new)]), weight_version="6")
    assert torch.equal(_params(fresh_service)[Q0], new) and (await cell.model_info())["weight_version"] == "6"
    # an abort with no window open is harmless
    assert (await cell._post("/end_weight_update", {"abort": True}))["success"]


async def test_two_windows_on_one_cell_are_taken_one_after_the_other(cell, fresh_service):
    """The cell agent's catch-up push and the trainer's publication meet on a cell: the
    second begin waits until the first window ends, so each end applies and labels only
    what its own owner sent (one engine-wide window mixed them: v5's tensors went out
    labelled v4, and v5's end was refused)."""
    original = _params(fresh_service)
    a_embed, b_q0 = _perturb(original[EMBED]), _perturb(original[Q0])
    await cell._post("/begin_weight_update", {})  # owner A
    b_begin = asyncio.create_task(cell._post("/begin_weight_update", {}))  # owner B
    await asyncio.sleep(0.2)
    assert not b_begin.done()  # waits for A's window
    await cell.update_weights_from_tensor(serialize_named_tensors([(EMBED, a_embed)]), weight_version="4")
    await cell._post("/end_weight_update", {"weight_version": "4"})
    await asyncio.wait_for(b_begin, 5)
    assert torch.equal(_params(fresh_service)[EMBED], a_embed) and torch.equal(_params(fresh_service)[Q0],
                                                                               original[Q0])
    assert (await cell.model_info())["weight_version"] == "4"
    await cell.update_weights_from_tensor(serialize_named_tensors([(Q0, b_q0)]), weight_version="5")
    await cell._post("/end_weight_update", {"weight_version": "5"})
    assert torch.equal(_params(fresh_service)[Q0], b_q0) and (await cell.model_info())["weight_version"] == "5"


async def test_an_abandoned_window_is_replaced_by_the_next_begin(cell, fresh_service, monkeypatch):
    """An owner that died between begin and end: after WINDOW_IDLE_S with nothing heard,
    a new begin drops its window (nothing of it applied) and opens its own; the dead
    owner's end is refused."""
    import services.engine.weights as weights_module

    monkeypatch.setattr(weights_module, "WINDOW_IDLE_S", 0.3)
    original = _params(fresh_service)
    await cell._post("/begin_weight_update", {})
    await cell.update_weights_from_tensor(serialize_named_tensors([(EMBED, _perturb(original[EMBED]))]))
    await asyncio.wait_for(cell._post("/begin_weight_update", {}), 5)  # after 0.3 s of silence
    new = _perturb(original[Q0])
    await cell.update_weights_from_tensor(serialize_named_tensors([(Q0, new)]), weight_version="7")
    await cell._post("/end_weight_update", {"weight_version": "7"})
    params = _params(fresh_service)
    assert torch.equal(params[Q0], new) and torch.equal(params[EMBED], original[EMBED])
    with pytest.raises(CellError) as err:
        await cell._post("/end_weight_update", {"weight_version": "6"})
    assert err.value.status == 400
