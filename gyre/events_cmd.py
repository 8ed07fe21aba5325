"""``gyre events tail|export`` and ``gyre replay``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from libs.common.bus.jetstream import JetStreamBus
from libs.common.db.engine import make_engine, upgrade
from libs.common.db.projection import ProjectionRunner, offsets
from libs.common.db.readmodels import readmodels
from libs.common.eventlog import export_stream, load_memory_bus, readmodel_digest
from libs.common.events import Context, EventDecodeError, decode
from libs.common.runtime import NatsNotConfigured, connect_tool_bus
from libs.common.settings import GyreSettings


async def tail(settings: GyreSettings, contexts: list[Context], run_id: str | None, from_seq: int,
               follow: bool, as_json: bool) -> None:
    """Print the log: ``GYRE_NATS_URL``'s, or a finished run's store (``run_nats_url``)."""
    with run_nats_url(settings) as url:
        bus = await connect_tool_bus(url, name="gyre-tail", settings=settings)
        try:
            if follow:
                await asyncio.gather(*(_follow(bus, c, run_id, from_seq, as_json) for c in contexts))
            for c in contexts:
                async for msg in bus.read_raw(c.stream, start_seq=from_seq, filter_subject=_subject(c, run_id)):
                    _print(c, msg.metadata.sequence.stream, msg.data, as_json)
        except BaseException:  # a closed pipe (`| head`), Ctrl-C: leave now, without draining
            with contextlib.suppress(Exception):
                await bus.nc.close()
            raise
        else:
            await bus.close()


async def _follow(bus: JetStreamBus, c: Context, run_id: str | None, from_seq: int, as_json: bool) -> None:
    async for raw in bus.follow(c, start_seq=from_seq, filter_subject=_subject(c, run_id), idle_s=1.0):
        if raw is not None:
            _print(c, raw.seq, raw.data, as_json)


def _subject(c: Context, run_id: str | None) -> str:
    return f"gyre.{run_id}.{c.value}.>" if run_id else c.subjects


def _print(c: Context, seq: int, data: bytes, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(data.decode(errors="replace") + "\n")
        sys.stdout.flush()
        return
    try:
        ev = decode(data)
    except EventDecodeError as exc:
        print(f"{c.value:9s} #{seq:<7d} <undecodable: {exc}>", flush=True)
        return
    payload = json.dumps(ev.payload(), separators=(",", ":"))
    print(f"{c.value:9s} #{seq:<7d} {ev.time:%H:%M:%S} {ev.run_id} {ev.TYPE} {payload[:160]}", flush=True)


async def export(settings: GyreSettings, contexts: list[Context], run_id: str | None, out: Path) -> int:
    n = 0
    with run_nats_url(settings) as url:
        bus = await connect_tool_bus(url, name="gyre-export", settings=settings)
        try:
            with open(out, "w", encoding="utf-8") as f:
                for c in contexts:
                    n += await export_stream(bus, c, f, run_id=run_id)
        finally:
            await bus.close()
    return n


def _load_files(files: list[Path]) -> Any:
    """The exported files in an in-memory bus, checked first: a missing or malformed file,
    or files that hold no event at all, are errors before anything is written."""
    from libs.common.eventlog import iter_lines

    n = 0
    for path in files:
        if not Path(path).is_file():
            raise FileNotFoundError(f"--from {path}: no such file")
        try:
            n += sum(1 for _ in iter_lines(Path(path)))
        except ValueError as exc:
            cause = exc.__cause__
            if isinstance(cause, KeyError):
                raise ValueError(f"{str(exc).rsplit(' (', 1)[0]} (missing field {cause})") from None
            if isinstance(cause, TypeError):
                raise ValueError(f"{str(exc).rsplit(' (', 1)[0]} (not a JSON object)") from None
            raise
        except UnicodeDecodeError:
            raise ValueError(f"--from {path}: not a text (JSON Lines) file") from None
    if n == 0:
        raise ValueError(f"no events in {', '.join(map(str, files))}: nothing to replay")
    return load_memory_bus(files)


class _NoDeadLetters:
    """A bus that is read from, not written to: ``dead_letter`` says what it would store."""

    def __init__(self, bus: Any) -> None:
        self._bus = bus

    async def dead_letter(self, consumer: str, message: Any, reason: str) -> None:
        print(f"replay: {message.stream} seq {message.seq} cannot be applied: {reason}", file=sys.stderr)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bus, name)


async def replay(settings: GyreSettings, files: list[Path], run_id: str | None) -> dict[str, Any]:
    """Rebuild the read models into the database of ``settings`` (a fresh SQLite file
    under a temp folder, removed afterwards, when none is given) from exported files or
    the live log."""
    import shutil

    memory = _load_files(files) if files else None  # before any database is created
    url = settings.database_url and settings.sqlalchemy_url
    scratch = None
    if not url:
        scratch = Path(tempfile.mkdtemp(prefix="gyre-replay-"))
        url = f"sqlite:///{scratch / 'replay.db'}"
    try:
        upgrade(url)
        engine = make_engine(url)
        held = {k: v for k, v in offsets(engine, readmodels.name).items() if v > 0}
        if held:  # its offsets would skip every event below them (another run's, the live projector's)
            where = engine.url.render_as_string(hide_password=True)
            engine.dispose()
            raise ValueError(f"replay rebuilds into an empty database; {where} already holds "
                             f"read models (projected up to {', '.join(f'{k} seq {v}' for k, v in sorted(held.items()))}): "
                             "give a new database, or no --database-url for a temporary one")
        bus: Any
        with contextlib.ExitStack() as stack:
            if memory is not None:
                bus = memory
            else:
                bus = await connect_tool_bus(stack.enter_context(run_nats_url(settings)), name="gyre-replay",
                                             settings=settings)
            try:
                # a rebuild only reads the log: what it cannot apply is counted and said, never
                # written to the live dead-letter stream under the live projector's name
                runner = ProjectionRunner(engine, _NoDeadLetters(bus), readmodels, filter_run=run_id)
                applied = await runner.catch_up()
                digest = readmodel_digest(engine)
            finally:
                engine.dispose()
                if memory is None:
                    await bus.close()
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return {"database": None if scratch is not None else url, "applied": applied,
            "duplicates": runner.duplicates, "dead_lettered": runner.dead_lettered, "digest": digest["*"],
            "tables": {k: v for k, v in digest.items() if k != "*"}}


async def started_config(bus: JetStreamBus, run_id: str) -> dict[str, Any]:
    """The run config the run was started with (its last ``RunStarted``; none: ``{}``)."""
    from libs.common.events import RunStarted

    config: dict[str, Any] = {}
    async for d in bus.read(Context.RUNS, filter_subject=f"gyre.{run_id}.runs.>"):
        if isinstance(d.event, RunStarted):
            config = d.event.config
    return config


class UnknownId(ValueError):
    """A run or rollout id the log does not know (a typo, or the wrong store)."""


async def _has_event(bus: JetStreamBus, context: Context, subject: str) -> bool:
    async for _ in bus.read_raw(context.stream, filter_subject=subject):
        return True
    return False


async def require_run(bus: JetStreamBus, run_id: str, where: str) -> None:
    """``UnknownId`` unless the log holds ``run_id``'s ``RunStarted``."""
    from libs.common.events import RunStarted

    if not await _has_event(bus, Context.RUNS, f"gyre.{run_id}.runs.{RunStarted.TYPE}"):
        raise UnknownId(f"no run {run_id!r} in the log at {where} (no RunStarted): check the run id, "
                        "--run-dir or GYRE_NATS_URL")


async def require_rollout(bus: JetStreamBus, run_id: str, rollout: str, where: str) -> None:
    from libs.common.events import RolloutStarted
    from libs.common.events.envelope import subject_token

    subject = f"gyre.{run_id}.rollouts.{RolloutStarted.TYPE}.{subject_token(rollout)}"
    if not await _has_event(bus, Context.ROLLOUTS, subject):
        raise UnknownId(f"no rollout {rollout!r} in run {run_id!r} (no RolloutStarted in the log at {where}): "
                        "check the rollout id and --run")


async def run_options(bus: JetStreamBus, run_id: str) -> dict[str, Any]:
    """The trajectory options the run was started with (none: the service's defaults), so
    a rebuild selects and packs as the live service did."""
    from services.trajectory.main import run_config_options

    return run_config_options(await started_config(bus, run_id))


async def tree_show(settings: GyreSettings, rollout: str, fmt: str, tokens: bool) -> str:
    from libs.common.blobs import ObjectStoreBlobStore
    from services.trajectory.main import ledger_config
    from services.trajectory.show import show_rollout

    with run_nats_url(settings) as url:
        bus = await connect_tool_bus(url, name="gyre-tree", settings=settings)
        try:
            await require_rollout(bus, settings.run_id, rollout, _where(settings, url))
            blobs = await ObjectStoreBlobStore.open(bus.js, settings.blob_bucket)
            config = ledger_config(settings.run_id, await run_options(bus, settings.run_id))
            return await show_rollout(bus, blobs, config, rollout, fmt=fmt, show_tokens=tokens)
        finally:
            await bus.close()


class _ReadThrough:
    """Reads from the live blob store, keeps what a replay writes to itself."""

    def __init__(self, live: Any) -> None:
        from libs.common.blobs import MemoryBlobStore

        self.live, self.mine = live, MemoryBlobStore()

    async def put(self, data: bytes) -> str:
        return await self.mine.put(data)

    async def get(self, digest: str) -> bytes:
        return await self.mine.get(digest) if await self.mine.has(digest) else await self.live.get(digest)

    async def has(self, digest: str) -> bool:
        return await self.mine.has(digest) or await self.live.has(digest)


def _tree_facts(ev: Any) -> tuple:
    from libs.common.events import MicroStepQueued, SamplesSelected, TreeSealed

    if isinstance(ev, TreeSealed):
        return (ev.TYPE, ev.rollout_id, ev.tree_digest, ev.content_digest)
    if isinstance(ev, SamplesSelected):
        return (ev.TYPE, ev.rollout_id, tuple(s.digest for s in ev.samples))
    if isinstance(ev, MicroStepQueued):
        return (ev.TYPE, ev.micro_step, tuple(ev.sample_digests), tuple(ev.advantages))
    return (ev.TYPE, ev.event_id)


def _distinct(events: list[Any]) -> list[Any]:
    """Each event once, by event id, in the order of its first stored copy."""
    first: dict[str, Any] = {}
    for ev in events:
        first.setdefault(ev.event_id, ev)
    return list(first.values())


async def replay_trees(nats_url: str, run_id: str, blob_bucket: str = "gyre-blobs") -> dict[str, Any]:
    """Rebuild a run's trees, samples and micro-steps from its rollouts, calls and scores
    (a fresh trajectory service on an in-memory copy of those streams, told only which
    calls each logged TreeSealed held) and compare them with what the live run recorded."""
    from libs.common.blobs import ObjectStoreBlobStore
    from libs.common.bus.memory import InMemoryBus
    from libs.common.events import TreeSealed
    from services.trajectory.main import ledger_config
    from services.trajectory.service import TrajectoryService

    bus = await connect_tool_bus(nats_url, name="gyre-replay-trees")
    try:
        await require_run(bus, run_id, nats_url)
        live_blobs = await ObjectStoreBlobStore.open(bus.js, blob_bucket)
        copy = InMemoryBus()
        for ctx in (Context.ROLLOUTS, Context.CALLS, Context.SCORES):
            async for msg in bus.read_raw(ctx.stream, filter_subject=f"gyre.{run_id}.{ctx.value}.>"):
                meta = msg.metadata
                copy.load(ctx.stream, meta.sequence.stream, msg.subject, msg.data, meta.timestamp)
        # a batch the live service re-published after a lost ack, past the bus's duplicate
        # window, is stored twice: compare distinct events (by id, first copy's order)
        live_trees = _distinct([d.event async for d in bus.read(Context.TREES,
                                                                  filter_subject=f"gyre.{run_id}.trees.>")])
        recorded = [_tree_facts(ev) for ev in live_trees]
        config = ledger_config(run_id, await run_options(bus, run_id))  # as the live service was configured
        service = TrajectoryService(config, bus=copy, blobs=_ReadThrough(live_blobs))
        # where the live service sealed each rollout is a logged decision (its TreeSealed): a
        # call recorded after it was rejected then, and is left out here too
        await service.load_seal_boundaries({ev.rollout_id: ev.tree_digest for ev in live_trees
                                            if isinstance(ev, TreeSealed)}, live_blobs)
        await service.rebuild()
        replayed = [_tree_facts(ev) for ev in _distinct([d.event async for d in copy.read(Context.TREES)])]
    finally:
        await bus.close()
    return {"recorded": len(recorded), "replayed": len(replayed),
            "identical": sorted(map(repr, recorded)) == sorted(map(repr, replayed))}


def _where(settings: GyreSettings, url: str) -> str:
    return url if settings.nats_url else str(settings.nats_store_dir)


@contextlib.contextmanager
def run_nats_url(settings: GyreSettings) -> Iterator[str]:
    """``GYRE_NATS_URL``, or, without one, the server of a ``gyre up`` still running on the
    run dir (``<run dir>/nats.url``), or a finished embedded run's store (``<run dir>/nats``)
    reopened for the duration."""
    from libs.common.natsserver import EmbeddedNats, live_url

    if settings.nats_url:
        yield settings.nats_url
        return
    running = live_url(settings.nats_store_dir)
    if running is not None:
        yield running
        return
    if not settings.nats_store_dir.is_dir():
        raise NatsNotConfigured(f"GYRE_NATS_URL is not set and {settings.nats_store_dir} holds no event store: "
                                "pass --run-dir of a finished run or set GYRE_NATS_URL")
    nats = EmbeddedNats(settings.nats_store_dir).start()
    try:
        yield nats.url
    finally:
        nats.stop()


async def replay_trees_of(settings: GyreSettings) -> dict[str, Any]:
    """``replay_trees`` on ``GYRE_NATS_URL`` or on a finished embedded run's own store."""
    with run_nats_url(settings) as url:
        return await replay_trees(url, settings.run_id, settings.blob_bucket)


async def replay_cells(nats_url: str, run_id: str, run_dir: Path) -> dict[str, Any]:
    """Rebuild the schedule (each cell's phases, the scheduler's state) from the cells
    stream alone, through the scheduler's own core, and compare it with what the live
    scheduler wrote when it stopped (``<run>/scheduler/schedule.json``), up to the same
    stream position."""
    from services.scheduler.main import SCHEDULE_FILE
    from services.scheduler.replay import CellsFold, compare, summary

    path = run_dir / SCHEDULE_FILE
    live = json.loads(path.read_text()) if path.exists() else None
    if live is not None and live.get("run_id") != run_id:
        raise ValueError(f"{path} is the schedule of run {live.get('run_id')!r}, not {run_id!r}")
    until = live.get("through_seq") if live else None
    bus = await connect_tool_bus(nats_url, name="gyre-replay-cells")
    fold, events = CellsFold(), 0
    try:
        await require_run(bus, run_id, nats_url)
        async for d in bus.read(Context.CELLS, filter_subject=f"gyre.{run_id}.cells.>", until_seq=until):
            fold.apply(d.event)
            events += 1
    finally:
        await bus.close()
    return {"run": run_id, "events": events, **compare(summary(fold), live)}


async def replay_cells_of(settings: GyreSettings) -> dict[str, Any]:
    """``replay_cells`` on ``GYRE_NATS_URL`` or on a finished embedded run's own store."""
    with run_nats_url(settings) as url:
        return await replay_cells(url, settings.run_id, settings.run_dir)


async def replay_training_step(settings: GyreSettings, step: int) -> dict[str, Any]:
    """Rebuild step ``step``'s micro-steps from the log and recompute its loss from the
    checkpoint before it (what the core trainer recorded in ``StepApplied``)."""
    from libs.common.blobs import ObjectStoreBlobStore
    from services.trainer.main import build_backend, run_config_options, train_config
    from services.trainer.replay import replay_step

    with run_nats_url(settings) as url:
        bus = await connect_tool_bus(url, name="gyre-replay-step", settings=settings)
        try:
            blobs = await ObjectStoreBlobStore.open(bus.js, settings.blob_bucket)
            # the run's own objective (clip range, TIS cap, KL); the checkpoint brings the weights
            options = run_config_options(await started_config(bus, settings.run_id))
            return await replay_step(bus, blobs, run_id=settings.run_id, step=step,
                                     checkpoint_dir=settings.run_dir / "trainer" / "checkpoints",
                                     backend=build_backend({}), train=train_config(options))
        finally:
            await bus.close()
