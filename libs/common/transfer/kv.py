"""KV-cache migration: a session's cached prefix moves from one inference cell to another.

Source cell: ``offer_kv`` registers the exported prefix (``[layers, 2, kv_heads, n,
head_dim]``, contiguous) and describes it: token ids, shape, dtype, weight version and
the per-layer K/V blocks (each (layer, K|V) plane, cut into blocks of at most
``block_bytes``). Target cell: ``fetch_kv`` reads every block in one batch into a
staging tensor and, only when all arrived (and the checksums match, when verifying),
hands it back for import into its prefix cache. ``release_kv`` drops the offer.

The scheduler's step during a switch is :func:`migrate_session`: port path first, the
engine's HTTP ``kv_export``/``kv_import`` as the fallback, and re-prefill (nothing to do:
the target computes the prefix on the session's next call) when both fail. Either way
the agent sees no error; the result says which happened and becomes a
``SessionRerouted`` event.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .port import Block, PeerDescriptor, TransferAgent, TransferFailed, verify_blocks

if TYPE_CHECKING:
    import torch

    from ..bus.port import EventBus
    from ..events.calls import SessionRerouted

log = logging.getLogger(__name__)

KV_BLOCK_BYTES = 1 << 20
_leases = itertools.count(1)


# -- source and target halves (run inside an engine process) ------------------------------


def kv_blocks(shape: tuple[int, ...], itemsize: int, local: str, remote: str, block_bytes: int) -> list[Block]:
    """Per-layer K/V blocks of a contiguous ``[layers, 2, ...]`` tensor, each at most ``block_bytes``."""
    layers, kinds = shape[0], shape[1]
    plane = itemsize
    for dim in shape[2:]:
        plane *= dim
    blocks = []
    for i in range(layers * kinds):
        for start in range(0, plane, block_bytes):
            off = i * plane + start
            blocks.append(Block(local, off, remote, off, min(block_bytes, plane - start)))
    return blocks


def offer_kv(agent: TransferAgent, kv: "torch.Tensor", token_ids: list[int], *, weight_version: str | None,
             checksums: bool = False, block_bytes: int = KV_BLOCK_BYTES) -> PeerDescriptor:
    """Registers ``kv`` (kept alive by the agent until :func:`release_kv`) and describes it."""
    kv = kv.contiguous()
    lease = f"kv-{next(_leases)}-{time.monotonic_ns()}"
    agent.register(lease, kv)
    meta = {"kind": "kv", "lease": lease, "token_ids": list(token_ids), "shape": list(kv.shape),
            "dtype": str(kv.dtype).removeprefix("torch."), "weight_version": weight_version,
            "block_bytes": block_bytes}
    return agent.descriptor([lease], checksums=checksums, meta=meta)


def release_kv(agent: TransferAgent, lease: str) -> bool:
    try:
        agent.unregister(lease)
    except KeyError:
        return False
    return True


def fetch_kv(agent: TransferAgent, offer: PeerDescriptor, *, verify: bool | None = None,
             timeout_s: float = 60.0) -> tuple[list[int], "torch.Tensor"]:
    """(token ids, KV tensor) of an offer, all of it or an exception; nothing is left registered."""
    import torch

    meta = offer.meta
    lease = meta["lease"]
    shape = tuple(int(d) for d in meta["shape"])
    stage_tensor = torch.empty(shape, dtype=getattr(torch, meta["dtype"]))
    if stage_tensor.numel() * stage_tensor.element_size() != offer.region(lease).nbytes:
        raise TransferFailed(f"offer {lease}: shape {shape} does not match {offer.region(lease).nbytes} bytes")
    stage = f"stage-{lease}"
    block_bytes = meta.get("block_bytes", KV_BLOCK_BYTES)
    if not isinstance(block_bytes, int) or isinstance(block_bytes, bool) or block_bytes <= 0:
        raise TransferFailed(f"offer {lease}: block_bytes must be a positive integer, not {block_bytes!r}")
    blocks = kv_blocks(shape, stage_tensor.element_size(), stage, lease, block_bytes)
    # a plan short of the region would leave part of the uninitialised staging tensor as "KV"
    planned = sum(b.length for b in blocks)
    if planned != offer.region(lease).nbytes:
        raise TransferFailed(f"offer {lease}: its blocks cover {planned} of {offer.region(lease).nbytes} bytes")
    agent.register(stage, stage_tensor)
    try:
        agent.read(offer, blocks, timeout_s=timeout_s)
        info = offer.region(lease)
        if verify or (verify is None and info.checksums is not None):
            if info.checksums is None:
                raise TransferFailed("verification asked for, but the offer has no checksums")
            verify_blocks(agent.view(stage), info.checksums, info.checksum_block)
    finally:
        agent.unregister(stage)
    return [int(t) for t in meta["token_ids"]], stage_tensor


# -- the scheduler's side --------------------------------------------------------------------


class KVCell(Protocol):
    """An inference cell as migration needs it (``services/engine/kv_port.PortCellClient``)."""

    name: str

    async def kv_offer(self, input_ids: list[int], *, checksums: bool = False) -> dict[str, Any]: ...

    async def kv_fetch(self, offer: dict[str, Any], *, verify: bool | None = None,
                       timeout_s: float = 60.0) -> dict[str, Any]: ...

    async def kv_release(self, lease: str) -> None: ...

    async def kv_export(self, input_ids: list[int]) -> bytes: ...

    async def kv_import(self, blob: bytes) -> dict[str, Any]: ...


@dataclass(frozen=True)
class MigrationResult:
    session_id: str
    from_cell: str
    to_cell: str
    kv: str  # "migrated" | "reprefilled"
    path: str | None  # "mooncake" | "ucx" | "http" | None (re-prefill)
    migrated_tokens: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    errors: tuple[str, ...] = field(default=())  # why earlier paths were passed over

    def event(self, run_id: str, *, reason: str, causation_id: str | None = None) -> "SessionRerouted":
        from ..events.calls import SessionRerouted

        return SessionRerouted(run_id=run_id, causation_id=causation_id, session_id=self.session_id,
                               from_cell=self.from_cell, to_cell=self.to_cell, reason=reason, kv=self.kv,
                               migrated_tokens=self.migrated_tokens)


async def migrate_session(source: KVCell, target: KVCell, input_ids: list[int], *, session_id: str,
                          run_id: str | None = None, bus: "EventBus | None" = None, reason: str = "drain",
                          causation_id: str | None = None, use_port: bool = True, use_http: bool = True,
                          verify: bool | None = None, timeout_s: float = 60.0) -> MigrationResult:
    """Moves the cached prefix of ``input_ids`` from ``source`` to ``target``; never raises for a
    failed move (the result says ``reprefilled``). Publishes ``SessionRerouted`` when ``bus`` is given.

    ``verify`` (default: ``GYRE_TRANSFER_VERIFY=1`` in the environment, a debug switch) has the
    source checksum every block and the target check them before importing."""
    if verify is None:
        verify = os.environ.get("GYRE_TRANSFER_VERIFY") == "1"
    started = time.perf_counter()
    errors: list[str] = []
    done: tuple[str, int, int] | None = None
    if use_port:
        done = await _via_port(source, target, input_ids, verify, timeout_s, errors)
    if done is None and use_http:
        done = await _via_http(source, target, input_ids, errors)
    path, tokens, nbytes = done if done else (None, 0, 0)
    result = MigrationResult(session_id, source.name, target.name, "migrated" if tokens else "reprefilled",
                             path if tokens else None, tokens, nbytes, time.perf_counter() - started, tuple(errors))
    if errors:
        log.warning("session %s %s -> %s: %s (%s)", session_id, source.name, target.name, result.kv, "; ".join(errors))
    if bus is not None:
        if run_id is None:
            raise ValueError("run_id is needed to publish SessionRerouted")
        await bus.publish(result.event(run_id, reason=reason, causation_id=causation_id))
    return result


async def _via_port(source: KVCell, target: KVCell, ids: list[int], verify: bool, timeout_s: float,
                    errors: list[str]) -> tuple[str, int, int] | None:
    try:
        offer = await source.kv_offer(ids, checksums=verify)
    except Exception as exc:
        errors.append(f"port offer: {exc}")
        return None
    peer = PeerDescriptor.from_json(offer)
    lease = peer.meta.get("lease")
    if not peer.meta.get("token_ids"):
        await _release(source, lease)
        errors.append("nothing cached on the source")
        return ("none", 0, 0)  # nothing to move; HTTP would find nothing either
    try:
        answer = await target.kv_fetch(offer, verify=verify, timeout_s=timeout_s)
        return (peer.backend, len(peer.meta["token_ids"]), int(answer.get("bytes", 0)))
    except Exception as exc:
        errors.append(f"port fetch over {peer.backend}: {exc}")
        return None
    finally:
        await _release(source, lease)


async def _release(source: KVCell, lease: str | None) -> None:
    if lease:
        try:
            await source.kv_release(lease)
        except Exception as exc:  # the source expires offers on its own
            log.debug("kv release %s: %s", lease, exc)


async def _via_http(source: KVCell, target: KVCell, ids: list[int], errors: list[str]) -> tuple[str, int, int] | None:
    try:
        blob = await source.kv_export(ids)
        answer = await target.kv_import(blob)
    except Exception as exc:
        errors.append(f"http: {exc}")
        return None
    if not answer.get("success", True):  # the target refused the blob: say why, as the other paths do
        errors.append(f"http import refused: {answer.get('message') or 'no reason given'}")
        return None
    return ("http", _blob_tokens(blob), len(blob))


def _blob_tokens(blob: bytes) -> int:
    """Token count of an engine's safetensors KV export (its metadata lists the ids)."""
    import json

    length = int.from_bytes(blob[:8], "little")
    meta = json.loads(blob[8 : 8 + length]).get("__metadata__", {})
    return len(json.loads(meta.get("input_ids", "[]")))
