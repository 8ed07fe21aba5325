"""Runs a scenario of ``tests/transfer/scenarios.py`` in a fresh process inside a private
network namespace (``unshare -n``, loopback only), because Mooncake and UCX listeners bind
every interface. Where the machine does not allow namespaces (not root), the scenario
runs in a plain subprocess instead and says so (``"netns": false``).
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def netns_available() -> bool:
    try:
        probe = subprocess.run(["unshare", "-n", "sh", "-c", "ip link set lo up"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def run_scenario(name: str, timeout_s: float = 120.0, **kwargs) -> dict:
    """The scenario's JSON result (its last stdout line); raises with its output on failure."""
    cmd = [sys.executable, "-m", "tests.transfer.scenarios", name, json.dumps(kwargs)]
    isolated = netns_available()
    if isolated:
        cmd = ["unshare", "-n", "sh", "-c", "ip link set lo up && exec " + shlex.join(cmd)]
    env = {**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n", "GLOG_minloglevel": "2",
           "GYRE_SCENARIO_NETNS": "1" if isolated else "0"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"scenario {name} failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    result = json.loads(lines[-1])
    result["netns"] = isolated
    return result
