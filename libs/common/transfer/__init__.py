"""The transfer port (KV blocks, weights) and its Mooncake / UCX adapters.

- :mod:`.port`: ``TransferAgent`` protocol, descriptors, blocks, checksums, errors.
- :mod:`.mooncake`, :mod:`.ucx`: the adapters (the only importers of their libraries).
- :mod:`.default`: ``open_agent()``, the embedded default that picks whichever works.
- :mod:`.kv`: KV offers/fetches and ``migrate_session`` (the scheduler's step).
- :mod:`.weights`: ``publish_weights`` / ``pull_weights``.
- :mod:`.bench`: ``run_bench("transfer" | "migrate", ...)`` for ``gyre bench``.
"""

from .port import (
    Block,
    ChecksumMismatch,
    PeerDescriptor,
    RegionInfo,
    TransferAgent,
    TransferFailed,
    TransferReport,
    TransferTimeout,
)

__all__ = [
    "Block",
    "ChecksumMismatch",
    "PeerDescriptor",
    "RegionInfo",
    "TransferAgent",
    "TransferFailed",
    "TransferReport",
    "TransferTimeout",
]
