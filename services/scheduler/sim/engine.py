"""Discrete-event cluster simulation that drives the scheduler's real policy code.

Every ``tick_s`` the simulated scheduler builds a :class:`Tick` from the simulated proxy,
runner and trainer, calls ``decide`` from ``services.scheduler.core`` and applies the
facts with ``evolve``; the simulated cell agents then walk each switch through its phases
and report ``PhaseReached``/``SwitchFinished``/``SwitchAborted``, which also go through
``evolve`` (so an illegal move in the policy fails the simulation loudly).

Order of same-time events is fixed by a sequence number and every random draw comes
from ``random.Random(seed)``: the same config gives the same schedule, bit for bit.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

from ..core import CellAdded, CellPhase, Fact, Policy, Role, SchedulerState, Tick, decide, evolve
from ..core.facts import PhaseReached, SwitchAborted, SwitchFinished, SwitchStarted
from .config import SimConfig
from .inference import Call, InferencePool
from .sessions import SessionPool
from .report import Sample, SimResult, build_result
from .training import MicroStep, StepQueue
from .workload import HOUR, RolloutPlan, draw_rollout

ARRIVE, CALL_DONE, PHASE, MICRO_DONE, UPDATE_DONE, SYNC_DONE, TICK = range(7)
MAX_SIM_H = 20_000.0  # a run this long has stalled


@dataclass
class Rollout:
    id: int
    plan: RolloutPlan
    started_at: float
    version: int
    turn: int = 0
    call: Call | None = None
    call_s: float = 0.0  # model-call seconds executed so far
    done: bool = False


@dataclass
class SwitchRun:
    """A switch as the simulated cell agent carries it out."""

    to_training: bool
    phases: tuple[tuple[str, float], ...]
    fail_at: int | None
    index: int = 0
    entered_at: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)


class ClusterSim:
    def __init__(self, config: SimConfig, policy: Policy) -> None:
        self.cfg = config
        self.policy = policy
        self.rng = random.Random(config.seed)
        self.fail_rng = random.Random(config.seed * 7919 + 1)
        self.now = 0.0
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self.pool = (
            SessionPool(config.slots_per_cell, config.sessions_per_cell, config.reprefill_s)
            if config.sessions_per_cell
            else InferencePool(config.slots_per_cell, config.full_batch_slowdown)
        )
        # Gyre's elastic trainer streams micro-steps; the baselines' trainer waits for the
        # step's whole batch unless ``baseline_streaming`` (docs/sim/calibration.md)
        streaming = policy.name == "elastic" or config.baseline_streaming
        self.steps = StepQueue(config.batch_rollouts, config.steps, streaming=streaming)
        self.state = SchedulerState()
        self.facts: list[Fact] = []
        self.samples: list[Sample] = []
        self.rollouts: dict[int, Rollout] = {}
        self.unfinished = 0
        self.trainers: dict[str, bool] = {}  # training cells -> leaving after this micro-step
        self.switch_runs: dict[str, SwitchRun] = {}
        self.updating = False
        self.micro_ends: dict[str, float] = {}  # training cell -> when its micro-step ends
        self.cohorts = 0
        self._call_ids = 0
        self.step_end_s: list[float] = []
        self.finished_walls: list[tuple[float, bool]] = []  # (wall seconds, timed out)

    # -- driving ---------------------------------------------------------------------------

    def run(self) -> SimResult:
        self._register_cells()
        self._launch_cohorts()
        self._push(0.0, TICK, None)
        handlers = {
            ARRIVE: self._on_arrive, CALL_DONE: self._on_call_done,
            PHASE: self._on_phase, MICRO_DONE: self._on_micro_done, UPDATE_DONE: self._on_update_done,
            SYNC_DONE: lambda _: self._dispatch(), TICK: self._on_tick,
        }
        while not self.steps.complete:
            if not self._heap or self.now > MAX_SIM_H * HOUR:
                raise RuntimeError(f"simulation stalled at {self.now / HOUR:.1f} h, step {self.steps.version}")
            self.now, _, kind, data = heapq.heappop(self._heap)
            handlers[kind](data)
        return build_result(self)

    def _push(self, at: float, kind: int, data: object) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at, self._seq, kind, data))

    def _apply(self, fact: Fact) -> None:
        self.state = evolve(self.state, fact)
        self.facts.append(fact)

    def _register_cells(self) -> None:
        for i in range(self.cfg.cells):
            name, is_core = f"c{i:02d}", i == 0
            role = self.policy.initial_role(i, is_core)
            self._apply(CellAdded(cell=name, role=role, capacity=self.cfg.cell_capacity, at=0.0, is_core=is_core))
            if role is Role.INFERENCE:
                self.pool.add_cell(name, 0.0)
            else:
                self.trainers[name] = False

    # -- rollouts and calls ------------------------------------------------------------------

    def _launch_cohorts(self) -> None:
        ahead = self.cfg.staleness if self.cfg.carry_over else 0
        target = min(self.cfg.steps, self.steps.version + ahead + 1)
        while self.cohorts < target:
            for _ in range(self.cfg.batch_rollouts):
                rid = len(self.rollouts)
                plan = draw_rollout(self.cfg.workload, self.rng)
                self.rollouts[rid] = Rollout(rid, plan, self.now, self.steps.version)
                self.unfinished += 1
                self._push(self.now, ARRIVE, rid)
            self.cohorts += 1

    def _on_arrive(self, rid: int) -> None:
        r = self.rollouts[rid]
        if r.done:
            return
        if r.turn >= len(r.plan.calls):
            self._finish(r, timed_out=r.plan.truncated)
            return
        self._call_ids += 1
        r.call = Call(self._call_ids, rid, r.plan.calls[r.turn])
        self.pool.submit(r.call)
        self._dispatch()

    def _dispatch(self) -> None:
        started = self.pool.dispatch(self.now)
        if self.pool.alpha:  # batch-dependent latency: calls whose cell's batch changed end elsewhen
            moved = {c.id: c for c in self.pool.take_retimed() if c.cell is not None}
            started = [c for c in started if c.id not in moved] + list(moved.values())
        for call in started:
            self._push(call.ends_at, CALL_DONE, (call.cell, call.id))

    def _on_call_done(self, data: object) -> None:
        cell, call_id = data  # type: ignore[misc]
        call = self.pool.finish(cell, call_id, self.now)
        if call is None:
            return  # moved to another cell or cancelled
        r = self.rollouts[call.rollout]
        r.call_s += r.plan.calls[r.turn]
        r.call = None
        tool_s = r.plan.tools[r.turn]
        r.turn += 1
        self._push(self.now + tool_s, ARRIVE, r.id)
        self._dispatch()

    def _finish(self, r: Rollout, *, timed_out: bool) -> None:
        r.done = True
        self.unfinished -= 1
        self.pool.end_session(r.id, self.now)
        self.finished_walls.append((self.now - r.started_at, timed_out))
        self.steps.add(MicroStep(r.id, self.cfg.train_cost_ratio * r.call_s))
        self._drive_training()

    # -- training ------------------------------------------------------------------------

    def _drive_training(self) -> None:
        core = self.state.core
        if (
            core is not None
            and core.phase is CellPhase.TRAINING
            and not self.trainers.get(core.name, True)
            and core.name not in self.steps.in_progress
            and self.steps.start_update()
        ):
            self.updating = True
            self._push(self.now + self.cfg.update_s, UPDATE_DONE, None)
        for cell, leaving in self.trainers.items():
            if leaving or (self.updating and core is not None and cell == core.name):
                continue
            if self.state.cell(cell).phase is not CellPhase.TRAINING:
                continue
            micro = self.steps.claim(cell)
            if micro is not None:
                self.micro_ends[cell] = self.now + micro.cost_s
                self._push(self.now + micro.cost_s, MICRO_DONE, cell)

    def _on_micro_done(self, cell: str) -> None:
        self.steps.complete_micro(cell)
        self.micro_ends.pop(cell, None)
        if self.trainers.get(cell):  # leaving: its micro-step was the last
            self._push(self.now + self.switch_runs[cell].phases[0][1], PHASE, cell)
        self._drive_training()

    def _on_update_done(self, _: object) -> None:
        self.updating = False
        self.steps.apply_update(self.cfg.update_s)
        self.step_end_s.append(self.now)
        if self.steps.complete:
            return
        self._launch_cohorts()
        self.pool.pause_all(self.now + self.cfg.weight_sync_s)
        self._push(self.now + self.cfg.weight_sync_s, SYNC_DONE, None)
        self._drive_training()

    # -- the scheduler -------------------------------------------------------------------

    def _tick(self) -> Tick:
        running, queued = self.pool.running_count, self.pool.queued_count
        busy = set(self.steps.in_progress)
        core = self.state.core
        if self.updating and core is not None:
            busy.add(core.name)
        return Tick(
            at=self.now,
            queued_calls=queued,
            running_calls=running,
            rollouts_between_calls=max(0, self.unfinished - running - queued),
            training_backlog=len(self.steps.claimable),
            update_pending=self.steps.update_pending,
            update_needs_training=True,  # the simulated core applies an update only in training (_drive_training)
            batch_ready=self.steps.batch_ready,
            cell_calls=self.pool.calls_by_cell(),
            busy_trainers=frozenset(busy),
            micro_step_left_s={c: end - self.now for c, end in self.micro_ends.items()},
        )

    def _on_tick(self, _: object) -> None:
        tick = self._tick()
        for fact in decide(self.state, tick, self.policy):
            self._apply(fact)
            if isinstance(fact, SwitchStarted):
                self._start_switch(fact)
        counts = self.state.roles_count()
        self.samples.append(Sample(self.now, self.state.level, counts.get("inference", 0),
                                   counts.get("training", 0), tick.queued_calls))
        self._push(self.now + self.cfg.tick_s, TICK, None)

    # -- the simulated cell agents -------------------------------------------------------

    def _start_switch(self, fact: SwitchStarted) -> None:
        to_training = fact.to_role is Role.TRAINING
        phases = self.cfg.phases(to_training)
        fail_at = None
        if self.cfg.switch_failure_rate and self.fail_rng.random() < self.cfg.switch_failure_rate:
            fail_at = self.fail_rng.randrange(len(phases))
        run = SwitchRun(to_training, phases, fail_at, entered_at=self.now)
        self.switch_runs[fact.cell] = run
        if to_training:
            self.pool.stop_accepting(fact.cell)
            self._push(self.now + phases[0][1], PHASE, fact.cell)
            return
        self.trainers[fact.cell] = True
        if fact.cell not in self.steps.in_progress:  # else it leaves after its micro-step
            self._push(self.now + phases[0][1], PHASE, fact.cell)

    def _on_phase(self, cell: str) -> None:
        run = self.switch_runs[cell]
        name = run.phases[run.index][0]
        run.timings[name] = round(self.now - run.entered_at, 6)
        if run.fail_at == run.index:
            self._abort_switch(cell, run, CellPhase(name))
            return
        run.index += 1
        run.entered_at = self.now
        if run.index == len(run.phases):
            self._finish_switch(cell, run)
            return
        phase = CellPhase(run.phases[run.index][0])
        self._apply(PhaseReached(cell=cell, phase=phase, at=self.now))
        if phase is CellPhase.MIGRATING:
            self.pool.migrate_out(cell, self.now)
            self._dispatch()
        elif phase is CellPhase.RELEASING:
            self.pool.remove_cell(cell, self.now)
        elif phase is CellPhase.RESUMING:
            self.trainers.pop(cell, None)
        self._push(self.now + run.phases[run.index][1], PHASE, cell)

    def _finish_switch(self, cell: str, run: SwitchRun) -> None:
        role = Role.TRAINING if run.to_training else Role.INFERENCE
        self._apply(SwitchFinished(cell=cell, role=role, at=self.now, weight_version=self.steps.version,
                                   phase_timings=dict(run.timings)))
        del self.switch_runs[cell]
        if run.to_training:
            self.trainers[cell] = False
            self._drive_training()
        else:
            self.pool.add_cell(cell, self.now)
            self._dispatch()

    def _abort_switch(self, cell: str, run: SwitchRun, phase: CellPhase) -> None:
        """Roll back to the safe role: inference before training is reached, else training."""
        role = Role.INFERENCE if run.to_training else Role.TRAINING
        self._apply(SwitchAborted(cell=cell, role=role, phase=phase, at=self.now,
                                  reason=f"simulated failure while {phase.value}"))
        del self.switch_runs[cell]
        if run.to_training:
            self.pool.add_cell(cell, self.now)
            self._dispatch()
        else:
            self.trainers[cell] = False
            self._drive_training()
