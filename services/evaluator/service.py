"""The evaluator service: rollout ended -> score (or a reasoned failure), for many at once.

``evaluate`` is the orchestration for one rollout and never raises for bad input: every
ended rollout yields exactly one ``RolloutScored`` or ``RolloutScoringFailed``, whose
event id is derived from the ended event's, so a redelivery is de-duplicated by the bus.
An end stored twice (a retry past the bus's de-duplication window) may be scored by two
replicas at once: the outcome is published expecting no message on its subject yet, so
only the first is stored and the later one is dropped (a conflict counts as done).
``run`` starts ``workers`` consumers on one durable consumer (a JetStream work queue);
a local claim set keeps two of them from scoring the same rollout when a bus (the
in-memory one) hands every event to each.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import re
import shutil
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from libs.common.bus.port import BlobStore, ConcurrencyConflict, ConsumerConfig, Delivery, EventBus, StopSignal
from libs.common.events import (
    Context,
    RolloutFinished,
    RolloutScored,
    RolloutScoringFailed,
    RolloutStarted,
    RolloutTimedOut,
    TestOutcome,
    subject_token,
)

from .adapters import scratch, workspace
from .adapters.catalog import TaskCatalog, TaskSpecError
from .adapters.judge_client import JudgeClient, JudgeFailed, JudgeUnreachable
from .adapters.plugin_scorers import Scorer
from .adapters.sandbox import SANDBOX_PATH, Sandbox
from .adapters.snapshot import SnapshotOverLimits, SnapshotRefused, UnpackLimits, UnsafeSnapshot, unpack_snapshot
from .core.judge import build_messages
from .core.results import TestReport, parse_junit, parse_outcome_lines
from .core.scoring import (
    RolloutEnded,
    TestsVerdict,
    combine,
    failed_event,
    fits_inline,
    score_tests,
    scored_event,
    with_plugin_scores,
    zero_event,
)
from .core.spec import TaskEvaluatorSpec
from .settings import EvaluatorSettings

log = logging.getLogger(__name__)
ScoreEvent = RolloutScored | RolloutScoringFailed


class _Unscorable(Exception):
    """Bad input: the message is the RolloutScoringFailed reason."""


class TransientError(RuntimeError):
    """The blob store or bus failed, not the rollout: worth another delivery."""


class _WorkspaceGone(Exception):
    """The rollout's scratch workspace was deleted or replaced while it was scored."""


class _AgentsDoing(Exception):
    """What the agent did to its own workspace or results: the rollout scores 0 (a score,
    so its group learns from it; never a failure that would drop it). The message is the
    reason."""

    def __init__(self, reason: str, isolation: str = "none (no tests run)") -> None:
        super().__init__(reason)
        self.isolation = isolation


class _RunNotStarted(Exception):
    """The tests never ran (the sandbox could not be set up, the interpreter or pytest did
    not start): not the rollout's fault, so retried while a delivery is left."""


@dataclass
class Evaluator:
    settings: EvaluatorSettings
    bus: EventBus
    store: BlobStore
    catalog: TaskCatalog
    sandbox: Sandbox
    judge: JudgeClient | None = None
    scorers: dict[str, Scorer] = field(default_factory=dict)  # gyre.scorers plugins, weighted by settings.scorers

    def __post_init__(self) -> None:
        self._tasks: OrderedDict[str, str] = OrderedDict()  # rollout id -> task id, from RolloutStarted
        self._claimed: OrderedDict[str, None] = OrderedDict()
        self.counts = {"scored": 0, "failed": 0}
        self._scratch: scratch.ScratchArea | None = None

    async def start(self) -> str:
        """Claim a scratch folder of our own, delete those evaluators that are no longer
        running left behind, and pick the sandbox; returns the isolation in force."""
        area = self._scratch_area()
        if self.settings.keep_workdirs:
            log.info("evaluator: keep_workdirs is set: scratch folders left by earlier evaluators under %s are "
                     "kept too (the next evaluator started without it deletes them)", self.settings.work_root)
        else:
            await asyncio.to_thread(self._sweep, area)
        isolation = await self.sandbox.probe(area.path, self.settings.python)
        log.info("evaluator: isolation %s", isolation)
        return isolation

    def _scratch_area(self) -> scratch.ScratchArea:
        """This evaluator's folder under work_root (made on first use), where its workspaces
        go; a new one if ours was deleted or replaced meanwhile. Raises UnsafeWorkRoot when
        work_root is not this uid's alone."""
        area = self._scratch
        if area is not None and area.held:
            if area.intact:
                return area
            log.warning("evaluator: its scratch folder %s was deleted or replaced by someone else (work_root must be "
                        "left to the evaluators); it makes a new one", area.path)
            area.release(remove=False)  # nothing of ours left at that path: only the lock goes
        root = self.settings.work_root
        scratch.prepare_root(root)
        self._scratch = scratch.ScratchArea.claim(root)
        log.info("evaluator: scratch workspaces under %s", self._scratch.path)
        return self._scratch

    def _new_workspace(self, rollout_id: str) -> scratch.Workspace:
        """A new, empty workspace in our folder, held open; if the folder vanished between the
        check and the mkdir, once more in a new one. Raises ScratchError when no folder of
        our own can be had."""
        name = f"{subject_token(rollout_id)[:64]}-{uuid.uuid4().hex[:8]}"
        try:
            return self._scratch_area().workspace(name)
        except FileNotFoundError:  # gone since _scratch_area looked: it sees that now
            return self._scratch_area().workspace(name)

    def _workspace_for(self, ended: RolloutEnded, *, may_retry: bool) -> scratch.Workspace:
        try:
            return self._new_workspace(ended.rollout_id)
        except scratch.ScratchError as exc:
            log.error("evaluator: rollout %s: no scratch folder of its own to score it in (%s); %s", ended.rollout_id,
                      exc, "it is scored on a later delivery" if may_retry else "last delivery: it fails")
            if may_retry:  # work_root is the evaluator's trouble, not the rollout's: redelivered
                raise TransientError(f"no scratch folder: {exc}") from exc
            raise _Unscorable(f"the evaluator had no scratch folder to score it in: {exc}") from exc

    def _workspace_gone(self, ended: RolloutEnded, ws: scratch.Workspace, *, may_retry: bool) -> ScoreEvent:
        """A workspace deleted or replaced while its rollout was scored (by an evaluator of an
        older version sharing work_root, or by hand): whatever was computed there is not the
        rollout's score. Redelivered (TransientError) when it may be; else a failure."""
        log.error("evaluator: rollout %s: its scratch workspace %s was deleted or replaced while it was scored "
                  "(work_root must be left to the evaluators): no score computed there is published; %s",
                  ended.rollout_id, ws.path, "it is scored again on a later delivery" if may_retry
                  else "last delivery: it fails")
        if may_retry:
            raise TransientError(f"scratch workspace {ws.path} deleted or replaced while scoring")
        return failed_event(ended, "the evaluator's scratch workspace was deleted or replaced while the rollout was "
                                   "scored (not scored: what was computed there does not count)")

    def _sweep(self, area: scratch.ScratchArea) -> None:
        swept = scratch.sweep(self.settings.work_root, own=area)
        if swept.removed:
            log.info("evaluator: deleted %d scratch folder(s) left by evaluators no longer running (about %.1f MB): "
                     "%s", len(swept.removed), swept.bytes / 1e6, ", ".join(swept.removed))
        if swept.busy:
            log.info("evaluator: %d scratch folder(s) of other running evaluators under %s left alone",
                     swept.busy, self.settings.work_root)
        if swept.foreign:
            log.warning("evaluator: %d entr%s under %s named like scratch folders but owned by another uid left alone "
                        "(never swept, never used; delete them by hand): %s", len(swept.foreign),
                        "y" if len(swept.foreign) == 1 else "ies", self.settings.work_root, ", ".join(swept.foreign))

    def close(self) -> None:
        """Delete our scratch folder (kept with keep_workdirs) and drop its lock. ``run``
        does this when it stops; idempotent."""
        if self._scratch is not None:
            self._scratch.release(remove=not self.settings.keep_workdirs)

    # -- one rollout ------------------------------------------------------------

    async def evaluate(self, ended: RolloutEnded, *, may_retry: bool = False) -> ScoreEvent:
        """The outcome for one ended rollout. With ``may_retry``, a failing blob store or bus,
        no scratch folder to be had, or a workspace deleted or replaced while it was scored
        raises TransientError (for a redelivery) instead of becoming a failure event; a score
        computed in a workspace that vanished is never returned."""
        ws: scratch.Workspace | None = None
        try:
            try:
                spec = await self._spec_for(ended)
                data = await self._snapshot(ended)
            except (_Unscorable, TransientError):
                raise
            except Exception as exc:  # the store or bus, not the rollout
                if may_retry:
                    raise TransientError(f"{exc!r}") from exc
                raise _Unscorable(f"could not fetch the rollout's inputs: {exc!r}") from exc
            ws = self._workspace_for(ended, may_retry=may_retry)
            workdir = ws.path
            try:
                unpacked = await asyncio.to_thread(unpack_snapshot, data, workdir, self._unpack_limits())
            except SnapshotRefused as exc:
                raise _AgentsDoing(f"score 0.000, the runner did not archive the workspace: {exc}") from exc
            except SnapshotOverLimits as exc:
                raise _AgentsDoing(f"score 0.000, the workspace is over the evaluator's limits: {exc}") from exc
            except UnsafeSnapshot as exc:
                raise _Unscorable(f"unusable snapshot: {exc}") from exc
            note = "; ".join(n for n in (_skipped_note(unpacked.skipped_links),
                                         _bad_names_note(unpacked.skipped_names)) if n)
            if note:
                log.info("evaluator: rollout %s: %s", ended.rollout_id, note)
            outcome = await self._score(ended, spec, workdir, may_retry=may_retry, note=note,
                                        intact=lambda: ws.intact)
            if not ws.intact:  # after the last look at it: what was computed there is void
                raise _WorkspaceGone()
            return outcome
        except TransientError:
            raise
        except Exception as exc:
            if ws is not None and not ws.intact:  # whatever failed, the workspace vanishing explains it
                return self._workspace_gone(ended, ws, may_retry=may_retry)
            if isinstance(exc, _AgentsDoing):
                log.info("evaluator: rollout %s scores 0: %s", ended.rollout_id, exc)
                return zero_event(ended, str(exc), isolation=exc.isolation)
            if isinstance(exc, _Unscorable):
                log.warning("evaluator: rollout %s not scored: %s", ended.rollout_id, exc)
                return failed_event(ended, str(exc))
            # our own fault: still an event, never a silent loss
            log.exception("evaluator: internal error on rollout %s", ended.rollout_id)
            return failed_event(ended, f"internal error: {exc!r}")
        finally:
            if ws is not None:
                if not self.settings.keep_workdirs and ws.there:  # never what took its name since
                    await self._remove_workdir(ws.path)
                ws.close()

    async def _remove_workdir(self, workdir: Path) -> None:
        """Best effort: a workspace that cannot be deleted costs disk space, never the outcome."""
        try:
            await asyncio.to_thread(workspace.remove_tree, workdir)
        except Exception as exc:
            log.error("evaluator: could not delete the scratch workspace %s (delete it by hand): %r", workdir, exc)

    async def _spec_for(self, ended: RolloutEnded) -> TaskEvaluatorSpec:
        task_id = getattr(ended, "task_id", None) or await self._task_of(ended)
        if task_id is None:
            raise _Unscorable(f"unknown rollout: no RolloutStarted for {ended.rollout_id}")
        try:
            spec = self.catalog.get(task_id)
        except TaskSpecError as exc:
            raise _Unscorable(f"bad task spec: {exc}") from exc
        if spec is None:
            raise _Unscorable(f"unknown task {task_id!r}")
        return spec

    async def _task_of(self, ended: RolloutEnded) -> str | None:
        if ended.rollout_id in self._tasks:
            return self._tasks[ended.rollout_id]
        subject = f"gyre.{ended.run_id}.rollouts.RolloutStarted.{subject_token(ended.rollout_id)}"
        async for d in self.bus.read(Context.ROLLOUTS, filter_subject=subject):
            if isinstance(d.event, RolloutStarted) and d.event.rollout_id == ended.rollout_id:
                self._tasks[ended.rollout_id] = d.event.task_id
                return d.event.task_id
        return None

    async def _snapshot(self, ended: RolloutEnded) -> bytes:
        if ended.snapshot_digest is None:
            raise _Unscorable("no workspace snapshot in the ended event: the runner could not take or store it "
                              "(the blob store failing, or an error of its own; a workspace over its "
                              "snapshot_max_bytes comes as a stand-in snapshot and scores 0); the runner's log and "
                              "the rollout's log say which")
        try:
            return await self.store.get(ended.snapshot_digest)
        except KeyError as exc:  # BlobNotFound
            raise _Unscorable(f"snapshot {ended.snapshot_digest[:12]} is missing from the blob store") from exc
        except ValueError as exc:  # BlobCorrupt
            raise _Unscorable(f"snapshot {ended.snapshot_digest[:12]} is corrupt: {exc}") from exc

    def _unpack_limits(self) -> UnpackLimits:
        s = self.settings
        return UnpackLimits(s.max_snapshot_bytes, s.max_unpacked_bytes, s.max_members)

    async def _score(self, ended: RolloutEnded, spec: TaskEvaluatorSpec, workdir: Path, *,
                     may_retry: bool = False, note: str = "",
                     intact: Callable[[], bool] = lambda: True) -> ScoreEvent:
        """``note``: something about the snapshot worth saying in the outcome's reason;
        ``intact``: whether the workspace is still there (checked once the tests ran)."""
        policy = spec.combine
        view = await asyncio.to_thread(workspace.describe, workdir) if policy.uses_judge else ""
        verdict: TestsVerdict | None = None
        isolation = "none (no tests run)"
        if spec.hidden_files or spec.command:
            try:
                verdict, isolation = await self._run_tests(spec, workdir)
            except _RunNotStarted as exc:
                if not intact():
                    raise _WorkspaceGone() from exc
                log.error("evaluator: rollout %s: the tests never ran: %s; %s", ended.rollout_id, exc,
                          "it is scored on a later delivery" if may_retry else "last delivery: it fails")
                if may_retry:
                    raise TransientError(f"the tests never ran: {exc}") from exc
                raise _Unscorable(f"the tests never ran: {exc}") from exc
            if not intact():  # deleted under the tests: their verdict is void; no judge asked
                raise _WorkspaceGone()
            if verdict.tampered:  # the agent's doing: 0, whatever a judge or plugin would add
                log.warning("evaluator: rollout %s: %s", ended.rollout_id, verdict.reason)
                reason = f"{verdict.reason}; {note}" if note else verdict.reason
                digest = None if fits_inline(verdict.outcomes) else await self._store_tests(
                    ended, verdict.outcomes, may_retry=may_retry)
                return zero_event(ended, reason, outcomes=verdict.outcomes, isolation=isolation, tests_digest=digest)
        judge_score, judge_error = None, None
        if policy.uses_judge:
            judge_score, judge_error = await self._ask_judge(spec, view, verdict, may_retry=may_retry)
        result = combine(policy, verdict, judge_score, judge_error)
        if isinstance(result, str):
            return failed_event(ended, f"{result}; {note}" if note else result)
        if note:
            result = replace(result, reason=f"{result.reason}; {note}" if result.reason else note)
        if self.scorers:
            result = with_plugin_scores(result, await self._plugin_scores(ended, spec, workdir))
        log.info("evaluator: rollout %s: %s [%s]", ended.rollout_id, result.reason, isolation)
        outcomes = verdict.outcomes if verdict else ()
        digest = None if fits_inline(outcomes) else await self._store_tests(ended, outcomes, may_retry=may_retry)
        return scored_event(ended, result, outcomes, isolation, tests_digest=digest)

    async def _store_tests(self, ended: RolloutEnded, outcomes: tuple[TestOutcome, ...], *,
                           may_retry: bool) -> str | None:
        """Too many outcomes for one event: the whole list goes to the blob store (a JSON
        array of TestOutcome objects), the event carries its digest and the failing ones.
        A store that fails on the last delivery leaves the list cut, and the event says so."""
        data = json.dumps([o.model_dump(mode="json") for o in outcomes]).encode()
        try:
            digest = await self.store.put(data)
        except Exception as exc:
            if may_retry:
                raise TransientError(f"storing the per-test list: {exc!r}") from exc
            log.warning("evaluator: rollout %s: the per-test list (%d outcomes) could not be stored, the score "
                        "event carries only part of it: %r", ended.rollout_id, len(outcomes), exc)
            return None
        log.info("evaluator: rollout %s: %d test outcomes, too many for the event; full list in blob %s",
                 ended.rollout_id, len(outcomes), digest[:12])
        return digest

    async def _run_tests(self, spec: TaskEvaluatorSpec, workdir: Path) -> tuple[TestsVerdict, str]:
        """The tests' verdict and the isolation they ran under. Raises _RunNotStarted when
        they never ran (not the rollout's fault) and _AgentsDoing when the workspace kept
        them from starting (over the task's disk limit before pytest's session began)."""
        control = await asyncio.to_thread(workspace.prepare, workdir, spec)
        hidden_id = await asyncio.to_thread(workspace.hidden_identity, workdir)
        env = workspace.sandbox_env(workdir, control)
        if spec.limits.per_test_s:
            env["GYRE_PER_TEST_S"] = f"{spec.limits.per_test_s:g}"
        if spec.uses_pytest:
            argv = workspace.pytest_argv(self.settings.python, workdir)
        else:
            argv = [self.settings.python if a == "{python}" else a for a in spec.command]
            if "/" not in argv[0]:  # a program looked up on PATH: one the host lacks never ran (not a 0)
                path = env.get("PATH") or SANDBOX_PATH
                if shutil.which(argv[0], path=path) is None:
                    raise _RunNotStarted(f"the task's command {argv[0]!r} is not installed on the evaluator's "
                                         f"host (not found on PATH {path})")
        try:
            run = await self.sandbox.run(
                argv, workdir=workdir, env=env, limits=spec.limits, readonly=workspace.READONLY,
                results_var=workspace.RESULTS_VAR if spec.uses_pytest else None,
                results_cap=self.settings.max_result_bytes)
        except OSError as exc:  # the sandbox's programs could not be started at all
            raise _RunNotStarted(f"the sandbox could not start the tests: {exc!r}") from exc
        if run.killed_by == "sandbox set-up failure":
            raise _RunNotStarted(f"sandbox could not be set up: {run.output_tail[-300:]}")
        if spec.uses_pytest:
            report = parse_outcome_lines(run.results.decode("utf-8", "replace"))
            if run.results_truncated:
                report = replace(report, notes=(*report.notes, "results over the cap were dropped"))
            if not report.started:
                tail = " | ".join(run.output_tail.strip().splitlines()[-3:])[-300:]
                if run.killed_by and run.killed_by.startswith("disk limit"):
                    raise _AgentsDoing(f"score 0.000, the workspace was over the task's {run.killed_by} before the "
                                       f"tests started", run.isolation)
                why = f"stopped by the {run.killed_by}" if run.killed_by else f"exit status {run.exit_code}"
                raise _RunNotStarted(f"pytest's session never began ({why}): {tail}")
        else:
            report = await asyncio.to_thread(self._read_report, spec, workdir)
        changed = await asyncio.to_thread(workspace.hidden_changes, workdir, spec, hidden_id)
        if changed:  # only the agent's code runs there besides the tests: the run is not scored
            report = replace(report, tampering=(*report.tampering, *changed))
        return score_tests(spec, report, run), run.isolation

    def _read_report(self, spec: TaskEvaluatorSpec, workdir: Path) -> TestReport:
        """A custom command's JUnit XML (pytest runs report through their pipe instead)."""
        cap = self.settings.max_result_bytes
        got = workspace.read_capped(workdir, spec.junit_path or "", cap)
        if got is None:
            return TestReport(notes=(f"no JUnit XML at {spec.junit_path}",))
        text, size = got
        if size > cap:  # the test cases before the cap count; the rest are unknown (missing if the spec names them)
            report = parse_junit(text, partial=True)
            return replace(report, notes=(*report.notes, f"the JUnit XML is {size} bytes, over the evaluator's "
                                                         f"max_result_bytes ({cap}): only its first "
                                                         f"{len(report.tests)} test case(s) were read"))
        try:
            return parse_junit(text)
        except ValueError as exc:
            return TestReport(notes=(str(exc)[:300],))

    async def _plugin_scores(self, ended: RolloutEnded, spec: TaskEvaluatorSpec,
                             workdir: Path) -> dict[str, tuple[float, float]]:
        task = {"task_id": spec.task_id, "prompt": spec.prompt, "rubric": spec.rubric,
                "rollout_id": ended.rollout_id, "timed_out": isinstance(ended, RolloutTimedOut)}
        got: dict[str, tuple[float, float]] = {}
        for name, fn in self.scorers.items():
            try:
                value = await asyncio.to_thread(fn, workdir, dict(task))
                value = float(value)
            except Exception as exc:
                raise _Unscorable(f"scorer plugin {name} failed: {exc!r}") from exc
            if not math.isfinite(value) or not 0.0 <= value <= 1.0:
                raise _Unscorable(f"scorer plugin {name} returned {value!r}, not a score in [0, 1]")
            got[name] = (value, self.settings.scorers.get(name, 0.0))
        return got

    async def _ask_judge(
        self, spec: TaskEvaluatorSpec, view: str, verdict: TestsVerdict | None, *, may_retry: bool = False
    ) -> tuple[float | None, str | None]:
        if self.judge is None:
            return None, "no judge configured"
        summary = verdict.reason if verdict else None
        try:
            return await self.judge.score(build_messages(spec, view, summary)), None
        except JudgeUnreachable as exc:
            if may_retry:  # the judge is down, not the rollout bad: score it on a later delivery
                raise TransientError(f"judge unreachable: {exc}") from exc
            return None, str(exc)
        except JudgeFailed as exc:
            return None, str(exc)

    # -- the pool ---------------------------------------------------------------

    async def handle(self, delivery: Delivery) -> None:
        event = delivery.event
        if isinstance(event, RolloutStarted):
            self._tasks[event.rollout_id] = event.task_id
            _bound(self._tasks)
            return
        if not isinstance(event, (RolloutFinished, RolloutTimedOut)) or event.event_id in self._claimed:
            return
        self._claimed[event.event_id] = None
        _bound(self._claimed)
        try:
            if await self._already_scored(event):
                return
            outcome = await self.evaluate(event, may_retry=delivery.num_delivered < self.consumer_config().max_deliver)
            # another replica may have scored a second stored copy of this end meanwhile
            if await self._already_scored(event):
                return
            try:
                # only the rollout's first outcome, of either kind, is stored: a copy of the
                # end stored twice (a retry past the bus's de-duplication window) scored by
                # another replica at the same time loses here, not in the log
                await self.bus.publish(outcome, expect_last_subject_seq=0,  # ack (by returning) once stored
                                       expect_subject=_outcomes_subject(event))
            except ConcurrencyConflict:
                # an outcome is already stored: another replica's, or ours whose ack was lost
                log.info("evaluator: rollout %s already has an outcome stored; this one (%s) dropped",
                         event.rollout_id, outcome.TYPE)
                self._tasks.pop(event.rollout_id, None)
                return
        except BaseException:
            self._claimed.pop(event.event_id, None)  # let the redelivery score it
            raise
        self._tasks.pop(event.rollout_id, None)
        self.counts["scored" if isinstance(outcome, RolloutScored) else "failed"] += 1

    async def _already_scored(self, ended: RolloutEnded) -> bool:
        """An outcome already in the log (a redelivery after a crash, or after the ack wait
        ran out once the bus's de-duplication window had passed, or a second stored copy of
        the end taken by another replica): don't score it twice. Checked before scoring and
        again just before publishing; the publish itself expects no outcome of either kind on
        the rollout (nats-server 2.11 or newer; an older one checks the outcome's own kind)."""
        token = subject_token(ended.rollout_id)
        for kind in (RolloutScored, RolloutScoringFailed):
            subject = f"gyre.{ended.run_id}.{Context.SCORES.value}.{kind.TYPE}.{token}"
            if await self.bus.last_on_subject(Context.SCORES, subject) is not None:
                log.info("evaluator: rollout %s already has a %s; not scored again", ended.rollout_id, kind.TYPE)
                return True
        return False

    def consumer_config(self) -> ConsumerConfig:
        run = self.settings.run_id or "*"
        return ConsumerConfig(
            # named per run: the bus reuses a durable of that name as it is, so a shared
            # name would bind a new run's evaluator to an earlier run's filter
            name=durable_name(self.settings.consumer_name, self.settings.run_id),
            context=Context.ROLLOUTS,
            filter_subject=f"gyre.{run}.rollouts.>",
            batch=1,  # one rollout per fetch, so the workers share the queue
            max_deliver=self.settings.max_deliver,
            retry_delay_s=self.settings.retry_delay_s,
            ack_wait_s=self.settings.ack_wait_s,
            # a scoring keeps its rollout however long its tests and judge take; a dead
            # evaluator's rollout goes to another ack_wait_s after its last heartbeat
            heartbeat_s=min(30.0, self.settings.ack_wait_s / 3),
        )

    async def run(self, stop: StopSignal) -> None:
        """Score rollouts until ``stop`` is set."""
        await self.start()
        config = self.consumer_config()
        try:
            await asyncio.gather(
                *(self.bus.run_consumer(config, self.handle, stop=stop) for _ in range(self.settings.workers))
            )
        finally:
            await asyncio.to_thread(self.close)


def durable_name(base: str, run_id: str | None) -> str:
    """The evaluator's durable consumer name for a run: ``<base>-<run id>``, or
    ``<base>-all-runs`` for an evaluator of every run. NATS refuses dots, spaces, ``*``,
    ``>`` and slashes in a name, so anything outside ``[A-Za-z0-9_-]`` becomes ``_``; a run
    id so changed (or longer than 64 characters) also gets a digest of itself, so two runs
    never share a name."""
    if run_id is None:
        return f"{base}-all-runs"
    clean = re.sub(r"[^A-Za-z0-9_\-]", "_", run_id)
    if clean != run_id or len(clean) > 64:
        clean = f"{clean[:64]}-{hashlib.sha256(run_id.encode()).hexdigest()[:10]}"
    return f"{base}-{clean}"


def _skipped_note(skipped: tuple[str, ...], shown: int = 5) -> str:
    """The outcome's word on symbolic links the snapshot held that lead outside the
    workspace (e.g. a virtualenv's ``bin/python``): left out, not followed."""
    if not skipped:
        return ""
    more = f" and {len(skipped) - shown} more" if len(skipped) > shown else ""
    return (f"{len(skipped)} symlink(s) leading outside the workspace skipped: "
            f"{', '.join(skipped[:shown])}{more}")


def _bad_names_note(skipped: tuple[str, ...], shown: int = 5) -> str:
    """The outcome's word on members left out for their names (a backslash, too long)."""
    if not skipped:
        return ""
    more = f" and {len(skipped) - shown} more" if len(skipped) > shown else ""
    return f"{len(skipped)} file(s) with names the evaluator does not make skipped: {', '.join(skipped[:shown])}{more}"


def _bound(memo: OrderedDict, limit: int = 100_000) -> None:
    while len(memo) > limit:
        memo.popitem(last=False)


def _outcomes_subject(ended: RolloutEnded) -> str:
    """Both kinds of a rollout's outcome (``RolloutScored``, ``RolloutScoringFailed``): the
    scores context holds only these, keyed by rollout."""
    return f"gyre.{ended.run_id}.{Context.SCORES.value}.*.{subject_token(ended.rollout_id)}"
