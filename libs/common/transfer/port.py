"""The transfer port: move many blocks of registered memory between processes.

One :class:`TransferAgent` per process (per cell). The owner of some memory *registers*
it under a name (a numpy array or a CPU/GPU tensor, kept alive by the agent) and hands a
:class:`PeerDescriptor` to others through the control plane (an HTTP answer, an event, the
scheduler's API); it is plain JSON (:meth:`PeerDescriptor.to_json`). A peer then
``read``s blocks of those regions into its own registered memory, or ``write``s its
blocks into them, many blocks in one batch.

Worked example (process A owns KV, process B pulls it)::

    a.register("kv-7", kv_array)                  # A
    desc = a.descriptor(["kv-7"], checksums=True)  # A -> control plane -> B
    b.register("stage", np.empty_like(kv_array))   # B
    b.read(desc, [Block("stage", 0, "kv-7", 0, n)]) # B: bytes now in "stage"
    verify_blocks(b.view("stage"), desc.region("kv-7").checksums)  # debug / tests

Failure rules: a transfer that fails or passes its deadline raises
:class:`TransferFailed` (or its subclass :class:`TransferTimeout`) and the caller must
treat the destination region as garbage. Callers therefore always land data in a
*staging* region and apply it only after the whole batch (and, when asked, its
checksums) succeeded; this is how KV import and weight pulls stay all-or-nothing.

Adapters: :mod:`.mooncake` (Mooncake transfer engine, one-sided over TCP here, RDMA on
clusters) and :mod:`.ucx` (ucxx / ucx-py tagged messages). :func:`.default.open_agent`
picks whichever works.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Protocol, Sequence, runtime_checkable

import numpy as np

DEFAULT_CHECKSUM_BLOCK = 1 << 20  # bytes covered by one checksum


class TransferFailed(RuntimeError):
    """A batch did not complete; the destination's content is undefined."""


class TransferTimeout(TransferFailed):
    """A batch did not complete before its deadline."""


class ChecksumMismatch(TransferFailed):
    """Bytes arrived but differ from what the owner checksummed."""


@dataclass(frozen=True)
class Block:
    """One contiguous byte range: ``length`` bytes at ``local_offset`` of the local region
    ``local`` <-> at ``remote_offset`` of the peer's region ``remote``."""

    local: str
    local_offset: int
    remote: str
    remote_offset: int
    length: int


@dataclass(frozen=True)
class RegionInfo:
    """What a peer needs to address one registered region (``address``: the raw pointer,
    used by one-sided adapters; ``checksums``: crc32 per ``checksum_block`` bytes, only
    when the owner was asked for them)."""

    name: str
    nbytes: int
    address: int = 0
    checksum_block: int = DEFAULT_CHECKSUM_BLOCK
    checksums: tuple[int, ...] | None = None


@dataclass(frozen=True)
class PeerDescriptor:
    """A process's transfer endpoint plus the regions it offers; JSON over the control plane."""

    backend: str  # "mooncake" | "ucx"
    endpoint: str  # "host:port" the adapter connects to
    regions: tuple[RegionInfo, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)

    def region(self, name: str) -> RegionInfo:
        for info in self.regions:
            if info.name == name:
                return info
        raise KeyError(f"peer {self.endpoint} offers no region {name!r}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any] | str) -> "PeerDescriptor":
        if isinstance(data, str):
            data = json.loads(data)
        regions = tuple(
            RegionInfo(**{**r, "checksums": tuple(r["checksums"]) if r.get("checksums") is not None else None})
            for r in data.get("regions", ())
        )
        return cls(data["backend"], data["endpoint"], regions, dict(data.get("meta") or {}))


@dataclass(frozen=True)
class TransferReport:
    """What one batch did."""

    backend: str
    blocks: int
    nbytes: int
    seconds: float

    @property
    def gb_s(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


@runtime_checkable
class TransferAgent(Protocol):
    backend: str

    @property
    def endpoint(self) -> str: ...

    def register(self, name: str, buffer: Any) -> RegionInfo:
        """Registers a numpy array or tensor (contiguous) under ``name``; the agent keeps it alive."""

    def unregister(self, name: str) -> None: ...

    def view(self, name: str) -> np.ndarray:
        """The registered region's bytes (uint8, CPU memory only)."""

    def descriptor(self, names: Iterable[str] | None = None, *, checksums: bool = False,
                   meta: dict[str, Any] | None = None) -> PeerDescriptor: ...

    def read(self, peer: PeerDescriptor, blocks: Sequence[Block], *, timeout_s: float = 60.0) -> TransferReport:
        """Copies each block from the peer's region into the local one; all or raise."""

    def write(self, peer: PeerDescriptor, blocks: Sequence[Block], *, timeout_s: float = 60.0) -> TransferReport:
        """Copies each block from the local region into the peer's; all or raise."""

    def close(self) -> None: ...


# -- helpers shared by the adapters -------------------------------------------------------


def as_bytes(buffer: Any) -> tuple[np.ndarray | None, int, int]:
    """(uint8 CPU view or None for device memory, address, nbytes) of a numpy array or tensor."""
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise ValueError("register a C-contiguous array")
        view = buffer.reshape(-1).view(np.uint8)
        return view, int(buffer.ctypes.data), int(buffer.nbytes)
    if hasattr(buffer, "data_ptr") and hasattr(buffer, "is_contiguous"):  # a torch tensor
        if not buffer.is_contiguous():
            raise ValueError("register a contiguous tensor")
        nbytes = buffer.numel() * buffer.element_size()
        if buffer.device.type == "cpu":
            view = np.frombuffer(_tensor_memory(buffer, nbytes), dtype=np.uint8, count=nbytes)
            return view, int(buffer.data_ptr()), nbytes
        return None, int(buffer.data_ptr()), nbytes
    raise TypeError(f"cannot register {type(buffer).__name__}: give a numpy array or a tensor")


def _tensor_memory(tensor: Any, nbytes: int):
    import ctypes

    if nbytes == 0:
        return bytearray(0)
    return (ctypes.c_uint8 * nbytes).from_address(tensor.data_ptr())


def checksums(data: np.ndarray, block: int = DEFAULT_CHECKSUM_BLOCK) -> tuple[int, ...]:
    """crc32 of each ``block`` bytes of ``data`` (uint8)."""
    mv = memoryview(data)
    return tuple(zlib.crc32(mv[i : i + block]) for i in range(0, len(data), block))


def verify_blocks(data: np.ndarray, expected: Sequence[int] | None, block: int = DEFAULT_CHECKSUM_BLOCK) -> None:
    """Raises :class:`ChecksumMismatch` naming the first bad block (no-op without checksums)."""
    if expected is None:
        return
    got = checksums(data, block)
    if len(got) != len(expected):
        raise ChecksumMismatch(f"{len(got)} checksum blocks arrived, {len(expected)} expected")
    for i, (a, b) in enumerate(zip(got, expected)):
        if a != b:
            raise ChecksumMismatch(f"block {i} (bytes {i * block}..) differs: crc32 {a:#x} != {b:#x}")


def split_blocks(local: str, remote: str, nbytes: int, block_bytes: int, *,
                 local_offset: int = 0, remote_offset: int = 0) -> list[Block]:
    """``nbytes`` cut into blocks of at most ``block_bytes`` at matching offsets."""
    return [
        Block(local, local_offset + start, remote, remote_offset + start, min(block_bytes, nbytes - start))
        for start in range(0, nbytes, block_bytes)
    ]


def check_blocks(blocks: Sequence[Block], local_sizes: dict[str, int], peer: PeerDescriptor) -> int:
    """Validates every block against both sides' region sizes before anything moves; returns bytes."""
    total = 0
    for b in blocks:
        if b.length <= 0 or b.local_offset < 0 or b.remote_offset < 0:
            raise TransferFailed(f"bad block {b}")
        if b.local not in local_sizes:
            raise TransferFailed(f"no local region {b.local!r}")
        if b.local_offset + b.length > local_sizes[b.local]:
            raise TransferFailed(f"block {b} overruns local region {b.local!r} ({local_sizes[b.local]} bytes)")
        try:
            remote = peer.region(b.remote)
        except KeyError as exc:
            raise TransferFailed(str(exc)) from None
        if b.remote_offset + b.length > remote.nbytes:
            raise TransferFailed(f"block {b} overruns remote region {b.remote!r} ({remote.nbytes} bytes)")
        total += b.length
    return total


@dataclass
class _Region:
    buffer: Any  # kept alive while registered
    view: np.ndarray | None
    address: int
    nbytes: int


class RegionTable:
    """Registered regions by name: the bookkeeping both adapters share."""

    def __init__(self) -> None:
        self._regions: dict[str, _Region] = {}

    def _add(self, name: str, buffer: Any) -> _Region:
        if name in self._regions:
            raise ValueError(f"region {name!r} is already registered")
        view, address, nbytes = as_bytes(buffer)
        if nbytes == 0:
            raise ValueError(f"region {name!r} is empty")
        region = _Region(buffer, view, address, nbytes)
        self._regions[name] = region
        return region

    def _pop(self, name: str) -> _Region:
        try:
            return self._regions.pop(name)
        except KeyError:
            raise KeyError(f"no region {name!r}") from None

    def _get(self, name: str) -> _Region:
        try:
            return self._regions[name]
        except KeyError:
            raise KeyError(f"no region {name!r}") from None

    def view(self, name: str) -> np.ndarray:
        region = self._get(name)
        if region.view is None:
            raise ValueError(f"region {name!r} is device memory")
        return region.view

    def sizes(self) -> dict[str, int]:
        return {name: r.nbytes for name, r in self._regions.items()}

    def region_info(self, name: str, checksums_wanted: bool) -> RegionInfo:
        region = self._get(name)
        sums = checksums(region.view) if checksums_wanted and region.view is not None else None
        return RegionInfo(name, region.nbytes, region.address, DEFAULT_CHECKSUM_BLOCK, sums)

    def names(self) -> list[str]:
        return list(self._regions)


def coalesce(blocks: Sequence[Block], max_bytes: int) -> list[Block]:
    """Merges runs of blocks that are adjacent on both sides (same regions) up to ``max_bytes``:
    fewer, larger messages for adapters that pay per message."""
    merged: list[Block] = []
    for b in blocks:
        last = merged[-1] if merged else None
        if (last is not None and last.local == b.local and last.remote == b.remote
                and last.local_offset + last.length == b.local_offset
                and last.remote_offset + last.length == b.remote_offset
                and last.length + b.length <= max_bytes):
            merged[-1] = Block(last.local, last.local_offset, last.remote, last.remote_offset, last.length + b.length)
        else:
            merged.append(b)
    return merged
