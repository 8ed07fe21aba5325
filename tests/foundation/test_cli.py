"""The ``gyre`` command line, run as a user would (real processes, real servers)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from libs.common.settings import GyreSettings


def gyre(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GYRE_")}
    return subprocess.run([sys.executable, "-m", "gyre", *args], env={**clean, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def test_help_lists_the_commands() -> None:
    res = gyre("--help")
    assert res.returncode == 0
    for cmd in ("up", "serve", "events", "replay", "db", "bench"):
        assert cmd in res.stdout
    # each command's summary flows as one paragraph: a docstring's hard line breaks do not
    # cut it mid-sentence (wide enough, each fits on one line)
    wide = gyre("--help", env={"COLUMNS": "240"})
    lines = wide.stdout.splitlines()
    for start, end in (("Greedy success", "(no updates)."), ("Start the embedded stack", "report.html."),
                       ("Run one service", '"Settings").')):
        line = next(x for x in lines if start in x)
        assert end in line, wide.stdout


def test_up_check_starts_the_embedded_stack_healthy(tmp_path) -> None:
    res = gyre("up", "--check", "--cells", "1", "--run-dir", str(tmp_path / "run"), "--run-id", "smoke", timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    for name in ("projector", "proxy", "trajectory", "evaluator", "engine-c0", "cell-c0", "scheduler"):
        assert name in res.stderr
    assert (tmp_path / "run" / "gyre.db").exists()
    assert (tmp_path / "run" / "nats").is_dir()


def test_up_records_the_run_config_as_first_event(nats_server, tmp_path) -> None:
    res = gyre("up", "--check", "--cells", "0", "--run-dir", str(tmp_path / "run"), "--run-id", "cfg",
               env={"GYRE_NATS_URL": nats_server.url, "GYRE_ADMIN_TOKEN": "s3cret"})
    assert res.returncode == 0, res.stderr
    res = gyre("events", "tail", "--context", "runs", "--json", env={"GYRE_NATS_URL": nats_server.url})
    first = json.loads(res.stdout.splitlines()[0])
    assert first["type"] == "RunStarted" and first["run_id"] == "cfg"
    assert first["config"]["settings"]["admin_token"] == "***"  # secrets never reach the log
    assert first["config"]["settings"]["nats_url"] == nats_server.url
    assert first["config"]["run"]["id"] == "cfg" and first["config"]["cells"]["count"] == 0  # the resolved run config


def test_serve_rejects_unknown_service_and_missing_nats() -> None:
    res = gyre("serve", "nonsense")
    assert res.returncode == 2 and "unknown service" in res.stderr
    res = gyre("serve", "projector")
    assert res.returncode == 1 and "GYRE_NATS_URL is not set" in res.stderr
    assert "projector" in gyre("serve", "--list").stdout


def test_bad_settings_are_named(tmp_path) -> None:
    res = gyre("up", "--check", "--run-id", "has spaces", "--run-dir", str(tmp_path))
    assert res.returncode == 2 and "run.id" in res.stderr
    res = gyre("up", "--check", "cells.count=-1", "trainer.lrr=3", "--run-dir", str(tmp_path))
    assert res.returncode == 2 and "cells.count" in res.stderr and "trainer.lrr" in res.stderr
    with pytest.raises(ValueError):
        GyreSettings(log_level="LOUD")


def test_database_url_forms() -> None:
    assert GyreSettings(database_url="postgres://u@h/db").sqlalchemy_url == "postgresql+psycopg://u@h/db"
    assert GyreSettings(database_url="").sqlalchemy_url.startswith("sqlite:///")


def test_db_upgrade(tmp_path) -> None:
    res = gyre("db", "upgrade", "--database-url", f"sqlite:///{tmp_path / 'x.db'}")
    assert res.returncode == 0 and "revision 0001" in res.stdout


def test_bench_bus_prints_one_json_object_last(tmp_path) -> None:
    res = gyre("bench", "bus", "--json", "--n", "2000")
    assert res.returncode == 0, res.stderr
    result = json.loads(res.stdout.strip().splitlines()[-1])
    for key in ("raw_publish_per_s", "gyre_publish_per_s", "publish_ratio", "raw_consume_per_s",
                "gyre_consume_per_s", "consume_ratio"):
        assert result[key] > 0
    assert gyre("bench", "nope").returncode == 2


def test_events_tail_reads_the_log(nats_server) -> None:
    import asyncio

    from libs.common.bus.jetstream import JetStreamBus
    from libs.common.events import RunStarted

    async def put() -> None:
        bus = await JetStreamBus.connect(nats_server.url)
        await bus.publish(RunStarted(run_id="tailed"))
        await bus.close()

    asyncio.run(put())
    res = gyre("events", "tail", "--context", "runs", env={"GYRE_NATS_URL": nats_server.url})
    assert res.returncode == 0 and "RunStarted" in res.stdout and "tailed" in res.stdout
    res = gyre("events", "tail", "--context", "nope", env={"GYRE_NATS_URL": nats_server.url})
    assert res.returncode == 2 and "contexts are" in res.stderr


def test_embedded_nats_dies_with_its_parent(tmp_path) -> None:
    code = (
        "import sys, time; from pathlib import Path; from libs.common.natsserver import EmbeddedNats\n"
        f"n = EmbeddedNats(Path({str(tmp_path)!r})).start(); print(n.proc.pid, flush=True); time.sleep(60)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    import time

    for _ in range(100):
        try:
            os.kill(child_pid, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{child_pid}/stat") as f:
            if f.read().split()[2] == "Z":
                return
        time.sleep(0.05)
    raise AssertionError("nats-server outlived the process that started it")


def test_main_job_runs_steps_and_the_report_rebuilds_from_the_log(tmp_path) -> None:
    runs = tmp_path / "runs"
    summary = tmp_path / "summary.json"
    # phase 0 (a 2-step warm start on the train-split scale tasks), held-out eval before and after
    # two cells: c0 (the core) switches between inference and training; c1 always serves
    res = gyre("up", "run.steps=1", "tasks.per_step=1", "group_size=2", "cells.count=2", "run.id=e2e",
               f"run.dir={runs}", "tasks.include=[starter_scale*]", "warmstart.enabled=true", "warmstart.steps=2",
               "warmstart.flaw_rate=0.5", "eval.heldout=true", "trainer.micro_step_tokens=8192",
               "--json-summary", str(summary), timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    figures = json.loads(summary.read_text())
    assert figures == json.loads((runs / "e2e" / "summary.json").read_text())  # always written beside the report
    assert figures["steps"] == 1 and figures["agent_errors"] == 0 and not figures["errors"]
    # trees and samples rebuilt from the log match (the rebuild packs micro-steps of the run's 8192 tokens)
    assert figures["replay_identical"] is True
    assert figures["cells_replay_same"] is True  # the schedule rebuilt from the cells stream is the live one
    assert 0.0 <= figures["heldout_success_before"] <= 1.0 and 0.0 <= figures["heldout_success_after"] <= 1.0
    report = json.loads((runs / "e2e" / "report.json").read_text())
    assert report["rollouts"] == 2 and report["scored"] == 2 and report["calls"] >= 2
    assert set(report["micro_steps_by_cell"]) <= {"c0", "c1"} and sum(report["micro_steps_by_cell"].values()) >= 1
    assert report["eval_rollouts"] == 4 and set(report["heldout"]) == {"before", "after"}  # 2 held-out tasks x 2
    assert report["warm_start"]["steps"] == 2 and report["warm_start"]["demos"] == 6
    assert report["warm_start"]["flaw_rate"] == 0.5  # recorded in WarmStartCompleted
    # the finished run's trees replay from its own store, reopened (no NATS URL)
    res = gyre("replay", "--trees", "--run", "e2e", "--run-dir", str(runs / "e2e"))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert json.loads(res.stdout.strip().splitlines()[-1])["identical"] is True
    res = gyre("replay", "--cells", "--run", "e2e", "--run-dir", str(runs / "e2e"))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    cells = json.loads(res.stdout.strip().splitlines()[-1])
    assert cells["same_as_live"] is True and set(cells["cells"]) == {"c0", "c1"} and not cells["errors"]
    # the finished run's log exports from its own store too; its micro-steps hold the group's
    # two rollouts with their shared prompt laid out once
    exported = tmp_path / "trees.jsonl"
    res = gyre("events", "export", "-o", str(exported), "-c", "trees", "--run", "e2e", "--run-dir", str(runs / "e2e"))
    assert res.returncode == 0, res.stderr[-2000:]
    events = [json.loads(line)["event"] for line in exported.read_text().splitlines()]
    sizes = {r["digest"]: r["n_tokens"] for e in events if e["type"] == "SamplesSelected" for r in e["samples"]}
    queued = [e for e in events if e["type"] == "MicroStepQueued"]
    assert any(len(e["sample_digests"]) == 2 for e in queued)  # both rollouts (about 800 tokens each) fit 8192
    assert sum(e["n_tokens"] for e in queued) < sum(sizes[d] for e in queued for d in e["sample_digests"])
    assert (runs / "e2e" / "warmstart" / "model" / "config.json").exists()
    marker = json.loads((runs / "e2e" / "warmstart" / "warmstart.json").read_text())
    assert marker["inputs"]["flaw_rate"] == 0.5 and marker["stats"]["flawed_demos"] == 6  # in the reuse digest
    assert (runs / "e2e" / "reward.png").exists() and (runs / "e2e" / "report.html").exists()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(runs / "e2e" / "tensorboard"))
    tb.Reload()
    tags = tb.Tags()["scalars"]
    assert "reward/mean" in tags and "rollouts/partial_score_share" in tags and "train/loss" in tags
    assert [e.step for e in tb.Scalars("reward/mean")] == [0]
    (runs / "e2e" / "report.json").unlink()
    res = gyre("report", "e2e", "--runs-dir", str(runs), timeout=120)  # from the stored log alone
    assert res.returncode == 0, res.stderr
    assert json.loads((runs / "e2e" / "report.json").read_text())["rollouts"] == 2


def test_eval_scores_each_heldout_task_once_greedily(tmp_path) -> None:
    out = tmp_path / "eval.json"
    res = gyre("eval", "cells.count=1", f"run.dir={tmp_path}", "--json-summary", str(out), timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    result = json.loads(out.read_text())
    from services.runner.tasks import load_tasks

    assert result["split"] == "heldout" and result["tasks"] == len(load_tasks(split="heldout")) >= 1
    assert result["scored"] == result["tasks"] and 0.0 <= result["pass_rate"] <= 1.0 and not result["errors"]


def test_warm_start_without_reference_solutions_is_a_clear_error(tmp_path) -> None:
    # a task set without solution/ folders is refused before any service starts
    tasks = tmp_path / "tasks"
    (tasks / "t1" / "hidden").mkdir(parents=True)
    (tasks / "t1" / "task.yaml").write_text("prompt: write f\nsplit: train\n")
    (tasks / "t1" / "hidden" / "test_t1.py").write_text("def test_x():\n    assert True\n")
    (tasks / "t1" / "evaluator.yaml").write_text("weights: {'test_t1.py::test_x': 1}\n")
    res = gyre("up", f"run.dir={tmp_path / 'runs'}", f"tasks.dir={tasks}", "warmstart.enabled=true", "cells.count=0",
               timeout=120)
    assert res.returncode == 2 and "no reference solution" in (res.stdout + res.stderr) and "t1" in res.stdout + res.stderr


def test_ctrl_c_stops_the_run_and_still_writes_the_report(tmp_path) -> None:
    """The first Ctrl-C (SIGINT to `gyre up` alone, as a terminal's reaches it: the services
    run in sessions of their own) stops the run in the middle and writes the report and the
    summary from the log."""
    runs = tmp_path / "runs"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GYRE_")}
    proc = subprocess.Popen([sys.executable, "-m", "gyre", "up", "run.steps=40", "tasks.per_step=1", "group_size=2",
                             "cells.count=1", "run.id=cc", f"run.dir={runs}", "tasks.include=[starter_scale*]"],
                            env=clean, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        workspaces = runs / "cc" / "workspaces"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None and not (workspaces.is_dir() and any(workspaces.iterdir())):
            time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert workspaces.is_dir() and any(workspaces.iterdir()), "no rollout started"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, out[-3000:]  # cut short: not a clean finish
    assert "stopping" in out and "Traceback" not in out, out[-3000:]
    summary = json.loads((runs / "cc" / "summary.json").read_text())
    assert summary["steps"] < 40 and summary["interrupted"] is True  # stopped in the middle, and says so
    assert (runs / "cc" / "report.html").exists() and (runs / "cc" / "report.json").exists()


def test_sigterm_in_the_middle_exits_143_and_the_summary_says_interrupted(tmp_path) -> None:
    runs = tmp_path / "runs"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GYRE_")}
    proc = subprocess.Popen([sys.executable, "-m", "gyre", "up", "run.steps=40", "tasks.per_step=1", "group_size=2",
                             "cells.count=1", "run.id=st", f"run.dir={runs}", "tasks.include=[starter_scale*]"],
                            env=clean, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        workspaces = runs / "st" / "workspaces"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None and not (workspaces.is_dir() and any(workspaces.iterdir())):
            time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, out[-3000:]
    assert "SIGTERM: stopping" in out and "Traceback" not in out, out[-3000:]
    summary = json.loads((runs / "st" / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["steps"] < 40
    # not a terminal: plain progress lines as it goes, not only the live table's last frame
    assert out.startswith("starting\n") or "\nstarting\n" in out.split("SIGTERM: stopping")[0], out[-3000:]


def test_the_runner_service_takes_its_options_from_the_environment() -> None:
    from gyre.services import runner_env_options

    environ = {"GYRE_PROXY_URL": "http://p", "GYRE_POLICY_MODEL": "my-policy", "GYRE_RUNNER_MAX_PARALLEL": ""}
    assert runner_env_options({}, environ) == {"proxy_url": "http://p", "model": "my-policy"}
    assert runner_env_options({"model": "given"}, environ)["model"] == "given"  # the command line wins


def _runner_config_from(environ: dict[str, str], tmp_path):
    """What ``gyre serve runner`` builds from these variables (``services/runner/main.py``)."""
    from services.runner.main import env_options, runner_config

    return runner_config("r1", env_options({"proxy_url": "http://p:1", "work_root": str(tmp_path)}, environ))


def test_the_runner_service_takes_max_turns_from_the_environment(tmp_path) -> None:
    assert _runner_config_from({}, tmp_path).max_turns == 40  # the service's own default
    assert _runner_config_from({"GYRE_RUNNER_MAX_TURNS": "8"}, tmp_path).max_turns == 8
    for bad in ("eight", "0", "-3", "2.5"):
        with pytest.raises(ValueError, match="GYRE_RUNNER_MAX_TURNS"):
            _runner_config_from({"GYRE_RUNNER_MAX_TURNS": bad}, tmp_path)


def test_the_runner_service_takes_time_limit_scale_from_the_environment(tmp_path) -> None:
    assert _runner_config_from({}, tmp_path).time_limit_scale == 1.0
    assert _runner_config_from({"GYRE_RUNNER_TIME_LIMIT_SCALE": "2.5"}, tmp_path).time_limit_scale == 2.5
    for bad in ("fast", "0", "-1", "inf", "nan"):
        with pytest.raises(ValueError, match="GYRE_RUNNER_TIME_LIMIT_SCALE"):
            _runner_config_from({"GYRE_RUNNER_TIME_LIMIT_SCALE": bad}, tmp_path)


def test_the_runner_service_takes_keep_workspaces_from_the_environment(tmp_path) -> None:
    assert _runner_config_from({}, tmp_path).keep_workspaces is False
    for word, kept in (("1", True), ("true", True), ("ON", True), ("0", False), ("no", False), ("off", False)):
        assert _runner_config_from({"GYRE_RUNNER_KEEP_WORKSPACES": word}, tmp_path).keep_workspaces is kept
    with pytest.raises(ValueError, match="GYRE_RUNNER_KEEP_WORKSPACES"):
        _runner_config_from({"GYRE_RUNNER_KEEP_WORKSPACES": "maybe"}, tmp_path)


def test_a_runner_option_given_in_process_wins_over_the_environment(tmp_path) -> None:
    from services.runner.main import env_options

    assert env_options({"max_turns": 8}, {"GYRE_RUNNER_MAX_TURNS": "3"})["max_turns"] == 8
