"""Launches and supervises a real SGLang server for a GPU cell.

The command line is built from Gyre's cell config (:class:`SGLangConfig`); the process runs
in its own session so that stopping it also stops SGLang's scheduler and detokenizer
children. :meth:`SGLangServer.supervise` restarts a server that died or stopped answering
``/health``. All HTTP calls go through :class:`~services.engine.client.EngineClient`, the
same client the embedded engine answers.

Version notes: every flag below is in SGLang 0.5.23's ``launch_server --help`` (checked
by ``gpu_check.py``, which also ran all of Gyre's calls against a real 0.5.23 server on
CPU). ``/begin_weight_update`` and ``/end_weight_update`` need >= 0.5.21.
``--weight-version`` and ``--admin-api-key`` are passed only when set, since older releases
lack them. ``--enable-memory-saver`` is on by default (GPU release/resume of memory needs
it; the CPU engine runs without it). The cell agent releases all of the engine's memory
(weights, KV cache, CUDA graphs); without ``--enable-weights-cpu-backup`` the weights'
values are lost and the agent loads the newest published weights after every resume
(``services.cell.agent``). ``enable_weights_cpu_backup`` (off by default: it holds a host
copy of the served weights for as long as the cell trains, host memory the training seat
may need) makes the resume give them back by itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .client import EngineClient

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SGLangConfig:
    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    tp_size: int = 1
    dp_size: int = 1
    dtype: str = "auto"
    mem_fraction_static: float | None = None
    context_length: int | None = None
    max_running_requests: int | None = None
    chunked_prefill_size: int | None = None
    api_key: str | None = None
    admin_api_key: str | None = None
    weight_version: str | None = None
    enable_memory_saver: bool = True
    enable_weights_cpu_backup: bool = False  # keep the weights in host memory while released
    skip_server_warmup: bool = False
    device: str | None = None  # "cpu" for SGLang's CPU engine (tests only)
    max_total_tokens: int | None = None
    log_level: str = "warning"
    extra_args: tuple[str, ...] = ()
    python: str = sys.executable
    module: str = "sglang.launch_server"
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def build_command(cfg: SGLangConfig) -> list[str]:
    cmd = [cfg.python, "-m", cfg.module, "--model-path", cfg.model_path, "--host", cfg.host,
           "--port", str(cfg.port), "--tp-size", str(cfg.tp_size), "--dtype", cfg.dtype,
           "--log-level", cfg.log_level]
    optional = {
        "--dp-size": cfg.dp_size if cfg.dp_size != 1 else None,
        "--mem-fraction-static": cfg.mem_fraction_static,
        "--context-length": cfg.context_length,
        "--max-running-requests": cfg.max_running_requests,
        "--chunked-prefill-size": cfg.chunked_prefill_size,
        "--api-key": cfg.api_key,
        "--admin-api-key": cfg.admin_api_key,
        "--weight-version": cfg.weight_version,
        "--device": cfg.device,
        "--max-total-tokens": cfg.max_total_tokens,
    }
    for flag, value in optional.items():
        if value is not None:
            cmd += [flag, str(value)]
    if cfg.enable_memory_saver:
        cmd.append("--enable-memory-saver")
    if cfg.enable_weights_cpu_backup:
        cmd.append("--enable-weights-cpu-backup")
    if cfg.skip_server_warmup:
        cmd.append("--skip-server-warmup")
    return cmd + list(cfg.extra_args)


class SGLangExited(RuntimeError):
    """The server process ended on its own."""


class SGLangServer:
    def __init__(self, config: SGLangConfig, *, log_path: Path | None = None) -> None:
        self.config = config
        self.log_path = log_path
        self.process: subprocess.Popen | None = None
        self.restarts = 0
        self._log_file = None

    @property
    def url(self) -> str:
        return self.config.url

    def client(self, **kwargs) -> EngineClient:
        return EngineClient(self.url, admin_token=self.config.admin_api_key or self.config.api_key, **kwargs)

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    async def start(self, *, wait: bool = True, timeout_s: float = 600.0) -> None:
        if self.running():
            raise RuntimeError("server already running")
        if self.log_path is not None:
            self._log_file = open(self.log_path, "ab")
        out = self._log_file or subprocess.DEVNULL
        env = {**os.environ, **self.config.env}
        self.process = subprocess.Popen(build_command(self.config), stdout=out, stderr=subprocess.STDOUT,
                                        env=env, start_new_session=True)
        log.info("started SGLang pid %s on %s", self.process.pid, self.url)
        if wait:
            await self.wait_healthy(timeout_s)

    async def wait_healthy(self, timeout_s: float = 600.0, interval_s: float = 0.25) -> None:
        deadline = time.monotonic() + timeout_s
        async with self.client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                if not self.running():
                    raise SGLangExited(f"SGLang exited with {self.process.returncode if self.process else None}"
                                       f"{self._log_tail()}")
                if await client.health():
                    return
                await asyncio.sleep(interval_s)
        raise TimeoutError(f"SGLang at {self.url} not healthy after {timeout_s}s{self._log_tail()}")

    async def stop(self, timeout_s: float = 30.0) -> int | None:
        proc, self.process = self.process, None
        if proc is None:
            return None
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                await asyncio.to_thread(proc.wait)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return proc.returncode

    async def supervise(self, *, interval_s: float = 5.0, failures_before_restart: int = 3,
                        max_restarts: int = 5, start_timeout_s: float = 600.0) -> None:
        """Keeps the server up until cancelled: restarts it when it dies or stops answering."""
        failures = 0
        async with self.client(timeout=5.0) as client:
            while True:
                await asyncio.sleep(interval_s)
                healthy = self.running() and await client.health()
                failures = 0 if healthy else failures + 1
                if healthy or (self.running() and failures < failures_before_restart):
                    continue
                if self.restarts >= max_restarts:
                    raise SGLangExited(f"SGLang at {self.url} failed {self.restarts} restarts")
                log.warning("SGLang at %s is down; restarting", self.url)
                self.restarts += 1
                await self.stop()
                await self.start(wait=True, timeout_s=start_timeout_s)
                failures = 0

    def _log_tail(self, limit: int = 2000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n--- log tail ---\n" + self.log_path.read_text(errors="replace")[-limit:]


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
