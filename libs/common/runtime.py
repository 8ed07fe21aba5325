"""Open what a service needs from settings: the bus, the blob store and the database.

``open_runtime`` is the one place that turns ``GyreSettings`` into live handles, so that
every ``gyre serve <service>`` wires the same way.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from sqlalchemy import Engine

from .blobs import ObjectStoreBlobStore
from .bus.jetstream import BusError, JetStreamBus, connect_nats
from .db.engine import make_engine, upgrade
from .settings import GyreSettings


TOOL_CONNECT_TRIES = 3  # a tool gives up after this many failed connects; a service never does


class NatsNotConfigured(BusError):
    pass


@dataclass
class Runtime:
    settings: GyreSettings
    bus: JetStreamBus
    blobs: ObjectStoreBlobStore
    engine: Engine | None


@asynccontextmanager
async def open_runtime(settings: GyreSettings, *, name: str, database: bool = False,
                       migrate: bool = False) -> AsyncIterator[Runtime]:
    if not settings.nats_url:
        raise NatsNotConfigured(
            "GYRE_NATS_URL is not set: point it at a NATS server with JetStream, "
            "or use `gyre up`, which starts an embedded one"
        )
    bus = await JetStreamBus.connect(
        settings.nats_url, name=f"gyre-{name}", creds=str(settings.nats_creds) if settings.nats_creds else None,
        replicas=settings.stream_replicas, max_age_s=settings.stream_max_age_days * 86400,
    )
    engine = None
    try:
        blobs = await ObjectStoreBlobStore.open(bus.js, settings.blob_bucket, replicas=settings.stream_replicas)
        if database:
            if migrate:
                upgrade(settings.sqlalchemy_url)
            engine = make_engine(settings.sqlalchemy_url)
        yield Runtime(settings, bus, blobs, engine)
    finally:
        if engine is not None:
            engine.dispose()
        await bus.close()


async def connect_tool_bus(url: str, *, name: str, settings: GyreSettings | None = None) -> JetStreamBus:
    """The bus for the CLI's tools (tail, export, replay, report): the deployment's NATS
    credentials (``GYRE_NATS_CREDS``), and existing streams left as the services
    configured them (replicas, max age); only missing ones are created, with the settings'."""
    settings = settings or GyreSettings()
    nc = await connect_nats(url, name=name, creds=str(settings.nats_creds) if settings.nats_creds else None,
                            tries=TOOL_CONNECT_TRIES)
    bus = JetStreamBus(nc, replicas=settings.stream_replicas, max_age_s=settings.stream_max_age_days * 86400)
    try:
        await bus.ensure_streams(update=False)
    except BaseException:
        await nc.close()
        raise
    return bus
