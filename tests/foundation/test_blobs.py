"""One contract for the blob store port: JetStream object store, files, memory."""

from __future__ import annotations

import asyncio

import os
from collections.abc import AsyncIterator

import pytest

from libs.common.blobs import (
    BlobCorrupt, BlobNotFound, FileBlobStore, MemoryBlobStore, ObjectStoreBlobStore, decode_logprobs,
    decode_tokens, digest_of, encode_logprobs, encode_tokens,
)


@pytest.fixture(params=["objectstore", "file", "memory"])
async def store(request: pytest.FixtureRequest, tmp_path) -> AsyncIterator[object]:
    if request.param == "memory":
        yield MemoryBlobStore()
    elif request.param == "file":
        yield FileBlobStore(tmp_path / "blobs")
    else:
        from libs.common.bus.jetstream import JetStreamBus
        from libs.common.natsserver import EmbeddedNats

        with EmbeddedNats(tmp_path / "nats") as server:
            bus = await JetStreamBus.connect(server.url)
            yield await ObjectStoreBlobStore.open(bus.js, "test-blobs")
            await bus.close()


async def test_put_get_has_by_content_digest(store) -> None:
    data = b"hello tokens"
    d = await store.put(data)
    assert d == digest_of(data) and len(d) == 64
    assert await store.has(d)
    assert await store.get(d) == data
    assert await store.put(data) == d  # idempotent


async def test_large_blob_round_trips_in_chunks(store) -> None:
    data = os.urandom(3 * 1024 * 1024 + 17)  # large: several object-store chunks
    d = await store.put(data)
    assert await store.get(d) == data


async def test_checkpoint_sized_blob_round_trips(store) -> None:
    # a tiny-qwen checkpoint is ~80 MB: nats-py's own get appends chunk by chunk (quadratic;
    # it took minutes at that size), so the store reads chunks into a buffer instead
    data = os.urandom(48 * 1024 * 1024)
    d = await store.put(data)
    assert await asyncio.wait_for(store.get(d), 120) == data


async def test_missing_blob_is_a_clear_error(store) -> None:
    missing = "0" * 64
    assert not await store.has(missing)
    with pytest.raises(BlobNotFound):
        await store.get(missing)


async def test_file_store_detects_corruption(tmp_path) -> None:
    store = FileBlobStore(tmp_path)
    d = await store.put(b"abc")
    (tmp_path / d[:2] / d).write_bytes(b"abd")
    with pytest.raises(BlobCorrupt):
        await store.get(d)


def test_token_and_logprob_codecs() -> None:
    ids = [0, 1, 151643, 151645, 2**31 - 1]
    assert decode_tokens(encode_tokens(ids)) == ids
    assert len(encode_tokens(ids)) == 4 * len(ids)
    lps = [-0.5, -1e-6, -20.25]
    assert decode_logprobs(encode_logprobs(lps)) == pytest.approx(lps, rel=1e-6)


async def test_a_deleted_blob_is_gone_and_deleting_again_is_fine(store) -> None:
    small, large = b"small gradient", bytes(range(256)) * 4096  # 1 MiB: the object store's side
    digests = [await store.put(small), await store.put(large)]
    for d in digests:
        await store.delete(d)
        assert not await store.has(d)
        with pytest.raises(BlobNotFound):
            await store.get(d)
        await store.delete(d)  # gone already
    assert await store.put(small) == digests[0] and await store.get(digests[0]) == small  # stored again
