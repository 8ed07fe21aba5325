"""The pure core: radix prefix tree, scheduler (batching, chunking, pause modes, stops), params."""

from __future__ import annotations

import pytest

from services.engine.params import InvalidRequest, check_input_ids, parse_sampling_params
from services.engine.radix import RadixCache
from services.engine.scheduler import PauseMode, Phase, Scheduler, Sequence, check_stop, trim_stop_text


def _split(value, at):
    return value[:at], value[at:]


def _tree(capacity=1000) -> RadixCache:
    # Values are the token runs themselves, so every split and match can be read directly.
    return RadixCache(capacity, _split)


def _runs(tokens):
    return lambda start, end: tuple(tokens[start:end])


def test_match_returns_values_covering_exactly_the_matched_tokens():
    tree = _tree()
    assert tree.insert([1, 2, 3, 4], _runs([1, 2, 3, 4])) == 4
    assert tree.insert([1, 2, 9], _runs([1, 2, 9])) == 1  # splits [1,2,3,4] after [1,2]
    assert tree.match([1, 2, 3, 7]) == (3, [(1, 2), (3,)])
    assert tree.match([1, 2, 9, 9]) == (3, [(1, 2), (9,)])
    assert tree.match([5]) == (0, [])
    assert tree.match([1, 2, 3, 4], limit=2) == (2, [(1, 2)])
    assert tree.total_tokens == 5


def test_reinserting_a_known_sequence_adds_nothing():
    tree = _tree()
    tree.insert([1, 2, 3], _runs([1, 2, 3]))
    assert tree.insert([1, 2, 3], _runs([1, 2, 3])) == 0
    assert tree.insert([1, 2], _runs([1, 2])) == 0
    assert tree.total_tokens == 3


def test_lru_eviction_drops_least_recent_leaves_first_under_the_cap():
    tree = _tree(capacity=8)
    tree.insert([1, 1, 1, 1], _runs([1, 1, 1, 1]))
    tree.insert([2, 2, 2, 2], _runs([2, 2, 2, 2]))
    tree.match([1, 1, 1, 1])  # 1s are now more recent than 2s
    tree.insert([3, 3, 3], _runs([3, 3, 3]))  # 11 tokens > 8: evict the 2s
    assert tree.total_tokens == 7
    assert tree.match([2, 2])[0] == 0
    assert tree.match([1, 1, 1, 1])[0] == 4
    assert tree.match([3, 3, 3])[0] == 3


def test_eviction_walks_up_to_parents_that_become_leaves():
    tree = _tree(capacity=100)
    tree.insert([1, 2, 3], _runs([1, 2, 3]))
    tree.insert([1, 2, 4], _runs([1, 2, 4]))
    assert tree.evict(0) == 4
    assert tree.total_tokens == 0 and tree.node_count() == 0


def _seq(rid, n_prompt, **params) -> Sequence:
    return Sequence(rid=rid, input_ids=list(range(10, 10 + n_prompt)), params=parse_sampling_params(params),
                    eos_ids=frozenset({2}))


def test_plan_puts_decodes_first_and_chunks_prompts_within_the_budget():
    sched = Scheduler(max_running=4, step_token_budget=10, max_context=1000)
    decoding, long_prompt = _seq("a", 3), _seq("b", 25)
    for seq in (decoding, long_prompt):
        sched.add(seq)
    assert sched.admit() == [decoding, long_prompt]
    decoding.kv_len = 2  # its prompt but the last token is computed: one token to feed
    feeds = sched.plan()
    assert [(f.seq.rid, f.start, f.count, f.samples) for f in feeds] == [("a", 2, 1, True), ("b", 0, 9, False)]


def test_ids_between_slices_prompt_and_output_without_joining_them():
    seq = Sequence(rid="a", input_ids=[10, 11, 12], params=parse_sampling_params({}), output_ids=[20, 21])
    spans = [(0, 2), (1, 3), (2, 4), (3, 5), (4, 5), (0, 5)]
    assert [seq.ids_between(a, b) for a, b in spans] == [seq.all_ids[a:b] for a, b in spans]


def test_admission_respects_max_running_and_pause():
    sched = Scheduler(max_running=1, step_token_budget=100, max_context=1000)
    first, second = _seq("a", 2), _seq("b", 2)
    sched.add(first)
    sched.add(second)
    assert sched.admit() == [first]
    assert sched.admit() == []
    sched.pause(PauseMode.IN_PLACE)
    assert sched.plan() == [] and not sched.has_work()
    sched.resume()
    sched.finish(first, {"type": "length", "length": 0})
    assert sched.admit() == [second]


def test_admission_keeps_running_kv_within_its_token_room():
    sched = Scheduler(max_running=8, step_token_budget=100, max_context=1000, max_running_tokens=100)
    big, small, other = _seq("a", 40, max_new_tokens=55), _seq("b", 5, max_new_tokens=5), _seq("c", 5, max_new_tokens=5)
    lone = _seq("d", 300, max_new_tokens=300)
    for seq in (big, small, other):
        sched.add(seq)
    assert sched.admit() == [big]  # 95 reserved: the next 10 do not fit in 100
    sched.finish(big, {"type": "length", "length": 55})
    assert sched.admit() == [small, other]
    sched.finish(small, {"type": "length", "length": 5})
    sched.finish(other, {"type": "length", "length": 5})
    sched.add(lone)
    assert sched.admit() == [lone]  # too big for the room, but alone: admitted


def test_pause_retract_requeues_running_in_order_and_abort_ends_everything():
    sched = Scheduler(max_running=4, step_token_budget=100, max_context=1000)
    seqs = [_seq(r, 3) for r in "abc"]
    for seq in seqs:
        sched.add(seq)
    sched.admit()
    aborted, retracted = sched.pause(PauseMode.RETRACT)
    assert aborted == [] and retracted == seqs
    assert list(sched.waiting) == seqs and all(s.phase is Phase.WAITING for s in seqs)
    sched.resume()
    aborted, _ = sched.pause(PauseMode.ABORT)
    assert aborted == seqs and all(s.finish_reason["type"] == "abort" for s in seqs)
    assert not sched.busy()


def test_stop_rules_follow_sglang_finish_reasons():
    seq = _seq("a", 2, max_new_tokens=3, stop_token_ids=[7])
    seq.output_ids = [7]
    assert check_stop(seq, 7, None, 1000) == {"type": "stop", "matched": 7}
    seq = _seq("a", 2, max_new_tokens=3, min_new_tokens=2)
    seq.output_ids = [2]
    assert check_stop(seq, 2, None, 1000) is None  # eos before min_new_tokens does not stop
    seq.output_ids = [2, 2]
    assert check_stop(seq, 2, None, 1000) == {"type": "stop", "matched": 2}
    seq = _seq("a", 2, max_new_tokens=3, ignore_eos=True)
    seq.output_ids = [2, 2, 2]
    assert check_stop(seq, 2, None, 1000) == {"type": "length", "length": 3}


def test_stop_strings_are_matched_across_tokens_and_trimmed():
    words = {5: "ab", 6: "c</", 7: "end>"}
    decode = lambda ids: "".join(words[i] for i in ids)
    seq = _seq("a", 2, stop="</end>")
    seq.output_ids = [5, 6]
    assert check_stop(seq, 6, decode, 1000) is None
    seq.output_ids = [5, 6, 7]
    assert check_stop(seq, 7, decode, 1000) == {"type": "stop", "matched": "</end>"}
    assert trim_stop_text("abc</end>", seq.stop_text, keep=False) == "abc"
    assert trim_stop_text("abc</end>", seq.stop_text, keep=True) == "abc</end>"


def test_sampling_params_validation_matches_sglang():
    with pytest.raises(InvalidRequest, match="unknown field bogus"):
        parse_sampling_params({"bogus": 1})
    with pytest.raises(InvalidRequest, match="temperature"):
        parse_sampling_params({"temperature": -1})
    with pytest.raises(InvalidRequest, match="not supported"):
        parse_sampling_params({"n": 2})
    params = parse_sampling_params({"stop": "x", "top_k": 0, "max_new_tokens": 5})
    assert params.stop == ["x"] and params.top_k == -1 and params.max_new_tokens == 5
    assert parse_sampling_params(None).max_new_tokens == 128


def test_input_ids_are_checked_against_vocabulary_and_context():
    with pytest.raises(InvalidRequest, match="empty"):
        check_input_ids([], 100, 50)
    with pytest.raises(InvalidRequest, match="out of vocabulary"):
        check_input_ids([1, 100], 100, 50)
    with pytest.raises(InvalidRequest, match=r"input \(50 tokens\) is longer than the model's context length"):
        check_input_ids([1] * 50, 100, 50)
    check_input_ids([0, 99], 100, 50)


def test_input_plus_new_tokens_must_stay_below_the_context_like_sglang():
    from services.engine.params import check_context_budget

    check_context_budget(40, 9, 50)  # 49 < 50
    with pytest.raises(InvalidRequest, match="maximum context length of 50 tokens. You requested a total of 50"):
        check_context_budget(40, 10, 50)


def test_an_engine_beyond_loopback_warns_what_is_open():
    from services.engine.main import exposure_warnings
    from services.engine.settings import EngineSettings

    assert exposure_warnings(EngineSettings(host="127.0.0.1")) == []
    open_all = exposure_warnings(EngineSettings(host="0.0.0.0"))
    assert len(open_all) == 2 and "/generate" in open_all[0] and "admin token" in open_all[1]
    assert len(exposure_warnings(EngineSettings(host="0.0.0.0", admin_token="t"))) == 1


def test_a_kv_buffer_never_grows_past_its_admitted_worst_case():
    # admission counts prompt + max_new_tokens; doubling used to reach ~2x that
    from services.engine.model_runner import KVBuffer, ModelShape

    shape = ModelShape(layers=1, heads=2, kv_heads=1, head_dim=4, hidden=8, vocab_size=10, max_positions=32768,
                       eps=1e-6, model_type="qwen2")
    for prompt, max_new in ((100, 1126), (100, 4000), (3000, 2200), (5, 3)):
        worst = prompt + max_new
        kv = KVBuffer(shape, prompt + min(max_new, 512), limit=worst)  # as Engine._attach makes it
        peak = kv.data.shape[3]
        for length in range(prompt, worst):  # the last token is never fed
            kv.reserve(length + 1)
            kv.length = length + 1
            peak = max(peak, kv.data.shape[3])
        assert peak <= max(worst, 16) and kv.data.shape[3] >= kv.length, (prompt, max_new)
    kv = KVBuffer(shape, 20, limit=30)
    kv.reserve(45)  # more than the limit is still given (never a failed step)
    assert kv.data.shape[3] == 45
