"""The scheduler's pure core: cell lifecycle, state, ``evolve`` and the policies.

No NATS, HTTP, SQL or torch here: the same code runs in the live scheduler, in replay
and in the cluster simulator (``services.scheduler.sim``). Start with ``lifecycle`` (the
phases, with a worked example), then ``state.evolve`` and ``policy.decide``.
"""

from .baselines import AsyncPolicy, ColocatePolicy
from .elastic import ElasticPolicy
from .facts import (
    CellAdded,
    CellRepaired,
    Fact,
    PhaseReached,
    Pressure,
    SwitchAborted,
    SwitchFinished,
    SwitchStarted,
    Tick,
    WaterLevelObserved,
)
from .lifecycle import CellPhase, IllegalTransition, Role
from .policy import Policy, decide, water_level
from .state import Cell, SchedulerState, evolve, evolve_all

__all__ = [
    "AsyncPolicy", "Cell", "CellAdded", "CellPhase", "CellRepaired", "ColocatePolicy", "ElasticPolicy", "Fact",
    "IllegalTransition", "PhaseReached", "Policy", "Pressure", "Role", "SchedulerState",
    "SwitchAborted", "SwitchFinished", "SwitchStarted", "Tick", "WaterLevelObserved", "decide",
    "evolve", "evolve_all", "water_level",
]
