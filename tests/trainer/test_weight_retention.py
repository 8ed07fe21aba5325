"""Weight blobs kept per version (``keep_weights``): the core deletes the blobs of all but
the newest published versions, never the newest ``WeightsPublished``'s nor the one before
it, never bytes a kept version shares, and a restarted core finishes what the log names."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch

from libs.common.blobs import MemoryBlobStore
from libs.common.events import Context, GroupQueued, WeightsPublished, WeightsRetired
from services.trainer.backends.torch_hf import TorchBackend
from services.trainer.core import DEFAULT_KEEP_WEIGHTS, CoreSettings, CoreTrainer
from services.trainer.main import ENV, keep_weights
from services.trainer.publish import EnginePublisher
from services.trainer.transfer import BlobTransfer
from services.trainer.worker import BusWeightSource

from .conftest import TINY
from .test_streaming import CONFIG, RUN, _cells, _events, _queue, _steps, _wait_version


async def _train(bus, blobs, tmp_path, *, keep, steps=2):
    core, workers = _cells(bus, blobs, tmp_path, n_satellites=0)
    core.settings = replace(core.settings, keep_weights=keep)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(core.run(stop))] + [asyncio.create_task(w.run(stop)) for w in workers]
    for step, samples in enumerate(_steps()[:steps]):
        await _queue(bus, blobs, step, samples)
    await _wait_version(core, steps)
    stop.set()
    await asyncio.gather(*tasks)
    return core


async def _held(bus, blobs) -> dict[int, bool]:
    """Published version -> whether its weights blob is still in the store."""
    return {e.weight_version: await blobs.has(e.checkpoint_digest)
            for e in await _events(bus, Context.TRAINING, WeightsPublished) if e.run_id == RUN}


async def test_only_the_newest_published_versions_keep_their_weight_blobs(js_bus, tmp_path):
    blobs = MemoryBlobStore()
    await _train(js_bus, blobs, tmp_path, keep=2)
    assert await _held(js_bus, blobs) == {0: False, 1: True, 2: True}
    # the log says which blob went, before it went
    v0 = next(e for e in await _events(js_bus, Context.TRAINING, WeightsPublished) if e.weight_version == 0)
    (retired,) = await _events(js_bus, Context.TRAINING, WeightsRetired)
    assert (retired.weight_versions, retired.digests, retired.kept_from) == ([0], [v0.checkpoint_digest], 1)
    # what a cell resuming or joining pulls is there
    weights = await BusWeightSource(js_bus, blobs, RUN).fetch(2)
    assert weights and all(isinstance(t, torch.Tensor) for t in weights.values())


async def test_a_restarted_core_deletes_what_an_earlier_run_left(js_bus, tmp_path):
    """Trained keeping every version, then restarted with keep_weights=2: the restart reads
    the older versions from the log and deletes their blobs."""
    blobs = MemoryBlobStore()
    await _train(js_bus, blobs, tmp_path, keep=None)
    assert await _held(js_bus, blobs) == {0: True, 1: True, 2: True}
    again, _ = _cells(js_bus, blobs, tmp_path, n_satellites=0)
    again.settings = replace(again.settings, keep_weights=2)
    await again.start()  # resumes at v2 and publishes it again
    assert again.state.weight_version == 2
    assert await _held(js_bus, blobs) == {0: False, 1: True, 2: True}


async def test_another_run_from_the_same_weights_keeps_its_blob(js_bus, tmp_path):
    """Runs share a blob bucket (content-addressed): another run started from the same model
    publishes the same weights, yet this run's deletions never take that run's blob."""
    blobs = MemoryBlobStore()
    other = CoreTrainer(CoreSettings("other-run", train=CONFIG, checkpoint_dir=tmp_path / "other"),
                        TorchBackend.tiny(TINY), bus=js_bus, blobs=blobs, gradients=BlobTransfer(blobs))
    await other.start()  # its v0: the same weights this run starts from
    (theirs,) = await _events(js_bus, Context.TRAINING, WeightsPublished)
    await _train(js_bus, blobs, tmp_path, keep=2)
    assert await _held(js_bus, blobs) == {0: False, 1: True, 2: True}
    assert await blobs.has(theirs.checkpoint_digest)
    assert await BusWeightSource(js_bus, blobs, "other-run").fetch(0)


async def test_a_blob_that_kept_versions_share_is_never_deleted(js_bus, tmp_path):
    """Steps with nothing to train republish the same weights: one blob, several versions."""
    blobs = MemoryBlobStore()
    core, _ = _cells(js_bus, blobs, tmp_path, n_satellites=0)
    core.settings = replace(core.settings, groups_per_step=1, keep_weights=2)
    stop = asyncio.Event()
    task = asyncio.create_task(core.run(stop))
    await js_bus.publish_many([GroupQueued(run_id=RUN, step=s, group_id=f"empty{s}", micro_steps=0)
                               for s in range(4)])
    await _wait_version(core, 4)
    stop.set()
    await task
    published = await _events(js_bus, Context.TRAINING, WeightsPublished)
    assert [e.weight_version for e in published] == [0, 1, 2, 3, 4]
    assert len({e.checkpoint_digest for e in published}) == 1
    assert await blobs.has(published[-1].checkpoint_digest)
    assert await _events(js_bus, Context.TRAINING, WeightsRetired) == []  # nothing deleted, nothing retired


def test_keep_weights_option_default_all_and_floor():
    assert ENV["keep_weights"] == "GYRE_TRAINER_KEEP_WEIGHTS"
    assert keep_weights({}) == DEFAULT_KEEP_WEIGHTS == CoreSettings(RUN).keep_weights >= 2
    assert keep_weights({"keep_weights": "5"}) == 5
    assert keep_weights({"keep_weights": "all"}) is None and keep_weights({"keep_weights": 0}) is None
    for bad in ("1", "-3", "many"):
        with pytest.raises(ValueError, match="keep_weights"):
            keep_weights({"keep_weights": bad})
    with pytest.raises(ValueError, match="at least 2"):
        CoreSettings(RUN, keep_weights=1)


async def test_disk_publication_keeps_the_newest_version_folders(tmp_path):
    config = tmp_path / "config.json"
    config.write_text("{}\n")
    publisher = EnginePublisher({}, mode="disk", folder=tmp_path / "published", hf_config=config, keep=2)
    for version in range(4):
        assert await publisher(version, {"w": torch.full((2,), float(version))}) == []
    assert sorted(p.name for p in (tmp_path / "published").iterdir()) == ["v000002", "v000003"]


async def test_blobs_are_kept_while_their_retirement_cannot_be_recorded(js_bus, tmp_path):
    """No ``WeightsRetired`` in the log, no delete: a failed publish keeps the blobs, and
    the next publish retires them."""
    blobs = MemoryBlobStore()
    core = await _train(js_bus, blobs, tmp_path, keep=None)
    assert await _held(js_bus, blobs) == {0: True, 1: True, 2: True}
    core.settings = replace(core.settings, keep_weights=2)
    real = core.bus.publish

    async def refuse(event, *a, **kw):
        if isinstance(event, WeightsRetired):
            raise ConnectionError("the bus is down")
        return await real(event, *a, **kw)

    core.bus.publish = refuse
    try:
        core._weight_blobs = await core._published_weight_blobs()
        (v2,) = [e for e in await _events(js_bus, Context.TRAINING, WeightsPublished) if e.weight_version == 2]
        await core._delete_old_weights(2, v2.checkpoint_digest)
        assert await _held(js_bus, blobs) == {0: True, 1: True, 2: True}
    finally:
        core.bus.publish = real
    await core._delete_old_weights(2, v2.checkpoint_digest)
    assert await _held(js_bus, blobs) == {0: False, 1: True, 2: True}
    (retired,) = await _events(js_bus, Context.TRAINING, WeightsRetired)
    assert retired.weight_versions == [0] and retired.kept_from == 1
