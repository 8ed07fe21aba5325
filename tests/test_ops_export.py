"""``gyre export``: a trainer checkpoint becomes a Hugging Face folder that transformers
reloads with the exact weights and that the embedded engine, served over HTTP on a
127.0.0.1 port, answers with the same tokens and logprobs as transformers' forward."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
import torch
from typer.testing import CliRunner

from gyre.cli import app
from services.engine.model_store import default_cache_dir, ensure_tiny_qwen
from services.trainer.checkpoint import TrainerState, save_checkpoint

PROMPT = [9707, 1879, 11, 419, 374, 264, 1273, 315, 279, 5392, 13]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run folder whose checkpoints hold weights that moved away from tiny-qwen's."""
    from transformers import AutoModelForCausalLM

    base = ensure_tiny_qwen(default_cache_dir())
    model = AutoModelForCausalLM.from_pretrained(str(base))  # the trainer's weights, under the same HF names
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run_dir = tmp_path_factory.mktemp("runs") / "r1"
    folder = run_dir / "trainer" / "checkpoints"
    save_checkpoint(folder, TrainerState(step=0), model.state_dict(), opt)
    torch.manual_seed(0)
    for step in (1, 2):  # two real optimizer steps on a next-token loss
        ids = torch.randint(0, 151643, (1, 24))
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        save_checkpoint(folder, TrainerState(step=step, weight_version=step), model.state_dict(), opt)
    return base, run_dir, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _export(*args: str):
    return CliRunner().invoke(app, ["export", *args], catch_exceptions=False)


def test_export_reloads_in_transformers_with_the_checkpoint_weights(trained, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base, run_dir, weights = trained
    out = tmp_path / "hf"
    result = _export(str(run_dir), str(out), "--model", "tiny-qwen")
    assert result.exit_code == 0, result.output
    assert "step 2, weights v2" in result.output
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "chat_template.jinja", "gyre_export.json"} <= {p.name for p in out.iterdir()}
    assert not (out / "READY").exists()
    info = json.loads((out / "gyre_export.json").read_text())
    assert info["step"] == 2 and info["weight_version"] == 2 and info["base_model"] == "tiny-qwen"

    model = AutoModelForCausalLM.from_pretrained(str(out))
    got = model.state_dict()
    assert set(got) == set(weights)
    assert all(torch.equal(got[k], weights[k]) for k in weights)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
    original = AutoModelForCausalLM.from_pretrained(str(base)).state_dict()
    assert not torch.equal(original["model.layers.0.mlp.up_proj.weight"], got["model.layers.0.mlp.up_proj.weight"])
    text = "def add(a, b):\n    return a + b<|im_end|>"
    assert (AutoTokenizer.from_pretrained(str(out))(text)["input_ids"]
            == AutoTokenizer.from_pretrained(str(base))(text)["input_ids"])


def test_export_picks_a_step_and_names_what_is_wrong(trained, tmp_path):
    from safetensors.torch import load_file

    _, run_dir, _ = trained
    result = _export(str(run_dir / "trainer" / "checkpoints"), str(tmp_path / "s1"), "--step", "1",
                     "--model", "tiny-qwen", "--dtype", "bfloat16")
    assert result.exit_code == 0, result.output
    assert load_file(str(tmp_path / "s1" / "model.safetensors"))["model.norm.weight"].dtype == torch.bfloat16
    assert json.loads((tmp_path / "s1" / "config.json").read_text())["dtype"] == "bfloat16"
    missing = _export(str(run_dir), str(tmp_path / "s9"), "--step", "9", "--model", "tiny-qwen")
    assert missing.exit_code == 2 and "no checkpoint for step 9" in missing.output
    assert "steps: 0, 1, 2" in missing.output
    again = _export(str(run_dir), str(tmp_path / "s1"), "--model", "tiny-qwen")
    assert again.exit_code == 2 and "--force" in again.output
    nowhere = _export("no-such-run", str(tmp_path / "x"), "--runs-dir", str(tmp_path))
    assert nowhere.exit_code == 2 and "no checkpoints found" in nowhere.output
    no_base = _export(str(run_dir / "trainer" / "checkpoints" / "step-000001.pt"), str(tmp_path / "x"))
    assert no_base.exit_code == 2 and "pass --model" in no_base.output


async def test_the_base_model_comes_from_the_runs_first_event(trained, tmp_path):
    import shutil

    from libs.common.bus.jetstream import JetStreamBus
    from libs.common.events import RunStarted
    from libs.common.natsserver import EmbeddedNats

    _, run_dir, _ = trained
    run = tmp_path / "runs" / "r2"
    shutil.copytree(run_dir / "trainer", run / "trainer")
    with EmbeddedNats(run / "nats") as nats:
        bus = await JetStreamBus.connect(nats.url)
        await bus.publish(RunStarted(run_id="r2", config={"model": {"name": "tiny-qwen"}}))
        await bus.close()
    result = await asyncio.to_thread(_export, "r2", str(tmp_path / "hf"), "--runs-dir", str(tmp_path / "runs"))
    assert result.exit_code == 0, result.output
    assert "base tiny-qwen" in result.output


def test_the_embedded_engine_serves_the_export_with_transformers_logprobs(trained, tmp_path):
    import uvicorn
    from transformers import AutoModelForCausalLM

    from libs.common.natsserver import free_port
    from services.engine.main import build
    from services.engine.settings import EngineSettings

    _, run_dir, _ = trained
    out = tmp_path / "hf"
    assert _export(str(run_dir), str(out), "--model", "tiny-qwen").exit_code == 0
    port = free_port()
    service = build(EngineSettings(model=str(out), host="127.0.0.1", port=port, num_threads=1))
    server = uvicorn.Server(uvicorn.Config(service.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        r = httpx.post(f"http://127.0.0.1:{port}/generate", timeout=120, json={
            "input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        served = r.json()
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        service.close()

    ids = served["output_ids"]
    model = AutoModelForCausalLM.from_pretrained(str(out))
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT + ids])).logits[0, len(PROMPT) - 1:-1]
    ref = torch.log_softmax(logits.float(), -1)
    assert ids == ref.argmax(-1).tolist()  # the greedy tokens transformers picks
    lps = [entry[0] for entry in served["meta_info"]["output_token_logprobs"]]
    expected = ref.gather(1, torch.tensor(ids)[:, None])[:, 0].tolist()
    assert max(abs(a - b) for a, b in zip(lps, expected)) < 1e-4
