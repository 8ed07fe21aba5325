"""Rebuilding the schedule from the cells stream alone (``gyre replay --cells``).

The live scheduler and a replay fold the same events through the same pure core
(``translate.from_event`` then ``evolve``), with one rule in common: a cell announcing the
first phase of a switch that the scheduler's request already entered is not applied twice
(:func:`repeats_phase`). :class:`CellsFold` keeps, besides the state, each cell's
*timeline*: the phases it went through, in order, with their times. The live scheduler
writes its own fold (:func:`summary`) when it stops; a replay of the run's log must give
the same state digest and the same timelines. The live scheduler reads the cells stream to
its end before each decision and applies its own facts as their events record them (times
to the microsecond), so both fold the same facts in the same order; the digests round
times to the millisecond.

    >>> from libs.common.events import CellRegistered, SwitchCompleted, SwitchPhaseEntered, SwitchRequested
    >>> fold = CellsFold()
    >>> for ev in (CellRegistered(run_id="r", cell="c0", role="inference", is_core=True, capacity=4),
    ...            SwitchRequested(run_id="r", cell="c0", from_role="inference", to_role="training",
    ...                            water_level=0.0, reason="backlog"),
    ...            SwitchPhaseEntered(run_id="r", cell="c0", phase="draining"),  # entered already
    ...            SwitchPhaseEntered(run_id="r", cell="c0", phase="migrating"),
    ...            SwitchPhaseEntered(run_id="r", cell="c0", phase="releasing"),
    ...            SwitchPhaseEntered(run_id="r", cell="c0", phase="joining"),
    ...            SwitchCompleted(run_id="r", cell="c0", role="training", weight_version=0)):
    ...     _ = fold.apply(ev)
    >>> [phase for _, phase in fold.timelines["c0"]]
    ['inference', 'draining', 'migrating', 'releasing', 'joining', 'training']
    >>> fold.errors
    []
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from .core import SchedulerState, evolve
from .core.facts import PhaseReached
from .core.translate import from_event


def repeats_phase(state: SchedulerState, fact: Any) -> bool:
    """A cell announces the first phase of a switch that the request already entered."""
    if not isinstance(fact, PhaseReached):
        return False
    known = {c.name: c for c in state.cells}.get(fact.cell)
    return known is not None and known.phase is fact.phase


def phase_changes(before: SchedulerState, after: SchedulerState, at: float) -> list[tuple[str, float, str]]:
    """``(cell, at, phase)`` for each cell whose phase ``after`` differs from ``before``."""
    old = {c.name: c.phase for c in before.cells}
    return [(c.name, at, c.phase.value) for c in after.cells if old.get(c.name) is not c.phase]


def state_digest(state: SchedulerState) -> str:
    """Digest of what the schedule decided: each cell's phase, role counters, last failure,
    silence and unusability (each only when set, so digests of logs without one are
    unchanged), and the policy's pressure (times to the millisecond)."""
    data = {"cells": [[c.name, c.phase.value, c.capacity, c.is_core, round(c.since, 3), c.switches,
                       c.last_failure, *(["silent"] if c.silent else []), *(["unusable"] if c.unusable else [])]
                      for c in state.cells],
            "pressure": state.pressure.value, "pressure_since": round(state.pressure_since, 3)}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def timelines_digest(timelines: dict[str, list[tuple[float, str]]]) -> str:
    data = {cell: [[round(at, 3), phase] for at, phase in line] for cell, line in sorted(timelines.items())}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


@dataclass
class CellsFold:
    state: SchedulerState = field(default_factory=SchedulerState)
    timelines: dict[str, list[tuple[float, str]]] = field(default_factory=dict)
    applied: int = 0
    errors: list[str] = field(default_factory=list)  # events the core refused, with the reason
    duplicates: int = 0  # second stored copies of an event (a retry past the bus's de-duplication window)
    _seen: set[str] = field(default_factory=set, repr=False)  # event ids read

    def apply_fact(self, fact: Any) -> None:
        before = self.state
        self.state = evolve(self.state, fact)
        self.applied += 1
        for cell, at, phase in phase_changes(before, self.state, fact.at):
            self.timelines.setdefault(cell, []).append((at, phase))

    def repeated(self, event: Any) -> bool:
        """``event`` is a second stored copy of one this fold has read (same event id)."""
        return getattr(event, "event_id", None) in self._seen

    def apply(self, event: Any) -> bool:
        """Applies one cells event; False when the core does not read it or refused it, or
        when it is a second stored copy of an event read already (same event id: a
        publisher's retry after a lost ack, past the bus's de-duplication window)."""
        if self.repeated(event):
            self.duplicates += 1
            return False
        if getattr(event, "event_id", None) is not None:
            self._seen.add(event.event_id)
        try:
            fact = from_event(event)
            if fact is None or repeats_phase(self.state, fact):
                return False
            self.apply_fact(fact)
            return True
        except ValueError as exc:  # IllegalTransition, or a phase name the core does not know
            self.errors.append(f"{event.TYPE} {getattr(event, 'cell', '')}: {exc}")
            return False


def summary(fold: CellsFold) -> dict[str, Any]:
    return {"state_digest": state_digest(fold.state), "timelines_digest": timelines_digest(fold.timelines),
            "cells": {c.name: c.phase.value for c in fold.state.cells},
            "switches": sum(c.switches for c in fold.state.cells),
            "timelines": {cell: [[round(at, 3), phase] for at, phase in line]
                          for cell, line in sorted(fold.timelines.items())},
            "errors": list(fold.errors)}


def compare(replayed: dict[str, Any], live: dict[str, Any] | None) -> dict[str, Any]:
    """The replay's summary beside the live scheduler's (``None``: the live one wrote none)."""
    out = {k: replayed[k] for k in ("state_digest", "timelines_digest", "cells", "switches", "errors")}
    if live is None:
        return {**out, "live": None, "same_as_live": None}
    same = (live.get("state_digest") == replayed["state_digest"]
            and live.get("timelines_digest") == replayed["timelines_digest"])
    diff = {} if same else {cell: {"live": live.get("timelines", {}).get(cell), "replay": line}
                            for cell, line in replayed["timelines"].items()
                            if live.get("timelines", {}).get(cell) != line}
    return {**out, "live": {k: live.get(k) for k in ("state_digest", "timelines_digest")},
            "same_as_live": same, **({"differences": diff} if diff else {})}
