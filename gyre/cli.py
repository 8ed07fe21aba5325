"""The ``gyre`` command line. It imports services; nothing imports it."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from libs.common.settings import GyreSettings

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Gyre: online RL for long-horizon LLM agents.")
events_app = typer.Typer(no_args_is_help=True, help="Read the event log (JetStream).")
db_app = typer.Typer(no_args_is_help=True, help="Database schema (Alembic migrations).")
app.add_typer(events_app, name="events")
app.add_typer(db_app, name="db")

RunDir = Annotated[Optional[Path], typer.Option("--run-dir", help="state folder of the embedded stack [GYRE_RUN_DIR]")]


def _settings(**overrides: object) -> GyreSettings:
    from pydantic import ValidationError

    from libs.common.settings import settings_error

    try:
        return GyreSettings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:  # say which variable (or the option standing for it) is wrong
        typer.echo(f"error: invalid setting: {settings_error(exc)}", err=True)
        raise typer.Exit(2) from None


def _finished_run_dir(run_id: str | None, run_dir: Path | None) -> Path | None:
    """Where a finished run's store is: ``--run-dir``, else ``GYRE_RUN_DIR``, else
    ``runs/<run>`` (where ``gyre up`` leaves a run)."""
    import os

    if run_dir is None and run_id and not os.environ.get("GYRE_RUN_DIR"):
        return Path("runs") / run_id
    return run_dir


_FINISHED_RUN_HELP = ("without GYRE_NATS_URL: the run's folder, whose event store is reopened (a run gyre up "
                      "is still running: read through its own server) [GYRE_RUN_DIR; default runs/<run>]")


def _logging(settings: GyreSettings) -> None:
    from libs.common.logs import configure_logging

    configure_logging(settings.log_level, json_lines=settings.log_json)


@app.command()
def up(
    overrides: Annotated[Optional[list[str]], typer.Argument(help="run-config overrides: key.path=value")] = None,
    config: Annotated[Optional[Path], typer.Option("--config", "-c", help="run config YAML")] = None,
    run_dir: Annotated[Optional[Path], typer.Option(
        "--run-dir", help="the stack's state folder: event store, logs, report (default: <run.dir>/<run.id>, "
                          "e.g. runs/demo; TensorBoard, W&B and agent workspaces stay there)")] = None,
    run_id: Annotated[Optional[str], typer.Option(help="run id (run.id)")] = None,
    check: Annotated[bool, typer.Option("--check", help="start the stack, exit 0 once every service is healthy")] = False,
    duration: Annotated[float, typer.Option(help="stop after this many seconds (0 = when the steps are done)")] = 0.0,
    cells: Annotated[Optional[int], typer.Option(min=0, max=16, help="engine cells (cells.count); c0 is the core")] = None,
    json_summary: Annotated[Optional[Path], typer.Option(help="write the run's summary figures here as JSON")] = None,
) -> None:
    """Start the embedded stack and run the RL steps of the run config, with live status;
    the report goes to runs/<run>/report.html."""
    from gyre.up import run_up
    from libs.common.runconfig import RunConfigError, load_run_config

    extra = list(overrides or [])
    if run_id:
        extra.append(f"run.id={run_id}")
    if cells is not None:
        extra.append(f"cells.count={cells}")
    try:
        cfg = load_run_config(config, extra)
    except RunConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    folder = run_dir or cfg.run_dir
    settings = _settings(run_dir=folder, run_id=cfg.run.id, nats_url=cfg.bus.nats_url,
                         database_url=cfg.storage.database_url)
    _logging(settings)
    raise typer.Exit(run_up(settings, cfg, check=check, duration=duration, json_summary=json_summary))


@app.command("eval")
def eval_(
    overrides: Annotated[Optional[list[str]], typer.Argument(help="run-config overrides: key.path=value")] = None,
    config: Annotated[Optional[Path], typer.Option("--config", "-c", help="run config YAML")] = None,
    split: Annotated[str, typer.Option(help="task split: heldout | train | all")] = "heldout",
    json_summary: Annotated[Optional[Path], typer.Option(help="write the result here as JSON")] = None,
) -> None:
    """Greedy success of the configured policy on a task split: each task once, temperature
    0, through the same harness, proxy and evaluator as training (no updates)."""
    from gyre.up import run_up
    from libs.common.runconfig import RunConfigError, load_run_config

    try:
        base = load_run_config(config, list(overrides or []))
        cfg = load_run_config(config, [*(overrides or []), f"tasks.split={split}", "tasks.per_step=1000",
                                       "group_size=1", "run.steps=1", "sampling.temperature=0",
                                       f"run.id={base.run.id}-eval-{split}"])
    except RunConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    settings = _settings(run_dir=cfg.run_dir, run_id=cfg.run.id, nats_url=cfg.bus.nats_url,
                         database_url=cfg.storage.database_url)
    _logging(settings)
    raise typer.Exit(run_up(settings, cfg, json_summary=json_summary, eval_split=split))


@app.command()
def report(
    run: Annotated[str, typer.Argument(help="run id (its folder is runs/<run>)")],
    runs_dir: Annotated[Path, typer.Option(help="where run folders are")] = Path("runs"),
) -> None:
    """Rebuild a run's report (report.html, PNGs, report.json) from its event log alone."""
    from gyre.up import rebuild_report

    path = asyncio.run(rebuild_report(_settings(run_id=run, run_dir=runs_dir / run), require=True))
    typer.echo(str(path))


@app.command()
def serve(
    service: Annotated[str, typer.Argument(help="service name (see `gyre serve --list`)")] = "",
    port: Annotated[int, typer.Option(help="port of /health and /metrics (the proxy's APIs, the engine's SGLang API "
                                           "too); 0 = a free port, chosen at start. For the engine it takes "
                                           "the place of GYRE_ENGINE_PORT, and GYRE_HOST of GYRE_ENGINE_HOST")] = 0,
    list_: Annotated[bool, typer.Option("--list", help="list the services and exit")] = False,
    batch: Annotated[int, typer.Option(help="projector: events per transaction")] = 500,
) -> None:
    """Run one service (what docker-compose, systemd and Helm start). Besides --port (and the
    projector's --batch) a service takes its settings and options from GYRE_* environment
    variables only (docs/deploy.md, "Settings")."""
    from gyre.services import SERVICES
    from libs.common.natsserver import free_port
    from libs.common.service import serve as serve_spec

    if list_ or not service:
        for name, spec in SERVICES.items():
            typer.echo(f"{name:12s} {spec.summary}")
        typer.echo(f"{'engine':12s} embedded CPU inference engine with SGLang's HTTP API (GYRE_ENGINE_* settings)")
        raise typer.Exit(0)
    if service == "engine":  # serves SGLang's API itself (its own /health), on --port
        from services.engine.main import serve as serve_engine

        settings = _settings()
        _logging(settings)
        serve_engine(host=settings.host, port=port or free_port())
        raise typer.Exit(0)
    spec = SERVICES.get(service)
    if spec is None:
        typer.echo(f"error: unknown service {service!r}; known: {', '.join([*SERVICES, 'engine'])}", err=True)
        raise typer.Exit(2)
    settings = _settings()
    _logging(settings)
    try:
        asyncio.run(serve_spec(spec, settings, port=port or free_port(), options={"batch": batch}))
    except _user_errors() as exc:  # NATS not configured, port taken, a bad GYRE_* setting: one line
        typer.echo(f"error: {service}: {_one_line(exc)}", err=True)
        raise typer.Exit(1) from None
    except Exception as exc:
        logging.getLogger("gyre").error("%s stopped: %r", service, exc, exc_info=True)
        raise typer.Exit(1) from exc


@db_app.command("upgrade")
def db_upgrade(
    database_url: Annotated[Optional[str], typer.Option(help="SQLAlchemy URL [GYRE_DATABASE_URL]")] = None,
    run_dir: RunDir = None,
) -> None:
    """Apply the migrations up to the newest (idempotent)."""
    from libs.common.db.engine import current_revision, upgrade

    url = _settings(database_url=database_url, run_dir=run_dir).sqlalchemy_url
    upgrade(url)
    typer.echo(f"database at revision {current_revision(url)}")


@events_app.command("tail")
def events_tail(
    context: Annotated[Optional[list[str]], typer.Option("--context", "-c", help="streams (default: all)")] = None,
    run_id: Annotated[Optional[str], typer.Option("--run", help="only this run")] = None,
    from_seq: Annotated[int, typer.Option(help="start at this stream sequence")] = 1,
    follow: Annotated[bool, typer.Option("--follow/--no-follow", "-f", help="keep waiting for new events")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON event per line")] = False,
    run_dir: Annotated[Optional[Path], typer.Option("--run-dir", help=_FINISHED_RUN_HELP)] = None,
) -> None:
    """Print events from the log, oldest first."""
    from gyre.events_cmd import tail

    settings = _settings(run_dir=_finished_run_dir(run_id, run_dir))
    try:
        asyncio.run(tail(settings, _contexts(context), run_id, from_seq, follow, as_json))
    except BrokenPipeError:  # the reader left (`| head`): done, quietly
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        raise typer.Exit(0) from None


@events_app.command("export")
def events_export(
    out: Annotated[Path, typer.Option("--out", "-o", help="JSON Lines file to write")],
    context: Annotated[Optional[list[str]], typer.Option("--context", "-c", help="streams (default: all)")] = None,
    run_id: Annotated[Optional[str], typer.Option("--run", help="only this run")] = None,
    run_dir: Annotated[Optional[Path], typer.Option("--run-dir", help=_FINISHED_RUN_HELP)] = None,
) -> None:
    """Write the log (all streams, in order) to a JSON Lines file for replay or debugging."""
    from gyre.events_cmd import export

    n = asyncio.run(export(_settings(run_dir=_finished_run_dir(run_id, run_dir)), _contexts(context), run_id, out))
    typer.echo(f"exported {n} events to {out}", err=True)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []})
def sim(ctx: typer.Context) -> None:
    """Cluster-scale simulation of the scheduler (colocate, async, elastic); `gyre sim --help`."""
    from services.scheduler.sim.cli import main as sim_main

    raise typer.Exit(sim_main(list(ctx.args)))


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []})
def agent(ctx: typer.Context) -> None:
    """Gyre's reference agent harness (OpenAI or Anthropic API, tools, compaction, sub-agents); `gyre agent --help`."""
    from services.runner.agent.main import main as agent_main

    raise typer.Exit(agent_main(list(ctx.args)))


tree_app = typer.Typer(no_args_is_help=True, help="Trajectory trees, rebuilt from the log.")
app.add_typer(tree_app, name="tree")


@tree_app.command("show")
def tree_show(
    rollout: Annotated[str, typer.Argument(help="rollout id")],
    fmt: Annotated[str, typer.Option("--format", "-f", help="text | svg | dot")] = "text",
    run_id: Annotated[Optional[str], typer.Option("--run", help="run id [GYRE_RUN_ID]")] = None,
    tokens: Annotated[bool, typer.Option("--tokens", help="show token ids")] = False,
    run_dir: Annotated[Optional[Path], typer.Option("--run-dir", help=_FINISHED_RUN_HELP)] = None,
) -> None:
    """Print one rollout's trajectory tree: forks, roles, selected branches."""
    from gyre.events_cmd import tree_show as show

    if fmt not in ("text", "svg", "dot"):
        raise typer.BadParameter("--format is text, svg or dot")
    typer.echo(asyncio.run(show(_settings(run_id=run_id, run_dir=_finished_run_dir(run_id, run_dir)),
                                rollout, fmt, tokens)))


@app.command()
def replay(
    from_file: Annotated[Optional[list[Path]], typer.Option("--from", help="exported JSON Lines (default: the log on "
                                                            "GYRE_NATS_URL; without it, a finished run's store, "
                                                            "reopened: --run-dir, GYRE_RUN_DIR, or runs/<run> "
                                                            "with --run)")] = None,
    database_url: Annotated[Optional[str], typer.Option(help="an empty database to rebuild into; default a temporary SQLite [GYRE_DATABASE_URL]")] = None,
    run_id: Annotated[Optional[str], typer.Option("--run", help="only this run's events")] = None,
    trees: Annotated[bool, typer.Option("--trees", help="rebuild the run's trees and samples instead; compare")] = False,
    step: Annotated[Optional[int], typer.Option("--step", help="recompute training step N from the checkpoint before it")] = None,
    cells: Annotated[bool, typer.Option("--cells", help="rebuild the schedule (each cell's phases) from the cells "
                                                        "stream; compare with the live scheduler's")] = False,
    run_dir: Annotated[Optional[Path], typer.Option("--run-dir", help=_FINISHED_RUN_HELP)] = None,
) -> None:
    """Rebuild the read models (or, with --trees, the trajectory trees and samples; with
    --cells, the schedule) from the log alone; prints digests / the comparison as JSON."""
    from gyre.events_cmd import replay as do_replay

    run_dir = _finished_run_dir(run_id, run_dir)
    if cells:
        from gyre.events_cmd import replay_cells_of

        result = asyncio.run(replay_cells_of(_settings(run_id=run_id, run_dir=run_dir)))
        typer.echo(json.dumps(result))
        raise typer.Exit(3 if result["same_as_live"] is False or result["errors"] else 0)
    if step is not None:
        from gyre.events_cmd import replay_training_step

        settings = _settings(run_id=run_id, run_dir=run_dir)
        result = asyncio.run(replay_training_step(settings, step))
        typer.echo(json.dumps(result))
        raise typer.Exit(0 if result.get("match") else 3)
    if trees:
        from gyre.events_cmd import replay_trees_of

        result = asyncio.run(replay_trees_of(_settings(run_id=run_id, run_dir=run_dir)))
        typer.echo(json.dumps(result))
        raise typer.Exit(0 if result["identical"] else 3)

    result = asyncio.run(do_replay(_settings(database_url=database_url, run_dir=run_dir), from_file or [], run_id))
    typer.echo(json.dumps(result))
    if not result.get("applied"):
        typer.echo(f"warning: no events applied{f' for run {run_id!r}' if run_id else ''}", err=True)
    if result.get("dead_lettered"):
        raise typer.Exit(3)


@app.command()
def bench(
    name: Annotated[str, typer.Argument(help="benchmark name (see `gyre bench --list`)")] = "",
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object as the last line")] = False,
    n: Annotated[int, typer.Option(min=0, help="size (benchmark-specific; 0 = its default)")] = 0,
    backend: Annotated[str, typer.Option(help="train: torch | megatron")] = "torch",
    list_: Annotated[bool, typer.Option("--list", help="list the benchmarks")] = False,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="tree: a workload parameter, key=value "
                                                      "(repeatable), e.g. --set main_turns=300 --set seed=2")] = None,
) -> None:
    """Run a benchmark; with --json its result is one JSON object on the last line."""
    import yaml

    from gyre.bench import BENCHMARKS

    if list_ or not name:
        for key, (_, summary) in BENCHMARKS.items():
            typer.echo(f"{key:12s} {summary}")
        raise typer.Exit(0)
    if name not in BENCHMARKS:
        typer.echo(f"error: unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}", err=True)
        raise typer.Exit(2)
    fn, _ = BENCHMARKS[name]
    extra: dict[str, Any] = {"backend": backend} if name == "train" else {}
    if set_:
        if name != "tree":
            typer.echo("error: --set is for the tree benchmark's workload parameters", err=True)
            raise typer.Exit(2)
        for item in set_:
            key, eq, value = item.partition("=")
            if not eq or not key:
                typer.echo(f"error: --set {item!r}: expected key=value", err=True)
                raise typer.Exit(2)
            extra[key.strip()] = yaml.safe_load(value)
    try:
        result = fn(n=n or None, progress=not as_json, **extra)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(json.dumps(result))
    else:
        for k, v in result.items():
            typer.echo(f"{k:24s} {v}")


@app.command("export")
def export_(
    source: Annotated[str, typer.Argument(help="run id, run folder, checkpoints folder or step-*.pt file")],
    out: Annotated[Path, typer.Argument(help="the Hugging Face folder to write")],
    step: Annotated[Optional[int], typer.Option(help="the weights after this many steps (default: the latest)")] = None,
    model: Annotated[Optional[str], typer.Option(help="base model (config + tokenizer): tiny-qwen | smollm2 | an "
                                                      "HF folder; default: the run's model.name")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="cast weights: float32 | bfloat16 | float16")] = None,
    runs_dir: Annotated[Path, typer.Option(help="where run folders are")] = Path("runs"),
    force: Annotated[bool, typer.Option("--force", help="replace OUT if it exists")] = False,
) -> None:
    """Export a trained policy checkpoint as a Hugging Face folder (model.safetensors,
    config.json, tokenizer) that transformers, SGLang and `gyre serve engine` load."""
    from services.trainer.export import ExportError, export_hf, find_checkpoint, run_base_model

    try:
        checkpoint = find_checkpoint(source, runs_dir=runs_dir, step=step)
        if model is None:  # the checkpoint lies in <run_dir>/trainer/checkpoints
            run_dir = checkpoint.resolve().parent.parent.parent
            model = run_base_model(run_dir, run_dir.name)
            if model is None:
                raise ExportError(f"cannot tell the base model of {checkpoint} (no RunStarted in "
                                  f"{run_dir / 'nats'}); pass --model")
        done = export_hf(checkpoint, out, base_model=model, dtype=dtype, overwrite=force)
    except ExportError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"exported {done.checkpoint} (step {done.step}, weights v{done.weight_version}, "
               f"base {done.base_model}, {done.tensors} tensors) to {done.folder}")


tasks_app = typer.Typer(no_args_is_help=True, help="Task sets: folders like tasks/, or JSONL / Parquet files.")
app.add_typer(tasks_app, name="tasks")


@tasks_app.command("validate")
def tasks_validate(
    path: Annotated[Path, typer.Argument(help="a .jsonl or .parquet task set, or a folder of task folders")],
    as_json: Annotated[bool, typer.Option("--json", help="print the result as one JSON object")] = False,
) -> None:
    """Check a task set; each problem names its line (row) and field. Exit 1 on problems."""
    from gyre.tasks_cmd import validate_task_set

    result = validate_task_set(path)
    if as_json:
        typer.echo(json.dumps(result))
    else:
        for problem in result["problems"]:
            typer.echo(f"{path}: {problem}", err=True)
        splits = ", ".join(f"{k} {v}" for k, v in sorted(result["splits"].items())) or "none"
        verdict = "ok" if not result["problems"] else f"{len(result['problems'])} problem(s)"
        typer.echo(f"{verdict}: {result['tasks']} valid task(s) ({splits}) in {path}")
    raise typer.Exit(1 if result["problems"] else 0)


def _contexts(names: Optional[list[str]]):
    from libs.common.events import Context

    if not names:
        return list(Context)
    try:
        return [Context(n) for n in names]
    except ValueError:
        raise typer.BadParameter(f"contexts are: {', '.join(c.value for c in Context)}") from None


def _user_errors() -> tuple[type[BaseException], ...]:
    from libs.common.bus.jetstream import BusError
    from libs.common.natsserver import NatsServerError

    from sqlalchemy.exc import ArgumentError, NoSuchModuleError, OperationalError

    from libs.common.service import ServiceStartError

    # a bad database URL: an unknown dialect, a malformed URL, a server that does not answer
    return (BusError, NatsServerError, ServiceStartError, ValueError, FileNotFoundError, PermissionError,
            NoSuchModuleError, ArgumentError, OperationalError)


def _one_line(exc: BaseException) -> str:
    """The first line of an error (SQLAlchemy's add the statement and a link)."""
    from sqlalchemy.exc import SQLAlchemyError

    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, SQLAlchemyError):
        text = text.splitlines()[0].strip()
        if not text.lower().startswith("database"):
            text = f"database: {text}"
    return text


def _short_helps(typer_app: typer.Typer) -> None:
    """A command list shows each command's first paragraph on its own lines; a docstring's
    hard line breaks would break it mid-sentence ("temperature / 0, through"): give each
    command without a ``short_help`` that paragraph as one line, which the list wraps."""
    for info in typer_app.registered_commands:
        doc = info.help if info.help is not None else (info.callback.__doc__ if info.callback else None)
        if info.short_help is None and doc:
            info.short_help = " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            _short_helps(group.typer_instance)


def main() -> None:
    _short_helps(app)
    try:
        app()
    except _user_errors() as exc:  # a clear line, not a traceback, for mistakes a user can fix
        typer.echo(f"error: {_one_line(exc)}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    sys.exit(main())
