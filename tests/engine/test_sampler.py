"""The sampler's cuts and logprobs (services/engine/sampler.py) on hand-made logits."""

from __future__ import annotations

import math
from collections import Counter

import torch

from services.engine.params import parse_sampling_params
from services.engine.sampler import SampleSpec, new_generator, sample

# probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625 over five ids, then padding rows
PROBS = [0.5, 0.25, 0.125, 0.0625, 0.0625]
LOGITS = torch.tensor([[math.log(p) for p in PROBS] + [5.0, 5.0]])  # ids 5, 6: padding beyond vocab_limit
VOCAB = 5


def _draws(n: int = 400, **params) -> Counter:
    spec = SampleSpec(parse_sampling_params(params), want_logprob=False, generator=new_generator(7))
    return Counter(sample(LOGITS.clone(), [spec], VOCAB)[0][0] for _ in range(n))


def test_picks_stay_inside_the_cuts_and_never_on_padding():
    assert set(_draws(temperature=1.0)) == {0, 1, 2, 3, 4}  # padding ids 5, 6 never drawn
    assert set(_draws(temperature=1.0, top_k=2)) == {0, 1}
    assert set(_draws(temperature=1.0, top_p=0.7)) == {0, 1}  # 0.5 + 0.25 is the smallest set holding 0.7
    assert set(_draws(temperature=1.0, min_p=0.3)) == {0, 1}  # p >= 0.3 * 0.5
    # joint cuts, as SGLang: top-p measures the whole row's mass (0.5 before id 1 <= 0.6), not
    # the top-k's renormalised one (2/3 before id 1 > 0.6, which would keep id 0 alone)
    assert set(_draws(temperature=1.0, top_k=2, top_p=0.6)) == {0, 1}
    assert set(_draws(temperature=1.0, min_p=0.2, top_p=0.6)) == {0, 1}
    draws = _draws(2000, temperature=1.0)
    assert abs(draws[0] / 2000 - 0.5) < 0.05 and abs(draws[1] / 2000 - 0.25) < 0.05


def test_greedy_ignores_the_padding_rows_and_seeded_draws_repeat():
    spec = SampleSpec(parse_sampling_params({"temperature": 0}), want_logprob=True, generator=None)
    tokens, logprobs, _ = sample(LOGITS.clone(), [spec], VOCAB)
    assert tokens == [0]
    # normalised over the whole output, padding rows included (as a trainer computes it)
    assert abs(logprobs[0] - torch.log_softmax(LOGITS[0], -1)[0].item()) < 1e-6
    assert _draws(50, temperature=1.0) == _draws(50, temperature=1.0)


def test_logprobs_are_of_the_temperature_scaled_distribution_before_the_cuts():
    spec = SampleSpec(parse_sampling_params({"temperature": 0.5, "top_k": 2}), want_logprob=True,
                      generator=new_generator(3), top_n=2)
    tokens, logprobs, tops = sample(LOGITS.clone(), [spec], VOCAB)
    want = torch.log_softmax(LOGITS[0] / 0.5, -1)
    assert abs(logprobs[0] - want[tokens[0]].item()) < 1e-6
    assert [t[1] for t in tops[0]] == [0, 1] and abs(tops[0][0][0] - want[0].item()) < 1e-6


def _one(params: dict, logits: torch.Tensor = LOGITS, want_logprob: bool = False, seed: int = 5, **spec):
    spec = SampleSpec(parse_sampling_params(params), want_logprob=want_logprob, generator=new_generator(seed), **spec)
    tokens, logprobs, _ = sample(logits.clone(), [spec], VOCAB)
    return tokens[0], logprobs[0]


def test_a_top_p_below_float32_range_keeps_the_most_likely_token():
    # 1e-46 is 0 in float32: the cut used to keep nothing and argmax an empty row
    for top_p in (1e-46, 1e-300, 1e-8):
        assert {_one({"temperature": 1.0, "top_p": top_p}, seed=s)[0] for s in range(20)} == {0}


def test_a_temperature_below_the_epsilon_is_greedy():
    # as SGLang: 0 <= temperature < 1e-6 samples greedily (dividing by it overflowed to inf/NaN)
    peaked = torch.tensor([[30.0, 29.0, 1.0, 0.0, 0.0, 5.0, 5.0]])
    for extra in ({}, {"top_p": 0.9}, {"min_p": 0.5}, {"top_k": 3}):
        params = {"temperature": 1e-40, **extra}
        assert parse_sampling_params(params).greedy
        token, logprob = _one(params, peaked, want_logprob=True)
        assert token == 0
        assert math.isfinite(logprob) and abs(logprob - torch.log_softmax(peaked[0], -1)[0].item()) < 1e-6
    assert not parse_sampling_params({"temperature": 1e-5}).greedy
    assert {_one({"temperature": 1e-5, "top_p": 0.5}, peaked, seed=s)[0] for s in range(10)} == {0}


def test_banned_ids_are_never_picked_and_keep_the_models_logprobs():
    want = torch.log_softmax(LOGITS[0], -1)
    for params in ({"temperature": 0}, {"temperature": 1.0}, {"temperature": 1.0, "top_p": 0.6}):
        for seed in range(10):
            token, logprob = _one(params, want_logprob=True, seed=seed, banned=(0, 10**30))
            assert token != 0 and abs(logprob - want[token].item()) < 1e-6


def test_greedy_argmax_is_torchs_first_maximum_nan_included():
    # the numpy path the engine uses on CPU picks what torch.argmax picks: the first
    # maximum, a NaN counting as the maximum, on strided rows and inference tensors too
    from services.engine.sampler import _argmax

    rows = torch.tensor([[1.0, 3.0, 3.0, 2.0], [0.0, float("nan"), 5.0, float("nan")], [-1.0, -1.0, -1.0, -1.0]])
    assert _argmax(rows) == rows.argmax(dim=-1).tolist() == [1, 1, 0]
    wide = torch.randn(4, 151936, generator=torch.Generator().manual_seed(0))
    assert _argmax(wide.T.contiguous().T) == wide.argmax(dim=-1).tolist()  # column-major storage
    with torch.inference_mode():
        made = wide * 1.0
    assert _argmax(made) == wide.argmax(dim=-1).tolist()
    assert _argmax(wide.double()) == wide.argmax(dim=-1).tolist()  # other dtypes: torch's own


def _seeded(logits: torch.Tensor, params: dict, seed: int, step: int) -> int:
    spec = SampleSpec(parse_sampling_params({"temperature": 1.0, "sampling_seed": seed, **params}),
                      want_logprob=False, generator=None, step=step)
    return sample(logits.clone(), [spec], logits.shape[1])[0][0]


CUTS = ({}, {"top_p": 0.9}, {"min_p": 0.05}, {"top_k": 50}, {"top_k": 200, "top_p": 0.8, "min_p": 0.01})


def test_a_seeded_pick_depends_only_on_seed_step_and_distribution():
    # no stream that earlier picks advance: the same (seed, step) gives the same pick in any order
    logits = 3 * torch.randn(1, 1000, generator=torch.Generator().manual_seed(1))
    for cut in CUTS:
        forward = [_seeded(logits, cut, 11, k) for k in range(24)]
        backward = [_seeded(logits, cut, 11, k) for k in reversed(range(24))][::-1]
        assert forward == backward, cut
        assert len(set(forward)) > 3, cut  # steps draw differently
        assert forward != [_seeded(logits, cut, 12, k) for k in range(24)], cut  # and seeds do
    # seeds that differ only above the low 32 bits are different seeds
    assert [_seeded(logits, {}, 5, k) for k in range(8)] != [_seeded(logits, {}, 5 + 2**32, k) for k in range(8)]


def test_a_marginal_candidate_joining_the_cut_moves_no_other_pick():
    # as a cache hit or another batch does: a tail token's logit moves across the top-p /
    # min-p / top-k edge. Draws keyed by candidate position (or a stream the count moved)
    # changed most picks; keyed by token id only a pick of the moved token can change.
    logits = 3 * torch.randn(1, 1000, generator=torch.Generator().manual_seed(2))
    order = torch.argsort(logits[0], descending=True)
    for cut in CUTS[1:]:
        before = [_seeded(logits, cut, s, 0) for s in range(300)]
        outside = next(int(t) for t in order if int(t) not in before and logits[0, t] > logits[0].min())
        nudged = logits.clone()
        nudged[0, outside] = logits[0, order[len(set(before)) // 2]]  # now well inside the cut
        after = [_seeded(nudged, cut, s, 0) for s in range(300)]
        moved = {outside} | (set(before) - set(after))  # joined, or pushed out by the mass it took
        same = [b == a for b, a in zip(before, after) if b not in moved and a not in moved]
        assert len(same) >= 200 and all(same), cut
