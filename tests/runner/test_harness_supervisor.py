"""A harness runs under a small supervisor (``libs.common.procs``, started by
``adapters.process.launch``) that leads its process group, so that the group dies with the
runner (tests/runner/test_groups_and_orphans.py). To the runner it reads as the harness did:
its exit code or signal, the error when the program cannot start, the environment as given,
and a signal sent to the supervisor alone reaches the harness."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from pathlib import Path

import pytest

from services.runner.adapters.process import launch


async def _run(tmp_path: Path, argv: list[str], env: dict[str, str] | None = None) -> tuple[int | None, str]:
    proc = await launch(argv, cwd=tmp_path, env={"PATH": os.environ["PATH"], **(env or {})},
                        log_file=tmp_path / "log")
    status = await proc.wait(10)
    return status, (tmp_path / "log").read_text()


@pytest.mark.parametrize("script, status", [("exit 0", 0), ("exit 7", 7), ("kill -TERM $$", -15),
                                            ("kill -SEGV $$", -11), ("kill -KILL $$", -9)])
async def test_the_status_is_the_harnesss_own(tmp_path, script, status) -> None:
    assert (await _run(tmp_path, ["/bin/sh", "-c", script]))[0] == status


@pytest.mark.parametrize("program, error", [("/nonexistent/harness", FileNotFoundError),
                                            ("no-such-harness-here", FileNotFoundError),
                                            (os.devnull, PermissionError)])
async def test_a_program_that_cannot_start_raises_as_a_direct_start_does(tmp_path, program, error) -> None:
    with pytest.raises(error) as info:
        await launch([program], cwd=tmp_path, env={"PATH": os.environ["PATH"]}, log_file=tmp_path / "log")
    assert info.value.filename == program


async def test_environment_stdio_and_cwd_pass_straight_through(tmp_path) -> None:
    # under the C locale Python adds LC_CTYPE to its own environment: the harness must not get it
    status, out = await _run(tmp_path, ["/bin/sh", "-c", "env; pwd; grep -E '^Sig(Blk|Ign)' /proc/self/status; "
                                                         "echo err >&2; cat"], {"LANG": "C", "X": "a b"})
    assert status == 0
    env = {line.split("=", 1)[0] for line in out.splitlines() if "=" in line}
    assert env == {"PATH", "LANG", "X", "PWD"}, out
    assert str(tmp_path) in out.splitlines() and "err" in out.splitlines()
    # the signal state a direct start gives, in this process as it is now (a library loaded by
    # an earlier test may have set a disposition of its own; SIGPIPE is reset either way)
    direct = subprocess.run(["grep", "-E", "^Sig(Blk|Ign)", "/proc/self/status"], capture_output=True, text=True,
                            check=True, start_new_session=True).stdout.splitlines()
    assert direct and all(line in out.splitlines() for line in direct), (direct, out)


async def test_a_signal_to_the_supervisor_alone_reaches_the_harness_once(tmp_path) -> None:
    proc = await launch(["/bin/sh", "-c", "n=0; trap 'n=$((n+1)); echo usr1 $n' USR1; "
                                          "trap 'echo term; exit 5' TERM; "
                                          "while true; do sleep 0.05; done"],
                        cwd=tmp_path, env={"PATH": os.environ["PATH"]}, log_file=tmp_path / "log")
    await asyncio.sleep(0.3)
    kill = await asyncio.create_subprocess_exec("kill", "-USR1", str(proc.pid))  # the supervisor alone, from
    assert await kill.wait() == 0                                                 # outside: passed on
    await asyncio.sleep(0.3)
    proc.signal_group(signal.SIGUSR1)  # the group: the harness gets it once, not twice
    await asyncio.sleep(0.3)
    status = await proc.kill_group(5)  # the runner's kill: SIGTERM to the group, the harness's status
    assert status == 5
    said = [line for line in (tmp_path / "log").read_text().splitlines() if line.startswith(("usr1", "term"))]
    assert said == ["usr1 1", "usr1 2", "term"]  # (the group's SIGUSR1 also ended a sleep: sh says so)


@pytest.mark.parametrize("mark", ["", "NAME", "=value", "A=b\0c"])
def test_a_supervisor_mark_must_be_an_environment_entry(mark) -> None:
    from libs.common.procs import supervised

    with pytest.raises(ValueError, match="NAME=value"):
        supervised(["true"], ready_fd=3, parent_pid=1, grace_s=1.0, mark=mark)
