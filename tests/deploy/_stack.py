"""Run docker-compose.yml's Gyre services as local processes, the way the containers would.

Each service gets the image's ENV and its compose `environment`, with what only exists in
the compose network replaced by local equivalents: the `nats` and `postgres` services by the
test's servers, `http://<service>:<port>` by a loopback port of that service's process, the
container's `--port` by a free port, 0.0.0.0 by 127.0.0.1, and container paths by folders
of the test. Processes start in the file's depends_on order; a dependent starts when its
dependencies' compose healthcheck passes. Services whose `gyre serve` name is not registered
yet (tests/deploy/_catalog.py, PENDING_SERVICES) are reported as pending, not started.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from libs.common.natsserver import free_port
from tests.deploy import _catalog as cat

HEALTHY_WITHIN_S = 120.0
STOP_WITHIN_S = 30.0


class LocalStack:
    def __init__(self, compose: dict, *, nats_url: str, database_url: str, work: Path) -> None:
        self.services = compose["services"]
        self.nats_url, self.database_url, self.work = nats_url, database_url, work
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self.ports: dict[tuple[str, int], int] = {}
        self.healthy: list[str] = []
        self.pending: list[str] = []
        self.failed: dict[str, str] = {}

    def __enter__(self) -> "LocalStack":
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)

    # -- mapping compose's world onto this machine ----------------------------------------

    def port(self, service: str, container_port: int) -> int:
        key = (service, container_port)
        if key not in self.ports:
            self.ports[key] = free_port()
        return self.ports[key]

    def local_value(self, value: str) -> str:
        if value.startswith(("postgres://", "postgresql://")) and "@postgres:" in value:
            return self.database_url
        value = re.sub(r"nats://nats:4222", self.nats_url, value)

        def url(m: re.Match) -> str:
            host, port = m.group(1), int(m.group(2))
            if host not in self.services or host in ("nats", "postgres"):
                return m.group(0)
            return f"http://127.0.0.1:{self.port(host, port)}"

        value = re.sub(r"http://([a-z0-9-]+):(\d+)", url, value)
        return "127.0.0.1" if value == "0.0.0.0" else value

    def local_path(self, service: str, value: str) -> str:
        places = {
            "/var/lib/gyre": self.work / service / "state",
            "/var/cache/gyre": Path.home() / ".cache" / "gyre",  # tiny-qwen is built there once
            "/srv/gyre/tasks": cat.ROOT / "tasks",
        }
        for container, local in places.items():
            if value == container or value.startswith(container + "/"):
                return str(local) + value[len(container):]
        return value

    def environment(self, name: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GYRE_")}
        wanted = {**cat.image_env(), **cat.environment(self.services[name])}
        wanted.pop("PATH", None)
        for key, value in wanted.items():
            env[key] = self.local_path(name, self.local_value(value))
        if env.get("GYRE_ENGINE_PORT"):
            env["GYRE_ENGINE_PORT"] = str(self.port(name, int(env["GYRE_ENGINE_PORT"])))
        return env

    def command(self, name: str) -> list[str]:
        command = list(self.services[name]["command"])
        i = command.index("--port")
        command[i + 1] = str(self.port(name, int(command[i + 1])))
        return [str(Path(sys.executable).parent / "gyre"), *command[1:]]

    def healthcheck(self, name: str) -> list[str]:
        test = list(self.services[name]["healthcheck"]["test"])
        assert test[:2] == ["CMD", "gyre-healthcheck"], test
        return [sys.executable, str(cat.HEALTHCHECK), str(self.port(name, int(test[2])))]

    # -- running ---------------------------------------------------------------------------

    def start(self, name: str) -> None:
        (self.work / name).mkdir(parents=True, exist_ok=True)
        self.logs[name] = self.work / name / "log.txt"
        with open(self.logs[name], "wb") as log:
            self.procs[name] = subprocess.Popen(self.command(name), env=self.environment(name), cwd=self.work / name,
                                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def check(self, name: str) -> bool | None:
        """True once healthy (compose's healthcheck passes, /metrics answers), False when it
        died, None while still starting."""
        proc = self.procs[name]
        if proc.poll() is not None:
            self.failed[name] = f"exited {proc.returncode}: {self.tail(name)}"
            return False
        port = self.healthcheck(name)[-1]
        try:  # poll in-process; the compose healthcheck itself runs once /health answers
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
        except (OSError, ValueError):
            return None
        run = subprocess.run(self.healthcheck(name), capture_output=True, text=True, timeout=30)
        if run.returncode != 0:
            self.failed[name] = f"/health answers but the compose healthcheck fails: {run.stderr[-300:]}"
            return False
        if cat.serve_name(self.services[name]["command"]) not in cat.WITHOUT_METRICS:
            status = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).status
            if status != 200:
                self.failed[name] = f"/metrics answered {status}"
                return False
        return True

    def run(self, order: list[str]) -> dict:
        """Start each service as soon as the services it depends on are healthy (as compose
        does), wait until all are healthy, then stop everything with SIGTERM."""
        registered = cat.registered_services()
        todo = [n for n in order if n not in ("nats", "postgres")]
        for name in list(todo):
            if cat.serve_name(self.services[name]["command"]) not in registered:
                self.pending.append(name)
                todo.remove(name)
        healthy = {"nats", "postgres", *self.pending}
        starting: dict[str, float] = {}
        while (todo or starting) and not self.failed:
            for name in [n for n in todo if set(self.services[n].get("depends_on") or {}) <= healthy]:
                self.start(name)
                starting[name] = time.monotonic()
                todo.remove(name)
            if not starting:
                self.failed["order"] = f"nothing can start: {todo} wait for {sorted(healthy)}"
                break
            for name, since in list(starting.items()):
                state = self.check(name)
                if state is None and time.monotonic() - since > HEALTHY_WITHIN_S:
                    self.failed[name] = f"not healthy within {HEALTHY_WITHIN_S:.0f}s: {self.tail(name)}"
                if state is not None or name in self.failed:
                    del starting[name]
                if state:
                    healthy.add(name)
                    self.healthy.append(name)
            time.sleep(0.3)
        stopped = self.stop_all()
        return {"healthy": self.healthy, "pending": self.pending, "failed": self.failed, "stopped_cleanly": stopped}

    def stop_all(self) -> list[str]:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        clean = []
        for name, proc in self.procs.items():
            try:
                code = proc.wait(STOP_WITHIN_S)
            except subprocess.TimeoutExpired:
                self.failed[name] = f"did not stop within {STOP_WITHIN_S:.0f}s of SIGTERM"
                continue
            if code in (0, -signal.SIGTERM):  # ended by the signal it was sent: clean, as systemd counts it
                clean.append(name)
            elif name not in self.failed:
                self.failed[name] = f"exit {code} after SIGTERM: {self.tail(name)}"
        return sorted(clean)

    def tail(self, name: str, n: int = 1500) -> str:
        return self.logs[name].read_text(errors="replace")[-n:] if name in self.logs else ""
