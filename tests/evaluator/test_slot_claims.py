"""Sandbox slots claim their uid host-wide: two evaluators on one machine (same
``uid_base``) never run as one uid at once, which in ``uid`` mode would kill each other's
processes and in both root modes would share one process limit."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.evaluator.adapters.sandbox import Sandbox, SandboxConfig, SandboxUnavailable


def _sandbox(lock_dir: Path, slots: int = 2, mode: str = "uid") -> Sandbox:
    box = Sandbox(SandboxConfig(uid_base=63000, slots=slots, lock_dir=lock_dir))
    box.mode = mode  # type: ignore[assignment]  (no process runs here: only the claims)
    return box


async def test_two_sandboxes_with_one_uid_base_take_different_uids(tmp_path):
    a, b = _sandbox(tmp_path / "locks"), _sandbox(tmp_path / "locks")
    first = await a._acquire()
    second = await b._acquire()
    assert first != second
    assert sorted(p.name for p in (tmp_path / "locks").iterdir()) == ["63000.lock", "63001.lock"]
    await a._release(first)
    assert await b._acquire() == first  # free again once released
    await b._release(first)
    await b._release(second)


async def test_a_slot_held_by_another_process_is_waited_for(tmp_path, caplog):
    """Another process (not this one's descriptors) holds the only uid: the run waits and
    says why, and takes the uid the moment that process lets go."""
    locks = tmp_path / "locks"
    locks.mkdir(mode=0o700)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600); "
         "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()", str(locks / "63000.lock")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        box = _sandbox(locks, slots=1)
        task = asyncio.create_task(box._acquire())
        await asyncio.sleep(0.6)
        assert not task.done()
        assert "held by other processes on this host" in caplog.text
        holder.stdin.close()  # the other evaluator ends: its claim goes with it
        assert await asyncio.wait_for(task, 10) == 0
        await box._release(0)
    finally:
        holder.kill()
        holder.wait()


async def test_none_mode_claims_nothing(tmp_path):
    box = _sandbox(tmp_path / "locks", mode="none")
    assert await box._acquire() == 0
    assert not (tmp_path / "locks").exists()
    await box._release(0)


async def test_an_unwritable_claims_folder_is_a_clear_error(tmp_path):
    # not even root may make a folder in /proc
    box = _sandbox(Path("/proc/gyre-no-such-folder"))
    with pytest.raises(SandboxUnavailable, match="cannot claim sandbox uid 63000"):
        await box._acquire()


async def test_a_claims_folder_others_can_write_is_refused(tmp_path):
    locks = tmp_path / "locks"
    locks.mkdir()
    os.chmod(locks, 0o777)
    with pytest.raises(SandboxUnavailable, match="others cannot write"):
        await _sandbox(locks)._acquire()
