"""The event catalogue. Importing this package registers every event type.

One module per bounded context (runs, rollouts, calls, scores, trees, cells, training);
see DESIGN.md "Contracts between services" for owners.
"""

from . import calls, cells, rollouts, runs, scores, training, trees  # noqa: F401  (registers)
from .calls import CallRecorded, DriftClass, RequestRouted, SessionOpened, SessionRerouted
from .cells import (CellRegistered, CellRepaired, SwitchCompleted, SwitchFailed, SwitchPhaseEntered,
                    SwitchRequested, WaterLevelSampled)
from .envelope import Context, Event, new_event_id, subject_token
from .registry import EventDecodeError, decode, decode_dict, event_types, types_in, upcaster
from .rollouts import RolloutFinished, RolloutStarted, RolloutTimedOut
from .runs import HeldoutEvaluated, RunFinished, RunStarted, WarmStartCompleted
from .scores import RolloutScored, RolloutScoringFailed, TestOutcome
from .training import MicroStepClaimed, MicroStepDone, StepApplied, WeightsPublished, WeightsRetired
from .trees import ForkDetected, GroupQueued, MicroStepQueued, SamplesSelected, TreeSealed

__all__ = [
    "CallRecorded", "CellRegistered", "CellRepaired", "Context", "DriftClass", "Event", "EventDecodeError",
    "ForkDetected", "GroupQueued", "MicroStepClaimed", "MicroStepDone", "MicroStepQueued", "RequestRouted",
    "RolloutFinished", "RolloutScored", "RolloutScoringFailed", "RolloutStarted",
    "RolloutTimedOut", "HeldoutEvaluated", "RunFinished", "RunStarted", "WarmStartCompleted", "SamplesSelected", "SessionOpened",
    "SessionRerouted", "StepApplied", "SwitchCompleted", "SwitchFailed", "SwitchPhaseEntered", "SwitchRequested",
    "TestOutcome", "TreeSealed", "WaterLevelSampled", "WeightsPublished", "WeightsRetired", "decode",
    "decode_dict", "event_types", "new_event_id", "subject_token", "types_in", "upcaster",
]
