"""Test doubles for the edges a CPU machine lacks.

Fakes two things. The ``sglang.launch_server`` program (SGLang needs a GPU here).
Run as ``python -m tests.engine._fakes <SGLang flags>``, it accepts the flags that
:func:`services.engine.sglang_server.build_command` emits, writes the argv it got to
``$GYRE_FAKE_SGLANG_ARGV`` (when set) so a test can check the command line, and serves
Gyre's embedded engine (which speaks SGLang's API) on ``--host``/``--port`` with uvicorn.
Everything behind the HTTP API is real: model, tokenizer, engine.

And the transfer library behind the KV port, for the engine tests that run in this
process's own network namespace (Mooncake and UCX bind every interface, so tests run them
in a private one: ``tests/transfer``, where the same offer expiry is checked over real
UCX): :class:`LoopbackAgent` is a ``TransferAgent`` whose peers are other agents of this
process; a read copies the bytes from the peer's registered region and is refused, as
UCX's listener refuses it, when that region is not (or no longer) registered.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from libs.common.transfer.port import (Block, PeerDescriptor, RegionInfo, RegionTable, TransferFailed,
                                       TransferReport, check_blocks)
from services.engine.main import serve


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="fake-sglang")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--admin-api-key")
    parser.add_argument("--api-key")
    parser.add_argument("--weight-version")
    parser.add_argument("--max-running-requests", type=int)
    parser.add_argument("--context-length", type=int)
    args, _ignored = parser.parse_known_args(argv)  # GPU-only flags (--tp-size, --dtype, ...)
    record = os.environ.get("GYRE_FAKE_SGLANG_ARGV")
    if record:
        with open(record, "w") as f:
            json.dump(argv, f)
    overrides = {"admin_token": args.admin_api_key or args.api_key, "weight_version": args.weight_version,
                 "max_running_requests": args.max_running_requests, "max_context": args.context_length}
    serve(args.host, args.port, args.model_path, **overrides)


class LoopbackAgent(RegionTable):
    """An in-process transfer agent; ``LoopbackAgent.peers`` finds a descriptor's owner."""

    backend = "loopback"
    peers: dict[str, "LoopbackAgent"] = {}

    def __init__(self) -> None:
        super().__init__()
        self.endpoint = f"loopback:{len(LoopbackAgent.peers) + 1}"
        LoopbackAgent.peers[self.endpoint] = self

    def register(self, name: str, buffer) -> RegionInfo:
        self._add(name, buffer)
        return self.region_info(name, False)

    def unregister(self, name: str) -> None:
        self._pop(name)

    def held(self, name: str):
        """The buffer registered as ``name`` (kept alive by this agent until unregistered)."""
        return self._get(name).buffer

    def descriptor(self, names=None, *, checksums: bool = False, meta=None) -> PeerDescriptor:
        chosen = list(names) if names is not None else self.names()
        return PeerDescriptor(self.backend, self.endpoint, tuple(self.region_info(n, checksums) for n in chosen),
                              dict(meta or {}))

    def read(self, peer: PeerDescriptor, blocks: list[Block], *, timeout_s: float = 60.0) -> TransferReport:
        nbytes = check_blocks(blocks, self.sizes(), peer)
        owner = LoopbackAgent.peers.get(peer.endpoint)
        if owner is None:
            raise TransferFailed(f"no peer at {peer.endpoint}")
        missing = sorted({b.remote for b in blocks} - set(owner.names()))
        if missing:
            raise TransferFailed(f"refused: no region {missing[0]!r}")
        for b in blocks:
            src = owner.view(b.remote)[b.remote_offset:b.remote_offset + b.length]
            self.view(b.local)[b.local_offset:b.local_offset + b.length] = src
        return TransferReport(self.backend, len(blocks), nbytes, 0.0)

    def close(self) -> None:
        LoopbackAgent.peers.pop(self.endpoint, None)


if __name__ == "__main__":
    main(sys.argv[1:])
