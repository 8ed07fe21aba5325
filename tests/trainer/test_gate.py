"""The core's own worker under ``follow_role`` (real NATS): it claims only between its
cell's join and leave requests (the core cell's ``TrainerSeat``), leave is answered after
the work in hand, and a restarted trainer of a training cell claims again at once."""

from __future__ import annotations

import asyncio

import pytest

from libs.common.events import CellRegistered, SwitchCompleted
from services.cell.adapters import TrainerSeat
from services.trainer.gate import run_gated


class RecordingWorker:
    """Stands for MicroStepWorker (the gating is what is tested): runs until paused, and
    finishes a 'micro-step in hand' of ``hold_s`` before it returns."""

    def __init__(self, hold_s: float = 0.0) -> None:
        self.runs, self.running, self.hold_s = 0, False, hold_s

    async def run(self, stop) -> None:
        self.runs += 1
        self.running = True
        try:
            await stop.wait()
            await asyncio.sleep(self.hold_s)
        finally:
            self.running = False


async def test_the_core_worker_claims_only_between_join_and_leave(js_bus) -> None:
    worker, stop = RecordingWorker(hold_s=0.3), asyncio.Event()
    await js_bus.publish(CellRegistered(run_id="gate", cell="c0", role="inference", is_core=True, capacity=4))
    task = asyncio.create_task(run_gated(worker, js_bus, "gate", "c0", stop))
    seat = TrainerSeat(js_bus, "gate", "c0")
    await seat.join(0)  # retried until the trainer has subscribed
    assert worker.running
    await seat.leave()
    assert not worker.running and worker.runs == 1  # answered after the work in hand
    await seat.join(0)
    await seat.join(0)  # idempotent
    assert worker.runs == 2
    stop.set()
    await asyncio.wait_for(task, 10)
    assert not worker.running


async def test_a_restarted_core_of_a_training_cell_claims_at_once(js_bus) -> None:
    await js_bus.publish(CellRegistered(run_id="gate2", cell="c0", role="inference", is_core=True, capacity=4))
    await js_bus.publish(SwitchCompleted(run_id="gate2", cell="c0", role="training", weight_version=0))
    worker, stop = RecordingWorker(), asyncio.Event()
    task = asyncio.create_task(run_gated(worker, js_bus, "gate2", "c0", stop))
    for _ in range(200):
        if worker.running:
            break
        await asyncio.sleep(0.02)
    assert worker.running
    stop.set()
    await asyncio.wait_for(task, 10)


async def test_a_seat_without_its_trainer_fails_the_join_clearly(js_bus) -> None:
    seat = TrainerSeat(js_bus, "gate3", "c0", tries=2)  # the switch then rolls back to inference
    with pytest.raises(RuntimeError, match="no core trainer answers for cell c0"):
        await seat.join(0)


async def test_a_leave_sent_while_the_role_is_read_wins_over_the_log(js_bus, monkeypatch) -> None:
    """A restarting core agent asks the trainer to leave while the trainer, starting too,
    still reads 'training' from the log: the request is newer, so the worker does not claim."""
    import services.trainer.gate as gate

    left = asyncio.Event()

    async def stale_role(bus, run_id, cell):
        await left.wait()  # the read ends after the agent's leave was answered
        return "training"

    monkeypatch.setattr(gate, "last_role", stale_role)
    worker, stop = RecordingWorker(), asyncio.Event()
    task = asyncio.create_task(run_gated(worker, js_bus, "gate4", "c0", stop))
    await TrainerSeat(js_bus, "gate4", "c0").leave()
    left.set()
    await asyncio.sleep(0.2)
    assert worker.runs == 0
    stop.set()
    await asyncio.wait_for(task, 10)


async def _claims_within(worker, seconds: float) -> bool:
    for _ in range(int(seconds / 0.02)):
        if worker.running:
            return True
        await asyncio.sleep(0.02)
    return worker.running


async def test_a_trainer_restarted_after_the_leave_answer_does_not_claim(js_bus) -> None:
    """The cell trained; the agent's leave was answered (phase ``leaving``, then
    ``resuming``) and the trainer restarted before ``SwitchCompleted(inference)``: the
    cell serves again, so the restarted trainer must not claim."""
    from libs.common.events import SwitchPhaseEntered

    await js_bus.publish(CellRegistered(run_id="gate5", cell="c0", role="inference", is_core=True, capacity=4))
    await js_bus.publish(SwitchCompleted(run_id="gate5", cell="c0", role="training", weight_version=0))
    for phase in ("leaving", "resuming"):
        await js_bus.publish(SwitchPhaseEntered(run_id="gate5", cell="c0", phase=phase))
    from services.trainer.gate import last_role

    assert await last_role(js_bus, "gate5", "c0") == "inference"
    worker, stop = RecordingWorker(), asyncio.Event()
    task = asyncio.create_task(run_gated(worker, js_bus, "gate5", "c0", stop))
    assert not await _claims_within(worker, 0.5)
    stop.set()
    await asyncio.wait_for(task, 10)


async def test_a_trainer_restarted_while_its_cell_joins_claims(js_bus) -> None:
    """The cell is on its way to training and in ``joining`` (its seat's join may have been
    answered before the restart): the restarted trainer claims, as the cell expects."""
    from libs.common.events import SwitchPhaseEntered
    from services.trainer.gate import last_role

    await js_bus.publish(CellRegistered(run_id="gate6", cell="c0", role="inference", is_core=True, capacity=4))
    for phase in ("draining", "migrating", "releasing"):
        await js_bus.publish(SwitchPhaseEntered(run_id="gate6", cell="c0", phase=phase))
        assert await last_role(js_bus, "gate6", "c0") == "inference"  # not joined yet
    await js_bus.publish(SwitchPhaseEntered(run_id="gate6", cell="c1", phase="leaving"))  # another cell's
    await js_bus.publish(SwitchPhaseEntered(run_id="gate6", cell="c0", phase="joining"))
    assert await last_role(js_bus, "gate6", "c0") == "training"
    worker, stop = RecordingWorker(), asyncio.Event()
    task = asyncio.create_task(run_gated(worker, js_bus, "gate6", "c0", stop))
    assert await _claims_within(worker, 4.0)
    stop.set()
    await asyncio.wait_for(task, 10)
