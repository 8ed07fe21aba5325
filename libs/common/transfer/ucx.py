"""UCX adapter: block reads/writes as tagged messages through ``ucxx`` (or ucx-py's ``ucp``).

ucxx 0.52 has no one-sided put/get in Python, so each agent also serves its registered
regions: a listener answers ``read`` requests by sending the asked byte ranges and
``write`` requests by receiving them into place. One request, in order on one endpoint::

    client -> server   u64 header length, JSON {"op": "read"|"write", "id": n, "blocks": [[region, offset, length], ...]}
    server -> client   i64 status (0 ok, else the length of an error text that follows)
    read:  server -> client  each block's bytes
    write: client -> server  each block's bytes, then server -> client  i64 status 0

Everything after the header travels under the request's own tag (its ``id``): ucxx 0.52
does not say how many bytes a receive got, so a message left over from an abandoned request
(a shorter one would land silently) must be unable to match a later request's receives.

Every block is checked against the regions before a byte moves, so a bad request is
refused whole. All UCX work runs on one event loop thread per process (UCX's worker is
process-wide); the agent's methods are blocking and safe to call from any other thread.
Transports: TCP by default (``UcxConfig.transports``); shared memory (``posix``/``cma``)
is much faster between processes on one host but does not support endpoint error
handling, so it is switched off with those. The listener binds every interface: tests
run it inside a private network namespace.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from .port import (
    Block,
    PeerDescriptor,
    RegionInfo,
    RegionTable,
    TransferFailed,
    TransferReport,
    TransferTimeout,
    check_blocks,
    coalesce,
)

log = logging.getLogger(__name__)

BACKEND = "ucx"
_SHM = ("posix", "sysv", "cma", "knem", "xpmem", "sm")


@dataclass(frozen=True)
class UcxConfig:
    host: str = "127.0.0.1"
    transports: str = "tcp,self"  # UCX_TLS; e.g. "posix,cma,tcp,self" for shared memory on one host
    message_bytes: int = 16 << 20  # adjacent blocks are merged into messages of at most this size
    # UCX's 8 KiB TCP segments cap loopback at ~0.3 GB/s here; 64 KiB segments give ~1 GB/s.
    options: tuple[tuple[str, str], ...] = (("TCP_TX_SEG_SIZE", "64k"), ("TCP_RX_SEG_SIZE", "64k"))

    @property
    def error_handling(self) -> bool:
        return not any(t in self.transports.split(",") for t in _SHM)

    def build(self) -> "UcxAgent":
        return UcxAgent(self)


def import_ucx():
    """(module, name): ``ucxx`` when installed, else ucx-py's ``ucp``; raises ImportError."""
    try:
        import ucxx

        return ucxx, "ucxx"
    except ImportError:
        import ucp  # ucx-py, the predecessor with the same API shape

        return ucp, "ucp"


class _LoopThread:
    """The process's one UCX event loop (ucx is initialised on it once)."""

    _instance: "_LoopThread | None" = None
    _guard = threading.Lock()

    def __init__(self, config: UcxConfig) -> None:
        self.config = config
        self.ucx, self.library = import_ucx()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="gyre-ucx", daemon=True)
        self.thread.start()
        self.run(self._init(), 30)

    async def _init(self) -> None:
        self.ucx.init(options={"TLS": self.config.transports, **dict(self.config.options)})

    @classmethod
    def get(cls, config: UcxConfig) -> "_LoopThread":
        with cls._guard:
            if cls._instance is None:
                cls._instance = cls(config)
            elif (cls._instance.config.transports, cls._instance.config.options) != (config.transports, config.options):
                log.warning("ucx already initialised with TLS=%s %s; ignoring %s %s", cls._instance.config.transports,
                            cls._instance.config.options, config.transports, config.options)
            return cls._instance

    def run(self, coro, timeout_s: float):
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout=timeout_s + 5)
        except TimeoutError:
            future.cancel()
            raise TransferTimeout(f"ucx operation did not finish within {timeout_s:g} s") from None


class UcxAgent(RegionTable):
    backend = BACKEND

    def __init__(self, config: UcxConfig | None = None) -> None:
        super().__init__()
        self.config = config or UcxConfig()
        self._io = _LoopThread.get(self.config)
        self.library = self._io.library
        self._endpoints: dict[str, tuple[Any, asyncio.Lock]] = {}
        self._connecting: dict[str, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._listener = self._io.run(self._listen(), 30)
        self._endpoint = f"{self.config.host}:{self._listener.port}"

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def register(self, name: str, buffer: Any) -> RegionInfo:
        region = self._add(name, buffer)
        if region.view is None:
            self._pop(name)
            raise ValueError("the ucx adapter here serves CPU memory only")
        return self.region_info(name, False)

    def unregister(self, name: str) -> None:
        self._pop(name)

    def descriptor(self, names: Iterable[str] | None = None, *, checksums: bool = False,
                   meta: dict[str, Any] | None = None) -> PeerDescriptor:
        chosen = list(names) if names is not None else self.names()
        return PeerDescriptor(BACKEND, self._endpoint, tuple(self.region_info(n, checksums) for n in chosen),
                              dict(meta or {}))

    def read(self, peer: PeerDescriptor, blocks: Sequence[Block], *, timeout_s: float = 60.0) -> TransferReport:
        return self._batch(peer, blocks, timeout_s, "read")

    def write(self, peer: PeerDescriptor, blocks: Sequence[Block], *, timeout_s: float = 60.0) -> TransferReport:
        return self._batch(peer, blocks, timeout_s, "write")

    def close(self) -> None:
        try:
            self._io.run(self._close(), 10)
        except Exception as exc:  # closing is best effort; the loop thread ends with the process
            log.debug("ucx close: %s", exc)
        for name in self.names():
            self._pop(name)

    # -- client side (on the loop) -----------------------------------------------------
    def _batch(self, peer: PeerDescriptor, blocks: Sequence[Block], timeout_s: float, op: str) -> TransferReport:
        if peer.backend != BACKEND:
            raise TransferFailed(f"peer speaks {peer.backend!r}, this agent {BACKEND!r}")
        if not blocks:
            return TransferReport(BACKEND, 0, 0, 0.0)
        nbytes = check_blocks(blocks, self.sizes(), peer)
        count = len(blocks)
        blocks = coalesce(blocks, self.config.message_bytes)
        views = [self.view(b.local)[b.local_offset : b.local_offset + b.length] for b in blocks]
        keep_alive = [self._get(b.local).buffer for b in blocks]  # live even if unregistered mid-flight
        started = time.perf_counter()
        self._io.run(self._request(peer.endpoint, op, blocks, views, timeout_s), timeout_s)
        del keep_alive
        return TransferReport(BACKEND, count, nbytes, time.perf_counter() - started)

    async def _request(self, endpoint: str, op: str, blocks: Sequence[Block], views: list[np.ndarray],
                       timeout_s: float) -> None:
        """One deadline for connecting, waiting for the endpoint and the exchange: the caller's
        own (``_LoopThread.run``, 5 s later) then never has to cancel a request half done."""
        try:
            await asyncio.wait_for(self._request_on(endpoint, op, blocks, views), timeout_s)
        except asyncio.TimeoutError:
            raise TransferTimeout(f"ucx {op} with {endpoint}: no completion within {timeout_s:g} s") from None

    async def _request_on(self, endpoint: str, op: str, blocks: Sequence[Block], views: list[np.ndarray]) -> None:
        while True:
            try:
                entry = await self._connect(endpoint)
            except Exception as exc:  # refused or unreachable
                raise TransferFailed(f"ucx connect to {endpoint} failed: {type(exc).__name__}: {exc}") from None
            ep, lock = entry
            async with lock:
                if self._endpoints.get(endpoint) is not entry:
                    continue  # dropped by the request before us while we waited: connect anew
                try:
                    await self._exchange(ep, op, blocks, views)
                    return
                except _Refused as exc:
                    raise TransferFailed(str(exc)) from None
                except BaseException as exc:
                    # cancelled (deadline) or broken mid-exchange: the stream is out of step
                    self._drop(endpoint, entry)
                    if isinstance(exc, TransferFailed) or not isinstance(exc, Exception):
                        raise
                    raise TransferFailed(f"ucx {op} with {endpoint} failed: {type(exc).__name__}: {exc}") from None

    async def _exchange(self, ep, op: str, blocks: Sequence[Block], views: list[np.ndarray]) -> None:
        request_id = next(self._ids)
        header = json.dumps({"op": op, "id": request_id,
                             "blocks": [[b.remote, b.remote_offset, b.length] for b in blocks]}).encode()
        await ep.send(np.array([len(header)], dtype=np.uint64))
        await ep.send(np.frombuffer(header, dtype=np.uint8))
        stream = _Tagged(ep, request_id)
        await _expect_ok(stream)
        # All posted at once: UCX matches same-tag messages in posting order, and keeping
        # many in flight is what makes small blocks fast.
        await asyncio.gather(*[(stream.recv(v) if op == "read" else stream.send(v)) for v in views])
        if op == "write":
            await _expect_ok(stream)

    async def _connect(self, endpoint: str) -> tuple[Any, asyncio.Lock]:
        """The cached endpoint, or the one connection being opened for all who ask meanwhile
        (shielded: one caller's deadline does not cancel the others' connect)."""
        entry = self._endpoints.get(endpoint)
        if entry is not None:
            return entry
        pending = self._connecting.get(endpoint)
        if pending is None:
            pending = asyncio.ensure_future(self._open(endpoint))
            self._connecting[endpoint] = pending

            def settled(future: asyncio.Future) -> None:
                if self._connecting.get(endpoint) is future:
                    del self._connecting[endpoint]
                if not future.cancelled():
                    future.exception()  # retrieved: no "never retrieved" warning when all waiters left

            pending.add_done_callback(settled)
        return await asyncio.shield(pending)

    async def _open(self, endpoint: str) -> tuple[Any, asyncio.Lock]:
        host, port = endpoint.rsplit(":", 1)
        ep = await self._io.ucx.create_endpoint(host, int(port), endpoint_error_handling=self.config.error_handling)
        entry = (ep, asyncio.Lock())
        self._endpoints[endpoint] = entry
        return entry

    def _drop(self, endpoint: str, entry: tuple[Any, asyncio.Lock]) -> None:
        """Aborts ``entry``'s endpoint; uncaches it only if it is still the one cached."""
        if self._endpoints.get(endpoint) is entry:
            del self._endpoints[endpoint]
        try:
            entry[0].abort()
        except Exception:  # already broken
            pass

    async def _close(self) -> None:
        for pending in list(self._connecting.values()):
            pending.cancel()
        for endpoint in list(self._endpoints):
            ep, _ = self._endpoints.pop(endpoint)
            try:
                await ep.close()
            except Exception:
                pass
        self._listener.close()

    # -- server side (on the loop) -----------------------------------------------------
    async def _listen(self):
        return self._io.ucx.create_listener(self._serve, port=0, endpoint_error_handling=self.config.error_handling)

    async def _serve(self, ep) -> None:
        while True:
            try:
                size = np.empty(1, dtype=np.uint64)
                await ep.recv(size)
                raw = np.empty(int(size[0]), dtype=np.uint8)
                await ep.recv(raw)
            except Exception:  # the peer closed its endpoint: normal end of a connection
                return
            stream = _Tagged(ep, None)  # a header without a readable id is refused under the endpoint's tag
            try:
                request = json.loads(raw.tobytes())
                stream = _Tagged(ep, request.get("id"))
                views, keep_alive = self._serve_views(request["blocks"])
            except Exception as exc:
                await _send_status(stream, f"refused: {exc}")
                continue
            await _send_status(stream, None)
            try:
                await asyncio.gather(*[(stream.send(v) if request["op"] == "read" else stream.recv(v)) for v in views])
                if request["op"] == "write":
                    await _send_status(stream, None)
                del keep_alive  # regions unregistered meanwhile stayed alive until here
            except Exception as exc:
                log.warning("ucx peer dropped mid-%s: %s", request.get("op"), exc)
                return

    def _serve_views(self, blocks: list) -> tuple[list[np.ndarray], list[Any]]:
        views, owners = [], []
        for name, offset, length in blocks:
            data = self.view(name)
            if offset < 0 or length <= 0 or offset + length > len(data):
                raise ValueError(f"block {name}[{offset}:{offset + length}] outside {len(data)} bytes")
            views.append(data[offset : offset + length])
            owners.append(self._get(name).buffer)
        return views, owners


class _Refused(TransferFailed):
    """The peer checked the request and said no; the endpoint stays usable."""


class _Tagged:
    """An endpoint's messages under one request's tag (``None``: the endpoint's own)."""

    def __init__(self, ep, tag: int | None) -> None:
        if tag is not None and (not isinstance(tag, int) or isinstance(tag, bool)):
            raise ValueError(f"request id must be an integer, not {tag!r}")
        self.ep, self.tag = ep, tag

    def send(self, buffer):
        return self.ep.send(buffer, tag=self.tag)

    def recv(self, buffer):
        return self.ep.recv(buffer, tag=self.tag)


async def _send_status(ep, error: str | None) -> None:
    text = (error or "").encode()
    await ep.send(np.array([len(text)], dtype=np.int64))
    if text:
        await ep.send(np.frombuffer(text, dtype=np.uint8))


async def _expect_ok(ep) -> None:
    status = np.empty(1, dtype=np.int64)
    await ep.recv(status)
    if int(status[0]):
        text = np.empty(int(status[0]), dtype=np.uint8)
        await ep.recv(text)
        raise _Refused(f"peer: {text.tobytes().decode(errors='replace')}")
