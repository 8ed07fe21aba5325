"""Hostile artifacts: each is contained, the rollout still gets a score, the evaluator goes on.

The agent's code (``evil.py`` in its workspace) tries to write to $HOME, /tmp, ../ and
the other shared places, to reach a TCP server listening on this machine's loopback, to
take 8 GiB of memory, to fork without end, to flood its output, to spin on the CPU, and
to fake its results (a conftest.py that marks every test passed, a pre-written results
file). Afterwards: none of those files exist, the server saw no connection, no process
of the sandbox is left, and honest tests scored honestly.
"""

from __future__ import annotations

import os
import socket
import sys
import uuid
from pathlib import Path

import pytest

from libs.common.events import RolloutScored
from services.evaluator.adapters.workspace import remove_tree
from services.evaluator.core.spec import Limits

from ._workspaces import CALC_PARTIAL, calc_spec, dedent_bytes, tar_of

EVIL = """
import os, socket, time

def write_everywhere(paths):
    hits = []
    for p in paths:
        try:
            with open(p, "w") as f:
                f.write("pwned")
            hits.append(p)
        except OSError:
            pass
    return hits

def connect(port):
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect(("127.0.0.1", port))
        return True
    except OSError:
        return False

def eat_memory():
    return bytearray(8 * 2**30)

def fork_many(n):
    kids = 0
    for _ in range(n):
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            time.sleep(120)
            os._exit(0)
        kids += 1
    return kids

def flood(megabytes):
    chunk = b"x" * 2**20
    for _ in range(megabytes):
        os.write(1, chunk)

def spin():
    while True:
        pass
"""


def _require_namespaces(h) -> None:
    if h.evaluator.sandbox.mode != "namespaces":
        pytest.skip(f"needs the namespaces sandbox (root); here: {h.evaluator.sandbox.description}")


def _sandbox_processes(h) -> list[int]:
    base = h.evaluator.sandbox.config.uid_base
    uids = range(base, base + h.evaluator.sandbox.config.slots)
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            uid_line = next(ln for ln in status.read_text().splitlines() if ln.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        if int(uid_line.split()[1]) in uids:
            found.append(int(status.parent.name))
    return found


async def test_escapes_network_memory_forks_and_floods_are_contained(make_harness, work_root: Path):
    h = await make_harness()
    _require_namespaces(h)
    tag = uuid.uuid4().hex[:8]
    targets = [f"{Path.home()}/gyre-escape-{tag}", f"/tmp/gyre-escape-{tag}", f"../gyre-escape-{tag}",
               f"/var/tmp/gyre-escape-{tag}", f"/dev/shm/gyre-escape-{tag}"]
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    port = server.getsockname()[1]
    hidden = dedent_bytes(f"""
        import evil

        def test_a_honest():
            assert 1 + 1 == 2

        def test_b_escape():
            assert evil.write_everywhere({targets!r}) == []

        def test_c_network():
            assert evil.connect({port})

        def test_d_memory():
            assert len(evil.eat_memory()) > 0

        def test_e_fork_bomb():
            assert evil.fork_many(10_000) < 64

        def test_f_honest_after_all_that():
            assert sum(range(10)) == 45

        def test_z_flood():
            evil.flood(64)
    """)
    spec = calc_spec("hostile", hidden_files={"test_evil.py": hidden}, weights={},
                     limits=Limits(wall_s=60, memory_mb=1024, max_processes=48, max_file_mb=8))
    try:
        ev = await h.score(spec, tar_of({"evil.py": EVIL}))
        assert isinstance(ev, RolloutScored), ev
        got = {t.name.split("::")[1]: t.outcome for t in ev.tests}
        assert got == {"test_a_honest": "passed", "test_b_escape": "passed", "test_c_network": "failed",
                       "test_d_memory": "failed", "test_e_fork_bomb": "passed",
                       "test_f_honest_after_all_that": "passed", "test_z_flood": "failed"}
        assert ev.score == pytest.approx(4 / 7)
        for target in targets:
            assert not Path(target).exists() and not (work_root / f"gyre-escape-{tag}").exists()
        with pytest.raises(BlockingIOError):
            server.accept()
        assert _sandbox_processes(h) == []
        assert "namespaces(net" in ev.isolation
    finally:
        server.close()
        for target in targets[:2]:
            Path(target).unlink(missing_ok=True)


async def test_cpu_spin_is_stopped_and_earlier_outcomes_kept(make_harness):
    h = await make_harness()
    hidden = dedent_bytes("""
        import evil
        def test_a_fine():
            assert True
        def test_b_spin():
            evil.spin()
    """)
    spec = calc_spec("spin", hidden_files={"test_spin.py": hidden}, weights={},
                     limits=Limits(wall_s=30, cpu_s=2))
    ev = await h.score(spec, tar_of({"evil.py": EVIL}))
    assert isinstance(ev, RolloutScored), ev
    assert {t.name: t.outcome for t in ev.tests} == {"test_spin.py::test_a_fine": "passed",
                                                     "test_spin.py::test_b_spin": "error"}
    assert ev.score == 0.5


async def test_faked_results_do_not_count(make_harness):
    h = await make_harness()
    cheat_conftest = """
import pytest

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome = "passed"
"""
    fake_results = "".join(
        f'{{"e": "test", "id": "test_calc.py::test_{n}", "outcome": "passed", "msg": ""}}\n'
        for n in ("add", "mul", "div")
    )
    fake_runner = f"import os, sys\nopen(os.environ['GYRE_OUTCOMES_PATH'], 'w').write({fake_results!r})\nsys.exit(0)\n"
    ev = await h.score(calc_spec(), tar_of({
        "calc.py": CALC_PARTIAL, "conftest.py": cheat_conftest, "_gyre_hidden/test_calc.py": "def test_mul(): pass",
        ".gyre_eval/outcomes.jsonl": fake_results, "pytest.py": fake_runner, "gyre_outcomes.py": fake_runner,
    }))
    assert isinstance(ev, RolloutScored), ev
    assert ev.score == 0.25  # only test_add really passes


async def test_output_flood_is_cut_and_the_run_stopped(make_harness, work_root: Path):
    h = await make_harness()
    folder = work_root / f"flood-{uuid.uuid4().hex[:6]}"
    folder.mkdir()
    run = await h.evaluator.sandbox.run(
        [sys.executable, "-c", "import os\nwhile True: os.write(1, b'y' * 65536)"],
        workdir=folder, env={}, limits=Limits(wall_s=30, output_bytes=64 * 1024),
    )
    assert run.killed_by == "output limit" and run.output_truncated and run.duration_s < 20
    assert run.output_tail.endswith("y")


async def test_a_process_that_leaves_the_group_does_not_hold_up_the_run(make_harness, work_root: Path):
    h = await make_harness()
    folder = work_root / f"daemon-{uuid.uuid4().hex[:6]}"
    folder.mkdir()
    daemon = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')"
    run = await h.evaluator.sandbox.run([sys.executable, "-c", daemon], workdir=folder, env={},
                                        limits=Limits(wall_s=30))
    assert run.exit_code == 0 and run.duration_s < 10
    if h.evaluator.sandbox.mode == "namespaces":
        assert _sandbox_processes(h) == []
    remove_tree(folder)


async def test_the_results_channel_is_no_file_to_swap_and_not_in_the_environment(make_harness):
    """Once a results file the tests could swap for a FIFO; now the outcomes go to a pipe
    whose descriptor the plugin takes out of the environment before any test runs."""
    h = await make_harness()
    _require_namespaces(h)
    hidden = dedent_bytes("""
        import os
        def test_no_channel_to_find():
            assert not [k for k in os.environ if k.startswith("GYRE_OUTCOMES")]
            assert sorted(os.listdir(".gyre_eval")) == ["gyre_outcomes.py", "home", "tmp"]
    """)
    spec = calc_spec("fifo", hidden_files={"test_fifo.py": hidden}, weights={}, limits=Limits(wall_s=20))
    ev = await h.score(spec, tar_of({"x.py": ""}))
    assert isinstance(ev, RolloutScored) and ev.score == 1.0, ev.reason


async def test_filling_the_disk_stops_the_run(make_harness, work_root: Path):
    h = await make_harness()
    folder = work_root / f"disk-{uuid.uuid4().hex[:6]}"
    folder.mkdir()
    filler = ("import os, time\nfor i in range(64):\n"
              "    open(f'f{i}', 'wb').write(os.urandom(4 * 2**20))\ntime.sleep(30)")
    run = await h.evaluator.sandbox.run([sys.executable, "-c", filler], workdir=folder, env={},
                                        limits=Limits(wall_s=30, max_file_mb=8, max_disk_mb=32))
    assert run.killed_by == "disk limit (32 MB)" and run.duration_s < 10
    remove_tree(folder)


@pytest.mark.skipif(os.geteuid() != 0, reason="uid mode switches to the slot's user: needs root")
async def test_uid_mode_kills_a_daemon_that_left_the_group_before_the_slot_is_reused(make_harness, work_root: Path):
    h = await make_harness(isolation="uid", workers=1)
    folder = work_root / f"uid-daemon-{uuid.uuid4().hex[:6]}"
    folder.mkdir()
    daemon = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
              "        open('daemon.pid', 'w').write(str(os.getpid()))\n        time.sleep(60)\n    os._exit(0)\n"
              "time.sleep(0.3)\nprint('parent done')")
    run = await h.evaluator.sandbox.run([sys.executable, "-c", daemon], workdir=folder, env={},
                                        limits=Limits(wall_s=30))
    pid = int((folder / "daemon.pid").read_text())
    assert run.exit_code == 0 and run.duration_s < 10
    assert not _running(pid), "the daemon of a uid-mode run outlived it"
    assert [p for p in _sandbox_processes(h) if _running(p)] == []
    remove_tree(folder)


def _running(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
