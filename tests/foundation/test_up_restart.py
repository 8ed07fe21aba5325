"""`gyre up` starts a failed service again (a few times), as systemd and Kubernetes would."""

from __future__ import annotations

import subprocess
import sys

from rich.console import Console

import gyre.up as up


def _proc(code: int | None) -> subprocess.Popen:
    script = "import time; time.sleep(30)" if code is None else f"import sys; sys.exit({code})"
    p = subprocess.Popen([sys.executable, "-c", script])
    if code is not None:
        p.wait()
    return p


def test_a_failed_service_is_started_again_until_its_restarts_run_out(tmp_path, monkeypatch):
    launch = up.Launch("trainer", "trainer", 1, {}, 3)
    spawned: list[up.Child] = []

    def spawn(launch, env, log_dir):
        spawned.append(up.Child(launch.name, launch.port, _proc(None), launch=launch))
        return spawned[-1]

    monkeypatch.setattr(up, "_spawn", spawn)
    (tmp_path / "trainer.log").write_text("Traceback ...\nRuntimeError: publish failed\n")
    console = Console(file=open(tmp_path / "console.txt", "w"))
    failed = up.Child("trainer", 1, _proc(1), launch=launch)
    clean = up.Child("proxy", 2, _proc(0), launch=up.Launch("proxy", "proxy", 2, {}, 1))
    children = [failed, clean]
    try:
        given_up = up._restart_failed(children, {}, tmp_path, console)
        assert given_up == [clean]  # a clean exit is no failure to retry: the run stops as before
        assert children[0] is spawned[0] and children[0].restarts == 1
        children[0] = up.Child("trainer", 1, _proc(1), launch=launch, restarts=up.MAX_RESTARTS)
        assert up._restart_failed(children[:1], {}, tmp_path, console) == [children[0]]  # none left
    finally:
        for c in spawned:
            c.proc.kill()
    console.file.close()
    assert "starting it again (1/3)" in (tmp_path / "console.txt").read_text()
