"""The cell agent's pure part: which phases a switch walks through, and how a failure
in each phase is rolled back.

A cell hosts one role at a time. Inference -> training walks ``draining`` (the proxy
sends it no new sessions; calls in flight finish), ``migrating`` (its sessions move to
other cells with their KV cache), ``releasing`` (the engine gives back its memory),
``joining`` (the training seat pulls the current weights). Training -> inference walks
``leaving`` (the seat hands back its work and frees its memory) and ``resuming`` (the
engine takes its memory back at the current weight version; the proxy routes to it
again).

    >>> plan("inference", "training")
    ('draining', 'migrating', 'releasing', 'joining')
    >>> rollback_role("inference", "joining")     # weights already released: go back up
    'inference'
    >>> rollback_role("training", "resuming")     # the engine would not come back: keep training
    'training'
    >>> rollback_role("training", "refused")      # a refused command changes nothing
    'training'
"""

from __future__ import annotations

from dataclasses import dataclass, field

PLANS: dict[tuple[str, str], tuple[str, ...]] = {
    ("inference", "training"): ("draining", "migrating", "releasing", "joining"),
    ("training", "inference"): ("leaving", "resuming"),
}


class SwitchRefused(ValueError):
    pass


def plan(from_role: str, to_role: str) -> tuple[str, ...]:
    try:
        return PLANS[(from_role, to_role)]
    except KeyError:
        raise SwitchRefused(f"no switch from {from_role!r} to {to_role!r}") from None


def rollback_role(from_role: str, failed_phase: str) -> str:
    """The role a cell is left in when ``failed_phase`` fails (always a safe one)."""
    if failed_phase == "refused":
        return from_role  # nothing was started
    if from_role == "inference":
        return "inference"  # every inference->training phase can be undone by resuming
    return "training" if failed_phase in ("leaving", "resuming") else "inference"


@dataclass
class SwitchRecord:
    cell: str
    from_role: str
    to_role: str
    timings: dict[str, float] = field(default_factory=dict)
    failed_phase: str | None = None
    reason: str | None = None
    unusable: bool = False  # a rollback step failed: the cell cannot do ``role_now`` until repaired

    @property
    def ok(self) -> bool:
        return self.failed_phase is None

    @property
    def role_now(self) -> str:
        return self.to_role if self.ok else rollback_role(self.from_role, self.failed_phase or "")

    @property
    def total_s(self) -> float:
        return sum(self.timings.values())
