"""Blob encodings (packed trees, token arrays) and group advantages."""

from __future__ import annotations

import math

import pytest

from libs.common.blobs import encode_logprobs as lead_encode_logprobs
from libs.common.blobs import encode_tokens as lead_encode_tokens
from services.trajectory.advantages import AdvantageConfig, group_advantages
from services.trajectory.codec import (CodecError, decode_ids, decode_logprobs, decode_packed,
                                       encode_ids, encode_packed, sha256_hex)
from services.trajectory.forks import HARNESS_RULES, classify_calls
from services.trajectory.packing import PackingConfig, pack_branches
from services.trajectory.sampling import list_branches, select_branches

from ._calls import build, random_calls


def _pieces(seed: int, budget=None):
    tree = build(random_calls(seed, n_calls=25))
    chosen = select_branches(list_branches(tree, classify_calls(tree, HARNESS_RULES["claude_code"])))
    return pack_branches(tree, chosen, PackingConfig(max_piece_tokens=budget))


@pytest.mark.parametrize("seed", range(8))
def test_packed_trees_round_trip_byte_for_byte(seed):
    for p in _pieces(seed, budget=12):
        data = encode_packed(p)
        back = decode_packed(data)
        assert encode_packed(back) == data
        for name in ("token_ids", "position_ids", "parent_index", "loss_weights",
                     "behaviour_logprobs", "weight_versions"):
            assert list(getattr(back, name)) == list(getattr(p, name))
        assert back.loss_mask == p.loss_mask
        assert back.segments == p.segments and back.branches == p.branches
        assert (back.role, back.piece, back.n_pieces, back.oversize) == (p.role, p.piece, p.n_pieces, p.oversize)


def test_same_content_same_digest():
    a = [sha256_hex(encode_packed(p)) for p in _pieces(3)]
    b = [sha256_hex(encode_packed(p)) for p in _pieces(3)]
    assert a == b


def test_broken_packed_bytes_are_refused():
    data = encode_packed(_pieces(1)[0])
    with pytest.raises(CodecError, match="magic"):
        decode_packed(b"XXXX" + data)
    with pytest.raises(CodecError, match="truncated"):
        decode_packed(data[:-3])
    with pytest.raises(CodecError, match="trailing"):
        decode_packed(data + b"\0")
    # whatever the bytes, a CodecError (the trainer rejects the sample with its reason), never another error
    import json
    import struct

    from services.trajectory.codec import MAGIC

    (n,) = struct.unpack_from("<I", data, len(MAGIC))
    head = json.loads(data[len(MAGIC) + 4: len(MAGIC) + 4 + n])

    def patched(**fields) -> bytes:
        h = json.dumps({**head, **fields}, sort_keys=True, separators=(",", ":")).encode()
        return MAGIC + struct.pack("<I", len(h)) + h + data[len(MAGIC) + 4 + n:]

    for bad in (MAGIC + b"\x01", MAGIC + struct.pack("<I", 2) + b"[]", MAGIC + struct.pack("<I", 2) + b"\xff\xfe",
                patched(n_tokens="10"), patched(n_tokens=-1), patched(segments=3), patched(branches=[[1]]),
                patched(segments=[["x"]])):
        with pytest.raises(CodecError):
            decode_packed(bad)


def test_token_arrays_match_the_foundations_codec():
    ids = [0, 1, 151643, 2**31 - 1]
    assert encode_ids(ids) == lead_encode_tokens(ids)
    assert list(decode_ids(lead_encode_tokens(ids))) == ids
    lps = [-0.5, -1.25, 0.0]
    assert list(decode_logprobs(lead_encode_logprobs(lps))) == lps
    with pytest.raises(CodecError):
        decode_ids(b"\0\0\0")


def test_group_advantages_are_centred_and_scaled():
    adv = group_advantages({"r1": 1.0, "r2": 0.0, "r3": 0.5, "r4": 0.5})
    assert sum(adv.values()) == pytest.approx(0.0, abs=1e-9)
    std = math.sqrt(sum(v * v for v in adv.values()) / 4)
    assert std == pytest.approx(1.0, rel=1e-4)
    assert adv["r1"] > adv["r3"] > adv["r2"]
    plain = group_advantages({"r1": 1.0, "r2": 0.0}, AdvantageConfig(scale="none"))
    assert plain == {"r1": 0.5, "r2": -0.5}


def test_a_group_with_equal_scores_teaches_nothing():
    assert group_advantages({"r1": 0.3, "r2": 0.3}) == {"r1": 0.0, "r2": 0.0}
    assert group_advantages({}) == {}
