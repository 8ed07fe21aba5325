"""The temperature each behaviour logprob was taken under travels with it: CallRecorded ->
call record -> tree (per position, owned like the logprob) -> packed tree -> blob -> the
trainer's batch. Old events and old blobs read as 1.0."""

from __future__ import annotations

import json
import struct
from array import array

import pytest

from libs.common.events import CallRecorded, decode_dict
from services.trajectory.codec import MAGIC, MAGIC_TEMPERED, CodecError, decode_packed, encode_packed
from services.trajectory.ledger import call_from_event
from services.trajectory.packing import pack_branches
from services.trajectory.rollout_tree import RolloutTree
from services.trajectory.sampling import Branch

from ._calls import SYSTEM, TASK, build, call

D = "d" * 64


def _event(**extra) -> dict:
    return dict(run_id="run", call_id="c1", rollout_id="r1", session_id="s", api="openai_chat",
                new_input_digest=D, n_new_input_tokens=1, output_digest=D, logprobs_digest=D, n_output_tokens=1,
                **extra)


def test_the_event_field_and_a_version_1_event():
    ev = CallRecorded(**_event(logprob_temperature=0.7))
    assert decode_dict(json.loads(ev.to_json())).logprob_temperature == 0.7
    old = decode_dict({"type": "CallRecorded", "schema_version": 1, **_event()})
    assert old.logprob_temperature is None
    assert call_from_event(old, [1], [2], [-0.1]).logprob_temperature == 1.0
    assert call_from_event(ev, [1], [2], [-0.1]).logprob_temperature == pytest.approx(0.7)
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError):
            CallRecorded(**_event(logprob_temperature=bad))


def _calls():
    """a at 0.7; b continues it at 1.0; c retries a's input at 1.3 and re-generates a's
    first word (owned by a, the first delivered writer); u is undelivered and writes a
    new word first, which d (delivered) then takes over."""
    prompt = SYSTEM + TASK
    return [
        call("a", prompt, [20, 21, 2], logprob_temperature=0.7),
        call("b", [3, 90, 2], [22, 2], parent="a", prefix=len(prompt) + 3, logprob_temperature=1.0),
        call("c", [], [20, 30, 2], parent="a", prefix=len(prompt), logprob_temperature=1.3),
        call("u", [], [40, 41], parent="a", prefix=len(prompt), delivered=False, logprob_temperature=0.5),
        call("d", [], [40, 42], parent="a", prefix=len(prompt), logprob_temperature=0.9),
    ]


def _temps_by_call(tree, call_id):
    c = tree.index[call_id]
    seq = tree.sequence(c)
    temps = tree._gather(tree.temperatures, c)
    gen = tree._gather(tree.generated, c)
    return [(t, round(x, 3)) for t, x, g in zip(seq, temps, gen) if g]


def test_the_tree_keeps_each_positions_temperature_with_its_logprob():
    tree = build(_calls())
    assert _temps_by_call(tree, "a") == [(20, 0.7), (21, 0.7), (2, 0.7)]
    assert _temps_by_call(tree, "b") == [(20, 0.7), (21, 0.7), (2, 0.7), (22, 1.0), (2, 1.0)]
    assert _temps_by_call(tree, "c") == [(20, 0.7), (30, 1.3), (2, 1.3)]  # 20 stays a's
    assert _temps_by_call(tree, "d") == [(40, 0.9), (42, 0.9)]  # 40: the delivered call took it over
    assert all(t == 1.0 for t, g in zip(tree.temperatures, tree.generated) if not g)
    assert tree.tempered


def test_the_tree_digest_counts_temperatures_only_when_some_are_not_1():
    tempered = build(_calls())
    plain_calls = [call(c.call_id, c.new_input_ids, c.output_ids, parent=c.parent_call_id, prefix=c.prefix_len,
                        delivered=c.delivered) for c in _calls()]
    ones = [call(c.call_id, c.new_input_ids, c.output_ids, parent=c.parent_call_id, prefix=c.prefix_len,
                 delivered=c.delivered, logprob_temperature=1.0) for c in _calls()]
    assert build(plain_calls).digest() == build(ones).digest() != tempered.digest()
    assert not build(ones).tempered


def test_a_call_with_a_bad_temperature_is_context_only():
    t = RolloutTree("r1")
    assert t.add(call("a", SYSTEM, [20], logprob_temperature=0.0)).outcome == "applied"
    assert [u.call_id for u in t.untrained] == ["a"] and "temperature 0.0" in t.untrained[0].reason
    assert not any(t.tree.generated) and set(t.tree.temperatures) == {1.0}


def _pack(calls, *ends):
    tree = build(calls)
    selected = [Branch(tree.call_end(tree.index[cid]), tree.index[cid], cid, "r1", "main",
                       tree.call_length(tree.index[cid]), True) for cid in ends]
    (packed,) = pack_branches(tree, selected)
    return packed


def test_temperatures_survive_packing_the_blob_and_the_trainers_batch():
    torch = pytest.importorskip("torch")
    from services.trainer.batch import tree_batch, validate_sample

    packed = _pack(_calls(), "b", "c", "d")
    trained = [(tok, round(x, 3)) for tok, x, m in zip(packed.token_ids, packed.logprob_temperatures,
                                                       packed.loss_mask) if m]
    assert sorted(trained) == sorted([(20, 0.7), (21, 0.7), (2, 0.7), (22, 1.0), (2, 1.0), (30, 1.3), (2, 1.3),
                                      (40, 0.9), (42, 0.9)])
    data = encode_packed(packed)
    assert data.startswith(MAGIC_TEMPERED)
    back = decode_packed(data)
    assert back.logprob_temperatures == packed.logprob_temperatures
    assert encode_packed(back) == data
    validate_sample(back, 1.0)
    batch = tree_batch([(back, 1.0)])
    assert [round(x, 3) for x in batch.target_temperatures.tolist()] == [x for _, x in trained]
    assert batch.target_temperatures.dtype == torch.float32


def test_an_untempered_tree_is_written_in_the_version_1_format():
    plain = [call(c.call_id, c.new_input_ids, c.output_ids, parent=c.parent_call_id, prefix=c.prefix_len,
                  delivered=c.delivered) for c in _calls()]
    packed = _pack(plain, "b", "c", "d")
    data = encode_packed(packed)
    assert data.startswith(MAGIC)
    (n_head,) = struct.unpack_from("<I", data, len(MAGIC))
    # the seven version 1 columns, nothing more: the digest is what it was before the column
    assert len(data) == len(MAGIC) + 4 + n_head + packed.n_tokens * (4 * 6 + 1)
    back = decode_packed(data)
    assert back.logprob_temperatures == array("f", [1.0]) * packed.n_tokens


def test_an_old_blob_without_the_column_reads_as_all_1():
    """A version 1 writer's bytes (the tempered tree's columns without the new one)."""
    packed = _pack(_calls(), "b", "c", "d")
    data = encode_packed(packed)
    old = MAGIC + data[len(MAGIC): len(data) - 4 * packed.n_tokens]
    back = decode_packed(old)
    assert back.behaviour_logprobs == packed.behaviour_logprobs
    assert back.logprob_temperatures == array("f", [1.0]) * packed.n_tokens
    with pytest.raises(CodecError, match="trailing"):
        decode_packed(MAGIC + data[len(MAGIC):])  # version 1 magic on version 2 columns
    with pytest.raises(CodecError, match="truncated"):
        decode_packed(MAGIC_TEMPERED + old[len(MAGIC):])
