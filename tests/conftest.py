"""Shared fixtures: a real nats-server per test, SQLite and PostgreSQL databases.

PostgreSQL: ``GYRE_TEST_POSTGRES_URL`` if set (each test gets its own throwaway database
on that server); else a throwaway server started from local binaries when present; else
the PostgreSQL tests are skipped with the reason. With ``GYRE_TEST_REQUIRE_POSTGRES=1``
(``.ci/run`` sets it when a server answers on 127.0.0.1:5432) a skip becomes a failure.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from libs.common.natsserver import EmbeddedNats


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    with EmbeddedNats(tmp_path / "nats") as server:
        yield server


@pytest.fixture
async def js_bus(nats_server: EmbeddedNats) -> AsyncIterator[object]:
    from libs.common.bus.jetstream import JetStreamBus

    bus = await JetStreamBus.connect(nats_server.url)
    yield bus
    await bus.close()


def _postgres_base_url() -> str | None:
    return os.environ.get("GYRE_TEST_POSTGRES_URL") or None


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database (dropped afterwards)."""
    base = _postgres_base_url()
    if base is None:
        from tests.pgserver import throwaway_server_url

        base = throwaway_server_url()
    if base is None:
        reason = "no PostgreSQL: set GYRE_TEST_POSTGRES_URL or install PostgreSQL server binaries"
        if os.environ.get("GYRE_TEST_REQUIRE_POSTGRES") == "1":
            pytest.fail(reason + " (GYRE_TEST_REQUIRE_POSTGRES=1)")
        pytest.skip(reason)
    import sqlalchemy as sa

    from libs.common.settings import _normalise_db_url

    admin = sa.create_engine(_normalise_db_url(base), isolation_level="AUTOCOMMIT")
    name = f"gyre_t_{uuid.uuid4().hex[:12]}"
    with admin.connect() as c:
        c.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = admin.url.set(database=name).render_as_string(hide_password=False)
    try:
        yield url
    finally:
        with admin.connect() as c:
            c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'gyre.db'}"


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest) -> str:
    """Every projection test runs against SQLite and PostgreSQL."""
    if request.param == "sqlite":
        return request.getfixturevalue("sqlite_url")
    return request.getfixturevalue("postgres_url")
