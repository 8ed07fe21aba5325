"""The embedded default: the first transfer library that is installed *and* works here.

``open_agent()`` tries Mooncake, then UCX (or only ``prefer``), builds an agent, and logs
which one it chose and why the others were passed over; ``probe()`` reports the same
without keeping an agent. ``GYRE_TRANSFER_BACKEND`` (``mooncake`` | ``ucx``) pins one.
``GYRE_TRANSFER_HOST`` is the address the agent advertises to its peers (in every KV offer
and port weight or gradient descriptor): 127.0.0.1 by default, which only a peer on the same
machine can reach; on a cluster set it to the pod's or node's address (the Helm chart sets
the pod IP). The libraries listen on every interface whatever it says.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from .port import TransferAgent, TransferFailed

log = logging.getLogger(__name__)

BACKENDS = ("mooncake", "ucx")


@dataclass(frozen=True)
class TransferConfig:
    """Which backend (None: the first that works) and where its listener says it lives."""

    backend: str | None = None
    host: str = field(default_factory=lambda: advertised_host())
    ucx_transports: str = "tcp,self"
    mooncake_protocol: str = "tcp"
    mooncake_device: str = ""

    def build(self) -> TransferAgent:
        return open_agent(self)


def advertised_host(environ: dict[str, str] | None = None) -> str:
    """``GYRE_TRANSFER_HOST``, else 127.0.0.1 (peers on this machine only). A value that is
    not a host name or IPv4 address raises :class:`TransferFailed` naming the variable (an
    agent cannot be opened, as when no backend works)."""
    env = os.environ if environ is None else environ
    host = (env.get("GYRE_TRANSFER_HOST") or "").strip()
    if not host:
        return "127.0.0.1"
    if any(c.isspace() or c in ":/[]" for c in host):
        raise TransferFailed(f"GYRE_TRANSFER_HOST must be a host name or IPv4 address its peers can reach "
                             f"(no port), not {host!r}")
    return host


@dataclass
class Choice:
    backend: str | None
    skipped: dict[str, str] = field(default_factory=dict)  # backend -> why not


def _build(name: str, config: TransferConfig) -> TransferAgent:
    if name == "mooncake":
        from .mooncake import MooncakeAgent, MooncakeConfig

        return MooncakeAgent(MooncakeConfig(host=config.host, protocol=config.mooncake_protocol,
                                            device=config.mooncake_device))
    if name == "ucx":
        from .ucx import UcxAgent, UcxConfig

        return UcxAgent(UcxConfig(host=config.host, transports=config.ucx_transports))
    raise ValueError(f"unknown transfer backend {name!r}; known: {', '.join(BACKENDS)}")


def open_agent(config: TransferConfig | None = None, *, prefer: str | None = None) -> TransferAgent:
    """An agent on the chosen (or first working) backend; raises TransferFailed listing why none works."""
    config = config or TransferConfig()
    wanted = prefer or config.backend or os.environ.get("GYRE_TRANSFER_BACKEND") or None
    order = (wanted,) if wanted else BACKENDS
    skipped: dict[str, str] = {}
    for name in order:
        try:
            agent = _build(name, config)
        except Exception as exc:  # ImportError, missing system library, init failure
            skipped[name] = f"{type(exc).__name__}: {exc}"
            continue
        if skipped:
            log.info("transfer: using %s at %s (skipped: %s)", name, agent.endpoint, skipped)
        else:
            log.info("transfer: using %s at %s", name, agent.endpoint)
        return agent
    raise TransferFailed(f"no transfer backend works: {skipped}")


def probe(config: TransferConfig | None = None) -> Choice:
    """Which backend ``open_agent`` would pick, and why each other one would not do."""
    config = config or TransferConfig()
    choice = Choice(None)
    for name in BACKENDS:
        try:
            agent = _build(name, config)
        except Exception as exc:
            choice.skipped[name] = f"{type(exc).__name__}: {exc}"
            continue
        agent.close()
        if choice.backend is None:
            choice.backend = name
    return choice
