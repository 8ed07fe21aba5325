"""``weight_update_mode``: an update that arrives while requests run (generation not paused) is
refused in ``reject`` mode (400, old weights and version kept, the running answer wholly
from the old weights) and waited for in ``wait`` mode; idle or paused, both modes apply."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import save_file

from services.engine.client import CellError
from services.engine.settings import EngineSettings
from services.engine.weights import serialize_named_tensors

from .conftest import asgi_client, make_service, reset_engine

ROOT = Path(__file__).resolve().parents[2]
PROMPT = list(range(7100, 7140))
LONG = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}
SHORT = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
EMBED = "model.embed_tokens.weight"
Q0 = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def reject_service(tiny_model_dir):
    service = make_service(admin_token="secret", weight_update_mode="reject")
    service.original = {k: v.detach().clone() for k, v in service.engine.runner.model.named_parameters()}
    yield service
    service.close()


@pytest.fixture
async def rejecting(reject_service):
    reject_service.engine.call(lambda: reset_engine(reject_service)).result(timeout=60)
    async with asgi_client(reject_service, admin_token="secret") as client:
        yield reject_service, client


@pytest.fixture
async def waiting(fresh_service):
    async with asgi_client(fresh_service, admin_token="secret") as client:
        yield fresh_service, client


def _new_embed(service) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return service.original[EMBED] + 0.5 * torch.randn(service.original[EMBED].shape, generator=g)


def _weights_are_original(service) -> bool:
    params = dict(service.engine.runner.model.named_parameters())
    return all(torch.equal(params[k], v) for k, v in service.original.items())


async def _wait_running(service, timeout=20.0):
    for _ in range(int(timeout / 0.01)):
        if service.engine.scheduler.running and service.engine.steps > 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("request never started")


async def _start_long(service, cell) -> tuple[dict, asyncio.Task]:
    """The idle reference answer, then the same request started and running."""
    reference = await cell.generate(PROMPT, LONG)
    await cell.flush_cache()
    pending = asyncio.create_task(cell.generate(PROMPT, LONG))
    await _wait_running(service)
    return reference, pending


def _assert_refused(err: CellError, service) -> None:
    assert err.status == 400
    body = json.loads(err.message)
    assert body["success"] is False and "refused" in body["message"] and "weight_update_mode=reject" in body["message"]
    assert service.engine.weight_version == "0"
    assert _weights_are_original(service)


def _assert_intact(out: dict, reference: dict) -> None:
    """Every token of ``out`` came from the old weights: same tokens and logprobs as the
    idle reference, one version run."""
    n = LONG["max_new_tokens"]
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["output_ids"] == reference["output_ids"]
    lps = [round(e[0], 4) for e in out["meta_info"]["output_token_logprobs"]]
    assert lps == [round(e[0], 4) for e in reference["meta_info"]["output_token_logprobs"]]
    assert out["meta_info"]["weight_version"] == "0"
    assert out["meta_info"]["weight_versions"] == [{"version": "0", "start": 0, "end": n}]


def test_mode_setting_defaults_to_wait_and_reads_the_environment(monkeypatch):
    assert EngineSettings().weight_update_mode == "wait"
    monkeypatch.setenv("GYRE_ENGINE_WEIGHT_UPDATE_MODE", "reject")
    assert EngineSettings().weight_update_mode == "reject"
    monkeypatch.setenv("GYRE_ENGINE_WEIGHT_UPDATE_MODE", "drop")
    with pytest.raises(ValidationError):
        EngineSettings()


async def test_server_info_shows_the_mode(rejecting, waiting):
    assert (await rejecting[1].server_info())["weight_update_mode"] == "reject"
    assert (await waiting[1].server_info())["weight_update_mode"] == "wait"


@pytest.mark.parametrize("kind", ["disk", "tensor", "window"])
async def test_reject_mode_refuses_an_update_during_generation(rejecting, tmp_path, kind):
    service, cell = rejecting
    new = _new_embed(service)
    save_file({**service.original, EMBED: new}, str(tmp_path / "model.safetensors"))

    async def update(version: str) -> dict:
        if kind == "disk":
            return await cell.update_weights_from_disk(str(tmp_path), weight_version=version)
        if kind == "tensor":
            return await cell.update_weights_from_tensor(serialize_named_tensors([(EMBED, new)]),
                                                         weight_version=version)
        await cell._post("/begin_weight_update", {})
        staged = await cell.update_weights_from_tensor(serialize_named_tensors([(EMBED, new)]))
        assert staged["success"]  # staging writes nothing, so it is never refused
        return await cell._post("/end_weight_update", {"weight_version": version})

    reference, pending = await _start_long(service, cell)
    with pytest.raises(CellError) as err:
        await update("1")
    assert not pending.done()  # refused at once, not after the request
    _assert_refused(err.value, service)
    assert service.weights.staged is None  # a refused end closes the window
    _assert_intact(await pending, reference)

    # idle now: the same update applies
    assert (await update("1"))["success"]
    assert torch.equal(service.engine.runner.model.get_parameter(EMBED), new)
    after = await cell.generate(PROMPT, SHORT)
    assert after["meta_info"]["weight_version"] == "1"
    assert after["output_ids"] != reference["output_ids"][:6]


async def test_reject_mode_applies_while_paused(rejecting):
    service, cell = rejecting
    new = _new_embed(service)
    pending = asyncio.create_task(cell.generate(PROMPT, {**LONG, "max_new_tokens": 200}))
    await _wait_running(service)
    await cell.pause("in_place")
    done_before = len(service.engine.scheduler.running[0].output_ids)
    result = await cell.update_weights_from_tensor(serialize_named_tensors([(EMBED, new)]), weight_version="2")
    assert result["success"]
    assert torch.equal(service.engine.runner.model.get_parameter(EMBED), new)
    await cell.resume_generation()
    spans = (await pending)["meta_info"]["weight_versions"]
    assert spans == [{"version": "0", "start": 0, "end": done_before}, {"version": "2", "start": done_before, "end": 200}]


async def test_reject_mode_disk_update_with_abort_all_requests_applies(rejecting, tmp_path):
    service, cell = rejecting
    new = _new_embed(service)
    save_file({**service.original, EMBED: new}, str(tmp_path / "model.safetensors"))
    pending = asyncio.create_task(cell.generate(PROMPT, {**LONG, "max_new_tokens": 3000}))
    await _wait_running(service)
    result = await cell.update_weights_from_disk(str(tmp_path), weight_version="3", abort_all_requests=True)
    assert result["success"]
    out = await pending
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert {run["version"] for run in out["meta_info"]["weight_versions"]} == {"0"}
    assert torch.equal(service.engine.runner.model.get_parameter(EMBED), new)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sender(port: int, file: Path, group: str, names: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.engine.weight_sender", "--port", str(port), "--file", str(file),
         "--group", group, "--names", ",".join(names)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


async def test_reject_mode_distributed_update_completes_the_broadcast_then_refuses(rejecting, tmp_path):
    """The refusal comes after the whole broadcast was received, so the trainer's
    collective completes (the sender exits) instead of waiting for a receiver; paused, the
    next broadcast applies."""
    service, cell = rejecting
    new = {EMBED: _new_embed(service), Q0: service.original[Q0] * -1}
    save_file(new, str(tmp_path / "w.safetensors"))
    names = [EMBED, Q0]
    shapes = [list(new[n].shape) for n in names]
    for round_, group in enumerate(("reject-1", "reject-2")):
        port = _free_port()
        sender = _sender(port, tmp_path / "w.safetensors", group, names)
        try:
            await cell.init_weights_update_group("127.0.0.1", port, 1, 2, group)
            if round_ == 0:
                reference, pending = await _start_long(service, cell)
                with pytest.raises(CellError) as err:
                    await cell.update_weights_from_distributed(names, ["float32"] * 2, shapes, group,
                                                               weight_version="4")
                _assert_refused(err.value, service)
                out, _ = await asyncio.to_thread(sender.communicate, timeout=60)
                assert sender.returncode == 0, out  # the broadcast completed: nothing left hanging
                _assert_intact(await pending, reference)
            else:
                pending = asyncio.create_task(cell.generate(PROMPT, {**LONG, "max_new_tokens": 3000}, rid="held"))
                await _wait_running(service)
                await cell.pause("in_place")
                result = await cell.update_weights_from_distributed(names, ["float32"] * 2, shapes, group,
                                                                    weight_version="4")
                assert result["success"]
                out, _ = await asyncio.to_thread(sender.communicate, timeout=60)
                assert sender.returncode == 0, out
                await cell.abort("held")
                await cell.resume_generation()
                await pending
                params = dict(service.engine.runner.model.named_parameters())
                assert all(torch.equal(params[n], new[n]) for n in names)
                assert service.engine.weight_version == "4"
            await cell.destroy_weights_update_group(group)
        finally:
            if sender.poll() is None:
                sender.kill()
                sender.wait()


async def test_wait_mode_is_unchanged(waiting, tmp_path):
    """Default mode: the update during generation waits for the running request (which
    stays wholly on the old weights), then applies; new requests see the new version."""
    service, cell = waiting
    new = _new_embed(service)
    save_file({**service.original, EMBED: new}, str(tmp_path / "model.safetensors"))
    pending = asyncio.create_task(cell.generate(PROMPT, {**LONG, "max_new_tokens": 60}))
    await _wait_running(service)
    result = await cell.update_weights_from_disk(str(tmp_path), weight_version="5")
    assert result["success"]
    out = await pending  # every token from the old weights: the write waited for it
    assert out["meta_info"]["weight_versions"] == [{"version": "0", "start": 0, "end": 60}]
    assert torch.equal(service.engine.runner.model.get_parameter(EMBED), new)
    assert (await cell.generate(PROMPT, SHORT))["meta_info"]["weight_version"] == "5"


async def test_kv_of_a_sequence_paused_in_place_across_an_update_never_enters_the_cache(waiting):
    service, client = waiting
    engine = service.engine
    pending = asyncio.create_task(client.generate(PROMPT, {**LONG, "max_new_tokens": 40}))
    while not engine.call(lambda: bool(engine.scheduler.running) and engine.steps > 3).result(10):
        await asyncio.sleep(0.01)
    await client.pause("in_place")
    await client.update_weights_from_tensor(serialize_named_tensors([(EMBED, _new_embed(service))]),
                                            weight_version="1")
    await client.resume_generation()
    first = await pending
    assert [run["version"] for run in first["meta_info"]["weight_versions"]] == ["0", "1"]
    # its KV mixes old- and new-weight tokens: dropped, not cached under version 1
    assert engine.prefix_cache.cached_tokens == 0
    probe = PROMPT + first["output_ids"][:10]
    assert engine.call(lambda: engine.prefix_cache.export(probe)[0]).result(10) == 0
    again = await client.generate(probe, SHORT)
    assert again["meta_info"]["cached_tokens"] == 0
    # KV computed wholly under the new weights is cached as usual, and matches a fresh prefill
    cached = await client.generate(probe, SHORT)
    assert cached["meta_info"]["cached_tokens"] > 0
    await client.flush_cache()
    fresh = await client.generate(probe, SHORT)
    assert fresh["meta_info"]["cached_tokens"] == 0
    assert again["output_ids"] == cached["output_ids"] == fresh["output_ids"]
