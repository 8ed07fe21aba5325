"""Export a trainer checkpoint as a Hugging Face folder (``gyre export``).

The folder holds ``model.safetensors`` (the checkpoint's weights under HF names), the base
model's ``config.json``, tokenizer files, chat template and generation config, and
``gyre_export.json`` (where it came from: checkpoint, step, weight version, base model).
transformers (``AutoModelForCausalLM.from_pretrained``), SGLang (``--model-path``) and
Gyre's embedded engine (``model: <folder>``) load it as they load any local model.

A checkpoint holds weights only, not the architecture; the base model (``model.name`` of
the run config) gives it. Its shapes are checked against the weights before anything is
written, so a wrong base model is an error naming the first mismatching tensor.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint import checkpoint_for_step, latest_checkpoint, load_checkpoint

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".msgpack", ".h5")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
CACHE_MARKERS = ("READY", "gyre_model.json")  # the engine's model cache bookkeeping


class ExportError(ValueError):
    """A checkpoint that cannot be exported; the message says why."""


@dataclass(frozen=True)
class Exported:
    folder: Path
    checkpoint: Path
    step: int
    weight_version: int
    base_model: str
    tensors: int


def find_checkpoint(source: str | Path, *, runs_dir: Path = Path("runs"), step: int | None = None) -> Path:
    """A checkpoint from what a user names: a ``step-*.pt`` file, a checkpoints folder, a
    run folder (``<run>/trainer/checkpoints``) or a run id (under ``runs_dir``). Without
    ``step``, the latest; with it, the state after ``step`` updates (``step-<step>.pt``)."""
    path = Path(source)
    if path.is_file():
        if step is not None:
            raise ExportError("--step names a checkpoint inside a folder; a file was given")
        return path
    candidates = [path, path / "trainer" / "checkpoints", runs_dir / str(source) / "trainer" / "checkpoints"]
    folder = next((c for c in candidates if c.is_dir() and any(c.glob("step-*.pt"))), None)
    if folder is None:
        raise ExportError(f"no checkpoints found for {str(source)!r} (looked in: "
                          + ", ".join(str(c) for c in candidates) + ")")
    chosen = checkpoint_for_step(folder, step) if step is not None else latest_checkpoint(folder)
    if chosen is None:  # checkpoints but no LATEST marker: the newest by step
        chosen = sorted(folder.glob("step-*.pt"))[-1]
    if not chosen.is_file():
        have = ", ".join(p.stem.removeprefix("step-").lstrip("0") or "0" for p in sorted(folder.glob("step-*.pt")))
        raise ExportError(f"no checkpoint for step {step} in {folder} (steps: {have})")
    return chosen


def run_base_model(run_dir: Path, run_id: str) -> str | None:
    """``model.name`` from the run's ``RunStarted`` event, read from the run's embedded event
    store (``<run_dir>/nats``); None when the run has no such store or event."""
    import asyncio

    store = run_dir / "nats"
    if not store.is_dir():
        return None

    async def read() -> str | None:
        from libs.common.bus.jetstream import JetStreamBus
        from libs.common.events import Context, RunStarted
        from libs.common.natsserver import EmbeddedNats, live_url

        running = live_url(store)  # a gyre up still running holds the store: read through its server
        nats = None if running else EmbeddedNats(store).start()
        try:
            bus = await JetStreamBus.connect(running or nats.url, name="gyre-export")
            try:
                async for d in bus.read(Context.RUNS, filter_subject=f"gyre.{run_id}.runs.RunStarted"):
                    if isinstance(d.event, RunStarted):
                        return (d.event.config.get("model") or {}).get("name")
            finally:
                await bus.close()
        finally:
            if nats is not None:
                nats.stop()
        return None

    return asyncio.run(read())


def export_hf(checkpoint: Path, out: Path, *, base_model: str = "tiny-qwen", dtype: str | None = None,
              overwrite: bool = False) -> Exported:
    """Write ``checkpoint``'s weights as an HF folder at ``out`` on ``base_model``'s
    config and tokenizer. ``dtype`` (float32 | bfloat16 | float16) casts floating weights;
    None keeps the checkpoint's."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from services.engine.model_store import resolve_model

    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"{out} exists and is not empty (pass --force to replace it)")
    location = resolve_model(base_model)
    if location.gguf_file:
        raise ExportError(f"base model {base_model!r} is a GGUF file; export needs an HF folder "
                          "(config.json + tokenizer) as its base")
    base = location.folder
    state, weights, _ = load_checkpoint(checkpoint)
    config = AutoConfig.from_pretrained(str(base))
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    expected = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for name, shape in expected.items():
        if name not in weights:
            if tied and name == "lm_head.weight":
                continue
            raise ExportError(f"checkpoint {checkpoint.name} has no tensor {name!r} that {base_model} needs")
        if tuple(weights[name].shape) != shape:
            raise ExportError(f"tensor {name!r}: checkpoint shape {tuple(weights[name].shape)}, "
                              f"{base_model} expects {shape} (is {base_model!r} the run's base model?)")
    unknown = sorted(set(weights) - set(expected))
    if unknown:
        raise ExportError(f"checkpoint {checkpoint.name} has tensors {base_model} does not know: {unknown[:5]}")
    cast = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype or "")
    if dtype and cast is None:
        raise ExportError(f"dtype {dtype!r}: expected float32, bfloat16 or float16")
    tensors: dict[str, torch.Tensor] = {}
    for name in expected:
        if tied and name == "lm_head.weight":
            continue  # shares the embedding's storage; transformers re-ties it on load
        t = weights[name].detach().to("cpu")
        if cast is not None and t.is_floating_point():
            t = t.to(cast)
        tensors[name] = t.contiguous().clone()  # own storage each: safetensors refuses shared ones
    saved_dtype = next((t.dtype for t in tensors.values() if t.is_floating_point()), torch.float32)

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for item in base.iterdir():  # config, tokenizer, templates; never the base weights
            skip = item.name.endswith(WEIGHT_SUFFIXES) or item.name in WEIGHT_INDEXES + CACHE_MARKERS
            if item.is_file() and not skip:
                shutil.copy2(item, staging / item.name)
        cfg = json.loads((staging / "config.json").read_text())
        cfg["dtype"] = str(saved_dtype).removeprefix("torch.")
        cfg.pop("torch_dtype", None)
        (staging / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        info = {"checkpoint": str(checkpoint.resolve()), "step": state.step, "weight_version": state.weight_version,
                "base_model": base_model, "tensors": len(tensors), "dtype": cfg["dtype"]}
        (staging / "gyre_export.json").write_text(json.dumps(info, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return Exported(out, checkpoint, state.step, state.weight_version, base_model, len(tensors))
