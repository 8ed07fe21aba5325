"""Where a service finds NATS, the database, its run directory and its secrets.

Read once at start from ``GYRE_*`` environment variables (or passed explicitly), validated,
then handed down; nothing reads the environment after that.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from .events.envelope import _TOKEN_RE


class GyreSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GYRE_", extra="ignore", frozen=True)

    run_id: str = Field(default="default", pattern=_TOKEN_RE, description="run id, part of every subject")
    run_dir: Path = Field(default=Path(".gyre"), description="state of the embedded stack")
    nats_url: str | None = Field(default=None, description="nats://host:port[,..]; empty = start an embedded nats-server")
    nats_creds: Path | None = Field(default=None, description="NATS credentials file, if the server needs one")
    database_url: str | None = Field(default=None, description="SQLAlchemy URL; empty = SQLite under run_dir")
    admin_token: str | None = Field(default=None, description="token for control endpoints")
    blob_bucket: str = Field(default="gyre-blobs", pattern=r"^[A-Za-z0-9_-]+$")
    stream_replicas: int = Field(default=1, ge=1, le=5, description="JetStream replicas per stream (3 on a cluster)")
    stream_max_age_days: float = Field(default=0, ge=0, description="0 = keep events forever")
    log_level: str = Field(default="INFO", pattern=r"^(DEBUG|INFO|WARNING|ERROR)$")
    log_json: bool = False
    host: str = "127.0.0.1"

    @field_validator("log_level", mode="before")
    @classmethod
    def _level_any_case(cls, v: object) -> object:
        return v.strip().upper() if isinstance(v, str) else v

    @field_validator("nats_url", "database_url", "admin_token", mode="before")
    @classmethod
    def _empty_is_none(cls, v: object) -> object:
        return None if isinstance(v, str) and not v.strip() else v

    @property
    def sqlalchemy_url(self) -> str:
        if self.database_url:
            return _normalise_db_url(self.database_url)
        return f"sqlite:///{(self.run_dir / 'gyre.db').resolve()}"

    @property
    def nats_store_dir(self) -> Path:
        return self.run_dir / "nats"


def _normalise_db_url(url: str) -> str:
    # Accept the libpq form and point SQLAlchemy at psycopg 3, the driver Gyre installs.
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix):]
    return url


def settings_error(exc: Exception) -> str:
    """A pydantic ``ValidationError`` of ``GyreSettings`` in the names a user sets:
    ``GYRE_LOG_LEVEL: ... (got 'LOUD')``, one problem after the other."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    parts = []
    for err in errors():
        field = str(err.get("loc", ("?",))[0])
        msg = str(err.get("msg", "invalid"))
        if err.get("type") == "string_pattern_mismatch" and field == "log_level":
            msg = "must be DEBUG, INFO, WARNING or ERROR"
        parts.append(f"GYRE_{field.upper()}: {msg} (got {err.get('input')!r})")
    return "; ".join(parts)
