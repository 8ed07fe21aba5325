"""A workspace too large to archive is the agent's doing, not a lost snapshot: the runner
stores a stand-in whose PAX global header says why, so the evaluator scores the rollout 0
instead of failing its scoring (which would drop it from training). A blob store that
refuses even the stand-in still leaves the rollout without a snapshot."""

from __future__ import annotations

import gzip
import io
import tarfile

from libs.common.blobs import MemoryBlobStore
from libs.common.bus.memory import InMemoryBus
from libs.common.events import Context, RolloutFinished
from services.runner.harness import HarnessConfig
from services.runner.runner import SNAPSHOT_REFUSED_HEADER, RolloutRunner, RunnerConfig, refused_snapshot
from services.runner.tasks import Task

SPARSE = HarnessConfig("sh", ("/bin/sh", "-c", "echo hi > a.txt && truncate -s 300M junk.bin"))


class DeadBlobs(MemoryBlobStore):
    async def put(self, data: bytes) -> str:
        raise ConnectionError("object store down")


async def _run(tmp_path, blobs) -> tuple:
    bus = InMemoryBus()
    config = RunnerConfig("r", "http://proxy:1", tmp_path / "work", harness=SPARSE, snapshot_max_bytes=2**20,
                          io_attempts=2, io_backoff_s=0.0)
    [o] = await RolloutRunner(config, bus=bus, blobs=blobs).run_step(0, [Task("demo", "hi\n", time_limit_s=10)], 1)
    [ended] = [d.event async for d in bus.read(Context.ROLLOUTS) if isinstance(d.event, RolloutFinished)]
    return o, ended


async def test_a_sparse_file_over_the_cap_gets_a_stand_in_that_says_why(tmp_path) -> None:
    blobs = MemoryBlobStore()
    o, ended = await _run(tmp_path, blobs)
    assert ended.snapshot_digest == o.snapshot_digest is not None
    with tarfile.open(fileobj=io.BytesIO(await blobs.get(ended.snapshot_digest))) as tar:
        why = tar.pax_headers[SNAPSHOT_REFUSED_HEADER]
        assert [m.name for m in tar.getmembers()] == [".gyre_snapshot_refused.txt"]  # no file of the workspace
    assert "more than 1048576 bytes of files (the runner's snapshot_max_bytes)" in why
    assert "workspace not archived" in o.log_tail


async def test_a_blob_store_that_refuses_the_stand_in_leaves_no_snapshot(tmp_path) -> None:
    o, ended = await _run(tmp_path, DeadBlobs())
    assert o.snapshot_digest is None and ended.snapshot_digest is None
    assert "no workspace snapshot: the blob store refused it 2 times" in o.log_tail


def test_the_stand_in_is_reproducible_and_names_the_header_the_evaluator_reads() -> None:
    from services.evaluator.adapters.snapshot import REFUSED_HEADER

    assert SNAPSHOT_REFUSED_HEADER == REFUSED_HEADER
    assert refused_snapshot("x") == refused_snapshot("x")
    assert gzip.decompress(refused_snapshot("x"))  # a .tar.gz like every snapshot
