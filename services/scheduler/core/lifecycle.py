"""Cell lifecycle: roles, phases and the legal moves between them.

A cell is always in exactly one :class:`CellPhase`. Two phases are stable (``INFERENCE``
and ``TRAINING``); the others are the explicit steps of a role switch, each reported by
the cell agent as it enters it, so a switch that stops half-way is visible and can be
rolled back to a safe role.

Worked example (a satellite cell ``c3`` moving to training and back)::

    INFERENCE --SwitchStarted(to=training)--> DRAINING     no new sessions routed to c3
    DRAINING  --PhaseReached(migrating)-----> MIGRATING    live sessions + KV moved away
    MIGRATING --PhaseReached(releasing)-----> RELEASING    inference memory freed
    RELEASING --PhaseReached(joining)-------> JOINING      pulls weights from the core
    JOINING   --SwitchFinished(training)----> TRAINING     claims micro-steps
    TRAINING  --SwitchStarted(to=inference)-> LEAVING      finishes/hands back its micro-step
    LEAVING   --PhaseReached(resuming)------> RESUMING     memory back, current weights
    RESUMING  --SwitchFinished(inference)---> INFERENCE    takes sessions again

``SwitchAborted`` from any transitional phase lands the cell in the stable phase of the
role it reports (``ROLLBACK`` lists which are allowed): before the inference memory is
gone a cell returns to inference; a cell that fails to resume stays in training. It may
name the phase the cell is in or one the switch passed already (``passed_on_path``: the
log stored an announcement the agent never heard was stored).

The core cell follows the same phases but never gives up the optimizer state or the
authoritative weights (``Cell.owns_optimizer``): while it serves inference the optimizer
is parked, and its JOINING step pulls nothing.
"""

from __future__ import annotations

import enum


class Role(str, enum.Enum):
    INFERENCE = "inference"
    TRAINING = "training"


class CellPhase(str, enum.Enum):
    INFERENCE = "inference"  # stable: serves model calls
    DRAINING = "draining"  # -> training: the proxy routes no new sessions here
    MIGRATING = "migrating"  # live sessions and their KV blocks move to other cells
    RELEASING = "releasing"  # inference memory (weights, KV pool) released
    JOINING = "joining"  # pulls the core's weights, joins the training group
    TRAINING = "training"  # stable: claims micro-steps
    LEAVING = "leaving"  # -> inference: finishes or hands back its micro-step
    RESUMING = "resuming"  # inference memory resumed with the current weight version

    @property
    def is_stable(self) -> bool:
        return self in (CellPhase.INFERENCE, CellPhase.TRAINING)

    @property
    def heading_to(self) -> Role:
        """The role this phase is on the way to (stable phases: their own role)."""
        return Role.INFERENCE if self in _TOWARD_INFERENCE else Role.TRAINING


_TOWARD_INFERENCE = frozenset({CellPhase.INFERENCE, CellPhase.LEAVING, CellPhase.RESUMING})

STABLE_PHASE: dict[Role, CellPhase] = {
    Role.INFERENCE: CellPhase.INFERENCE,
    Role.TRAINING: CellPhase.TRAINING,
}

# The path each switch walks, first phase after the stable one to the last before it.
SWITCH_PATH: dict[Role, tuple[CellPhase, ...]] = {
    Role.TRAINING: (CellPhase.DRAINING, CellPhase.MIGRATING, CellPhase.RELEASING, CellPhase.JOINING),
    Role.INFERENCE: (CellPhase.LEAVING, CellPhase.RESUMING),
}

# Phase -> phases reachable by a PhaseReached/SwitchFinished report (forward moves only).
NEXT_PHASE: dict[CellPhase, CellPhase] = {
    CellPhase.DRAINING: CellPhase.MIGRATING,
    CellPhase.MIGRATING: CellPhase.RELEASING,
    CellPhase.RELEASING: CellPhase.JOINING,
    CellPhase.JOINING: CellPhase.TRAINING,
    CellPhase.LEAVING: CellPhase.RESUMING,
    CellPhase.RESUMING: CellPhase.INFERENCE,
}

# Transitional phase -> the safe roles a failed switch may leave the cell in.
ROLLBACK: dict[CellPhase, frozenset[Role]] = {
    CellPhase.DRAINING: frozenset({Role.INFERENCE}),
    CellPhase.MIGRATING: frozenset({Role.INFERENCE}),
    CellPhase.RELEASING: frozenset({Role.INFERENCE}),
    CellPhase.JOINING: frozenset({Role.INFERENCE}),
    CellPhase.LEAVING: frozenset({Role.TRAINING}),
    CellPhase.RESUMING: frozenset({Role.TRAINING}),
}


class IllegalTransition(ValueError):
    """An event asked a cell (or the scheduler) for a move its lifecycle forbids."""


def check_switch_start(cell: str, phase: CellPhase, to_role: Role) -> CellPhase:
    """Phase a cell enters when a switch to ``to_role`` starts; raises if it cannot."""
    if not phase.is_stable:
        raise IllegalTransition(
            f"cell {cell}: cannot start a switch to {to_role.value} while {phase.value} "
            "(a switch is already in progress)"
        )
    if phase.heading_to is to_role:
        raise IllegalTransition(f"cell {cell}: already in role {to_role.value}")
    return SWITCH_PATH[to_role][0]


def check_phase_reached(cell: str, phase: CellPhase, reached: CellPhase) -> CellPhase:
    """Validate a progress report; only the next phase on the path is accepted."""
    expected = NEXT_PHASE.get(phase)
    if expected is None:
        raise IllegalTransition(f"cell {cell}: no switch in progress (phase {phase.value})")
    if reached is not expected or reached.is_stable:
        raise IllegalTransition(
            f"cell {cell}: {phase.value} -> {reached.value} is not a legal step "
            f"(next is {expected.value})"
        )
    return reached


def passed_on_path(phase: CellPhase) -> tuple[CellPhase, ...]:
    """The phases a switch now in ``phase`` went through before it (none for a stable one)."""
    path = SWITCH_PATH[phase.heading_to]
    return path[: path.index(phase)] if phase in path else ()


def check_switch_finished(cell: str, phase: CellPhase, role: Role) -> CellPhase:
    """A switch may finish only from the last phase of the path toward ``role``."""
    path = SWITCH_PATH[role]
    if phase is not path[-1]:
        raise IllegalTransition(
            f"cell {cell}: switch to {role.value} cannot finish from {phase.value} "
            f"(must pass through {' -> '.join(p.value for p in path)})"
        )
    return STABLE_PHASE[role]


def check_rollback(cell: str, phase: CellPhase, role: Role) -> CellPhase:
    """A failed switch lands in the stable phase of a safe role for where it stopped."""
    allowed = ROLLBACK.get(phase)
    if allowed is None:
        raise IllegalTransition(f"cell {cell}: no switch in progress to fail (phase {phase.value})")
    if role not in allowed:
        safe = ", ".join(sorted(r.value for r in allowed))
        raise IllegalTransition(
            f"cell {cell}: a switch failing in {phase.value} must roll back to {safe}, "
            f"not {role.value}"
        )
    return STABLE_PHASE[role]
