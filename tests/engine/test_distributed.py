"""A distributed weight update over gloo from a second process (the trainer's role)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from services.cell.adapters import push_weights
from services.engine.client import CellError

from .conftest import asgi_client

ROOT = Path(__file__).resolve().parents[2]
EMBED = "model.embed_tokens.weight"
Q0 = "model.layers.0.self_attn.q_proj.weight"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_weights_broadcast_from_a_trainer_process(fresh_service, tmp_path):
    original = fresh_service.original
    gen = torch.Generator().manual_seed(1)
    new = {EMBED: original[EMBED] + 0.3 * torch.randn(original[EMBED].shape, generator=gen),
           Q0: (original[Q0] * -1).to(torch.bfloat16)}
    save_file(new, str(tmp_path / "w.safetensors"))
    port, names = _free_port(), [Q0, EMBED]
    q0_dims = "x".join(str(d) for d in original[Q0].shape)
    sender = subprocess.Popen(
        [sys.executable, "-m", "tests.engine.weight_sender", "--port", str(port), "--file",
         str(tmp_path / "w.safetensors"), "--group", "g1", "--names", ",".join(names),
         "--refused", f"float32:3x3,int64:{q0_dims},float32:{q0_dims}"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        async with asgi_client(fresh_service, admin_token="secret") as cell:
            before = await cell.generate(list(range(100, 130)), {"max_new_tokens": 5, "temperature": 0})
            await cell.init_weights_update_group("127.0.0.1", port, 1, 2, "g1")
            # Refused updates: each announced tensor is still received (the trainer sent it),
            # so the group stays in step; nothing is applied.
            with pytest.raises(CellError) as err:  # wrong shape
                await cell.update_weights_from_distributed([Q0], ["float32"], [[3, 3]], "g1")
            assert err.value.status == 400 and "shape" in err.value.message
            with pytest.raises(CellError) as err:  # not a floating point dtype
                await cell.update_weights_from_distributed([Q0], ["int64"], [list(original[Q0].shape)], "g1")
            assert err.value.status == 400
            with pytest.raises(CellError) as err:  # unknown name
                await cell.update_weights_from_distributed(["no.such.weight"], ["float32"],
                                                           [list(original[Q0].shape)], "g1")
            assert err.value.status == 400
            # unreadable announcements: refused before receiving (the trainer sent nothing for them either)
            for dtypes, shapes in ((["bogus"], [[3, 3]]), (["float32"], [[-1]]), (["float32"], ["3x3"])):
                with pytest.raises(CellError) as err:
                    await cell.update_weights_from_distributed([Q0], dtypes, shapes, "g1")
                assert err.value.status == 400
            params = dict(fresh_service.engine.runner.model.named_parameters())
            assert torch.equal(params[Q0], original[Q0]) and fresh_service.engine.weight_version == "0"
            result = await cell.update_weights_from_distributed(
                names, ["bfloat16", "float32"], [list(new[n].shape) for n in names], "g1", weight_version="11")
            assert result["success"]
            out, _ = await asyncio.to_thread(sender.communicate, timeout=60)
            assert sender.returncode == 0, out
            after = await cell.generate(list(range(100, 130)), {"max_new_tokens": 5, "temperature": 0})
            assert after["meta_info"]["weight_version"] == "11" and after["output_ids"] != before["output_ids"]
            await cell.destroy_weights_update_group("g1")
            with pytest.raises(CellError):
                await cell.update_weights_from_distributed([Q0], ["float32"], [list(original[Q0].shape)], "g1")
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait()
    params = dict(fresh_service.engine.runner.model.named_parameters())
    assert torch.equal(params[EMBED], new[EMBED])
    assert torch.equal(params[Q0], new[Q0].float())


async def test_a_distributed_update_after_a_failed_windowed_push_is_applied(fresh_service, tmp_path):
    """The cell agent's push_weights (begin / tensor / end) fails part-way: the window must
    not stay open, or the trainer's next distributed update (which opens no window) would
    answer success while only staged, and the cell would serve old weights as the new version."""
    original = fresh_service.original
    async with asgi_client(fresh_service, admin_token="secret") as cell:
        with pytest.raises(CellError):
            await push_weights(cell, 5, {Q0: torch.zeros(3, 3)})
        assert fresh_service.weights.staged is None
        assert (await cell.model_info())["weight_version"] == "0"  # the failed push is not counted
        new = {Q0: original[Q0] * -1}
        save_file(new, str(tmp_path / "w.safetensors"))
        port = _free_port()
        sender = subprocess.Popen(
            [sys.executable, "-m", "tests.engine.weight_sender", "--port", str(port), "--file",
             str(tmp_path / "w.safetensors"), "--group", "g2", "--names", Q0],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            await cell.init_weights_update_group("127.0.0.1", port, 1, 2, "g2")
            answer = await cell.update_weights_from_distributed([Q0], ["float32"], [list(original[Q0].shape)], "g2",
                                                               weight_version="6")
            out, _ = await asyncio.to_thread(sender.communicate, timeout=60)
            assert sender.returncode == 0, out
            assert answer["success"]
            params = dict(fresh_service.engine.runner.model.named_parameters())
            assert torch.equal(params[Q0], new[Q0]) and (await cell.model_info())["weight_version"] == "6"
            await cell.destroy_weights_update_group("g2")
        finally:
            if sender.poll() is None:
                sender.kill()
                sender.wait()
