"""Bytes for the blob store: token arrays (from the proxy) and packed trees (for the trainer).

Token arrays: token ids are int32 little-endian, logprobs float32 little-endian, no
header (the event carries the count). This must match what the proxy writes.

Packed tree (``GYRPK1``, ``GYRPK2``)::

    b"GYRPK1\\n" | uint32 LE header length | header JSON (sorted keys, no spaces) |
    token_ids i4 | position_ids i4 | parent_index i4 | loss_mask u1 |
    loss_weights f4 | behaviour_logprobs f4 | weight_versions i4        (all LE, n each)

    b"GYRPK2\\n" | the same | logprob_temperatures f4

``logprob_temperatures`` is the temperature each behaviour logprob was taken under (the
trainer divides its logits by it). A tree whose temperatures are all 1.0 is written as
``GYRPK1``, byte for byte what it was before the column existed (same digests; readers
that know only version 1 still read it); any other as ``GYRPK2``, which such a reader
refuses (bad magic) instead of training with untempered logprobs. A ``GYRPK1`` blob reads
with all temperatures 1.0.

The encoding is deterministic, so the digest of a packed tree is a function of its
content: rebuilding from the log gives the same digests.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from array import array

from .packing import BranchEnd, PackedTree, Segment

MAGIC = b"GYRPK1\n"  # all logprob temperatures 1.0: the column is left out
MAGIC_TEMPERED = b"GYRPK2\n"  # with the logprob_temperatures column
_COLUMNS = (
    ("token_ids", "i"),
    ("position_ids", "i"),
    ("parent_index", "i"),
    ("loss_mask", "B"),
    ("loss_weights", "f"),
    ("behaviour_logprobs", "f"),
    ("weight_versions", "i"),
)
_TEMPERATURE_COLUMN = ("logprob_temperatures", "f")


class CodecError(ValueError):
    """Bytes that are not what they claim to be."""


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _le(a: array) -> bytes:
    if sys.byteorder == "big" and a.itemsize > 1:
        a = array(a.typecode, a)
        a.byteswap()
    return a.tobytes()


def _from_le(code: str, data: bytes) -> array:
    a = array(code)
    if len(data) % a.itemsize:
        raise CodecError(f"{len(data)} bytes is not a whole number of {a.itemsize}-byte items")
    a.frombytes(data)
    if sys.byteorder == "big" and a.itemsize > 1:
        a.byteswap()
    return a


def encode_ids(ids) -> bytes:
    return _le(array("i", ids))


def decode_ids(data: bytes) -> array:
    return _from_le("i", data)


def encode_logprobs(logprobs) -> bytes:
    return _le(array("f", logprobs))


def decode_logprobs(data: bytes) -> array:
    return _from_le("f", data)


def encode_packed(p: PackedTree) -> bytes:
    header = {
        "rollout_id": p.rollout_id,
        "piece": p.piece,
        "n_pieces": p.n_pieces,
        "role": p.role,
        "n_tokens": p.n_tokens,
        "n_execution_trained_tokens": p.n_execution_trained_tokens,
        "oversize": p.oversize,
        "segments": [[s.offset, s.length, s.parent, s.depth, int(s.context)] for s in p.segments],
        "branches": [[b.call_id, b.role, b.last_token] for b in p.branches],
    }
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    tempered = p.tempered
    parts = [MAGIC_TEMPERED if tempered else MAGIC, struct.pack("<I", len(head)), head]
    for name, code in _COLUMNS + ((_TEMPERATURE_COLUMN,) if tempered else ()):
        value = getattr(p, name)
        parts.append(bytes(value) if code == "B" else _le(value))
    return b"".join(parts)


def decode_packed(data: bytes) -> PackedTree:
    """A packed tree from its bytes; :class:`CodecError` for anything else (truncated, a
    header of the wrong shape or types), never another exception."""
    try:
        return _decode_packed(data)
    except CodecError:
        raise
    except (struct.error, TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as exc:
        raise CodecError(f"not a readable packed tree: {type(exc).__name__}: {exc}") from None


def _decode_packed(data: bytes) -> PackedTree:
    if data.startswith(MAGIC):
        columns = _COLUMNS
    elif data.startswith(MAGIC_TEMPERED):
        columns = _COLUMNS + (_TEMPERATURE_COLUMN,)
    else:
        raise CodecError("not a packed tree (bad magic)")
    at = len(MAGIC)
    (n_head,) = struct.unpack_from("<I", data, at)
    at += 4
    header = json.loads(data[at : at + n_head])
    at += n_head
    if not isinstance(header, dict) or not isinstance(header.get("n_tokens"), int) or header["n_tokens"] < 0:
        raise CodecError("packed tree header is not an object with a whole n_tokens")
    n = header["n_tokens"]
    cols = {}
    for name, code in columns:
        size = n * array(code).itemsize
        chunk = data[at : at + size]
        if len(chunk) != size:
            raise CodecError(f"packed tree truncated in {name}")
        cols[name] = bytes(chunk) if code == "B" else _from_le(code, chunk)
        at += size
    if at != len(data):
        raise CodecError(f"{len(data) - at} trailing bytes after a packed tree")
    return PackedTree(
        rollout_id=header["rollout_id"], piece=header["piece"], n_pieces=header["n_pieces"],
        role=header["role"], segments=tuple(Segment(o, ln, par, d, bool(c))
                                            for o, ln, par, d, c in header["segments"]),
        branches=tuple(BranchEnd(cid, role, seg) for cid, role, seg in header["branches"]),
        n_execution_trained_tokens=header["n_execution_trained_tokens"],
        oversize=header["oversize"], **cols,
    )
