"""GPU check: a real SGLang server with a small model, driven by the calls Gyre makes.

Run on a GPU machine with ``sglang`` installed (``bash services/engine/gpu_check.sh``):

    python -m services.engine.gpu_check --model tiny-qwen --out gpu_check.json

It checks that every flag :func:`build_command` emits is in ``launch_server --help``,
starts the server through :class:`SGLangServer`, then runs the proxy's calls (generate with
input_ids and logprobs, prefix reuse, streaming, abort) and the trainer's and scheduler's
(pause modes, flush, begin/end + tensor update, disk update, gloo broadcast from a second
process, memory release/resume). Each step is recorded as ok/failed with its detail; the
JSON report is what the closing note quotes. Nothing is asserted beyond recording.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

from .client import EngineClient
from .model_store import resolve_model
from .sglang_server import SGLangConfig, SGLangServer, build_command

PROMPT = [9707, 1879, 11, 419, 374, 264, 1273]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Report:
    def __init__(self) -> None:
        self.steps: list[dict] = []

    async def step(self, name: str, coro):
        start = time.perf_counter()
        try:
            detail = await coro
            self.steps.append({"step": name, "ok": True, "s": round(time.perf_counter() - start, 3),
                               "detail": detail})
            return detail
        except Exception as exc:  # recorded, the check goes on
            self.steps.append({"step": name, "ok": False, "error": repr(exc),
                               "trace": traceback.format_exc()[-1500:]})
            return None


def check_flags(cfg: SGLangConfig) -> dict:
    help_text = subprocess.run([cfg.python, "-m", cfg.module, "--help"], capture_output=True, text=True,
                               timeout=300).stdout
    flags = [a for a in build_command(cfg) if a.startswith("--")]
    return {"missing_flags": [f for f in flags if f not in help_text]}


async def run_checks(model_path: str, folder: Path, port: int, workdir: Path,
                     module: str = "sglang.launch_server", python: str = sys.executable, cpu: bool = False) -> dict:
    import torch
    from safetensors.torch import load_file, save_file

    from .weights import serialize_named_tensors

    cfg = SGLangConfig(model_path=str(folder), port=port, dtype="float32", mem_fraction_static=0.3,
                       weight_version="0", module=module, python=python)
    if cpu:  # SGLang's CPU engine: a dry run of this script on a machine without a GPU
        cfg = dataclasses.replace(cfg, device="cpu", max_total_tokens=8192, mem_fraction_static=None,
                                  enable_memory_saver=False, env={"SGLANG_USE_CPU_ENGINE": "1"})
    report = Report()
    await report.step("help_flags", asyncio.to_thread(check_flags, cfg))
    server = SGLangServer(cfg, log_path=workdir / "sglang.log")
    await report.step("start", server.start(timeout_s=600))
    client = EngineClient(server.url, timeout=300)
    try:
        await report.step("model_info", client.model_info())
        base = await report.step("generate", client.generate(PROMPT, GREEDY))
        if base:
            turn = PROMPT + base["output_ids"] + [11, 12]
            await report.step("prefix_reuse", _cached(client, turn))
        await report.step("stream", _stream(client))
        await report.step("abort", _abort(client))
        for mode in ("abort", "retract", "in_place"):
            await report.step(f"pause_{mode}", _pause(client, mode))
        await report.step("flush_cache", client.flush_cache())
        weights = load_file(str(next(folder.glob("*.safetensors"))))
        embed = "model.embed_tokens.weight"
        noisy = weights[embed] + 0.5 * torch.randn_like(weights[embed])
        await report.step("tensor_update", _tensor_update(client, serialize_named_tensors([(embed, noisy)])))
        await report.step("disk_update", client.update_weights_from_disk(str(folder), weight_version="2"))
        await report.step("same_after_disk_restore", _same(client, base))
        save_file({embed: noisy.contiguous()}, str(workdir / "sent.safetensors"))
        await report.step("distributed_update", _distributed(client, workdir / "sent.safetensors", embed))
        await report.step("release_resume", _release_resume(client))
        await report.step("health_generate", _health_generate(server.url))
    finally:
        await client.aclose()
        await server.stop()
    return {"model": model_path, "url": server.url, "steps": report.steps,
            "ok": all(s["ok"] for s in report.steps)}


async def _cached(client, turn):
    out = await client.generate(turn, GREEDY)
    return {"cached_tokens": out["meta_info"].get("cached_tokens"), "prompt_tokens": len(turn)}


async def _stream(client):
    chunks = [c async for c in client.generate_stream(PROMPT, GREEDY)]
    return {"chunks": len(chunks), "last_finish": chunks[-1]["meta_info"]["finish_reason"] if chunks else None}


async def _abort(client):
    task = asyncio.create_task(client.generate(PROMPT, {**GREEDY, "max_new_tokens": 4000}, rid="gpu-check-abort"))
    await asyncio.sleep(0.5)
    await client.abort("gpu-check-abort")
    out = await task
    return {"finish_reason": out["meta_info"]["finish_reason"], "tokens": len(out["output_ids"])}


async def _pause(client, mode):
    task = asyncio.create_task(client.generate(PROMPT, {**GREEDY, "max_new_tokens": 400}))
    await asyncio.sleep(0.3)
    paused = await client.pause(mode)
    await client.resume_generation()
    out = await task
    return {"pause": paused, "finish_reason": out["meta_info"]["finish_reason"]}


async def _tensor_update(client, payload):
    async with client.weight_update_window(weight_version="1"):
        result = await client.update_weights_from_tensor(payload, weight_version="1")
    return {"result": result, "weight_version": (await client.model_info()).get("weight_version")}


async def _same(client, base):
    out = await client.generate(PROMPT, GREEDY)
    return {"same_as_first": bool(base) and out["output_ids"] == base["output_ids"]}


async def _distributed(client, file: Path, name: str):
    port = _free_port()
    sender = subprocess.Popen([sys.executable, "-m", "services.engine.gpu_check", "--send", str(file),
                               "--send-port", str(port), "--send-name", name])
    try:
        from safetensors.torch import load_file

        tensor = load_file(str(file))[name]
        await client.init_weights_update_group("127.0.0.1", port, 1, 2, "gpu-check", backend="gloo")
        async with client.weight_update_window(weight_version="3"):
            result = await client.update_weights_from_distributed([name], ["float32"], [list(tensor.shape)],
                                                                  "gpu-check", weight_version="3")
        await client.destroy_weights_update_group("gpu-check")
        return {"result": result, "sender_exit": await asyncio.to_thread(sender.wait, 120)}
    finally:
        if sender.poll() is None:
            sender.kill()


async def _release_resume(client):
    released = await client.release_memory()
    resumed = await client.resume_memory()
    out = await client.generate(PROMPT, GREEDY)
    return {"released": released, "resumed": resumed, "tokens_after": len(out["output_ids"])}


async def _health_generate(url):
    import httpx

    async with httpx.AsyncClient(timeout=120) as http:
        return {"status": (await http.get(f"{url}/health_generate")).status_code}


def _send(file: str, port: int, name: str) -> None:
    from safetensors.torch import load_file

    from .weights import broadcast_rank0, join_weight_group

    group, _store = join_weight_group("127.0.0.1", port, 0, 2, "gpu-check", timeout_s=300)
    broadcast_rank0(group, load_file(file)[name].contiguous())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-qwen")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--workdir", default=".gyre/gpu_check")
    parser.add_argument("--module", default="sglang.launch_server",
                        help="launcher module (tests.engine._fakes dry-runs this script on CPU)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter that has sglang")
    parser.add_argument("--cpu", action="store_true", help="run SGLang's CPU engine (no GPU)")
    parser.add_argument("--send")
    parser.add_argument("--send-port", type=int)
    parser.add_argument("--send-name")
    args = parser.parse_args()
    if args.send:
        _send(args.send, args.send_port, args.send_name)
        return
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    folder = resolve_model(args.model).folder
    result = asyncio.run(run_checks(args.model, folder, args.port or _free_port(), workdir, args.module,
                                    args.python, args.cpu))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({s["step"]: s["ok"] for s in result["steps"]}, indent=2))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
