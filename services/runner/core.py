"""A rollout's lifecycle as pure decide/evolve over frozen dataclasses (no I/O here).

Worked example (a rollout that times out)::

    s = planned(plan)                         # PLANNED
    s, fx = step(s, Register(now=0.0))        # fx: Publish(RolloutStarted) -> REGISTERED
    s, fx = step(s, Launched(now=0.1))        # RUNNING, deadline = 0.1 + time_limit_s
    s, fx = step(s, DeadlinePassed(now=60.2)) # fx: KillGroup, TakeSnapshot -> SNAPSHOTTING (timed_out)
    s, fx = step(s, Exited(-15, now=60.3))    # late exit: only its status is kept
    s, fx = step(s, Snapshotted("ab..", 60.4))# fx: Publish(RolloutTimedOut) -> ENDED

A harness that exits first goes RUNNING -> SNAPSHOTTING (finished) instead; whichever of
exit and deadline comes first decides finished vs timed out. A harness that cannot be
started still ends (``LaunchFailed``): its workspace is snapshotted and the rollout is
reported finished with exit status 127, so the evaluator scores what is there and the
group stays complete. A rollout the runner itself fails on (``Failed``: its workspace could
not be prepared, an unexpected error while carrying out an effect) ends from whatever phase
it is in, with no snapshot (so its scoring fails and its group settles without it) and exit
status 127 unless the harness's own is known; one not yet registered is registered first.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from libs.common.events import Event, RolloutFinished, RolloutStarted, RolloutTimedOut

LAUNCH_FAILED_STATUS = 127


class Phase(str, enum.Enum):
    PLANNED = "planned"
    REGISTERED = "registered"  # RolloutStarted published: the proxy accepts the key
    RUNNING = "running"
    SNAPSHOTTING = "snapshotting"
    ENDED = "ended"


@dataclass(frozen=True)
class RolloutPlan:
    run_id: str
    rollout_id: str
    task_id: str
    group_id: str
    step: int
    harness: str
    weight_version: int
    api_key_digest: str
    time_limit_s: float
    group_size: int | None = None
    purpose: str = "train"  # "eval": scored, never trained on


@dataclass(frozen=True)
class RolloutState:
    plan: RolloutPlan
    phase: Phase = Phase.PLANNED
    launched_at: float | None = None
    deadline: float | None = None
    ended_at: float | None = None  # harness exit or deadline, whichever came first
    timed_out: bool = False
    exit_status: int | None = None
    snapshot_digest: str | None = None
    note: str = ""


# -- commands (what the adapters observed) ------------------------------------------


@dataclass(frozen=True)
class Register:
    now: float


@dataclass(frozen=True)
class Launched:
    now: float


@dataclass(frozen=True)
class LaunchFailed:
    now: float
    reason: str


@dataclass(frozen=True)
class Exited:
    status: int
    now: float


@dataclass(frozen=True)
class DeadlinePassed:
    now: float


@dataclass(frozen=True)
class Snapshotted:
    digest: str | None  # None: the snapshot could not be taken
    now: float


@dataclass(frozen=True)
class Failed:
    """The runner failed on the rollout (not the harness's doing): end it as it stands."""
    now: float
    reason: str


Command = Register | Launched | LaunchFailed | Exited | DeadlinePassed | Snapshotted | Failed


# -- effects (what the adapters must do) --------------------------------------------


@dataclass(frozen=True)
class Publish:
    event: Event


@dataclass(frozen=True)
class KillGroup:
    pass


@dataclass(frozen=True)
class TakeSnapshot:
    pass


Effect = Publish | KillGroup | TakeSnapshot


def planned(plan: RolloutPlan) -> RolloutState:
    return RolloutState(plan)


def decide(state: RolloutState, command: Command) -> list[Effect]:
    """The effects a command calls for in this state (none when it comes too late)."""
    phase = state.phase
    if isinstance(command, Register) and phase is Phase.PLANNED:
        return [Publish(started_event(state.plan))]
    if isinstance(command, LaunchFailed) and phase is Phase.REGISTERED:
        return [TakeSnapshot()]
    if isinstance(command, Exited) and phase is Phase.RUNNING:
        return [TakeSnapshot()]
    if isinstance(command, DeadlinePassed) and phase is Phase.RUNNING:
        return [KillGroup(), TakeSnapshot()]
    if isinstance(command, Snapshotted) and phase is Phase.SNAPSHOTTING:
        return [Publish(ended_event(evolve(state, command)))]
    if isinstance(command, Failed) and phase is not Phase.ENDED:
        ended = Publish(ended_event(evolve(state, command)))
        return [Publish(started_event(state.plan)), ended] if phase is Phase.PLANNED else [ended]
    return []


def evolve(state: RolloutState, command: Command) -> RolloutState:
    """The state after a command (unchanged when the command does not apply)."""
    phase = state.phase
    if isinstance(command, Register) and phase is Phase.PLANNED:
        return replace(state, phase=Phase.REGISTERED)
    if isinstance(command, Launched) and phase is Phase.REGISTERED:
        return replace(state, phase=Phase.RUNNING, launched_at=command.now,
                       deadline=command.now + state.plan.time_limit_s)
    if isinstance(command, LaunchFailed) and phase is Phase.REGISTERED:
        return replace(state, phase=Phase.SNAPSHOTTING, launched_at=command.now, ended_at=command.now,
                       exit_status=LAUNCH_FAILED_STATUS, note=command.reason)
    if isinstance(command, Exited):
        if phase is Phase.RUNNING:
            return replace(state, phase=Phase.SNAPSHOTTING, ended_at=command.now, exit_status=command.status)
        if state.timed_out and state.exit_status is None:
            return replace(state, exit_status=command.status)  # the killed harness's status
        return state
    if isinstance(command, DeadlinePassed) and phase is Phase.RUNNING:
        return replace(state, phase=Phase.SNAPSHOTTING, ended_at=command.now, timed_out=True)
    if isinstance(command, Snapshotted) and phase is Phase.SNAPSHOTTING:
        return replace(state, phase=Phase.ENDED, snapshot_digest=command.digest)
    if isinstance(command, Failed) and phase is not Phase.ENDED:
        launched = state.launched_at if state.launched_at is not None else command.now
        return replace(state, phase=Phase.ENDED, launched_at=launched,
                       ended_at=state.ended_at if state.ended_at is not None else command.now,
                       exit_status=LAUNCH_FAILED_STATUS if state.exit_status is None else state.exit_status,
                       snapshot_digest=None, note=command.reason)
    return state


def step(state: RolloutState, command: Command) -> tuple[RolloutState, list[Effect]]:
    return evolve(state, command), decide(state, command)


def wall_time(state: RolloutState) -> float:
    if state.launched_at is None or state.ended_at is None:
        return 0.0
    return max(0.0, state.ended_at - state.launched_at)


def started_event(plan: RolloutPlan) -> RolloutStarted:
    return RolloutStarted(event_id=f"{plan.rollout_id}-started", run_id=plan.run_id, rollout_id=plan.rollout_id,
                          task_id=plan.task_id, group_id=plan.group_id, harness=plan.harness,
                          weight_version=plan.weight_version, api_key_digest=plan.api_key_digest,
                          step=plan.step, time_limit_s=plan.time_limit_s, group_size=plan.group_size,
                          purpose=plan.purpose)


def ended_event(state: RolloutState) -> RolloutFinished | RolloutTimedOut:
    plan = state.plan
    kind = RolloutTimedOut if state.timed_out else RolloutFinished
    return kind(event_id=f"{plan.rollout_id}-ended", run_id=plan.run_id, rollout_id=plan.rollout_id,
                task_id=plan.task_id, snapshot_digest=state.snapshot_digest, exit_status=state.exit_status,
                wall_time_s=round(wall_time(state), 3), causation_id=f"{plan.rollout_id}-started")
