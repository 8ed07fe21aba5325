"""Start-up mistakes a new user makes (a wrong NATS URL, a taken port, a bad setting, an id
that does not exist) end in one ``error:`` line and a non-zero exit, not in tracebacks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from tests.foundation.test_cli import gyre

NOWHERE = "nats://127.0.0.1:1"  # nothing listens on port 1


def test_a_tool_gives_up_on_an_unreachable_nats_with_one_line() -> None:
    for args in (("events", "tail"), ("events", "export", "--out", os.devnull), ("tree", "show", "s0", "--run", "x"),
                 ("replay", "--trees", "--run", "x")):
        res = gyre(*args, env={"GYRE_NATS_URL": NOWHERE}, timeout=60)
        assert res.returncode != 0, args
        assert f"error: cannot connect to NATS at {NOWHERE}:" in res.stderr, (args, res.stderr)
        assert "Traceback" not in res.stderr, (args, res.stderr)


def test_a_service_keeps_retrying_an_unreachable_nats_one_line_a_try_and_stops_on_sigterm() -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GYRE_")}
    proc = subprocess.Popen([sys.executable, "-m", "gyre", "serve", "projector"], env={**clean, "GYRE_NATS_URL": NOWHERE},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(6)
        assert proc.poll() is None  # still trying
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "Traceback" not in out, out[-3000:]
    tries = [line for line in out.splitlines() if f"cannot reach NATS at {NOWHERE}" in line]
    assert len(tries) >= 2, out[-3000:]


def test_a_taken_port_is_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = gyre("serve", "projector", "--port", str(port), env={"GYRE_NATS_URL": NOWHERE}, timeout=60)
    assert res.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_serve_without_nats_url_and_unknown_service_are_one_line() -> None:
    res = gyre("serve", "projector")
    assert res.returncode == 1 and res.stderr.startswith("error:") and "GYRE_NATS_URL is not set" in res.stderr
    assert "Traceback" not in res.stderr
    res = gyre("serve", "nosuch")
    assert res.returncode == 2 and "engine" in res.stderr.split("known:")[1]


def test_a_bad_service_setting_is_one_line(nats_server) -> None:
    res = gyre("serve", "proxy", env={"GYRE_NATS_URL": nats_server.url, "GYRE_PROXY_KEEPALIVE_S": "0"}, timeout=120)
    assert res.returncode == 1 and "error:" in res.stderr and "GYRE_PROXY_KEEPALIVE_S" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_db_upgrade_with_a_bad_database_url_is_one_line(tmp_path) -> None:
    for url in ("nosuchdb://x/y", "postgresql://nobody@127.0.0.1:1/none"):
        res = gyre("db", "upgrade", "--database-url", url, timeout=60)
        assert res.returncode != 0 and res.stderr.startswith("error:"), res.stderr
        assert "Traceback" not in res.stderr, res.stderr
    export = tmp_path / "one.jsonl"
    export.write_text('{"stream": "GYRE_RUNS", "seq": 1, "subject": "gyre.x.runs.RunStarted", "event": {}}\n')
    res = gyre("replay", "--from", str(export), "--database-url", "nosuchdb://x/y", timeout=60)
    assert res.returncode != 0 and res.stderr.startswith("error: database:"), res.stderr


def _publish(url: str, *events) -> None:
    import asyncio

    from libs.common.bus.jetstream import JetStreamBus

    async def put() -> None:
        bus = await JetStreamBus.connect(url)
        for ev in events:
            await bus.publish(ev)
        await bus.close()

    asyncio.run(put())


def test_debug_commands_fail_on_ids_the_log_does_not_hold(nats_server, tmp_path) -> None:
    from libs.common.events import RunStarted

    _publish(nats_server.url, RunStarted(run_id="demo"))
    env = {"GYRE_NATS_URL": nats_server.url}
    res = subprocess.run([sys.executable, "-m", "gyre", "report", "nosuchrun"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60, env={k: v for k, v in os.environ.items() if not k.startswith("GYRE_")})
    assert res.returncode != 0 and res.stderr.startswith("error:"), res.stderr
    assert not (tmp_path / "runs").exists()  # no empty run folder, no all-zero report
    res = gyre("report", "nosuchrun", "--runs-dir", str(tmp_path / "runs"), env=env)
    assert res.returncode != 0 and "no run 'nosuchrun'" in res.stderr, res.stderr
    assert not (tmp_path / "runs" / "nosuchrun").exists()
    res = gyre("tree", "show", "s0-typo", "--run", "demo", env=env)
    assert res.returncode != 0 and "no rollout 's0-typo'" in res.stderr, res.stderr
    for flag in ("--trees", "--cells"):
        res = gyre("replay", flag, "--run", "nosuchrun", "--run-dir", str(tmp_path), env=env)
        assert res.returncode != 0 and "no run 'nosuchrun'" in res.stderr, (flag, res.stdout, res.stderr)
    res = gyre("report", "demo", "--runs-dir", str(tmp_path / "runs"), env=env)  # a run the log holds still works
    assert res.returncode == 0 and (tmp_path / "runs" / "demo" / "report.html").exists(), res.stderr


def test_log_level_in_any_case_and_bad_settings_name_their_variable() -> None:
    from libs.common.settings import GyreSettings

    assert GyreSettings(log_level="info").log_level == "INFO"
    res = gyre("serve", "projector", env={"GYRE_LOG_LEVEL": "loud"})
    assert res.returncode == 2 and "GYRE_LOG_LEVEL" in res.stderr and "Usage" not in res.stderr, res.stderr
    res = gyre("events", "tail", env={"GYRE_STREAM_REPLICAS": "9"})
    assert res.returncode == 2 and "GYRE_STREAM_REPLICAS" in res.stderr, res.stderr


def test_events_tail_into_a_closed_pipe_ends_at_once_and_quietly(nats_server) -> None:
    from libs.common.events import RunStarted

    _publish(nats_server.url, *(RunStarted(run_id="demo") for _ in range(300)))
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GYRE_")}
    proc = subprocess.Popen([sys.executable, "-m", "gyre", "events", "tail", "--run", "demo"],
                            env={**clean, "GYRE_NATS_URL": nats_server.url}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, bufsize=1)
    try:
        lines = [proc.stdout.readline() for _ in range(2)]  # what `| head -2` reads
        assert all("RunStarted" in line for line in lines)
        proc.stdout.close()
        started = time.monotonic()
        rc = proc.wait(timeout=30)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0 and "Traceback" not in err and "BrokenPipe" not in err, err
    assert time.monotonic() - started < 10


def test_replay_from_files_checks_them_first_and_leaves_no_scratch_database(nats_server, tmp_path) -> None:
    import json

    from libs.common.events import RunStarted

    db = tmp_path / "rebuilt.db"
    empty, no_stream = tmp_path / "empty.jsonl", tmp_path / "nostream.jsonl"
    empty.write_text("")
    no_stream.write_text('{"seq": 1, "subject": "gyre.x.runs.RunStarted"}\n')
    res = gyre("replay", "--from", str(empty))
    assert res.returncode != 0 and "no events in" in res.stderr, res.stderr
    res = gyre("replay", "--from", str(no_stream))
    assert res.returncode != 0 and "missing field 'stream'" in res.stderr, res.stderr
    for bad in (tmp_path / "missing.jsonl", no_stream):
        res = gyre("replay", "--from", str(bad), "--database-url", f"sqlite:///{db}")
        assert res.returncode != 0 and not db.exists(), res.stderr

    _publish(nats_server.url, RunStarted(run_id="demo"))
    export = tmp_path / "log.jsonl"
    assert gyre("events", "export", "--out", str(export), env={"GYRE_NATS_URL": nats_server.url}).returncode == 0
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    res = gyre("replay", "--from", str(export), env={"TMPDIR": str(scratch)})
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["applied"] >= 1 and not list(scratch.iterdir())  # the scratch database is gone
    res = gyre("replay", "--from", str(export), "--run", "other", env={"TMPDIR": str(scratch)})
    assert res.returncode == 0 and "warning: no events applied for run 'other'" in res.stderr, res.stderr
