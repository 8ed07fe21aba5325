"""Weight pulls: the core cell publishes named tensors, satellites (or inference cells) pull them.

``publish_weights`` copies the tensors into one registered snapshot (so training may go
on changing the live parameters while peers pull) and returns a JSON-able
:class:`WeightsDescriptor` to hand over the control plane (e.g. in ``WeightsPublished``
or the scheduler's switch command); ``pull_weights`` reads the whole snapshot in one
batch into a fresh buffer and returns the named tensors (views of that buffer), or
raises and returns nothing. The descriptor carries the weight version, so whoever pulls
knows (and reports) the version it got.

    desc = publish_weights(model.state_dict(), version="v7")        # core
    tensors = pull_weights(WeightsDescriptor.from_json(payload))    # satellite
    model.load_state_dict(tensors)
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from .port import PeerDescriptor, TransferAgent, TransferFailed, split_blocks, verify_blocks

if TYPE_CHECKING:
    import torch

ALIGN = 64
BLOCK_BYTES = 4 << 20
_counter = itertools.count(1)
_default: TransferAgent | None = None
_default_lock = threading.Lock()


def default_agent() -> TransferAgent:
    """This process's shared agent (the embedded default), opened on first use."""
    global _default
    with _default_lock:
        if _default is None:
            from .default import open_agent

            _default = open_agent()
        return _default


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # torch dtype name without "torch.", e.g. "float32"
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class WeightsDescriptor:
    peer: PeerDescriptor
    region: str
    tensors: tuple[TensorSpec, ...]
    version: str | None = None

    @property
    def nbytes(self) -> int:
        return self.peer.region(self.region).nbytes

    def to_json(self) -> dict[str, Any]:
        return {"peer": self.peer.to_json(), "region": self.region, "version": self.version,
                "tensors": [[t.name, t.dtype, list(t.shape), t.offset, t.nbytes] for t in self.tensors]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "WeightsDescriptor":
        tensors = tuple(TensorSpec(n, d, tuple(s), o, b) for n, d, s, o, b in data["tensors"])
        return cls(PeerDescriptor.from_json(data["peer"]), data["region"], tensors, data.get("version"))


def publish_weights(named_tensors: Mapping[str, "torch.Tensor"], *, version: str | None = None,
                    agent: TransferAgent | None = None, checksums: bool = False) -> WeightsDescriptor:
    """Snapshots ``named_tensors`` into one registered buffer; returns what peers need to pull it."""
    import torch

    agent = agent or default_agent()
    specs, offset = [], 0
    for name, tensor in named_tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        specs.append(TensorSpec(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    flat = torch.empty(max(offset, 1), dtype=torch.uint8)
    with torch.no_grad():
        for spec, tensor in zip(specs, named_tensors.values()):
            _typed(flat, spec).copy_(tensor.detach().to("cpu"))
    region = f"weights-{version or 'x'}-{next(_counter)}"
    agent.register(region, flat)
    peer = agent.descriptor([region], checksums=checksums, meta={"kind": "weights"})
    return WeightsDescriptor(peer, region, tuple(specs), version)


def unpublish_weights(descriptor: WeightsDescriptor, *, agent: TransferAgent | None = None) -> None:
    (agent or default_agent()).unregister(descriptor.region)


def pull_weights(descriptor: WeightsDescriptor, *, agent: TransferAgent | None = None, verify: bool | None = None,
                 timeout_s: float = 300.0) -> dict[str, "torch.Tensor"]:
    """All named tensors of ``descriptor`` or an exception (TransferFailed / ChecksumMismatch).

    ``verify`` checks the owner's block checksums (default: when the descriptor has them)."""
    import torch

    agent = agent or default_agent()
    info = descriptor.peer.region(descriptor.region)
    flat = torch.empty(info.nbytes, dtype=torch.uint8)
    stage = f"pull-{descriptor.region}-{next(_counter)}"
    agent.register(stage, flat)
    try:
        agent.read(descriptor.peer, split_blocks(stage, descriptor.region, info.nbytes, BLOCK_BYTES),
                   timeout_s=timeout_s)
        if verify or (verify is None and info.checksums is not None):
            if info.checksums is None:
                raise TransferFailed("verification asked for, but the publisher sent no checksums")
            verify_blocks(agent.view(stage), info.checksums, info.checksum_block)
    finally:
        agent.unregister(stage)
    return {spec.name: _typed(flat, spec) for spec in descriptor.tensors}


def _typed(flat: "torch.Tensor", spec: TensorSpec) -> "torch.Tensor":
    import torch

    dtype = getattr(torch, spec.dtype)
    return flat[spec.offset : spec.offset + spec.nbytes].view(dtype).view(spec.shape)


class PortTransfer:
    """The trainer's ``TensorTransfer`` shape (``services/trainer/transfer.py``) over the port:
    ``await put(tensors) -> {"kind": "port", ...}`` publishes a snapshot, ``await get(desc)``
    pulls it. The publisher keeps its newest ``keep`` snapshots registered and unpublishes
    older ones (a reader must pull before ``keep`` newer puts; weights: the last versions,
    gradients: the micro-steps not yet reduced). :meth:`close` unregisters every snapshot
    still held (a satellite's seat calls it when it leaves training); a reader is never told
    here when it has pulled one, so until then the newest ``keep`` stay registered."""

    kind = "port"

    def __init__(self, agent: TransferAgent | None = None, *, keep: int = 4, checksums: bool = False) -> None:
        self.agent, self.keep, self.checksums = agent, keep, checksums
        self._published: list[WeightsDescriptor] = []

    async def put(self, tensors: Mapping[str, "torch.Tensor"], *, version: str | None = None) -> dict[str, Any]:
        import asyncio

        desc = await asyncio.to_thread(publish_weights, tensors, version=version, agent=self.agent,
                                       checksums=self.checksums)
        self._published.append(desc)
        while len(self._published) > self.keep:
            unpublish_weights(self._published.pop(0), agent=self.agent)
        return {"kind": self.kind, **desc.to_json()}

    async def get(self, descriptor: dict[str, Any]) -> dict[str, "torch.Tensor"]:
        import asyncio

        return await asyncio.to_thread(pull_weights, WeightsDescriptor.from_json(descriptor), agent=self.agent)

    async def close(self) -> None:
        """Unregisters and drops every snapshot still published (idempotent; ``put`` works
        again afterwards). A descriptor handed out before fails to pull from then on."""
        import asyncio

        while self._published:
            desc = self._published.pop(0)
            try:
                await asyncio.to_thread(unpublish_weights, desc, agent=self.agent)
            except Exception as exc:  # already gone, or the agent closed: nothing left to free
                import logging

                logging.getLogger(__name__).debug("unpublishing %s: %r", desc.region, exc)
