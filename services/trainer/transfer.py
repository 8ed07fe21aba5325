"""How tensors move between trainer cells: gradients to the core, weights from it.

A small port of the trainer's own (the shared transfer port in ``libs/common/transfer``
is being built; Mooncake/UCX adapters will implement this same Protocol). ``put``
returns a JSON-able descriptor that travels in an event (``MicroStepDone.gradient``,
``WeightsPublished.checkpoint_digest``); ``get`` resolves it on the other side.

- :class:`InProcessTransfer`: cells in one process share tensors by reference.
- :class:`BlobTransfer`: safetensors bytes in the content-addressed blob store (works
  across processes and machines, and survives a restart of the core: a killed core
  rebuilds its step from the log and these blobs).
"""

from __future__ import annotations

import itertools
import uuid
from typing import Any, Protocol, runtime_checkable

import torch

from libs.common.bus.port import BlobStore


@runtime_checkable
class TensorTransfer(Protocol):
    async def put(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]: ...

    async def get(self, descriptor: dict[str, Any]) -> dict[str, torch.Tensor]: ...


GradientSink = TensorTransfer  # satellite -> core
WeightSource = TensorTransfer  # core -> satellites and checkpoints


class InProcessTransfer:
    """Gradients handed over in this process's memory. Keys carry a per-process prefix: a
    restarted core reads its dead predecessor's ``MicroStepDone`` events again, and their
    descriptors must not name a gradient this process's worker stored since (a counter
    alone would restart at 0, and the core would add the wrong micro-step's gradient)."""

    def __init__(self) -> None:
        self._items: dict[str, dict[str, torch.Tensor]] = {}
        self._ids = itertools.count()
        self._prefix = f"mem-{uuid.uuid4().hex[:12]}"

    async def put(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        key = f"{self._prefix}-{next(self._ids)}"
        self._items[key] = {k: v.detach().clone() for k, v in tensors.items()}
        return {"kind": "memory", "key": key}

    async def get(self, descriptor: dict[str, Any]) -> dict[str, torch.Tensor]:
        try:
            return self._items.pop(descriptor["key"])  # read once, by the core
        except KeyError:
            raise LookupError(f"{descriptor['key']} is gone (another process, or a restart)") from None


class RoutedTransfer:
    """Puts through ``primary``; gets by the descriptor's kind (the core reads its own
    worker's gradients in memory and the satellites' from blobs)."""

    def __init__(self, primary: TensorTransfer, **by_kind: TensorTransfer) -> None:
        self.primary, self.by_kind = primary, by_kind

    async def put(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        return await self.primary.put(tensors)

    async def get(self, descriptor: dict[str, Any]) -> dict[str, torch.Tensor]:
        kind = descriptor.get("kind")
        if kind not in self.by_kind:
            raise LookupError(f"no transfer for {kind!r} descriptors here")
        return await self.by_kind[kind].get(descriptor)


class BlobTransfer:
    def __init__(self, blobs: BlobStore) -> None:
        self.blobs = blobs

    async def put(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        from safetensors.torch import save

        data = save({k: v.detach().contiguous().cpu() for k, v in tensors.items()})
        return {"kind": "blob", "digest": await self.blobs.put(data), "bytes": len(data)}

    async def get(self, descriptor: dict[str, Any]) -> dict[str, torch.Tensor]:
        from safetensors.torch import load

        return load(await self.blobs.get(descriptor["digest"]))
