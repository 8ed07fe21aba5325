"""Weights & Biases, offline: a run with ``metrics.wandb_project`` writes its W&B run under
``runs/<run>/wandb`` without a network; the records read back from the run file carry the
project, the run config and every step's figures."""

from __future__ import annotations

import json
import struct

import pytest

from gyre.metrics import RunMetrics
from libs.common.runconfig import load_run_config

wandb = pytest.importorskip("wandb")


def read_records(path):
    """The records of a ``.wandb`` file: a 7-byte header (``:W&B``, magic, version), then
    LevelDB-log framing (32 KiB blocks; chunks of crc32, length, type: full/first/middle/last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, records, pending = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_offline_wandb_run_is_written_under_the_run_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens: any network use would fail
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = load_run_config(None, [f"run.dir={tmp_path}", "run.id=wb1", "metrics.wandb_project=gyre-test",
                                 "metrics.tensorboard=false"])
    metrics = RunMetrics.for_run(cfg)
    for step in range(3):
        metrics.step(step, [0.0, 0.5 * step, 1.0], [False, True, False], 1, 3,
                     {"loss": 0.1 * step, "clip_fraction": 0.05})
    metrics.close()

    runs = list((tmp_path / "wb1" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((tmp_path / "wb1").rglob("*"))
    assert not (tmp_path / "wb1" / "tensorboard").exists()
    (run_file,) = runs[0].glob("run-*.wandb")
    records = read_records(run_file)
    kinds = [r.WhichOneof("record_type") for r in records]
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.project == "gyre-test" and run.display_name == "wb1"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    config = {k: v.get("value", v) if isinstance(v, dict) and set(v) == {"value"} else v for k, v in config.items()}
    assert config["run"]["id"] == "wb1" and config["metrics"]["wandb_project"] == "gyre-test"
    history = [{(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [h["_step"] for h in history] == [0, 1, 2]
    assert [h["reward/mean"] for h in history] == pytest.approx([1 / 3, 1 / 2, 2 / 3])
    assert history[2]["train/loss"] == pytest.approx(0.2)
    assert history[1]["rollouts/partial_score_share"] == pytest.approx(1 / 3)
    assert "exit" in kinds  # finished cleanly


def test_wandb_is_off_unless_a_project_is_set(tmp_path):
    cfg = load_run_config(None, [f"run.dir={tmp_path}", "run.id=wb2"])
    metrics = RunMetrics.for_run(cfg)
    assert metrics.wandb is None
    metrics.step(0, [1.0], [False], 0, 1, None)
    metrics.close()
    assert not (tmp_path / "wb2" / "wandb").exists() and (tmp_path / "wb2" / "tensorboard").is_dir()
