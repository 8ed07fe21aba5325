"""Weight publication to inference cells through :class:`EngineClient` (SGLang's API).

``tensor``: ``/update_weights_from_tensor`` inside a ``begin/end_weight_update`` window
(all or nothing, the version recorded at ``end``); the tensors travel through shared
memory, so this is for cells on the same machine. ``disk``: the weights are written as
an HF folder (safetensors + the model's ``config.json``) and each cell loads it with
``/update_weights_from_disk``. Running rollouts go on: the engine applies an update
between forward steps and every output token keeps the version that produced it.

``update_weights_from_distributed`` (a gloo/NCCL broadcast group between the core and
the cells) is not wired yet: the engine side exists, the trainer's broadcast does not.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

log = logging.getLogger(__name__)


@dataclass
class EnginePublisher:
    clients: dict[str, object]  # cell -> services.engine.client.EngineClient
    mode: Literal["tensor", "disk"] = "tensor"
    folder: Path | None = None  # disk mode: where versions are written
    hf_config: Path | None = None  # disk mode: the model's config.json

    async def __call__(self, version: int, weights: dict[str, torch.Tensor]) -> list[str]:
        done = []
        path = self._write(version, weights) if self.mode == "disk" else None
        for cell, client in self.clients.items():
            try:
                await self._send(client, version, weights, path)
            except Exception as exc:  # one cell failing must not stop the others or the core
                log.warning("publishing v%d to %s failed: %r", version, cell, exc)
                continue
            done.append(cell)
        return done

    async def _send(self, client, version: int, weights: dict[str, torch.Tensor], path: Path | None) -> None:
        tag = str(version)
        if path is not None:
            await client.update_weights_from_disk(str(path), weight_version=tag)
            return
        from services.engine.weights import serialize_named_tensors

        named = [(k, v.detach().contiguous()) for k, v in weights.items()]
        async with client.weight_update_window(tag):
            await client.update_weights_from_tensor(serialize_named_tensors(named), weight_version=tag)

    def _write(self, version: int, weights: dict[str, torch.Tensor]) -> Path:
        from safetensors.torch import save_file

        if self.folder is None or self.hf_config is None:
            raise ValueError("disk publication needs a folder and the model's config.json")
        target = self.folder / f"v{version:06d}"
        target.mkdir(parents=True, exist_ok=True)
        seen, state = set(), {}
        for k, v in weights.items():  # tied tensors: write each storage once
            if v.data_ptr() in seen and k == "lm_head.weight":
                continue
            seen.add(v.data_ptr())
            state[k] = v.detach().contiguous().cpu()
        save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
        shutil.copy(self.hf_config, target / "config.json")
        (target / "gyre_weights.json").write_text(json.dumps({"weight_version": version}) + "\n")
        return target
