"""The rollout runner: for the tasks of a step, run ``group_size`` harnesses per task.

Per rollout (the lifecycle itself is ``core``; this module only carries out its effects):
prepare the workspace, publish ``RolloutStarted`` (so the proxy accepts the rollout's
key) *before* the harness starts, run the harness under the task's time limit (on
timeout its whole process group is killed: the rollout is partial, not failed), snapshot
the workspace into the blob store, publish ``RolloutFinished`` / ``RolloutTimedOut``.
A publish the bus refuses is tried again until it is taken or the runner stops: a
rollout missing from the log would hold its group and its training step for good. Only a
bus connection that is closed (it never comes back) ends the tries: ``BusClosed``, which
says the group will not complete; the step then fails (``StepFailed``). For the
same reason a rollout the runner itself fails on (its workspace cannot be prepared, an
unexpected error) is still registered and ended, like a harness that cannot be launched.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import io
import logging
import math
import os
import secrets
import tarfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar

from libs.common.bus.port import BlobStore, EventBus
from libs.common.events import Context, Event, RolloutStarted

from . import core
from .adapters import workspace
from .adapters.process import MARK_VAR, RUNNER_VAR, HarnessProcess, kill_marked, kill_orphans, launch
from .adapters.snapshot import SnapshotTooLarge, snapshot_workspace
from .harness import HarnessConfig, gyre_agent, render
from .tasks import Task

log = logging.getLogger(__name__)
T = TypeVar("T")

# A workspace the runner will not archive (over snapshot_max_bytes: the agent's doing) still
# gets a snapshot: a stand-in whose PAX global header says why (the ended event has no field
# for it). The evaluator (services/evaluator/adapters/snapshot.py, same name) scores such a
# rollout 0 instead of failing its scoring, which would drop it from training. Only a
# snapshot that could not be stored (or taken, for a reason of the runner's) is missing.
SNAPSHOT_REFUSED_HEADER = "GYRE.snapshot_refused"
_REFUSED_NOTE = ".gyre_snapshot_refused.txt"


@dataclass(frozen=True)
class RunnerConfig:
    run_id: str
    proxy_url: str  # the proxy's root; each rollout gets <proxy_url>/r/<rollout_id>
    work_root: Path
    harness: HarnessConfig = field(default_factory=gyre_agent)
    model: str = "policy"
    max_parallel: int = 4
    max_turns: int = 40
    kill_grace_s: float = 2.0
    time_limit_scale: float = 1.0  # multiplies each task's time limit
    keep_workspaces: bool = False
    snapshot_max_bytes: int = 256 * 2**20
    # Tries of a blob-store put before the snapshot is given up (the rollout still ends). A
    # publish is not given up while the runner runs and its bus connection is open (see
    # RolloutRunner._publish): after io_attempts tries it logs an error and goes on trying.
    io_attempts: int = 5
    io_backoff_s: float = 0.5  # wait before the second try; doubled for each further one
    io_backoff_max_s: float = 30.0  # ... up to this; also the wait of a publish past io_attempts when io_backoff_s is 0

    def __post_init__(self) -> None:
        if isinstance(self.max_parallel, bool) or not isinstance(self.max_parallel, int) or self.max_parallel < 1:
            raise ValueError(f"max_parallel must be an integer >= 1 (rollouts at once), not {self.max_parallel!r}")
        if not (math.isfinite(self.time_limit_scale) and self.time_limit_scale > 0):
            raise ValueError(f"time_limit_scale must be a finite number > 0, not {self.time_limit_scale!r}")
        if self.io_attempts < 1 or not self.io_backoff_s >= 0:
            raise ValueError(f"io_attempts must be >= 1 and io_backoff_s >= 0, got {self.io_attempts}, "
                             f"{self.io_backoff_s}")
        if not (math.isfinite(self.io_backoff_max_s) and self.io_backoff_max_s > 0):
            raise ValueError(f"io_backoff_max_s must be a finite number > 0, not {self.io_backoff_max_s!r}")


@dataclass(frozen=True)
class RolloutOutcome:
    rollout_id: str
    task_id: str
    group_id: str
    status: Literal["finished", "timed_out"]
    exit_status: int | None
    wall_time_s: float
    snapshot_digest: str | None
    log_tail: str = ""


class StepFailed(RuntimeError):
    """Some rollouts of a step raised even past the runner's own recovery. Raised only once
    every rollout of the step has ended; ``outcomes`` holds the others', ``errors`` what was
    raised (each noted with its rollout and group)."""

    def __init__(self, step: int, total: int, outcomes: list[RolloutOutcome], errors: list[BaseException]) -> None:
        detail = "; ".join(", ".join([*getattr(exc, "__notes__", ()), _cause(exc)]) for exc in errors)
        super().__init__(f"step {step}: {len(errors)} of {total} rollouts failed in the runner (after all of them "
                         f"had ended): {detail}; the other {len(outcomes)} outcomes are in .outcomes")
        self.step, self.outcomes, self.errors = step, outcomes, errors


class BusClosed(RuntimeError):
    """The runner's bus connection is closed (not merely refusing): a rollout's event can
    never be published, so its group will not complete unless its step is run again."""


def _bus_closed(bus: object, exc: BaseException | None = None) -> bool:
    """Whether ``bus``'s connection is closed for good (or draining, which ends in closed):
    nats-py raises ``ConnectionClosedError`` / ``ConnectionDrainingError`` for a publish on
    it, and ``JetStreamBus.nc.is_closed`` says so."""
    nc = getattr(bus, "nc", None)
    if getattr(nc, "is_closed", False) is True:
        return True
    if exc is None:
        return False
    try:
        from nats.errors import ConnectionClosedError, ConnectionDrainingError
    except ImportError:  # pragma: no cover - nats-py is a dependency of the runner
        return False
    return isinstance(exc, (ConnectionClosedError, ConnectionDrainingError))


def group_id_for(step: int, task_id: str) -> str:
    return f"s{step}-{task_id}"


def new_rollout_id(step: int, task_id: str, index: int) -> str:
    return f"s{step}-{task_id}-{index}-{uuid.uuid4().hex[:8]}"


class RolloutRunner:
    def __init__(self, config: RunnerConfig, *, bus: EventBus, blobs: BlobStore,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.bus = bus
        self.blobs = blobs
        self.clock = clock
        self._slots = asyncio.Semaphore(config.max_parallel)
        self.running: dict[str, core.RolloutState] = {}
        # rollout -> the type of its event the bus refuses now (cleared once taken, or on a
        # stop); publish_failures counts refused tries since start. The served runner shows
        # both in /metrics and /health (main.py).
        self.waiting_for_bus: dict[str, str] = {}
        self.publish_failures = 0
        # event id -> the event as first handed to the bus, and the ids it took: after an
        # error an event is sent again only as it was, and never once taken (see _end_failed)
        self._handed: dict[str, Event] = {}
        self._taken: set[str] = set()
        # group ids the log or this runner has used: a step run again gets new ones
        self._groups_used: set[str] = set()
        self._groups_active: set[str] = set()  # groups of this runner's run_step calls still going
        self._groups_read_to = 0  # the rollouts stream read up to this sequence
        self._groups_lock = asyncio.Lock()
        kill_orphans()  # what harnesses of a runner that died hard left running

    async def run_step(self, step: int, tasks: list[Task], group_size: int, *, weight_version: int = 0,
                       harness: HarnessConfig | None = None, purpose: str = "train",
                       group_prefix: str = "") -> list[RolloutOutcome]:
        """Run every task ``group_size`` times; returns when all rollouts have ended.
        ``purpose="eval"`` rollouts are scored but never trained on; ``group_prefix`` keeps
        their groups and rollout ids apart from the training step's.

        Each entry of ``tasks`` gets a group id no rollout in the log (or in this runner)
        has: ``s<step>-<task>``; else, when that group is one a ``run_step`` of this runner
        is still running (a task listed twice, a request sent again meanwhile),
        ``dup<n>-s<step>-<task>``, a group of its own that is trained beside it; else (the
        step run again after a stop: the old group's abandoned rollouts never end, and a
        group is queued only once all its members are sealed) ``re<n>-s<step>-<task>``,
        which the scheduler reads as replacing the unqueued group of an earlier attempt.
        ``n`` is the first free one."""
        prefixes = await self._fresh_group_prefixes(step, tasks, group_prefix)
        groups = {p + group_id_for(step, t.task_id) for p, t in zip(prefixes, tasks)}
        self._groups_active |= groups
        jobs = [self.run_rollout(step, task, i, group_size, weight_version=weight_version, harness=harness,
                                 purpose=purpose, group_prefix=prefix)
                for task, prefix in zip(tasks, prefixes) for i in range(group_size)]
        # Not a plain gather: one rollout raising must not leave its siblings running with
        # nobody to collect them. (A cancel of run_step still cancels them all.)
        try:
            results = await asyncio.gather(*jobs, return_exceptions=True)
        finally:
            self._groups_active -= groups
        outcomes = [r for r in results if isinstance(r, RolloutOutcome)]
        errors = [r for r in results if not isinstance(r, RolloutOutcome)]
        if errors:
            err = StepFailed(step, len(results), outcomes, errors)
            log.error("%s", err)
            raise err from errors[0]
        return outcomes

    async def _fresh_group_prefixes(self, step: int, tasks: list[Task], group_prefix: str) -> list[str]:
        async with self._groups_lock:
            subject = f"gyre.{self.config.run_id}.{Context.ROLLOUTS.value}.{RolloutStarted.TYPE}.>"
            try:
                async for d in self.bus.read(Context.ROLLOUTS, start_seq=self._groups_read_to + 1,
                                             filter_subject=subject):
                    if isinstance(d.event, RolloutStarted):
                        self._groups_used.add(d.event.group_id)
                    self._groups_read_to = max(self._groups_read_to, d.seq)
            except Exception as exc:  # the rollouts' own publishes wait for the bus (or give up) as ever
                log.warning("step %s: the rollouts stream cannot be read (%r); the step's group ids are chosen "
                            "from what this runner has seen only", step, exc)
            prefixes = []
            for task in tasks:
                own = group_id_for(step, task.task_id)
                base = group_prefix + own
                prefix, n = group_prefix, 0
                if base in self._groups_used:
                    # one still going here (or just claimed in this call): a sibling group;
                    # else the step is run again
                    kind = "dup" if base in self._groups_active or base in {p + own for p in prefixes} else "re"
                    while prefix + own in self._groups_used:
                        n += 1
                        prefix = f"{kind}{n}-{group_prefix}"
                    log.warning("step %s: group %s exists already (%s); its rollouts go to group %s", step, base,
                                "the task listed twice, or the step asked for again while it runs"
                                if kind == "dup" else "the step run again", prefix + own)
                self._groups_used.add(prefix + own)
                prefixes.append(prefix)
            return prefixes

    async def run_rollout(self, step: int, task: Task, index: int, group_size: int | None, *,
                          weight_version: int = 0, harness: HarnessConfig | None = None, purpose: str = "train",
                          group_prefix: str = "") -> RolloutOutcome:
        harness = harness or self.config.harness
        rollout_id = group_prefix + new_rollout_id(step, task.task_id, index)
        api_key = "gyre-" + secrets.token_urlsafe(24)
        plan = core.RolloutPlan(
            run_id=self.config.run_id, rollout_id=rollout_id, task_id=task.task_id,
            group_id=group_prefix + group_id_for(step, task.task_id), step=step, harness=harness.name,
            weight_version=weight_version, api_key_digest=hashlib.sha256(api_key.encode()).hexdigest(),
            time_limit_s=task.time_limit_s * self.config.time_limit_scale, group_size=group_size, purpose=purpose)
        try:
            return await self._run_planned(plan, task, harness, api_key)
        except Exception as exc:  # past the recovery below: run_step names it once all have ended
            exc.add_note(f"rollout {rollout_id} of group {plan.group_id}")
            raise

    async def _run_planned(self, plan: core.RolloutPlan, task: Task, harness: HarnessConfig,
                           api_key: str) -> RolloutOutcome:
        rollout_id = plan.rollout_id
        async with self._slots:
            dirs = workspace.RolloutDirs(self.config.work_root / rollout_id)
            try:
                try:
                    dirs = await asyncio.to_thread(workspace.prepare, self.config.work_root, rollout_id,
                                                   task.files_dir, task.prompt)
                except Exception as exc:  # disk full, the task's files unreadable: still registered and ended
                    state = await self._end_failed(plan, dirs, f"its workspace could not be prepared: {_cause(exc)}")
                else:
                    try:
                        state = await self._lifecycle(core.planned(plan), dirs, harness, api_key, task)
                    except BusClosed:  # nothing can be published any more: no ending it either
                        raise
                    except Exception as exc:  # an error of the runner's own: the rollout must still end
                        phase = self.running.get(rollout_id, core.planned(plan)).phase.value
                        state = await self._end_failed(plan, dirs, f"the runner failed on it while it was {phase}: "
                                                       f"{_cause(exc)}", exc)
                return _outcome(state, _with_note(workspace.log_tail(dirs), state))
            finally:
                self.running.pop(rollout_id, None)
                for event_id in (f"{rollout_id}-started", f"{rollout_id}-ended"):
                    self._handed.pop(event_id, None)
                    self._taken.discard(event_id)
                # also after a cancel: nothing reads a workspace once its snapshot is
                # taken (or given up on)
                if not self.config.keep_workspaces:
                    await asyncio.to_thread(workspace.remove, dirs)

    async def _end_failed(self, plan: core.RolloutPlan, dirs: workspace.RolloutDirs, reason: str,
                          exc: BaseException | None = None) -> core.RolloutState:
        """Registers (if it was not yet) and ends a rollout the runner failed on, like one
        whose harness could not be launched (exit status 127 unless the harness's own is
        known), with no snapshot: the evaluator fails its scoring and its group settles
        without it instead of waiting for it for good. What the bus took is not sent again;
        an event handed to it but not acknowledged is sent again as it was (same id and
        content, so the bus de-duplicates it), never in a second version."""
        rollout = plan.rollout_id
        if _bus_closed(self.bus):
            msg = (f"the bus connection is closed: rollout {rollout} cannot be ended ({reason}); group "
                   f"{plan.group_id} will not complete unless its step is run again")
            log.error("%s", msg, exc_info=exc)
            raise BusClosed(msg) from exc
        state = self.running.get(rollout, core.planned(plan))
        new, effects = core.step(state, core.Failed(self.clock(), reason))
        self.running[rollout] = new
        if state.phase is core.Phase.ENDED:  # its end was decided (and handed to the bus) before the error
            outcome = "its end as decided before is kept"
            log.error("rollout %s (group %s, task %s): %s; %s", rollout, plan.group_id, plan.task_id, reason,
                      outcome, exc_info=exc)
        else:
            outcome = "the rollout is ended with no snapshot"
            log.error("rollout %s (group %s, task %s): %s; it is ended like a harness that could not be launched "
                      "(exit status %s, no snapshot): its scoring fails and group %s settles without it", rollout,
                      plan.group_id, plan.task_id, reason, new.exit_status, plan.group_id, exc_info=exc)
        with contextlib.suppress(OSError), dirs.log_file.open("a") as f:
            f.write(f"gyre runner: {reason}; {outcome}\n")
        # an event in flight when the error came first (it precedes what the new phase calls for)
        todo = [self._handed[i] for i in (f"{rollout}-started", f"{rollout}-ended") if i in self._handed]
        todo += [fx.event for fx in effects if isinstance(fx, core.Publish)]
        for event in todo:
            if event.event_id not in self._taken:
                await self._publish(plan, self._handed.get(event.event_id, event))
        return new

    async def _apply(self, state: core.RolloutState, command: core.Command,
                     proc: HarnessProcess | None = None) -> core.RolloutState:
        new, effects = core.step(state, command)
        self.running[state.plan.rollout_id] = new
        for effect in effects:
            if isinstance(effect, core.Publish):
                await self._publish(state.plan, effect.event)
            elif isinstance(effect, core.KillGroup) and proc is not None:
                status = await proc.kill_group(self.config.kill_grace_s)
                new = core.evolve(new, core.Exited(status, self.clock()))
        return new

    async def _lifecycle(self, state: core.RolloutState, dirs: workspace.RolloutDirs, harness: HarnessConfig,
                         api_key: str, task: Task) -> core.RolloutState:
        state = await self._apply(state, core.Register(self.clock()))
        proc: HarnessProcess | None = None
        try:
            proc = await self._launch(state.plan, dirs, harness, api_key, task)
        except (OSError, ValueError, KeyError) as exc:
            log.warning("rollout %s: harness %s did not start: %s", state.plan.rollout_id, harness.name, exc)
            with contextlib.suppress(OSError), dirs.log_file.open("a") as f:  # a full disk: it still ends
                f.write(f"gyre runner: harness did not start: {exc}\n")
            state = await self._apply(state, core.LaunchFailed(self.clock(), str(exc)))
        try:
            if proc is not None:
                state = await self._apply(state, core.Launched(self.clock()))
                status = await proc.wait(state.deadline - self.clock())
                if status is None:
                    state = await self._apply(state, core.DeadlinePassed(self.clock()), proc)
                else:
                    proc.reap_group()
                    state = await self._apply(state, core.Exited(status, self.clock()))
        finally:
            if proc is not None and proc.proc.returncode is None:  # cancelled: leave nothing running
                await proc.kill_group(0.1)
            if proc is not None:  # and what left the group, so nothing writes after the snapshot
                strays = await asyncio.to_thread(kill_marked, state.plan.rollout_id)
                if strays:
                    log.info("rollout %s: killed %d process(es) that outlived the harness's group",
                             state.plan.rollout_id, strays)
        digest = await self._snapshot(dirs)
        return await self._apply(state, core.Snapshotted(digest, self.clock()))

    async def _launch(self, plan: core.RolloutPlan, dirs: workspace.RolloutDirs, harness: HarnessConfig,
                      api_key: str, task: Task) -> HarnessProcess:
        base_url = f"{self.config.proxy_url.rstrip('/')}/r/{plan.rollout_id}"
        values = {"workspace": str(dirs.workspace), "home": str(dirs.home), "prompt_file": str(dirs.prompt_file),
                  "prompt": task.prompt, "base_url": base_url, "openai_base_url": base_url + "/v1",
                  "model": self.config.model, "rollout_id": plan.rollout_id,
                  "max_turns": str(task.max_turns or self.config.max_turns)}
        rendered = render(harness, values, api_key)
        rendered.env[MARK_VAR] = plan.rollout_id  # how kill_marked finds what outlives the group
        rendered.env[RUNNER_VAR] = str(os.getpid())  # how a later runner finds what outlives this one
        for path, text in rendered.files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        return await launch(rendered.argv, cwd=dirs.workspace, env=rendered.env, log_file=dirs.log_file)

    async def _snapshot(self, dirs: workspace.RolloutDirs) -> str | None:
        """The snapshot's digest, or None (the rollout still ends; the reason goes to the
        runner's log and the rollout's log, whose tail is in the outcome). A workspace over
        snapshot_max_bytes gets the stand-in of ``refused_snapshot`` (scored 0); only one
        that could not be taken otherwise, or stored, has none (its scoring fails)."""
        try:
            data = await asyncio.to_thread(snapshot_workspace, dirs.workspace, max_bytes=self.config.snapshot_max_bytes)
        except SnapshotTooLarge as exc:
            reason = f"{exc} (the runner's snapshot_max_bytes)"
            self._note(dirs, f"workspace not archived: {reason}; a stand-in that says so is stored instead (the "
                             f"evaluator scores the rollout 0)")
            data = refused_snapshot(reason)
        except OSError as exc:
            return self._no_snapshot(dirs, f"could not take it: {exc}")
        except Exception as exc:  # e.g. MemoryError: the rollout must still end
            log.exception("rollout %s: taking the workspace snapshot failed", dirs.root.name)
            return self._no_snapshot(dirs, f"could not take it: {exc!r}")
        try:
            return await self._retry(f"storing the snapshot of rollout {dirs.root.name}", lambda: self.blobs.put(data))
        except Exception as exc:
            return self._no_snapshot(dirs, f"the blob store refused it {self.config.io_attempts} times: {exc!r}")

    @staticmethod
    def _no_snapshot(dirs: workspace.RolloutDirs, reason: str) -> None:
        RolloutRunner._note(dirs, f"no workspace snapshot: {reason}")
        return None

    @staticmethod
    def _note(dirs: workspace.RolloutDirs, text: str) -> None:
        """To the runner's log and the rollout's log (whose tail is in the outcome)."""
        log.warning("rollout %s: %s", dirs.root.name, text)
        with contextlib.suppress(OSError), dirs.log_file.open("a") as f:
            f.write(f"gyre runner: {text}\n")

    async def _publish(self, plan: core.RolloutPlan, event: Event) -> None:
        """Publishes one of the rollout's events, however long the bus refuses it.

        The log is the only way the rollout's group learns of it: the trajectory service
        settles a group once as many rollouts are sealed as ``RolloutStarted.group_size``
        states, and the trainer's step waits for the group. A start or end given up on would
        hold both for good, so past ``io_attempts`` the runner logs an error and keeps
        trying (backoff up to ``io_backoff_max_s``) while it runs; the event's id is fixed
        per rollout, so a try whose ack was lost is de-duplicated. A stop (cancel) ends the
        wait, logged with what it leaves incomplete. A closed bus connection (it never comes
        back) ends it too: ``BusClosed``, logged likewise, instead of trying for good."""
        rollout, group = plan.rollout_id, plan.group_id
        if isinstance(event, RolloutStarted):
            members = f"all {plan.group_size} of its rollouts" if plan.group_size else "it"
            stuck = (f"rollout {rollout} is not started yet: the runner keeps trying (every "
                     f"{self.config.io_backoff_max_s:g} s at most) while it runs, since its group {group} waits "
                     f"for {members}")
            left = "the rollout was never started"
        else:
            stuck = (f"rollout {rollout} has ended; the runner keeps trying (every {self.config.io_backoff_max_s:g} s "
                     f"at most) while it runs, since its group {group} waits for its end")
            left = "its end is not in the log"
        began = self.clock()
        self._handed.setdefault(event.event_id, event)

        def refused() -> None:
            self.waiting_for_bus[rollout] = event.TYPE
            self.publish_failures += 1

        try:
            await self._retry(f"publishing {event.TYPE} of rollout {rollout}", lambda: self.bus.publish(event),
                              on_failure=refused, keep_trying=stuck, give_up=lambda exc: _bus_closed(self.bus, exc))
        except asyncio.CancelledError:
            if rollout in self.waiting_for_bus:
                log.error("rollout %s: stopped while the bus refused its %s (for %.1f s): %s; group %s will not "
                          "complete unless its step is run again", rollout, event.TYPE, self.clock() - began, left,
                          group)
            raise
        except Exception as exc:  # only a closed bus ends the tries (see give_up)
            if not _bus_closed(self.bus, exc):
                raise
            msg = (f"the bus connection is closed: {event.TYPE} of rollout {rollout} cannot be published "
                   f"({left}); group {group} will not complete unless its step is run again")
            log.error("%s (%r)", msg, exc)
            raise BusClosed(msg) from exc
        finally:
            waited = self.waiting_for_bus.pop(rollout, None)
        self._taken.add(event.event_id)
        if waited is not None:
            log.warning("the bus took %s of rollout %s after refusing it for %.1f s", event.TYPE, rollout,
                        self.clock() - began)

    async def _retry(self, what: str, attempt: Callable[[], Awaitable[T]], *,
                     on_failure: Callable[[], None] = lambda: None, keep_trying: str | None = None,
                     give_up: Callable[[Exception], bool] = lambda exc: False) -> T:
        """``attempt()``, tried up to ``io_attempts`` times with a doubling backoff (at most
        ``io_backoff_max_s``); the last failure is raised. With ``keep_trying`` (why) it is
        logged as an error with that reason instead, and the tries go on until one succeeds
        or the caller is cancelled. A failure ``give_up`` says no try can mend is raised at
        once."""
        attempts, cap = self.config.io_attempts, self.config.io_backoff_max_s
        delay = min(self.config.io_backoff_s, cap)
        n = 0
        while True:
            n += 1
            try:
                return await attempt()
            except Exception as exc:
                on_failure()
                if give_up(exc):
                    raise
                if n < attempts:
                    log.warning("%s failed (try %d of %d, again in %.3g s): %r", what, n, attempts, delay, exc)
                elif keep_trying is None:
                    log.error("%s failed %d times, giving up: %r", what, n, exc)
                    raise
                else:
                    delay = delay or cap  # no backoff asked for (tests): still no busy loop on a bus that stays down
                    if n == attempts:
                        log.error("%s failed %d times (%r); %s", what, n, exc, keep_trying)
                    else:
                        log.warning("%s still failing (try %d, again in %.3g s): %r", what, n, delay, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, cap)


def refused_snapshot(reason: str) -> bytes:
    """The stand-in for a workspace not archived: a .tar.gz holding one note file, with
    ``reason`` in its PAX global header ``SNAPSHOT_REFUSED_HEADER``."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT,
                      pax_headers={SNAPSHOT_REFUSED_HEADER: reason}) as tar:
        note = f"gyre runner: the workspace was not archived: {reason}\n".encode()
        info = tarfile.TarInfo(_REFUSED_NOTE)
        info.size, info.mode, info.mtime = len(note), 0o644, 0
        tar.addfile(info, io.BytesIO(note))  # a tar of no member cannot be opened again
    return gzip.compress(raw.getvalue(), mtime=0)


def _cause(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"  # str() of an OSError has the path; its repr does not


def _with_note(tail: str, state: core.RolloutState) -> str:
    """The log's tail, with the runner's reason for ending the rollout when the log could
    not take it (a full disk, or no folder at all)."""
    if state.snapshot_digest is None and state.note and state.note not in tail:
        tail += f"gyre runner: {state.note}\n"
    return tail


def _outcome(state: core.RolloutState, tail: str) -> RolloutOutcome:
    plan = state.plan
    return RolloutOutcome(rollout_id=plan.rollout_id, task_id=plan.task_id, group_id=plan.group_id,
                          status="timed_out" if state.timed_out else "finished", exit_status=state.exit_status,
                          wall_time_s=round(core.wall_time(state), 3), snapshot_digest=state.snapshot_digest,
                          log_tail=tail)
