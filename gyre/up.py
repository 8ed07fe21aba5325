"""``gyre up``: the embedded stack on one machine, with a live status view.

Starts a nats-server (unless ``GYRE_NATS_URL`` is given), migrates the database (SQLite
under the run folder unless ``GYRE_DATABASE_URL``), records the run's resolved settings as
its first event (``RunStarted``), starts every service as its own ``gyre serve``
process, and shows their health until Ctrl-C (or ``--duration``/``--check``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import secrets
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.live import Live
from rich.table import Table

from gyre.services import SERVICES
from libs.common.bus.jetstream import JetStreamBus
from libs.common.runtime import connect_tool_bus
from libs.common.db.engine import upgrade
from libs.common.events import RunStarted, WarmStartCompleted
from libs.common.natsserver import EmbeddedNats, clear_live_url, free_port, live_url, write_live_url
from libs.common.runconfig import RunConfig
from libs.common.settings import GyreSettings

SECRET_KEYS = {"admin_token", "nats_creds"}
FINISH_TIMEOUT_S = 180.0  # the report and the tree replay at the end of a run
# A service that fails (exits non-zero) is started again this many times: each resumes from
# the log and its own durable state (the trainer from its checkpoint), as under systemd's or
# Kubernetes' restart policy; after that the run stops with the service's last log lines.
MAX_RESTARTS = 3


@dataclass
class Child:
    name: str
    port: int
    proc: subprocess.Popen[bytes]
    health: dict[str, Any] | None = None
    launch: "Launch | None" = None
    restarts: int = 0

    @property
    def state(self) -> str:
        if self.proc.poll() is not None:
            return f"exited ({self.proc.returncode})"
        return (self.health or {}).get("status", "starting")


@dataclass(frozen=True)
class Launch:
    """One process of the stack: ``gyre serve <service>`` with its own environment."""

    name: str
    service: str
    port: int
    env: dict[str, str]
    stage: int  # started once every process of the stages before is healthy


def plan_stack(cfg: RunConfig, admin_token: str) -> list[Launch]:
    """The embedded stack: services, ``cells.count`` embedded engine cells with their
    agents, and the scheduler that switches them (cell c0 is the core cell)."""
    from services.trainer.main import run_config_options as trainer_options
    from services.trajectory.main import run_config_options

    cells = cfg.cells.count
    proxy_port = free_port()
    proxy_url = f"http://127.0.0.1:{proxy_port}"
    tasks_dir = str((cfg.tasks.dir or Path(__file__).resolve().parent.parent / "tasks").resolve())
    common = {"GYRE_ADMIN_TOKEN": admin_token, "GYRE_MODEL": cfg.model.name,
              "GYRE_POLICY_MODEL": cfg.model.policy_name, "GYRE_EVALUATOR_TASKS_DIR": tasks_dir,
              "GYRE_EVALUATOR_SCORERS": json.dumps(cfg.evaluator.scorers),
              "GYRE_SCHEDULER_POLICY": cfg.cells.policy, "GYRE_SCHEDULER_HOLD_S": str(cfg.cells.hold_s),
              "GYRE_SCHEDULER_MIN_DWELL_S": str(cfg.cells.min_dwell_s),
              "GYRE_SCHEDULER_SMOOTHING_S": str(cfg.cells.smoothing_s),
              "GYRE_SCHEDULER_TICK_S": str(cfg.cells.tick_s),
              "GYRE_SCHEDULER_LOW_WATERMARK": str(cfg.cells.low_watermark),
              "GYRE_SCHEDULER_HIGH_WATERMARK": str(cfg.cells.high_watermark),
              "GYRE_SCHEDULER_MAX_SWITCHES_IN_FLIGHT": str(cfg.cells.max_switches_in_flight),
              "GYRE_SCHEDULER_MIN_INFERENCE_CELLS": str(cfg.cells.min_inference_cells),
              "GYRE_SCHEDULER_TRAINING_CELLS": str(cfg.cells.training_cells),
              "GYRE_SCHEDULER_MAX_RESENDS": str(cfg.cells.max_resends),
              "GYRE_SCHEDULER_GROUPS_PER_STEP": str(cfg.tasks.per_step),
              **{f"GYRE_TRAJECTORY_{k.upper()}": str(v) for k, v in run_config_options(cfg.model_dump()).items()},
              "GYRE_EVALUATOR_WORKERS": str(cfg.evaluator.workers),
              **({"GYRE_EVALUATOR_JUDGE__BASE_URL": cfg.evaluator.judge_url,
                  "GYRE_EVALUATOR_JUDGE__MODEL": cfg.evaluator.judge_model} if cfg.evaluator.judge_url else {})}
    plan = [Launch("projector", "projector", free_port(), common, 0),
            Launch("proxy", "proxy", proxy_port,  # calls naming no max_tokens get the run's
                   {**common, "GYRE_PROXY_DEFAULT_MAX_TOKENS": str(cfg.sampling.max_tokens)}, 0),
            Launch("trajectory", "trajectory", free_port(), common, 0),
            Launch("evaluator", "evaluator", free_port(), common, 0)]
    trainer_env = {f"GYRE_TRAINER_{k.upper()}": str(v) for k, v in trainer_options(cfg.model_dump()).items()}
    follow = core_follows_role(cfg)
    for i in range(cells):
        port = free_port()
        plan.append(Launch(f"engine-c{i}", "engine", port,
                           {**common, "GYRE_ENGINE_ADMIN_TOKEN": admin_token, "GYRE_ENGINE_NUM_THREADS": "1",
                            "GYRE_ENGINE_MODEL": cfg.model.name}, 0))
        plan.append(Launch(f"cell-c{i}", "cell", free_port(),
                           {**common, "GYRE_CELL_NAME": f"c{i}", "GYRE_CELL_ENGINE_URL": f"http://127.0.0.1:{port}",
                            "GYRE_PROXY_URL": proxy_url, "GYRE_CELL_CORE": "1" if i == 0 else "0",
                            **({"GYRE_CELL_SEAT": "trainer"} if i == 0 and follow else {}),
                            **trainer_env}, 1))  # a non-core cell trains as a satellite with the core's options
    if cells:
        engines = ",".join(f"c{i}=http://127.0.0.1:{launch.port}"
                           for i, launch in enumerate(x for x in plan if x.service == "engine"))
        plan.append(Launch("trainer", "trainer", free_port(), {
            **common, "GYRE_TRAINER_ROLE": "core", "GYRE_TRAINER_CELL": "c0", "GYRE_TRAINER_PUBLISH_TO": engines,
            "GYRE_TRAINER_GROUPS_PER_STEP": str(cfg.tasks.per_step),
            "GYRE_TRAINER_FOLLOW_ROLE": "1" if follow else "0",
            **trainer_env}, 1))
        plan.append(Launch("scheduler", "scheduler", free_port(), {**common, "GYRE_PROXY_URL": proxy_url}, 2))
    return plan


def core_follows_role(cfg: RunConfig) -> bool:
    """``cells.core_follows_role``, where it can work: the elastic scheduler never moves the
    only cell of a one-cell run to training (it must keep serving), so there the core
    trains in every role (``follow_role_note`` says so)."""
    return cfg.cells.core_follows_role and not (cfg.cells.count < 2 and cfg.cells.policy == "elastic")


def follow_role_note(cfg: RunConfig) -> str | None:
    if cfg.cells.core_follows_role and not core_follows_role(cfg):
        return ("cells.core_follows_role is off for this run: with one cell the elastic scheduler keeps it "
                "serving, so the core trains in every role")
    return None


def resolved_config(settings: GyreSettings, cfg: RunConfig) -> dict[str, Any]:
    """The run config as validated, plus where the services found NATS and the database."""
    data = settings.model_dump(mode="json")
    for key in SECRET_KEYS:
        if data.get(key):
            data[key] = "***"
    return {**cfg.model_dump(mode="json"), "settings": data, "services": sorted(SERVICES)}


async def _record_run_started(settings: GyreSettings, cfg: RunConfig) -> None:
    config = resolved_config(settings, cfg)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    from gyre import __version__

    await _publish(settings, RunStarted(run_id=settings.run_id, config=config, config_digest=digest,
                                        gyre_version=__version__))


def _spawn(launch: Launch, env: dict[str, str], log_dir: Any) -> Child:
    log = open(log_dir / f"{launch.name}.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "gyre", "serve", launch.service, "--port", str(launch.port)],
                            env={**env, **launch.env}, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)  # a terminal's Ctrl-C reaches gyre up, which stops them in order
    log.close()
    return Child(launch.name, launch.port, proc, launch=launch)


def _restart_failed(children: list[Child], env: dict[str, str], log_dir: Any, console: Console) -> list[Child]:
    """Starts again each child that exited non-zero and has restarts left; returns the
    exited children it could not restart (a clean exit, or no restarts left)."""
    given_up = []
    for i, c in enumerate(children):
        if c.proc.poll() is None:
            continue
        log = log_dir / f"{c.name}.log"
        tail = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else []
        if c.proc.returncode == 0 or c.launch is None or c.restarts >= MAX_RESTARTS:
            given_up.append(c)
            continue
        console.print(f"[yellow]{c.name} exited ({c.proc.returncode}); starting it again "
                      f"({c.restarts + 1}/{MAX_RESTARTS}); last lines of {log}:[/]")
        console.print("\n".join(tail), markup=False, highlight=False)
        again = _spawn(c.launch, env, log_dir)
        again.restarts = c.restarts + 1
        children[i] = again
    return given_up


def _poll(children: list[Child], client: httpx.Client) -> None:
    for c in children:
        try:
            r = client.get(f"http://127.0.0.1:{c.port}/health", timeout=0.5)
        except httpx.HTTPError:
            c.health = None
            continue
        try:
            c.health = r.json() if r.content else {}
        except ValueError:
            c.health = {}
        if not isinstance(c.health, dict):
            c.health = {}
        if r.status_code == 200 and "status" not in c.health:
            c.health["status"] = "ok"  # SGLang-style engines answer 200 with no body


def _table(settings: GyreSettings, nats_url: str, children: list[Child], job: "MainJob | None" = None) -> Table:
    t = Table(title=f"gyre up · run {settings.run_id} · {settings.run_dir}", expand=False)
    for col in ("service", "state", "pid", "port", "detail"):
        t.add_column(col)
    t.add_row("nats", "ok", "", nats_url.rsplit(":", 1)[-1], nats_url)
    t.add_row("database", "ok", "", "", settings.sqlalchemy_url)
    for c in children:
        detail = {k: v for k, v in (c.health or {}).items() if k not in ("service", "status")}
        colour = "green" if c.state == "ok" else "yellow" if c.state == "starting" else "red"
        t.add_row(c.name, f"[{colour}]{c.state}[/]", str(c.proc.pid), str(c.port),
                  " ".join(f"{k}={v}" for k, v in detail.items())[:90])
    if job is not None:
        t.caption = job.progress.row()
    return t


def _admin_token(settings: GyreSettings) -> str:
    if settings.admin_token:
        return settings.admin_token
    path = settings.run_dir / "admin_token"
    if path.exists():
        return path.read_text().strip()
    token = secrets.token_hex(16)
    path.write_text(token + "\n")
    path.chmod(0o600)
    return token


def preflight(cfg: RunConfig, json_summary: Path | None) -> str | None:
    """What the run config or the command asks for that cannot work, found before anything
    starts (else hours later: the harness is first used after the warm start and the
    stack, the summary written after the run); None when all is well."""
    from services.runner.harness import PRESETS

    if cfg.harness.name not in PRESETS:
        return f"harness.name: unknown harness {cfg.harness.name!r}; known: {', '.join(sorted(PRESETS))}"
    if cfg.tasks.dir is not None and not Path(cfg.tasks.dir).is_dir():
        return f"tasks.dir: {cfg.tasks.dir} is not a folder"
    if json_summary is not None:
        parent = json_summary.parent
        if not parent.is_dir():
            return f"--json-summary {json_summary}: the folder {parent} does not exist"
        if json_summary.is_dir():
            return f"--json-summary {json_summary} is a folder"
        if not os.access(parent, os.W_OK):
            return f"--json-summary {json_summary}: the folder {parent} is not writable"
    return None


def run_up(settings: GyreSettings, cfg: RunConfig, *, check: bool = False, duration: float = 0.0,
           json_summary: Path | None = None, eval_split: str | None = None) -> int:
    console = Console(stderr=check)
    problem = preflight(cfg, json_summary)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr, flush=True)
        return 2
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    log_dir = settings.run_dir / "logs"
    log_dir.mkdir(exist_ok=True)
    nats = None
    if not settings.nats_url and live_url(settings.nats_store_dir) is not None:
        print(f"error: a gyre up is running on {settings.run_dir} already (its server: "
              f"{live_url(settings.nats_store_dir)}); stop it first, or pass another --run-dir or run.id",
              file=sys.stderr, flush=True)
        return 2
    if not settings.nats_url:
        nats = EmbeddedNats(settings.nats_store_dir).start()
        write_live_url(settings.nats_store_dir, nats.url)  # gyre events tail/report/... connect here meanwhile
        settings = settings.model_copy(update={"nats_url": nats.url})
    children: list[Child] = []
    stopping = False
    stopped_by: int | None = None  # the signal that stopped the run early

    def _stop(signum: int | None = None, _frame: object = None) -> None:
        nonlocal stopping, stopped_by
        if stopping and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop at once, without the report
        if not stopping:
            name = signal.Signals(signum).name if signum else "stop"
            print(f"gyre up: {name}: stopping; the report and summary are still written "
                  "(Ctrl-C again to stop at once)", file=sys.stderr, flush=True)
        stopping = True
        stopped_by = signum

    def _interrupted_code() -> int:
        return 128 + (stopped_by or signal.SIGINT)

    # from here a Ctrl-C stops the run like SIGTERM: the report is still written
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        upgrade(settings.sqlalchemy_url)
        asyncio.run(_record_run_started(settings, cfg))
        if cfg.warmstart.enabled and eval_split is None and not check:
            from gyre.warmstart import WarmStartInterrupted

            try:
                cfg = warm_start_phase(settings, cfg, console, should_stop=lambda: stopping)
            except ValueError as exc:  # no solutions, held-out tasks, a demonstration that cannot be rendered
                console.print(f"[red]warm start: {exc}[/]")
                return 2
            except WarmStartInterrupted as exc:
                console.print(f"[yellow]{exc}; no RL step ran[/]")
                return _interrupted_code()
            if stopping:
                return _interrupted_code()
        env = {**os.environ, "GYRE_NATS_URL": settings.nats_url or "", "GYRE_RUN_ID": settings.run_id,
               "GYRE_RUN_DIR": str(settings.run_dir), "GYRE_DATABASE_URL": settings.sqlalchemy_url}
        plan = plan_stack(cfg, _admin_token(settings))
        if follow_role_note(cfg):
            console.print(f"[yellow]{follow_role_note(cfg)}[/]")
        job = None if check else MainJob(cfg, settings.nats_url or "", proxy_url(plan), eval_split=eval_split,
                                             blob_bucket=settings.blob_bucket)
        code = _watch(settings, plan, children, env, console, check=check, duration=duration,
                      stopping=lambda: stopping, job=job)
        # cut short: a signal before the steps were done (or, for --check, before all were healthy)
        interrupted = stopping and not (job is not None and job.done and job.error is None)
        if job is not None:
            # the stack stopped before the steps were done: a service that exited for good,
            # or --duration; the summary says so (and why, for a service)
            cut_short = not job.done
            if cut_short and not stopping:
                job.progress.errors.append(
                    "the stack stopped before the steps were done: " + (
                        "a service exited for good (its last lines are printed above)" if code else
                        f"--duration {duration:g}s reached"))
            job.stop()  # its thread must not outlive the stack it talks to
            _stop_children(children, {"scheduler"})  # it writes the schedule the cells replay checks
            code = job.finish(settings, json_summary, console, interrupted=interrupted or cut_short) or code
        if interrupted:
            return code or _interrupted_code()
        return code
    except KeyboardInterrupt:
        return _interrupted_code()
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for c in children:
            if c.proc.poll() is None:
                c.proc.terminate()
        for c in children:
            try:
                c.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                c.proc.kill()
        if nats is not None:
            clear_live_url(nats.store_dir)
            nats.stop()


def _stop_children(children: list[Child], names: set[str], timeout_s: float = 30.0) -> None:
    for c in children:
        if c.name in names and c.proc.poll() is None:
            c.proc.terminate()
            try:
                c.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                c.proc.kill()


def warm_start_phase(settings: GyreSettings, cfg: RunConfig, console: Console,
                     should_stop: Any = None) -> RunConfig:
    """Phase 0, before RL: supervised fine-tuning on the scripted solver's demonstrations of
    the *train* tasks (never the held-out ones). Writes ``<run>/warmstart/model`` (kept and
    reused when its inputs are unchanged), records ``WarmStartCompleted`` and returns the
    config with the model pointed at the warm-started folder."""
    from gyre.run import select_tasks
    from gyre.warmstart import DEFAULT_CURRICULUM, warm_start
    from libs.common.tasksets import is_task_set, materialize
    from services.engine.model_store import resolve_model
    from services.runner.tasks import default_tasks_dir

    tasks = [t for t in select_tasks(cfg, "train") if t.split == "train"]
    if not tasks:
        raise ValueError("warmstart.enabled needs train-split tasks with a reference solution")

    root = Path(cfg.tasks.dir) if cfg.tasks.dir else default_tasks_dir()
    root = materialize(root) if is_task_set(root) else root  # where the tasks (and solutions) were loaded from
    missing = [t.task_id for t in tasks if not (root / t.task_id / "solution").is_dir()]
    if missing:
        raise ValueError(f"warmstart.enabled: no reference solution (solution/ folder) for {', '.join(missing[:5])}"
                         f"{' ...' if len(missing) > 5 else ''} in {root}; narrow tasks.include or turn it off")
    out = settings.run_dir / "warmstart" / "model"
    ws = cfg.warmstart
    base = resolve_model(cfg.model.name).folder
    solutions = hashlib.sha256()
    for t in tasks:
        for p in sorted((root / t.task_id).rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts and "hidden" not in p.relative_to(root / t.task_id).parts:
                solutions.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes())
    inputs = {"base": cfg.model.name, "base_folder": str(base), "tasks": [t.task_id for t in tasks],
              "tasks_digest": solutions.hexdigest(), "steps": ws.steps, "lr": ws.lr, "seed": ws.seed,
              "curriculum": [list(stage) for stage in DEFAULT_CURRICULUM], "max_completion_tokens": cfg.sampling.max_tokens}
    if ws.flaw_rate:  # only when set, so digests of earlier warm starts stay valid
        inputs["flaw_rate"] = ws.flaw_rate
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
    marker = out.parent / "warmstart.json"
    console.rule("[bold]phase 0: warm start[/] (SFT on scripted demonstrations of the train tasks)")
    stats: dict[str, Any] = {}
    reused = False
    if marker.exists() and (out / "config.json").exists():
        try:
            old = json.loads(marker.read_text())
            reused = old.get("inputs_digest") == digest
            stats = old.get("stats", {}) if reused else {}
        except ValueError:
            reused = False
    if not reused:
        marker.unlink(missing_ok=True)  # a crash while training must not leave new weights under an old digest
        started = time.monotonic()
        stats = warm_start(base, out, tasks, steps=ws.steps, lr=ws.lr, seed=ws.seed, tasks_root=root,
                           max_completion_tokens=cfg.sampling.max_tokens, flaw_rate=ws.flaw_rate,
                           log=lambda msg: console.print(f"  warm start: {msg}", markup=False, highlight=False),
                           should_stop=should_stop)
        stats.setdefault("seconds", round(time.monotonic() - started, 1))
        marker.write_text(json.dumps({"inputs": inputs, "inputs_digest": digest, "stats": stats}, indent=2))
    console.print(f"  warm start {'reused' if reused else 'done'}: {len(tasks)} train tasks, "
                  f"{stats.get('demos', '?')} demonstrations, {stats.get('steps', '?')} steps, "
                  f"loss {stats.get('loss_first', '?')} -> {stats.get('loss_last', '?')}"
                  f"{f', flawed demonstrations drawn at {ws.flaw_rate:g}' if ws.flaw_rate else ''}, model {out}")
    asyncio.run(_publish(settings, WarmStartCompleted(
        run_id=settings.run_id, base_model=cfg.model.name, model_dir=str(out), tasks=[t.task_id for t in tasks],
        demos=int(stats.get("demos", 0)), steps=int(stats.get("steps", 0)), loss_first=stats.get("loss_first"),
        loss_last=stats.get("loss_last"), seconds=float(stats.get("seconds", 0.0)), reused=reused,
        flaw_rate=ws.flaw_rate)))
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"name": str(out.resolve())})})


async def _publish(settings: GyreSettings, event: Any) -> None:
    bus = await connect_tool_bus(settings.nats_url or "", name="gyre-up", settings=settings)
    try:
        await bus.publish(event)
    finally:
        await bus.close()


def proxy_url(plan: list[Launch]) -> str:
    return next(f"http://127.0.0.1:{launch.port}" for launch in plan if launch.service == "proxy")


class MainJob:
    """The RL steps, run in a thread of their own once the stack is healthy."""

    def __init__(self, cfg: RunConfig, nats_url: str, proxy: str, *, eval_split: str | None = None,
                 blob_bucket: str = "gyre-blobs") -> None:
        from gyre.run import Progress

        self.cfg, self.nats_url, self.proxy, self.blob_bucket = cfg, nats_url, proxy, blob_bucket
        self.eval_split = eval_split
        self.progress = Progress(steps=cfg.run.steps)
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self) -> None:
        from gyre.run import RunFailed, run_steps

        async def steps() -> None:
            self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
            await run_steps(self.cfg, self.nats_url, self.proxy, self.progress,
                            trainer_running=self.cfg.cells.count > 0 and self.eval_split is None,
                            eval_only=self.eval_split is not None, blob_bucket=self.blob_bucket)

        def target() -> None:
            try:
                asyncio.run(steps())
            except asyncio.CancelledError:  # stop(): the run was cut short
                self.progress.status = "interrupted"
            except RunFailed as exc:  # one line, already in progress.errors (and its status)
                self.error = exc
            except BaseException as exc:  # shown by finish(); the stack is stopped either way
                self.error = exc
                self.progress.status = f"failed: {exc!r}"

        self.thread = threading.Thread(target=target, name="gyre-main-job", daemon=True)
        self.thread.start()

    @property
    def done(self) -> bool:
        return self.thread is not None and not self.thread.is_alive()

    def stop(self, timeout_s: float = 15.0) -> None:
        """Cancel the steps (a stop in the middle), so they do not outlive the stack."""
        if self.thread is None or not self.thread.is_alive():
            return
        loop, task = getattr(self, "_loop", None), getattr(self, "_task", None)
        if loop is not None and task is not None:
            with contextlib.suppress(RuntimeError):  # its loop just closed
                loop.call_soon_threadsafe(task.cancel)
        self.thread.join(timeout_s)

    def finish(self, settings: GyreSettings, json_summary: Path | None, console: Console, *,
               interrupted: bool = False) -> int:
        from gyre.run import eval_summary, summary

        if self.eval_split is not None:
            result = eval_summary(self.progress, self.eval_split)
            result["interrupted"] = interrupted
            if json_summary is not None:
                json_summary.write_text(json.dumps(result, indent=2))
            console.print(json.dumps(result))
            self._print_error(console)
            return 1 if self.error is not None else 0

        try:  # bounded: a stop in the middle of a run must not hang here
            path = asyncio.run(asyncio.wait_for(rebuild_report(settings), FINISH_TIMEOUT_S))
            facts = json.loads((path.parent / "report.json").read_text())
            console.print(f"report: {path}")
        except Exception as exc:  # the summary is still written
            console.print(f"[red]report failed: {exc!r}[/]")
            facts = {}
        result = summary(self.progress, role_switches=facts.get("role_switches", 0),
                         agent_errors=facts.get("harness_failures", 0) + facts.get("undelivered_calls", 0))
        result["interrupted"] = interrupted  # stopped before the steps were done
        result["replay_identical"] = self._replay_identical(settings, console)
        if self.cfg.cells.count:
            result["cells_replay_same"] = self._cells_replay_same(settings, console)
        (settings.run_dir / "summary.json").write_text(json.dumps(result, indent=2))  # always, beside the report
        if json_summary is not None:
            json_summary.write_text(json.dumps(result, indent=2))
        console.print(json.dumps(result))
        self._print_error(console)
        return 1 if self.error is not None else 0

    def _print_error(self, console: Console) -> None:
        if self.error is not None:
            from gyre.run import RunFailed

            what = str(self.error) if isinstance(self.error, RunFailed) else repr(self.error)
            console.print(f"gyre: run failed: {what}", style="red", markup=False, highlight=False)


    def _cells_replay_same(self, settings: GyreSettings, console: Console) -> bool | None:
        """The schedule rebuilt from the cells stream against the live scheduler's own."""
        from gyre.events_cmd import replay_cells

        try:
            result = asyncio.run(asyncio.wait_for(
                replay_cells(settings.nats_url or "", settings.run_id, settings.run_dir), FINISH_TIMEOUT_S))
        except Exception as exc:
            console.print(f"[red]cells replay failed: {exc!r}[/]")
            return None
        console.print("cells replay: " + json.dumps({k: result[k] for k in (
            "events", "switches", "cells", "same_as_live", "errors")}))
        return result["same_as_live"]

    def _replay_identical(self, settings: GyreSettings, console: Console) -> bool | None:
        """Rebuild the run's trees and samples from the log and compare (the trajectory
        service may still be sealing the last step: a few tries, a few seconds apart)."""
        from gyre.events_cmd import replay_trees

        result: dict[str, Any] = {}
        for _ in range(4):
            try:
                result = asyncio.run(asyncio.wait_for(replay_trees(settings.nats_url or "", settings.run_id,
                                                                   settings.blob_bucket),
                                                      FINISH_TIMEOUT_S))
            except Exception as exc:
                console.print(f"[red]tree replay failed: {exc!r}[/]")
                return None
            if result["identical"]:
                break
            time.sleep(3)
        console.print(f"tree replay: {result}")
        return bool(result.get("identical"))


async def rebuild_report(settings: GyreSettings, *, require: bool = False) -> Path:
    """The report of ``settings.run_id`` from its log (the embedded store when no NATS URL).
    ``require`` (``gyre report``): a run the log does not hold is an error, and nothing is
    written."""
    from gyre.events_cmd import require_run, run_nats_url
    from gyre.report import collect, write_report

    if require:
        with run_nats_url(settings) as url:  # no store under the run folder: an error, not an empty one
            bus = await connect_tool_bus(url, name="gyre-report", settings=settings)
            try:
                await require_run(bus, settings.run_id, settings.nats_url or str(settings.nats_store_dir))
                facts = await collect(bus, settings.run_id)
            finally:
                await bus.close()
        return write_report(facts, settings.run_dir)
    nats = None
    url = settings.nats_url or live_url(settings.nats_store_dir)  # a run still going: its own server
    if not url:
        nats = EmbeddedNats(settings.nats_store_dir).start()
        url = nats.url
    try:
        bus = await connect_tool_bus(url, name="gyre-report", settings=settings)
        try:
            facts = await collect(bus, settings.run_id)
        finally:
            await bus.close()
    finally:
        if nats is not None:
            nats.stop()
    return write_report(facts, settings.run_dir)


class PlainProgress:
    """Where the status is not a terminal (a log file, CI), Rich's live table shows only
    its last frame: one plain line per change of the run's phase or step instead."""

    def __init__(self) -> None:
        self.status: str | None = None
        self.step = -1
        self.rewards = 0
        self.evals: set[str] = set()

    def lines(self, p: Any) -> list[str]:
        out = []
        for phase in [k for k in p.evals if k not in self.evals]:
            self.evals.add(phase)
            e = p.evals[phase]
            name = "eval" if phase == "eval" else f"held-out eval {phase}"
            out.append(f"{name}: {e.get('scored', 0)}/{e.get('tasks', 0)} scored, success {e.get('success')}, "
                       f"mean score {e.get('mean_score')}")
        while self.rewards < len(p.rewards):
            self.rewards += 1
            out.append(f"step {self.rewards}/{p.steps} applied: reward {p.rewards[self.rewards - 1]:.3f}, "
                       f"weights v{p.weight_version}")
        if p.step != self.step or p.status != self.status:
            if p.step != self.step and p.step >= 0 and p.status == "rollouts":
                out.append(f"step {p.step + 1}/{p.steps} started")
            elif p.status != self.status and p.status not in ("rollouts", "scoring", "training"):
                out.append(str(p.status))
            self.step, self.status = p.step, p.status
        return out


def _watch(settings: GyreSettings, plan: list[Launch], children: list[Child], env: dict[str, str],
           console: Console, *, check: bool, duration: float, stopping: Any, job: MainJob | None = None) -> int:
    start = time.monotonic()
    log_dir = settings.run_dir / "logs"
    waiting = sorted(plan, key=lambda launch: launch.stage)
    plain = None if console.is_terminal or job is None else PlainProgress()
    with httpx.Client() as client, Live(console=console, refresh_per_second=4, transient=False) as live:
        while not stopping():
            if plain is not None:
                for line in plain.lines(job.progress):
                    console.print(line, markup=False, highlight=False)
            ready = all(c.state == "ok" for c in children)
            stage = waiting[0].stage if waiting else None
            while waiting and waiting[0].stage == stage and (ready or not children):
                children.append(_spawn(waiting.pop(0), env, log_dir))
            _poll(children, client)
            live.update(_table(settings, settings.nats_url or "", children, job))
            healthy = not waiting and all(c.state == "ok" for c in children)
            if job is not None and healthy and job.thread is None:
                job.start()
            if job is not None and job.done:
                if plain is not None:
                    for line in plain.lines(job.progress):
                        console.print(line, markup=False, highlight=False)
                return 0
            exited = _restart_failed(children, env, log_dir, console)
            if exited:
                live.update(_table(settings, settings.nats_url or "", children, job))
                for c in exited:
                    log = settings.run_dir / "logs" / f"{c.name}.log"
                    tail = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else []
                    console.print(f"[red]{c.name} exited ({c.proc.returncode}); last lines of {log}:[/]")
                    console.print("\n".join(tail), markup=False, highlight=False)
                return 1
            if check and healthy:
                return 0
            elapsed = time.monotonic() - start
            if check and elapsed > 240:
                console.print("[red]services not healthy within 240 s[/]")
                return 1
            if duration and elapsed >= duration:
                return 0
            time.sleep(0.5)
    return 0
