"""The SGLang adapter: command line from the cell config, launch, health, supervision and the
shared client, against a real process on 127.0.0.1 that speaks SGLang's API (see _fakes.py)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from pathlib import Path

import pytest

from services.engine.sglang_server import SGLangConfig, SGLangServer, build_command

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_command_line_is_built_from_the_cell_config():
    cfg = SGLangConfig(model_path="/models/qwen", port=31000, tp_size=4, dtype="bfloat16",
                       mem_fraction_static=0.8, admin_api_key="k", weight_version="3",
                       extra_args=("--enable-metrics",))
    cmd = build_command(cfg)
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    pairs = dict(zip(cmd[3::2], cmd[4::2]))
    assert pairs["--model-path"] == "/models/qwen" and pairs["--port"] == "31000"
    assert pairs["--tp-size"] == "4" and pairs["--dtype"] == "bfloat16"
    assert pairs["--mem-fraction-static"] == "0.8" and pairs["--admin-api-key"] == "k"
    assert "--enable-memory-saver" in cmd and cmd[-1] == "--enable-metrics"
    assert "--dp-size" not in cmd and "--context-length" not in cmd


async def test_launch_drive_supervise_and_stop(tiny_model_dir, tmp_path):
    argv_file = tmp_path / "argv.json"
    cfg = SGLangConfig(model_path=str(tiny_model_dir), port=_free_port(), admin_api_key="adm",
                       weight_version="4", module="tests.engine._fakes",
                       env={"GYRE_FAKE_SGLANG_ARGV": str(argv_file), "PYTHONPATH": str(ROOT)})
    server = SGLangServer(cfg, log_path=tmp_path / "sglang.log")
    await server.start(timeout_s=120)
    supervisor = None
    try:
        assert json.loads(argv_file.read_text()) == build_command(cfg)[3:]
        async with server.client() as cell:
            out = await cell.generate([9707, 1879, 11], {"max_new_tokens": 4, "temperature": 0})
            assert out["meta_info"]["weight_version"] == "4" and len(out["output_ids"]) == 4
            await cell.pause("in_place")
            await cell.resume_generation()
            await cell.flush_cache()
            await _client_going_away_aborts_its_stream(cell)
            first_pid = server.process.pid
            supervisor = asyncio.create_task(server.supervise(interval_s=0.2, failures_before_restart=1))
            os.killpg(first_pid, signal.SIGKILL)  # the cell crashes
            for _ in range(600):
                await asyncio.sleep(0.1)
                if server.restarts == 1 and server.running() and await cell.health():
                    break
            assert server.restarts == 1 and server.process.pid != first_pid
            again = await cell.generate([9707, 1879, 11], {"max_new_tokens": 4, "temperature": 0})
            assert again["output_ids"] == out["output_ids"]
    finally:
        if supervisor is not None:
            supervisor.cancel()
            await asyncio.gather(supervisor, return_exceptions=True)
        pid = server.process.pid if server.process else None
        await server.stop()
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)


async def _client_going_away_aborts_its_stream(cell):
    chunks = 0
    async for _ in cell.generate_stream([9707, 1879, 11], {"max_new_tokens": 5000, "ignore_eos": True}):
        chunks += 1
        if chunks == 2:
            break  # closes the HTTP stream
    for _ in range(100):
        if (await cell.server_info())["internal_states"][0]["running"] == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the abandoned stream kept generating")
