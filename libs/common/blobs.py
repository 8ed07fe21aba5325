"""Content-addressed blob stores (sha256 hex digests) and the token-array codec.

Token ids and logprobs never ride in events: a call's new input ids, output ids and
logprobs go here, and ``CallRecorded`` carries their digests. The default store is the
JetStream object store (chunked, replicated with the cluster); ``FileBlobStore`` and
``MemoryBlobStore`` serve tests and tools. All pass the same contract tests.
"""

from __future__ import annotations


import array
import hashlib
import io
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class BlobNotFound(KeyError):
    pass


class BlobCorrupt(ValueError):
    pass


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _check(digest: str, data: bytes) -> bytes:
    if digest_of(data) != digest:
        raise BlobCorrupt(f"blob {digest[:12]}… does not match its digest")
    return data


def _le(arr: array.array) -> array.array:
    if sys.byteorder != "little":
        arr.byteswap()
    return arr


def encode_tokens(ids: list[int]) -> bytes:
    """Token ids as little-endian int32."""
    return _le(array.array("i", ids)).tobytes()


def decode_tokens(data: bytes) -> list[int]:
    arr = array.array("i")
    arr.frombytes(data)
    return _le(arr).tolist()


def encode_logprobs(values: list[float]) -> bytes:
    """Logprobs as little-endian float32."""
    return _le(array.array("f", values)).tobytes()


def decode_logprobs(data: bytes) -> list[float]:
    arr = array.array("f")
    arr.frombytes(data)
    return _le(arr).tolist()


@dataclass
class MemoryBlobStore:
    blobs: dict[str, bytes] = field(default_factory=dict)

    async def put(self, data: bytes) -> str:
        d = digest_of(data)
        self.blobs.setdefault(d, bytes(data))
        return d

    async def get(self, digest: str) -> bytes:
        try:
            return _check(digest, self.blobs[digest])
        except KeyError:
            raise BlobNotFound(digest) from None

    async def has(self, digest: str) -> bool:
        return digest in self.blobs

    async def delete(self, digest: str) -> None:
        """Removes a blob (gone already is fine)."""
        self.blobs.pop(digest, None)


@dataclass
class FileBlobStore:
    """Blobs as files ``<root>/<d[:2]>/<d>``, written atomically (temp file + rename)."""

    root: Path

    def _path(self, digest: str) -> Path:
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise BlobNotFound(digest)
        return Path(self.root) / digest[:2] / digest

    async def put(self, data: bytes) -> str:
        d = digest_of(data)
        path = self._path(d)
        if path.exists():
            return d
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        return d

    async def get(self, digest: str) -> bytes:
        try:
            return _check(digest, self._path(digest).read_bytes())
        except FileNotFoundError:
            raise BlobNotFound(digest) from None

    async def has(self, digest: str) -> bool:
        return self._path(digest).exists()

    async def delete(self, digest: str) -> None:
        """Removes a blob (gone already is fine)."""
        try:
            self._path(digest).unlink()
        except (FileNotFoundError, BlobNotFound):
            pass


class ObjectStoreBlobStore:
    """Blobs on JetStream: small ones as single messages, large ones in the object store.

    A call's token arrays are small and many; the object store spends several round trips
    per object (a look-up, the chunks, the metadata). So a blob of at most
    ``SMALL_BYTES`` is one message on the ``GYRE_BLOBS_<bucket>`` stream, subject
    ``gyreblob.<bucket>.<digest>``, published with pipelined acks and de-duplicated by
    digest; read back with a direct get of the subject's last message. Larger blobs
    (workspace snapshots, checkpoints) go to the JetStream object store, chunked.
    """

    SMALL_BYTES = 512 * 1024

    def __init__(self, js: Any, obs: Any, bucket: str) -> None:
        self.js = js
        self.obs = obs
        self.bucket = bucket
        self.stream = f"GYRE_BLOBS_{bucket.upper().replace('-', '_')}"

    @classmethod
    async def open(cls, js: Any, bucket: str = "gyre-blobs", *, replicas: int = 1) -> "ObjectStoreBlobStore":
        from nats.js import api
        from nats.js.errors import BadRequestError, BucketNotFoundError, NotFoundError

        try:
            obs = await js.object_store(bucket)
        except (BucketNotFoundError, NotFoundError):
            obs = await js.create_object_store(
                bucket, config=api.ObjectStoreConfig(bucket=bucket, storage=api.StorageType.FILE, replicas=replicas)
            )
        store = cls(js, obs, bucket)
        cfg = api.StreamConfig(name=store.stream, subjects=[f"gyreblob.{bucket}.*"], storage=api.StorageType.FILE,
                               num_replicas=replicas, max_msg_size=cls.SMALL_BYTES + 4096, allow_direct=True,
                               max_msgs_per_subject=1, duplicate_window=120.0)
        try:
            await js.add_stream(cfg)
        except BadRequestError:
            await js.update_stream(cfg)
        return store

    def _subject(self, digest: str) -> str:
        return f"gyreblob.{self.bucket}.{digest}"

    async def put(self, data: bytes) -> str:
        d = digest_of(data)
        if len(data) <= self.SMALL_BYTES:
            fut = await self.js.publish_async(self._subject(d), data, headers={"Nats-Msg-Id": d})
            ack = await fut
            if getattr(ack, "duplicate", False) and await self._small(d) is None:
                await self.js.publish(self._subject(d), data)  # deleted since its first put: store again
        elif not await self.has(d):
            await self.obs.put(d, data)
        return d

    async def _small(self, digest: str) -> bytes | None:
        from nats.js.errors import NotFoundError

        try:
            msg = await self.js.get_last_msg(self.stream, self._subject(digest), direct=True)
        except NotFoundError:
            return None
        return msg.data or b""

    async def get(self, digest: str) -> bytes:
        from nats.js.errors import ObjectNotFoundError, NotFoundError

        small = await self._small(digest)
        if small is not None:
            return _check(digest, small)
        buf = io.BytesIO()  # nats-py appends chunks to one bytes object (quadratic) unless given a file
        try:
            await self.obs.get(digest, writeinto=buf)
        except (ObjectNotFoundError, NotFoundError):
            raise BlobNotFound(digest) from None
        return _check(digest, buf.getvalue())

    async def has(self, digest: str) -> bool:
        from nats.js.errors import ObjectNotFoundError, NotFoundError

        if await self._small(digest) is not None:
            return True
        try:
            info = await self.obs.get_info(digest)
        except (ObjectNotFoundError, NotFoundError):
            return False
        return not getattr(info, "deleted", False)

    async def delete(self, digest: str) -> None:
        """Removes a blob, a single message or an object (gone already is fine). Blobs are
        content-addressed: whoever deletes one must know nobody else still needs those bytes
        (the trainer core deletes the gradients of checkpointed steps)."""
        from nats.js.errors import NotFoundError, ObjectNotFoundError

        await self.js.purge_stream(self.stream, subject=self._subject(digest))
        try:
            await self.obs.delete(digest)
        except (ObjectNotFoundError, NotFoundError):
            pass
