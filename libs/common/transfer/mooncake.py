"""Mooncake transfer engine adapter: one-sided batch reads/writes of registered memory.

Here (``mooncake-transfer-engine-non-cuda``) it runs the TCP transport with the
peer-to-peer handshake, so no metadata server is needed; on clusters the same calls run
over RDMA (``protocol="rdma"``, ``device`` naming the NICs) with the RDMA/CUDA builds.
The library needs the system ``libibverbs1`` even for TCP, logs "No RDMA devices found"
on machines without them (harmless), and its listener binds every interface whatever
``host`` says: tests run it inside a private network namespace.

A peer is addressed by ``host:rpc_port`` (its segment name under P2PHANDSHAKE); blocks
carry raw addresses from the owner's :class:`RegionInfo`.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from .port import (
    Block,
    PeerDescriptor,
    RegionInfo,
    RegionTable,
    TransferFailed,
    TransferReport,
    TransferTimeout,
    check_blocks,
)

log = logging.getLogger(__name__)

BACKEND = "mooncake"


@dataclass(frozen=True)
class MooncakeConfig:
    host: str = "127.0.0.1"
    protocol: str = "tcp"  # "rdma" on clusters
    metadata: str = "P2PHANDSHAKE"  # or an etcd/http metadata server URL
    device: str = ""  # RDMA device names, "" for TCP

    def build(self) -> "MooncakeAgent":
        return MooncakeAgent(self)


class MooncakeAgent(RegionTable):
    backend = BACKEND

    def __init__(self, config: MooncakeConfig | None = None) -> None:
        super().__init__()
        from mooncake.engine import TransferEngine  # the adapter is the only importer

        self.config = config or MooncakeConfig()
        self._engine = TransferEngine()
        rc = self._engine.initialize(self.config.host, self.config.metadata, self.config.protocol, self.config.device)
        if rc != 0:
            raise TransferFailed(f"mooncake initialize({self.config.host!r}, {self.config.protocol!r}) returned {rc}")
        self._endpoint = f"{self.config.host}:{self._engine.get_rpc_port()}"
        self._closed = False

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def register(self, name: str, buffer: Any) -> RegionInfo:
        region = self._add(name, buffer)
        rc = self._engine.register_memory(region.address, region.nbytes)
        if rc != 0:
            self._pop(name)
            raise TransferFailed(f"mooncake register_memory({name!r}, {region.nbytes} bytes) returned {rc}")
        return self.region_info(name, False)

    def unregister(self, name: str) -> None:
        region = self._pop(name)
        self._engine.unregister_memory(region.address)

    def descriptor(self, names: Iterable[str] | None = None, *, checksums: bool = False,
                   meta: dict[str, Any] | None = None) -> PeerDescriptor:
        chosen = list(names) if names is not None else self.names()
        regions = tuple(self.region_info(n, checksums) for n in chosen)
        return PeerDescriptor(BACKEND, self._endpoint, regions, dict(meta or {}))

    def read(self, peer: PeerDescriptor, blocks: Sequence[Block], *, timeout_s: float = 60.0) -> TransferReport:
        return self._batch(peer, blocks, timeout_s, write=False)

    def write(self, peer: PeerDescriptor, blocks: Sequence[Block], *, timeout_s: float = 60.0) -> TransferReport:
        return self._batch(peer, blocks, timeout_s, write=True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for name in self.names():
            self.unregister(name)
        # The engine object ends its threads when collected.
        self._engine = None  # type: ignore[assignment]

    # -- plumbing ------------------------------------------------------------------------
    def _batch(self, peer: PeerDescriptor, blocks: Sequence[Block], timeout_s: float, *, write: bool) -> TransferReport:
        if peer.backend != BACKEND:
            raise TransferFailed(f"peer speaks {peer.backend!r}, this agent {BACKEND!r}")
        if not blocks:
            return TransferReport(BACKEND, 0, 0, 0.0)
        nbytes = check_blocks(blocks, self.sizes(), peer)
        local = [self._get(b.local).address + b.local_offset for b in blocks]
        remote = [peer.region(b.remote).address + b.remote_offset for b in blocks]
        lengths = [b.length for b in blocks]
        keep_alive = [self._get(b.local).buffer for b in blocks]  # live even if unregistered mid-flight
        call = self._engine.batch_transfer_sync_write if write else self._engine.batch_transfer_sync_read
        started = time.perf_counter()
        # No lock: the engine's batch calls are thread-safe, and one stuck peer must not hold up others.
        rc = _run_with_deadline(lambda: _call(call, peer.endpoint, local, remote, lengths, keep_alive),
                                timeout_s, f"mooncake {'write to' if write else 'read from'} {peer.endpoint}")
        if rc != 0:
            raise TransferFailed(f"mooncake batch {'write to' if write else 'read from'} {peer.endpoint} "
                                 f"({len(blocks)} blocks, {nbytes} bytes) returned {rc}")
        return TransferReport(BACKEND, len(blocks), nbytes, time.perf_counter() - started)



def _call(call, endpoint, local, remote, lengths, _keep_alive) -> int:
    return call(endpoint, local, remote, lengths)  # _keep_alive: the buffers outlive a timed-out wait


def _run_with_deadline(fn, timeout_s: float, what: str):
    """Runs a blocking library call in a helper thread so that a stuck peer becomes an error."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # reported to the waiting caller
            future.set_exception(exc)

    threading.Thread(target=run, name="gyre-mooncake-batch", daemon=True).start()
    try:
        return future.result(timeout=timeout_s)
    except TimeoutError:
        raise TransferTimeout(f"{what}: no completion within {timeout_s:g} s") from None
