"""The core's own worker follows its cell's role when ``follow_role`` is on (real NATS)."""

from __future__ import annotations

import asyncio

from libs.common.events import CellRegistered, SwitchCompleted, SwitchFailed
from services.trainer.gate import CellRole, run_gated


class RecordingWorker:
    """Stands for MicroStepWorker: records when it runs and stops (the gating is what is tested)."""

    def __init__(self) -> None:
        self.runs = 0
        self.running = False

    async def run(self, stop) -> None:
        self.runs += 1
        self.running = True
        try:
            await stop.wait()
        finally:
            self.running = False


async def _until(cond, timeout=10.0):
    for _ in range(int(timeout / 0.02)):
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


async def test_the_core_worker_claims_only_while_its_cell_trains(js_bus) -> None:
    worker, stop = RecordingWorker(), asyncio.Event()
    role = CellRole("gate", "c0")
    task = asyncio.create_task(run_gated(worker, role, js_bus, stop))
    await js_bus.publish(CellRegistered(run_id="gate", cell="c0", role="inference", is_core=True, capacity=4))
    await _until(lambda: role.role == "inference")
    await asyncio.sleep(0.2)
    assert worker.runs == 0
    await js_bus.publish(SwitchCompleted(run_id="gate", cell="c1", role="training", weight_version=0))  # not ours
    await js_bus.publish(SwitchCompleted(run_id="gate", cell="c0", role="training", weight_version=0))
    await _until(lambda: worker.running)
    await js_bus.publish(SwitchCompleted(run_id="gate", cell="c0", role="inference", weight_version=1))
    await _until(lambda: not worker.running)
    await js_bus.publish(SwitchFailed(run_id="gate", cell="c0", role="training", phase="resuming", reason="oom"))
    await _until(lambda: worker.running and worker.runs == 2)  # rolled back to training: claims again
    stop.set()
    await asyncio.wait_for(task, 10)
    assert not worker.running
