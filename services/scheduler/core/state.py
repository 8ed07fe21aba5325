"""Scheduler state and ``evolve``: the only way that state changes.

``evolve(state, fact) -> state`` is pure and total over legal facts; an illegal one
(a second core cell, a phase skipped, a satellite joining training while the core heads
away from it) raises :class:`IllegalTransition` with the cell and the reason, so a live
scheduler refuses it and a replay of a corrupt log stops where the log went wrong.

Checked on every switch start: the training group is rooted at the core cell. A satellite
may start toward training only while the core is in or heading to training (and is not
silent), and the core may start leaving training only once no satellite is in or heading
to it (nor silent where its seat may have joined: below). A failed or
refused switch, or a cell registering again after a restart, puts the cell in the role it
reports, even where that breaks the rule (the cell's word on itself stands); the policies
then move the satellites back. A failure may be reported in a phase the switch already
passed (the agent announced the next one, the log stored it, the acknowledgement was lost:
the agent reports the last phase it knows the log has); it rolls back from where the log
says the cell is.

A cell whose agent took a switch command and never answered is *declared* failed by the
scheduler (``SwitchAborted(declared=True)``): it rolls back like any failure (the
lifecycle's safe role for the phase the log has) and is marked ``silent``. A declaration
never overrides the cell's own word: one that lands after the cell finished, failed or
registered again (the cell is in a stable phase) is void. While the cell is silent, the
agent's own word, if it wakes up, is taken as it comes: a phase it announces of the
switch it was in puts the cell in that phase, its ``SwitchFinished`` or ``SwitchAborted``
puts it in the role it reports, a registration in the role it states; any of them ends
the silence. The policies do not start a switch for a silent cell and do not count it as
serving (``SchedulerState.serving``): nothing is known of its engine until it speaks.

A declaration is matched to the switch it gives up on: the fold keeps the id of the
``SwitchRequested`` that started each cell's current switch (``Cell.request``, read from
the log; not part of the state digest) and a declaration whose causation id names another
switch (a late copy for an older one) is void.

Silence and the training group, both checked here, so a live scheduler and a replay refuse
the same switches:

- a satellite declared failed in ``releasing`` or ``joining`` is back in inference in the
  schedule, but its seat may have joined (or join: an agent that wakes up finishes the
  phase under way, and may announce the next one before it reads the declaration). While
  it is silent it counts as in the training group (``Cell.may_train``): the core may not
  start leaving training under it. Its late ``SwitchFinished(training)`` is then taken at
  its word, inside a group the core still roots.
- a silent core roots no new training group: no satellite may start toward training
  while the core is silent, whatever role the declaration left it in.

A cell whose agent rolled a failed switch back and could not finish the rollback (its
engine would not resume, its seat would not join again) reports it:
``SwitchAborted(unusable=True)``, and so does every command it refuses meanwhile. The
cell is in the role it reports but *unusable* (``Cell.unusable``): like a silent cell it
is not counted as serving, no switch is started for it, and an unusable core roots no new
training group, until the agent reports :class:`CellRepaired` (or registers again after a
restart). Its proxy does not route to it meanwhile, so the fold is what the proxy does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .facts import (
    CellAdded,
    CellRepaired,
    Fact,
    PhaseReached,
    Pressure,
    SwitchAborted,
    SwitchFinished,
    SwitchStarted,
    WaterLevelObserved,
)
from .lifecycle import (
    STABLE_PHASE,
    CellPhase,
    IllegalTransition,
    Role,
    check_phase_reached,
    check_rollback,
    check_switch_finished,
    check_switch_start,
    passed_on_path,
)


@dataclass(frozen=True)
class Cell:
    name: str
    phase: CellPhase
    capacity: int
    is_core: bool = False
    since: float = 0.0  # when the current role or switch began
    switches: int = 0  # switches started, for flapping checks and reports
    last_failure: str | None = None
    # the scheduler declared its switch failed (its agent never answered); nothing heard
    # from the cell since. Cleared by any word of the cell's own (see the module docstring).
    silent: bool = False
    # the phase the log had when the declaration landed (None unless silent)
    silent_in: CellPhase | None = None
    # id of the SwitchRequested of the cell's current (or last) switch, when read from the
    # log: a declaration naming another one is void. Not in the state digest.
    request: str | None = None
    # its agent could not finish rolling a failed switch back (SwitchAborted.unusable): in
    # its role but unable to do it until it reports CellRepaired. In the digest only when set.
    unusable: bool = False

    @property
    def held(self) -> bool:
        """Not to be counted on nor switched: silent (nothing heard since a declaration) or
        unusable (its agent says it cannot do its role until repaired)."""
        return self.silent or self.unusable

    @property
    def owns_optimizer(self) -> bool:
        """The core keeps optimizer state and authoritative weights in every phase."""
        return self.is_core

    @property
    def heading_to(self) -> Role:
        return self.phase.heading_to

    @property
    def switching(self) -> bool:
        return not self.phase.is_stable

    @property
    def may_train(self) -> bool:
        """In or heading to training, or silent after a declaration where its seat may have
        joined (releasing, joining): the core may not leave training under such a cell."""
        return self.heading_to is Role.TRAINING or (self.silent and self.silent_in in _SEAT_MAY_HAVE_JOINED)


_SEAT_MAY_HAVE_JOINED = frozenset({CellPhase.RELEASING, CellPhase.JOINING})


@dataclass(frozen=True)
class SchedulerState:
    cells: tuple[Cell, ...] = ()  # sorted by name, so iteration order is deterministic
    now: float = 0.0
    pressure: Pressure = Pressure.STEADY
    pressure_since: float = 0.0
    level: float = 0.0  # last raw water level
    smoothed_level: float | None = None  # None until the first observation
    level_at: float = 0.0  # when the water level was last observed

    def cell(self, name: str) -> Cell:
        for c in self.cells:
            if c.name == name:
                return c
        raise IllegalTransition(f"unknown cell {name!r}")

    @property
    def core(self) -> Cell | None:
        return next((c for c in self.cells if c.is_core), None)

    def in_phase(self, *phases: CellPhase) -> tuple[Cell, ...]:
        return tuple(c for c in self.cells if c.phase in phases)

    @property
    def serving(self) -> tuple[Cell, ...]:
        """Cells in inference that can be counted on to serve (neither silent nor unusable)."""
        return tuple(c for c in self.cells if c.phase is CellPhase.INFERENCE and not c.held)

    def heading_to(self, role: Role) -> tuple[Cell, ...]:
        return tuple(c for c in self.cells if c.heading_to is role)

    @property
    def switching(self) -> tuple[Cell, ...]:
        return tuple(c for c in self.cells if c.switching)

    @property
    def training_satellites(self) -> tuple[Cell, ...]:
        """Satellites the core may not leave training under (``Cell.may_train``)."""
        return tuple(c for c in self.cells if not c.is_core and c.may_train)

    @property
    def training_group_open(self) -> bool:
        """A satellite may start toward training: the core is in or heading to training
        and is neither silent nor unusable (such a core roots no new training group)."""
        core = self.core
        return core is not None and core.heading_to is Role.TRAINING and not core.held

    def pressure_held(self, at: float) -> float:
        """Seconds the current pressure has lasted (0 while steady)."""
        return 0.0 if self.pressure is Pressure.STEADY else at - self.pressure_since

    def roles_count(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for c in self.cells:
            counts[c.phase.value] = counts.get(c.phase.value, 0) + 1
        return counts


def evolve(state: SchedulerState, fact: Fact) -> SchedulerState:
    """Apply one fact. Raises :class:`IllegalTransition` for a fact the lifecycle forbids."""
    handler = _HANDLERS.get(type(fact))
    if handler is None:
        raise TypeError(f"evolve: not a scheduler fact: {type(fact).__name__}")
    new = handler(state, fact)
    return replace(new, now=max(state.now, fact.at))


def evolve_all(state: SchedulerState, facts: list[Fact] | tuple[Fact, ...]) -> SchedulerState:
    for fact in facts:
        state = evolve(state, fact)
    return state


def _heard(cell: Cell, **changes: object) -> Cell:
    """The cell with ``changes``, its own word heard: no longer silent (nor unusable: an
    agent that cannot do its role refuses every switch, saying so, until repaired)."""
    return replace(cell, **{"silent": False, "silent_in": None, "unusable": False, **changes})  # type: ignore[arg-type]


def _put(state: SchedulerState, cell: Cell) -> SchedulerState:
    others = [c for c in state.cells if c.name != cell.name]
    return replace(state, cells=tuple(sorted([*others, cell], key=lambda c: c.name)))


def _cell_added(state: SchedulerState, fact: CellAdded) -> SchedulerState:
    known = next((c for c in state.cells if c.name == fact.cell), None)
    if known is not None:
        return _cell_registered_again(state, known, fact)
    if fact.capacity < 1:
        raise IllegalTransition(f"cell {fact.cell}: capacity must be >= 1, got {fact.capacity}")
    if fact.is_core and state.core is not None:
        raise IllegalTransition(
            f"cell {fact.cell}: a core cell already exists ({state.core.name}); "
            "there is one optimizer owner per run"
        )
    if fact.role is Role.TRAINING and not fact.is_core and not _core_toward_training(state):
        raise IllegalTransition(f"cell {fact.cell}: a satellite cannot register in training without the core")
    cell = Cell(fact.cell, STABLE_PHASE[fact.role], fact.capacity, fact.is_core, since=fact.at)
    return _put(state, cell)


def _cell_registered_again(state: SchedulerState, known: Cell, fact: CellAdded) -> SchedulerState:
    """A cell agent that restarted registers again: it is in the role it states now,
    whatever switch the scheduler saw in progress (that switch died with the agent)."""
    if fact.is_core != known.is_core:
        raise IllegalTransition(f"cell {fact.cell}: registered again as {'core' if fact.is_core else 'satellite'}, "
                                f"but it is a {'core' if known.is_core else 'satellite'} cell")
    if fact.capacity < 1:
        raise IllegalTransition(f"cell {fact.cell}: capacity must be >= 1, got {fact.capacity}")
    note = None if known.phase is STABLE_PHASE[fact.role] else f"registered again as {fact.role.value} while {known.phase.value}"
    cell = _heard(known, phase=STABLE_PHASE[fact.role], capacity=fact.capacity, since=fact.at,
                  last_failure=note or known.last_failure)
    return _put(state, cell)


def _core_toward_training(state: SchedulerState) -> bool:
    core = state.core
    return core is not None and core.heading_to is Role.TRAINING


def _switch_started(state: SchedulerState, fact: SwitchStarted) -> SchedulerState:
    cell = state.cell(fact.cell)
    phase = check_switch_start(cell.name, cell.phase, fact.to_role)
    if fact.to_role is Role.TRAINING and not cell.is_core and not state.training_group_open:
        if _core_toward_training(state) and state.core is not None and state.core.silent:
            raise IllegalTransition(
                f"cell {cell.name}: a satellite cannot move to training while the core cell is silent "
                "(its agent answered none of its last switch's commands)"
            )
        if _core_toward_training(state):
            raise IllegalTransition(
                f"cell {cell.name}: a satellite cannot move to training while the core cell is unusable "
                "(its agent could not finish rolling back a failed switch)"
            )
        raise IllegalTransition(
            f"cell {cell.name}: a satellite cannot move to training while the core cell "
            "is not in or heading to training"
        )
    if fact.to_role is Role.INFERENCE and cell.is_core:
        in_training = [c.name + (" (silent, its seat may have joined)" if c.heading_to is not Role.TRAINING else "")
                       for c in state.training_satellites]
        if in_training:
            raise IllegalTransition(
                f"cell {cell.name}: the core cell cannot leave training while satellites "
                f"{', '.join(in_training)} are in or heading to it"
            )
    moved = _heard(cell, phase=phase, since=fact.at, switches=cell.switches + 1,
                   request=fact.request)
    # A switch answers the current pressure: the next one must see it held again.
    return replace(_put(state, moved), pressure_since=fact.at)


def _phase_reached(state: SchedulerState, fact: PhaseReached) -> SchedulerState:
    cell = state.cell(fact.cell)
    if cell.silent and not fact.phase.is_stable and fact.phase.heading_to is not cell.heading_to:
        # declared failed (rolled back to the role the switch left), but its agent woke up
        # and goes on with the switch: it is where it says
        return _put(state, _heard(cell, phase=fact.phase))
    phase = check_phase_reached(cell.name, cell.phase, fact.phase)
    return _put(state, replace(cell, phase=phase))


def _switch_finished(state: SchedulerState, fact: SwitchFinished) -> SchedulerState:
    cell = state.cell(fact.cell)
    if cell.silent:
        # declared failed, but its agent finished the switch after all: it is where it says.
        # A satellite silent from releasing or joining held the core in training
        # (Cell.may_train), so its join lands in a group the core still roots, unless the
        # core's own word (a registration) moved it meanwhile: the policies move it back.
        return _put(state, _heard(cell, phase=STABLE_PHASE[fact.role], since=fact.at, last_failure=None))
    phase = check_switch_finished(cell.name, cell.phase, fact.role)
    return _put(state, replace(cell, phase=phase, since=fact.at, last_failure=None))


def _switch_aborted(state: SchedulerState, fact: SwitchAborted) -> SchedulerState:
    cell = state.cell(fact.cell)
    if fact.declared and cell.phase.is_stable:
        return state  # the cell's own outcome (or registration) landed first: the declaration is void
    if fact.declared and None not in (fact.causation, cell.request) and fact.causation != cell.request:
        return state  # a late declaration for an older switch of the cell's: void for this one
    if cell.silent and not fact.declared:  # its agent woke up and reports where it rolled back to
        return _put(state, _heard(cell, phase=STABLE_PHASE[fact.role], since=fact.at, last_failure=fact.reason,
                                  unusable=fact.unusable))
    if fact.phase is None:  # refused before any phase: the cell's own word on its role stands
        return _put(state, replace(cell, phase=STABLE_PHASE[fact.role], since=fact.at, last_failure=fact.reason,
                                   unusable=fact.unusable))
    if fact.phase is not cell.phase and fact.phase not in passed_on_path(cell.phase):
        raise IllegalTransition(
            f"cell {cell.name}: failure reported in {fact.phase.value} but the cell is {cell.phase.value}"
        )
    phase = check_rollback(cell.name, cell.phase, fact.role)
    if fact.declared:
        return _put(state, replace(cell, phase=phase, since=fact.at, last_failure=fact.reason, silent=True,
                                   silent_in=cell.phase))
    return _put(state, _heard(cell, phase=phase, since=fact.at, last_failure=fact.reason, unusable=fact.unusable))


def _cell_repaired(state: SchedulerState, fact: CellRepaired) -> SchedulerState:
    """The agent finished the rollback steps left: the cell does its role again (the role
    and the time of its last switch stand; a repair is no switch)."""
    cell = state.cell(fact.cell)
    if cell.phase is not STABLE_PHASE[fact.role]:
        raise IllegalTransition(f"cell {cell.name}: repaired as {fact.role.value} but the cell is {cell.phase.value}")
    return _put(state, _heard(cell))  # the cell's own word: not silent either


def _water_level_observed(state: SchedulerState, fact: WaterLevelObserved) -> SchedulerState:
    since = state.pressure_since if fact.pressure is state.pressure else fact.at
    return replace(state, pressure=fact.pressure, pressure_since=since, level=fact.level,
                   smoothed_level=fact.smoothed, level_at=fact.at)


_HANDLERS = {
    CellAdded: _cell_added,
    SwitchStarted: _switch_started,
    PhaseReached: _phase_reached,
    SwitchFinished: _switch_finished,
    SwitchAborted: _switch_aborted,
    CellRepaired: _cell_repaired,
    WaterLevelObserved: _water_level_observed,
}
