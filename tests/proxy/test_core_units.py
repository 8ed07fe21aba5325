"""Pure core units of the proxy: doctests (worked examples), message canonical forms,
tool-output parsing, incremental decoding, routing."""

from __future__ import annotations

import doctest

import pytest

from services.proxy.core import hints, messages, routing
from services.proxy.core.decode import IncrementalDecoder
from services.proxy.core.messages import Msg, ToolCall, chain_hashes
from services.proxy.core.routing import NoCellAvailable, Router
from services.proxy.core.toolparse import StreamParser, parse_output


@pytest.mark.parametrize("module", [messages, routing, hints])
def test_worked_examples(module) -> None:
    assert doctest.testmod(module).failed == 0


def test_canonical_form_ignores_ids_whitespace_and_argument_order() -> None:
    a = Msg("assistant", " hi ", (ToolCall("call_1", "ls", {"a": 1, "b": [2]}),))
    b = Msg("assistant", "hi", (ToolCall("toolu_9", "ls", '{"b": [2], "a": 1}'),))
    assert a.canonical() == b.canonical()
    assert Msg("user", "hi").canonical() != Msg("assistant", "hi").canonical()
    assert chain_hashes([a], "t1")[1] == chain_hashes([b], "t1")[1]
    assert chain_hashes([a], "t1")[1] != chain_hashes([a], "t2")[1]  # tools start the chain


def test_tool_output_parsing() -> None:
    p = parse_output('<think>plan</think>\nSure.<tool_call>\n{"name": "ls", "arguments": {"p": "."}}\n</tool_call>'
                     '<|im_end|>', ("<|im_end|>",))
    assert (p.reasoning, p.content, [c.name for c in p.tool_calls]) == ("plan", "Sure.", ["ls"])
    bad = parse_output("x <tool_call>{oops</tool_call>", ())
    assert bad.tool_calls == [] and "<tool_call>{oops</tool_call>" in bad.content  # nothing the model wrote is lost
    cut = parse_output('<tool_call>\n{"name": "ls", "arguments": {}}', ())  # generation ended inside the call
    assert [c.name for c in cut.tool_calls] == ["ls"]


def test_stream_parser_holds_back_partial_tags() -> None:
    p = StreamParser(("<|im_end|>",))
    out = "".join(p.feed(ch)[0] for ch in "Hello <tool") + p.feed('_call>{"name":"x","arguments":{}}</tool_call>')[0]
    assert out == "Hello" == p.content  # the space before the call: held, then dropped with the call at the end
    assert p.finish() == ("", "") and [c.name for c in p.tool_calls] == ["x"]


def test_incremental_decoder_matches_full_decode(renderer) -> None:
    text = "déjà vu 🙂 数据 " * 20
    ids = renderer.tokenizer.encode(text, add_special_tokens=False)
    dec = IncrementalDecoder(renderer.decode)
    assert "".join(dec.push([i]) for i in ids) == renderer.decode(ids)


def test_router_affinity_load_drain_down() -> None:
    r = Router()
    r.add_cell("a", 1)
    r.add_cell("b", 4)
    assert r.pick("s1") == "a"
    r.begin("a")
    assert r.pick("s2") == "b"
    r.mark_down("a")
    assert r.pick("s1") == "b"  # its cell is down: moved
    r.drain("b")
    with pytest.raises(NoCellAvailable):
        r.pick("s3")
    with pytest.raises(NoCellAvailable):
        r.move_session("s1", "a")
    r.activate("a")
    assert r.move_session("s1", "a") == "b"


def test_matching_tokenizes_only_new_messages_even_at_long_contexts(renderer) -> None:
    from services.proxy.core.tito import Tito
    from services.proxy.core.toolparse import parse_output as parse

    tito = Tito(renderer, stop_texts=renderer.stop_texts)
    msgs = [Msg("system", "sys"), Msg("user", "lorem ipsum dolor " * 20000)]  # ~100k tokens
    end = renderer.stop_token_ids[-1]
    per_turn = []
    for turn in range(12):
        before = renderer.encoded_tokens
        plan = tito.plan(msgs, [], "")
        out = renderer.tokenizer.encode(f"answer {turn}", add_special_tokens=False) + [end]
        tito.record(f"c{turn}", plan, out, parse(renderer.decode(out), renderer.stop_texts).as_msg(), [], "", True)
        per_turn.append(renderer.encoded_tokens - before)
        msgs = msgs + [Msg("assistant", f"answer {turn}"), Msg("user", f"next {turn}")]
        if turn:
            assert plan.drift.value == "append" and plan.parent_call_id == f"c{turn - 1}"
    assert per_turn[0] > 50_000  # the first call renders everything once
    assert max(per_turn[1:]) < 60  # then only each turn's new messages (+ the reply check)
    assert len(tito.input_ids(plan)) > 50_000


def test_sessions_of_ended_rollouts_are_forgotten_and_cells_count_their_own() -> None:
    r = Router()
    r.add_cell("a", 8)
    r.add_cell("b", 8)
    for i in range(2000):
        r.pick(f"rollout-{i}/call")
    assert r.pinned("a") + r.pinned("b") == 2000 and len(r.sessions) == 2000
    for i in range(1990):
        assert r.forget_rollout(f"rollout-{i}") == 1
    assert len(r.sessions) == 10 and r.pinned("a") + r.pinned("b") == 10
    r.drain("a")
    moving = r.sessions_on("a")
    for s in moving:  # what an evacuation does: only live sessions are moved
        r.unpin(s)
        assert r.pick(s) == "b"
    assert r.pinned("a") == 0 and r.pinned("b") == 10 and r.sessions_on("b") == sorted(r.sessions)
    with pytest.raises(TypeError):
        r.sessions["x"] = "a"  # type: ignore[index]  # read-only: the indexes stay in step
    r.remove_cell("b")
    assert not r.sessions and r.forget_rollout("rollout-1999") == 0


def test_full_ids_of_a_long_uncached_chain_is_iterative() -> None:
    import array

    from services.proxy.core.tito import CallTokens, Tito

    tito = Tito(renderer=None, cache_calls=4)  # type: ignore[arg-type]
    parent, prefix = None, 0
    for i in range(3000):  # deeper than Python's recursion limit, as a restarted proxy sees it
        tito.restore(CallTokens(f"c{i}", parent, prefix, array.array("i", [i, -1]), array.array("i", [i, -2])), [])
        prefix, parent = prefix + 4 if parent else 4, f"c{i}"
    full = tito.full_ids("c2999")
    assert len(full) == 12000 and list(full[-4:]) == [2999, -1, 2999, -2] and list(full[:4]) == [0, -1, 0, -2]
    assert tito.full_ids("c1500").tolist() == full[: 1501 * 4].tolist()
    tito.restore(CallTokens("fork", "c10", 6, array.array("i", [7]), array.array("i", [8])), [])  # mid-reply fork
    assert tito.full_ids("fork").tolist() == full[:6].tolist() + [7, 8]
